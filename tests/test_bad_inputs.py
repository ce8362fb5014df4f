"""The bad-input corpus (tests/bad_inputs/*.yaml): every case -> exit 2, one clear message, no traceback, nothing
written. Each case runs in-process through ``rlfactory.cli.main`` (``config check`` and ``train`` unless the case
says otherwise); a few also run end to end in a subprocess. The case format is in tests/bad_inputs/README.md."""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli

CASES_DIR = Path(__file__).parent / "bad_inputs"
CASES = sorted(CASES_DIR.glob("*.yaml"))
DELETE = "<delete>"

BASES: dict[str, dict[str, Any]] = {
    "sft": {
        "stage": "sft",
        "output_dir": "{tmp}/out",
        "model": {"name_or_path": "{model}"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"dataset": "arith_sft", "dataset_dir": "{data}", "max_samples": 8, "cutoff_len": 128},
        "train": {"max_steps": 1, "per_device_batch_size": 4},
        "logging": {"progress_bar": False, "plot_loss": False},
    },
}
for _stage, _dataset in (("dpo", "arith_pref"), ("rm", "arith_pref"), ("kto", "arith_kto"), ("orpo", "arith_pref")):
    BASES[_stage] = {**BASES["sft"], "stage": _stage, "data": {**BASES["sft"]["data"], "dataset": _dataset}}
BASES["grpo"] = {
    **BASES["sft"],
    "stage": "grpo",
    "data": {**BASES["sft"]["data"], "dataset": "arith_prompts"},
    "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_response_len": 8},
    "reward": {"functions": {"answer_match": 1.0}},
}
BASES["ppo"] = {**BASES["grpo"], "stage": "ppo"}
BASES["pipeline"] = {
    "output_dir": "{tmp}/out",
    "defaults": {k: v for k, v in BASES["sft"].items() if k not in ("stage", "output_dir")},
    "stages": [{"stage": "sft", "name": "first"}],
}


def merge(base: Any, top: Any) -> Any:
    """``top`` over ``base``; a mapping merges key by key, ``<delete>`` removes a key."""
    if not (isinstance(base, dict) and isinstance(top, dict)):
        return copy.deepcopy(top)
    out = copy.deepcopy(base)
    for key, value in top.items():
        if value == DELETE:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def fill(value: Any, places: dict[str, str]) -> Any:
    """Replace {tmp}, {model}, {data} in every string (bytes are written as they are)."""
    if isinstance(value, str):
        for name, place in places.items():
            value = value.replace("{" + name + "}", place)
        return value
    if isinstance(value, dict):
        return {fill(k, places): fill(v, places) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, places) for v in value]
    return value


def prepare(case: dict[str, Any], tmp: Path) -> tuple[Path, list[str]]:
    """Write the case's files and run YAML under ``tmp``; returns (the YAML, the overrides)."""
    places = {"tmp": str(tmp), "model": str(TINY_MODEL), "data": str(DATA_DIR)}
    if case.get("model_copy"):
        shutil.copytree(TINY_MODEL, tmp / "model")
        places["model"] = str(tmp / "model")
    for name, content in fill(case.get("files") or {}, places).items():
        path = tmp / name
        if content == DELETE:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    for name, size in (case.get("truncate") or {}).items():
        with open(tmp / fill(name, places), "r+b") as handle:
            handle.truncate(size)
    for name in case.get("make_dirs") or []:
        (tmp / name).mkdir(parents=True, exist_ok=True)
    run_yaml = tmp / "run.yaml"
    if "config_path" in case:  # a config path that is not a run YAML (missing, a folder)
        return Path(fill(case["config_path"], places)), fill(case.get("overrides") or [], places)
    if "config_text" in case:
        text = fill(case["config_text"], places)
        run_yaml.write_bytes(text if isinstance(text, bytes) else text.encode())
    else:
        config = fill(merge(BASES[case.get("base", "sft")], case.get("config") or {}), places)
        run_yaml.write_text(yaml.safe_dump(config, sort_keys=False))
    return run_yaml, fill(case.get("overrides") or [], places)


def snapshot(folder: Path) -> dict[str, int]:
    """Every path under ``folder`` with its size: what a failed command must leave as it found it."""
    return {str(p.relative_to(folder)): (p.stat().st_size if p.is_file() else -1) for p in sorted(folder.rglob("*"))}


def argv_for(command: str, case: dict[str, Any], run_yaml: Path, overrides: list[str]) -> list[str]:
    """``check`` and ``train`` take the case's YAML; any other command (webui) its ``args``."""
    if command == "check":
        return ["config", "check", str(run_yaml), *overrides]
    if command == "train":
        return ["train", str(run_yaml), *overrides]
    return [command, *case.get("args", [])]


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A loopback port held open for the command (``{port}`` in a case's args)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def load_case(path: Path) -> dict[str, Any]:
    from rlfactory.config.yaml_io import parse_yaml

    case = parse_yaml(path.read_text(), path.name)  # a case file with a duplicate key is refused too
    assert case.get("why") and (case.get("expect") or case.get("check_warns")), f"{path.name}: needs why and expect"
    return case


def assert_clear_error(code: int, out: str, err: str, expect: list[str]) -> None:
    assert code == 2, f"exit code {code}\n{err[-3000:]}"
    assert "Traceback" not in out + err, err[-6000:]
    assert "\nerror: " in "\n" + err, err[-3000:]
    message = err[err.index("error: ") :] if err.startswith("error: ") else err[err.index("\nerror: ") + 1 :]
    for fragment in expect:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


@pytest.fixture(autouse=True)
def _logs_to_this_tests_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """A library's log handler keeps the stderr of the test that created it (transformers makes one at import);
    pointed at a closed capture, logging prints '--- Logging error --- Traceback'. A real process has one stderr:
    point every handler at this test's. Not one without a stream: torch's LazyTraceHandler opens its file on first
    use, and given a stream it has not opened, it takes itself for a forked child and closes that stream's fd."""
    for handler in (ref() for ref in logging._handlerList):  # every handler alive, on a logger or not
        ours = type(handler).__module__ not in ("logging", "_pytest.logging") or type(handler) is logging.StreamHandler
        if isinstance(handler, logging.StreamHandler) and ours and handler.stream is not None:
            handler.stream = sys.stderr  # not setStream: it flushes the old, closed stream


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_bad_input(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    from rlfactory.cli import main

    case = load_case(path)
    if case.get("subprocess_only"):
        pytest.skip("runs in test_bad_input_end_to_end: in-process, a library's log handler kept a closed stream")
    monkeypatch.chdir(tmp_path)
    if "webui" in case.get("commands", []):  # `webui` sets this process's workspace before it checks the port
        from rlfactory.webui import workspace

        monkeypatch.setattr(workspace, "_CURRENT", [])
    run_yaml, overrides = prepare(case, tmp_path)
    if case.get("check_warns"):  # the machine cannot run it (a GPU-only setting): check warns, train refuses
        assert main(argv_for("check", case, run_yaml, overrides)) == 0
        out, err = capsys.readouterr()
        for fragment in case["check_warns"]:
            assert fragment in out + err, f"{fragment!r} not in:\n{out}{err}"
    for command in case.get("commands", ["train"] if case.get("check_warns") else ["check", "train"]):
        before = snapshot(tmp_path)
        capsys.readouterr()
        with busy_port() as port:
            places = {"tmp": str(tmp_path), "port": str(port)}
            code = main(fill(argv_for(command, case, run_yaml, overrides), places))
        out, err = capsys.readouterr()
        assert_clear_error(code, out, err, fill(case["expect"], places))
        assert snapshot(tmp_path) == before, f"{command} wrote into {tmp_path}"


SUBPROCESS_ONLY = [p.stem for p in CASES if load_case(p).get("subprocess_only")]
END_TO_END = ["yaml_binary", "override_broken_yaml", "seed_negative", "jsonl_invalid_utf8", "safetensors_truncated"]
END_TO_END += SUBPROCESS_ONLY


@pytest.mark.parametrize("name", END_TO_END)
def test_bad_input_end_to_end(name: str, tmp_path: Path):
    """The real CLI in a subprocess: exit code 2 and no traceback as a user sees them."""
    case = load_case(CASES_DIR / f"{name}.yaml")
    run_yaml, overrides = prepare(case, tmp_path)
    before = snapshot(tmp_path)
    commands = case.get("commands", ["check", "train"])
    for command in commands if case.get("subprocess_only") else commands[-1:]:  # train proves the exit code
        result = run_cli(*argv_for(command, case, run_yaml, overrides), cwd=tmp_path)
        expect = fill(case["expect"], {"tmp": str(tmp_path)})
        assert_clear_error(result.returncode, result.stdout, result.stderr, expect)
        assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback(tmp_path: Path):
    """`--debug` (or RLFACTORY_DEBUG=1) prints the traceback behind the message, still with exit code 2."""
    case = load_case(CASES_DIR / "override_broken_yaml.yaml")
    run_yaml, overrides = prepare(case, tmp_path)
    result = run_cli("--debug", "config", "check", str(run_yaml), *overrides, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "error: " in result.stderr


def test_unused_sections_are_warned_at_the_start_of_a_run(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A section for another fine-tuning method is a warning in the run's log too (check prints it: see the corpus)."""
    from rlfactory.config.loader import load_config
    from rlfactory.stages.common import preflight

    run_yaml, overrides = prepare(load_case(CASES_DIR / "lora_section_with_full.yaml"), tmp_path)
    with caplog.at_level("WARNING"):
        preflight(load_config(run_yaml, overrides))
    assert "the `lora:` section is ignored: model.finetuning is full" in caplog.text
    assert not (tmp_path / "out").exists()


# every input issue 21 saw end in a traceback (or pass `config check` and fail in `train`)
ISSUE_CASES = [
    "yaml_binary", "override_broken_yaml", "seed_negative", "flash_attention_not_installed", "model_dir_empty",
    "safetensors_truncated", "safetensors_garbage", "registry_top_level_list", "jsonl_invalid_utf8", "csv_ragged",
    "parquet_corrupt", "dataset_file_is_plain_directory", "preference_margin_not_number", "resume_corrupt_state",
    "resume_auto_half_written", "output_dir_under_proc", "output_dir_under_file", "from_stage_single_run",
    "yaml_duplicate_key", "webui_port_busy", "webui_port_too_large", "lora_section_with_full",
    "eval_steps_without_eval_data", "fp16_on_cpu", "pipeline_stage_bad_dataset",
]


def test_corpus_is_large_and_covers_the_issue():
    errors = [p for p in CASES if load_case(p).get("commands") != []]
    assert len(errors) >= 100
    names = {p.stem for p in CASES}
    assert set(END_TO_END + ISSUE_CASES) <= names, set(END_TO_END + ISSUE_CASES) - names
