"""Never delete, overwrite or kill what is not ours: the output_dir rules (through the real CLI where it
matters), the WebUI's workspace rule, its login throttle and origin check, and the `webui` launch checks
(exposure without a password, bad port) run as a user would run them. The WebUI refusals against a
running server are in tests/test_webui.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import ROOT, run_cli, write_yaml

from rlfactory.engine import run_dir
from rlfactory.errors import UserError
from rlfactory.webui import security
from rlfactory.webui.workspace import Workspace


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
    (run / "checkpoint-2").mkdir()  # a complete checkpoint (trainer_state.json lists its files: none here)
    (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2, "files": {}}')
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


# --------------------------------------------------------------------------- the WebUI workspace
def test_workspace_paths(tmp_path: Path):
    """Writes only inside the root; reads also from --allow-read roots; symlinks are followed; hub ids pass."""
    root, shared, outside = tmp_path / "ws", tmp_path / "shared", tmp_path / "outside"
    for folder in (root, shared, outside):
        folder.mkdir()
    (root / "out").symlink_to(outside)
    (root / "models").symlink_to(shared)
    ws = Workspace(root.resolve(), (shared.resolve(),))
    assert ws.writable("outputs/run", "output_dir") == root.resolve() / "outputs/run"
    assert ws.readable("models/m", "model") == shared.resolve() / "m"
    for path in ("../x", str(outside / "x"), "out/x", "/etc/passwd", "outputs/../../x", "models/m"):
        with pytest.raises(UserError, match="outside the WebUI workspace"):
            ws.writable(path, "output_dir")
    for path in ("/etc/passwd", "out/run.yaml", "~/.ssh/id_rsa"):
        with pytest.raises(UserError, match="refused to read it; start the WebUI with --allow-read"):
            ws.readable(path, "YAML to load")
    ws.readable_model("Qwen/Qwen2.5-0.5B", "model.name_or_path")  # a hub id, not a path
    ws.readable_model("./m", "model.name_or_path")  # a local path inside the workspace
    for name in ("../m", "/etc", "out", "./out/m"):
        with pytest.raises(UserError, match="model.name_or_path"):
            ws.readable_model(name, "model.name_or_path")


# --------------------------------------------------------------------------- login throttle, origins
def test_login_throttle_backs_off_per_client():
    throttle = security.LoginThrottle(free=3, base_s=10, max_s=25)
    for _ in range(2):
        throttle.record("a", ok=False)
    assert throttle.wait_s("a") == 0
    throttle.record("a", ok=False)
    assert 9 < throttle.wait_s("a") <= 10
    throttle.record("a", ok=False)
    assert 19 < throttle.wait_s("a") <= 20
    throttle.record("a", ok=False)
    assert throttle.wait_s("a") <= 25  # capped
    assert throttle.wait_s("b") == 0  # another client is not locked out
    throttle.record("a", ok=True)
    assert throttle.wait_s("a") == 0


def test_same_origin():
    assert security.same_origin("http://127.0.0.1:7860", "127.0.0.1:7860")
    assert not security.same_origin("http://evil.example", "127.0.0.1:7860")
    assert not security.same_origin("null", "127.0.0.1:7860")
    assert not security.same_origin("http://127.0.0.1:7861", "127.0.0.1:7860")


# --------------------------------------------------------------------------- `rlfactory webui` launch checks
def _webui(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.time()
    environment = {key: value for key, value in os.environ.items() if key != security.AUTH_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "rlfactory", "webui", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, time.time() - start


def test_webui_refuses_network_without_auth_and_busy_ports(tmp_path: Path):
    """0.0.0.0 and --share without a password exit 2 before binding anything (fast: gradio is not even
    imported); a busy or invalid port is one clear message."""
    result, took = _webui("--host", "0.0.0.0", "--port", "7")
    _expect_refused(result, "--host 0.0.0.0 serves the WebUI to other machines", "--auth-file", "--insecure")
    assert took < 20
    result, _ = _webui("--share", "--port", "7")
    _expect_refused(result, "a public gradio.live link serves the WebUI")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result, _ = _webui("--port", str(port))
        _expect_refused(result, f"--port {port} on 127.0.0.1 is not free", "choose another with --port")
    _expect_refused(_webui("--port", "70000")[0], "--port 70000 is not a valid port")
    _expect_refused(_webui("--workspace", str(tmp_path / "nope"))[0], "--workspace", "is not a directory")
    secret = tmp_path / "auth"
    secret.write_text("just-a-password\n")
    _expect_refused(_webui("--auth-file", str(secret))[0], f"--auth-file '{secret}' must look like user:password")


def test_auth_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    monkeypatch.delenv(security.AUTH_ENV, raising=False)
    assert security.load_auth(None, None) is None
    secret = tmp_path / "auth"
    secret.write_text("me:s3cret\n")
    secret.chmod(0o600)
    assert security.load_auth(None, str(secret)) == ("me", "s3cret")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(security.AUTH_ENV, "env:pw")
    assert security.load_auth(None, None) == ("env", "pw")
    assert security.load_auth("cli:pw", None) == ("cli", "pw")
    assert "visible to every user of this machine in the process list" in capsys.readouterr().err
    with pytest.raises(UserError, match="either --auth or --auth-file"):
        security.load_auth("a:b", str(secret))
    with pytest.raises(UserError, match="cannot be read"):
        security.load_auth(None, str(tmp_path / "missing"))


def test_stop_after_a_restart_signals_the_verified_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A run started by an earlier WebUI process (nothing in memory, only webui_run.json) is recognised by
    its start time and command line, and Stop ends it; its process group is gone afterwards."""
    import psutil
    import yaml

    from rlfactory.webui import runner, workspace

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(workspace, "_CURRENT", [])
    workspace.configure(str(tmp_path), [str(ROOT / "data"), str(ROOT / "examples")])
    raw = yaml.safe_load((ROOT / "examples/quickstart/sft.yaml").read_text())
    raw.pop("evaluation", None)
    raw["data"].pop("eval_dataset", None)
    raw["data"]["dataset_dir"] = str(ROOT / "data")
    raw["model"]["name_or_path"] = str(ROOT / "data/models/tiny-arith")
    raw.update(output_dir="outputs/r", train={**raw["train"], "max_steps": 5000, "eval_steps": None})  # no eval data
    runner.start(raw, yaml.safe_dump(raw))
    pid = runner.read_state("outputs/r")["pid"]
    for active in runner._ACTIVE.values():  # its watcher thread would record "failed" when the run is killed
        active.stopping = True
    monkeypatch.setattr(runner, "_ACTIVE", {})  # as if the WebUI had been restarted
    assert runner.is_busy("outputs/r")
    assert runner.live_runs() == [Path("outputs/r")]  # what a reloaded page reattaches to
    assert runner.stop("outputs/r").startswith("stopped the run in 'outputs/r'")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert runner.status("outputs/r")["status"] == "stopped"
    assert runner.live_runs() == []
