"""Launch and stop ``rlfactory train`` runs for the WebUI: the same path as the CLI, in a subprocess.

Start validates the form exactly as ``rlfactory config check`` does, writes the YAML into the run's
output dir (``webui_run.yaml``) and runs ``python -m rlfactory train webui_run.yaml`` in a new session
(its own process group), with stdout and stderr going to ``webui_run.log`` beside it. The run's state
(pid, running/finished/failed/stopped, exit code) is kept in ``webui_run.json``, so a WebUI restarted
later still sees a run that is going on, and the Runs list can tell how old runs ended.

The output dir is prepared here, with the engine's own rules (``engine.run_dir``), before launching:
``overwrite_output_dir`` wipes it now rather than in the child, which would otherwise delete the log
file it is writing to; the child then gets ``overwrite_output_dir=false`` on its command line.

One run at a time per output dir: a second Start on a busy dir is refused. Stop terminates the whole
process tree (SIGTERM: the run saves a checkpoint after its current step; SIGKILL after a grace period);
checkpoints stay, so a later run with ``resume_from_checkpoint: auto`` continues from the last one.

Every path is checked against the workspace (``webui.workspace``) first. The state file is never trusted
on its own: it records the run's pid with the process's start time, command line and workspace, and Stop
(or "busy") signals a process only when all of them match the live process and the command is this very
run's ``rlfactory train <output_dir>/webui_run.yaml``; a state file naming any other process is refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfactory.config.schema import PipelineConfig, RunConfig
from rlfactory.engine.run_dir import write_atomic
from rlfactory.errors import UserError
from rlfactory.webui import workspace

YAML_NAME = "webui_run.yaml"
LOG_NAME = "webui_run.log"
STATE_NAME = "webui_run.json"
RUNS_ROOT = "outputs"  # where the page lists runs (relative to the workspace)
STOP_GRACE_S = 30.0  # on SIGTERM a run finishes its step and saves a checkpoint: time for that, then SIGKILL


@dataclass
class _Active:
    process: subprocess.Popen
    output_dir: Path
    stopping: bool = False


_ACTIVE: dict[Path, _Active] = {}
_LOCK = threading.Lock()


Config = RunConfig | PipelineConfig


def check(raw: dict[str, Any], source: str = "WebUI form") -> tuple[Config, list[str]]:
    """``rlfactory config check`` on the form (schema, datasets, reward and tool files, model path or cache,
    template, the stage's rendering), for a run on this machine: what it lacks (a GPU for zero3, a hub model not
    in the cache when offline) is an error here, not the CLI's warning. A mapping with ``stages:`` is a pipeline,
    as for ``rlfactory train`` (``config.loader.validate_config`` decides); each of its stages is checked.
    Returns the config and the check's notes; raises UserError."""
    from rlfactory.config.loader import validate_config
    from rlfactory.stages.check import check_config

    config = validate_config(raw, source)
    workspace.current().writable(config.output_dir, "output_dir")
    for run in config.stages if isinstance(config, PipelineConfig) else [config]:
        workspace.check_run_paths(run)  # before check_config reads the model and the data
    return config, check_config(config, here=True)


def validate(raw: dict[str, Any], source: str = "WebUI form") -> Config:
    return check(raw, source)[0]


def read_state(output_dir: str | Path) -> dict[str, Any]:
    path = Path(output_dir) / STATE_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_state(output_dir: Path, **update: Any) -> None:
    state = {**read_state(output_dir), **update}
    write_atomic(output_dir / STATE_NAME, json.dumps(state, indent=2))  # read while the watcher thread writes


def _alive(pid: int | None) -> bool:
    import psutil

    if not isinstance(pid, int) or pid <= 0:  # the state file may hold anything
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _command(out: Path, pipeline: bool = False) -> list[str]:
    """The command line of the run in ``out`` (a resolved output dir). A single run's folder was prepared here (see
    the module's docstring); a pipeline's stages prepare their own folders below ``out``, as under the CLI."""
    command = [sys.executable, "-m", "rlfactory", "train", str(out / YAML_NAME)]
    return command if pipeline else [*command, "overwrite_output_dir=false"]


def _run_process(key: Path, state: dict[str, Any]) -> Any:
    """The live process the state file names, only when it is verifiably this run: same start time and
    command line as recorded at launch, the command is this output dir's ``rlfactory train``, it leads its
    own process group, and it was started in this workspace. Else None (a psutil.Process otherwise)."""
    import psutil

    pid = state.get("pid")
    if state.get("status") != "running" or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        same = (
            abs(proc.create_time() - float(state.get("create_time"))) < 0.05
            and cmdline == state.get("command")
            and cmdline[1:] in (_command(key)[1:], _command(key, True)[1:])  # another venv's WebUI may have started it
            and os.getpgid(pid) == pid
            and state.get("workspace") == str(workspace.current().root)
            and proc.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.Error, OSError, TypeError, ValueError):
        return None
    return proc if same else None


def _busy(key: Path) -> bool:
    """Call with _LOCK held. ``key`` is a resolved output dir."""
    active = _ACTIVE.get(key)
    if active is not None:
        return active.process.poll() is None
    return _run_process(key, read_state(key)) is not None


def is_busy(output_dir: str | Path) -> bool:
    """A run started by this or another WebUI is still going on in ``output_dir``."""
    with _LOCK:
        return _busy(Path(output_dir).resolve())


def start(raw: dict[str, Any], yaml_text: str) -> Config:
    """Validate, prepare the output dir and launch the run (or pipeline); returns its config. Raises UserError."""
    from rlfactory.engine import run_dir

    out = raw.get("output_dir")
    if isinstance(out, str) and out.strip() and is_busy(Path(out).expanduser()):
        raise _busy_error(out)  # said first: validate would call the folder "another run"
    config = validate(raw)
    key = Path(config.output_dir).resolve()
    with _LOCK:
        if _busy(key):
            raise _busy_error(config.output_dir)
        pipeline = isinstance(config, PipelineConfig)
        if pipeline:  # its stages' folders are checked (check_config) and prepared by each stage, below this one
            run_dir.check_output_location(config.output_dir)
            key.mkdir(parents=True, exist_ok=True)
        else:
            resume_from = run_dir.resolve_resume(config.output_dir, config.resume_from_checkpoint)
            run_dir.check_output_dir(config.output_dir, config.overwrite_output_dir, resume_from)
            run_dir.prepare_output_dir(config.output_dir, config.overwrite_output_dir, resume_from)
        _ACTIVE[key] = _launch(key, yaml_text, pipeline)
    return config


def _busy_error(output_dir: str) -> UserError:
    return UserError(
        f"output_dir '{output_dir}' is busy: a run is still going on there; stop it first or choose another output_dir"
    )


def _launch(out: Path, yaml_text: str, pipeline: bool = False) -> _Active:
    """Start the run in ``out`` (resolved) and record what identifies its process."""
    import psutil

    (out / YAML_NAME).write_text(yaml_text)
    command = _command(out, pipeline)
    root = workspace.current().root
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(out / LOG_NAME, "w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:  # Popen returns after the exec, so this is the run's own start time and command line
        created = psutil.Process(process.pid).create_time()
    except psutil.Error:  # already gone: the watcher records how it ended
        created = None
    state = {"status": "running", "pid": process.pid, "create_time": created, "command": command}
    state |= {"workspace": str(root), "started": time.time()}
    write_atomic(out / STATE_NAME, json.dumps(state, indent=2))
    active = _Active(process, out)
    threading.Thread(target=_watch, args=(active,), daemon=True, name=f"webui-run-{process.pid}").start()
    return active


def _watch(active: _Active) -> None:
    """Record how the run ended once its process exits."""
    code = active.process.wait()
    status = "stopped" if active.stopping else ("finished" if code == 0 else "failed")
    _write_state(active.output_dir, status=status, returncode=code, ended=time.time())


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_tree(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process, its group and all its descendants; SIGKILL what is left after ``grace_s``."""
    import psutil

    procs = _tree(pid)
    try:
        os.killpg(pid, signal.SIGTERM)  # the run is a session leader: its pgid is its pid
    except (ProcessLookupError, PermissionError):
        pass
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, survivors = psutil.wait_procs(procs, timeout=grace_s)
    for proc in survivors:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(survivors, timeout=grace_s)


def stop(output_dir: str | Path) -> str:
    """Stop the run in ``output_dir``; returns a message for the page. Raises UserError when the folder is
    outside the workspace or its state file names a process this WebUI cannot verify as the run."""
    key = workspace.current().writable(output_dir, "run")
    with _LOCK:
        active = _ACTIVE.get(key)
        state = read_state(key)
        proc = None if active else _run_process(key, state)
    if active is None and proc is None and state.get("status") == "running" and _alive(state.get("pid")):
        raise UserError(
            f"refused to stop process {state.get('pid')}: {output_dir}/{STATE_NAME} names a process that is not "
            "a run this WebUI started in this workspace (its start time or command line differ)"
        )
    pid = active.process.pid if active else (proc.pid if proc else None)
    if pid is None or not is_busy(key):
        return f"no run is going on in '{output_dir}'"
    if active is not None:
        active.stopping = True
    kill_tree(pid)
    if active is not None:
        active.process.wait()
    else:  # started by an earlier WebUI process: nobody watches it, record the end here
        _write_state(key, status="stopped", ended=time.time())
    return f"stopped the run in '{output_dir}' (checkpoints kept: resume_from_checkpoint: auto continues it)"


def live_runs() -> list[Path]:
    """The runs going on that this WebUI can stop, newest first (a reloaded page or a second tab reattaches to the
    first): those this process started, then runs under outputs/ that an earlier WebUI of this workspace started
    (their state file verified). Paths relative to the workspace when inside it, as the page shows them."""
    root = workspace.current().root
    with _LOCK:
        mine = [key for key, active in _ACTIVE.items() if active.process.poll() is None]
        states = [*(root / RUNS_ROOT).glob(f"*/{STATE_NAME}"), *(root / RUNS_ROOT).glob(f"*/*/{STATE_NAME}")]
        found = {path.parent.resolve() for path in states} - set(mine)
        earlier = [key for key in found if _run_process(key, read_state(key)) is not None]
    newest = sorted([*mine, *earlier], key=lambda key: read_state(key).get("started") or 0, reverse=True)
    return [key.relative_to(root) if key.is_relative_to(root) else key for key in newest]


def status(output_dir: str | Path) -> dict[str, Any]:
    """The run's state: running / finished / failed / stopped / interrupted / unknown, with its details."""
    folder = Path(output_dir)
    state = read_state(folder)
    with _LOCK:
        active = _ACTIVE.get(folder.resolve())
    if active is not None and active.process.poll() is not None and state.get("status") == "running":
        code = active.process.returncode  # ended a moment ago; the watcher is about to record it
        state["status"] = "stopped" if active.stopping else ("finished" if code == 0 else "failed")
        state["returncode"] = code
    elif state.get("status") == "running" and not is_busy(folder):
        # the WebUI that watched it went away before it ended: judge by what the run left
        state["status"] = "finished" if (folder / "run_summary.json").is_file() else "interrupted"
    if not state:
        done = (folder / "run_summary.json").is_file()
        state = {"status": "finished" if done else ("unknown" if folder.is_dir() else "not started")}
    return state
