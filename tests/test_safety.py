"""Never delete or overwrite what is not ours: the output_dir rules (through the real CLI where it matters)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tests.conftest import ROOT, run_cli, write_yaml

from rlfactory.engine import run_dir
from rlfactory.errors import UserError


def _expect_refused(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


# --------------------------------------------------------------------------- output_dir
def _unrelated(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("mine\n")
    (folder / "config.yaml").write_text("not: a run\n")  # a config.yaml alone is not a run
    return folder


def test_cli_overwrite_refuses_an_unrelated_folder_and_the_project_root(tmp_path: Path, sft_config: dict):
    """overwrite_output_dir: true on a folder without our marker, on the project root and on an empty
    output_dir: exit 2, one message naming output_dir, not a file touched."""
    other = _unrelated(tmp_path / "other")
    cfg = {**sft_config, "output_dir": str(other), "overwrite_output_dir": True}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    _expect_refused(result, f"output_dir '{other}' holds files that are not an rlfactory run (no run.json)")
    assert sorted(p.name for p in other.iterdir()) == ["config.yaml", "notes.txt"]

    elsewhere = tmp_path / "elsewhere"  # not inside the project: the repository is then only "the project root"
    elsewhere.mkdir()
    before = sorted(p.name for p in ROOT.iterdir())
    cfg = {**sft_config, "output_dir": str(ROOT), "overwrite_output_dir": True}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)), cwd=elsewhere)
    _expect_refused(result, f"output_dir '{ROOT}' is the project root {ROOT}")
    assert sorted(p.name for p in ROOT.iterdir()) == before

    cfg = {**sft_config, "output_dir": "", "overwrite_output_dir": True}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)), cwd=elsewhere)
    _expect_refused(result, "output_dir: must not be empty")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    ("output_dir", "expected"),
    [
        (".", "is the working directory"),
        ("~", "is the home directory"),
        ("..", "contains the working directory"),
        ("/", "contains the working directory"),
    ],
)
def test_output_dir_may_not_be_cwd_home_or_a_parent(
    output_dir: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from rlfactory.config.loader import validate_config

    monkeypatch.chdir(tmp_path)
    raw = {"stage": "sft", "output_dir": output_dir, "model": {"name_or_path": "m"}, "data": {"dataset": "d"}}
    config = validate_config(raw, "run.yaml")
    for overwrite in (False, True):
        with pytest.raises(UserError, match=expected):
            run_dir.check_output_dir(config.output_dir, overwrite, None)


def test_overwrite_deletes_only_our_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Empty folders, marked runs and runs of older versions are replaced; a symlink is never followed."""
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    run_dir.check_output_dir(str(empty), True, None)
    run = run_dir.prepare_output_dir(str(tmp_path / "run"), False, None)
    marker = json.loads((run / run_dir.MARKER_FILE).read_text())
    assert marker["tool"] == "rlfactory" and len(marker["run_id"]) == 32
    (run / "config.yaml").write_text("stage: sft\n")
    (run / "checkpoint-2").mkdir()
    run_dir.prepare_output_dir(str(run), False, None)  # resuming keeps the run's id
    assert json.loads((run / run_dir.MARKER_FILE).read_text())["run_id"] == marker["run_id"]
    run_dir.check_output_dir(str(run), True, None)
    run_dir.prepare_output_dir(str(run), True, None)
    assert sorted(p.name for p in run.iterdir()) == [run_dir.MARKER_FILE]
    assert json.loads((run / run_dir.MARKER_FILE).read_text())["run_id"] != marker["run_id"]

    legacy = tmp_path / "legacy"  # written before run.json existed: config.yaml with a stage + a log
    legacy.mkdir()
    (legacy / "config.yaml").write_text("stage: dpo\n")
    (legacy / run_dir.LOG_FILE).write_text('{"step": 1}\n')
    assert run_dir.is_our_run(legacy)
    run_dir.prepare_output_dir(str(legacy), True, None)
    assert not (legacy / run_dir.LOG_FILE).exists()

    other = _unrelated(tmp_path / "other")
    link = tmp_path / "link"
    link.symlink_to(run)
    for folder, message in ((other, "not an rlfactory run"), (link, "symbolic link")):
        with pytest.raises(UserError, match=message):
            run_dir.check_output_dir(str(folder), True, None)
        with pytest.raises(UserError, match=message):  # checked again right before deleting
            run_dir.prepare_output_dir(str(folder), True, None)
    assert (other / "notes.txt").is_file() and (run / run_dir.MARKER_FILE).is_file()
