"""The output directory of a run: refuse to clobber another run, find and rotate checkpoints, log lines.

A run directory carries a marker, ``run.json`` (``{"tool": "rlfactory", "run_id": ...}``), written when the
run starts. ``overwrite_output_dir`` deletes only a directory that holds this marker, an empty one, or a run
written by an older rlfactory (no marker yet, but a ``config.yaml`` with a ``stage`` key next to a
``trainer_log.jsonl`` or a ``checkpoint-*`` folder). Anything else is refused, and so is an output_dir
that is the working directory, the home directory, a project root or a parent of one of them.

A run that never trained a step (it failed while loading data or the model, or crashed before its first step)
leaves only our own start files behind (``run.json``, ``config.yaml``, a log without a trained step): such a
folder does not count as a run, and the same command may start again in it without overwrite_output_dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from rlfactory.errors import UserError

CHECKPOINT_PREFIX = "checkpoint-"
PARTIAL_SUFFIX = ".partial"  # a checkpoint being written; renamed to checkpoint-N when complete
STATE_FILE = "trainer_state.json"
SUMMARY_FILE = "run_summary.json"  # written last by a finished stage
LOG_FILE = "trainer_log.jsonl"
RUN_MARKERS = ("config.yaml", LOG_FILE)
MARKER_FILE = "run.json"
STATE_FILE = "trainer_state.json"  # a checkpoint's loop state, written last
START_FILES = {MARKER_FILE, "config.yaml", LOG_FILE}  # all a run writes before its first step
PROJECT_FILES = ("pyproject.toml", ".git")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it: a kill leaves the old file or the new
    one, never half of one; a reader never sees an empty file (the WebUI's threads write its state file too)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the folder ``src`` to ``dst``, replacing an older ``dst`` (a step saved again after a resume)."""
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)


def remove_partial_checkpoints(output_dir: str | Path) -> None:
    """Folders of checkpoints whose writing was cut by a kill (``checkpoint-N.partial``)."""
    for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}"):
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None. Complete: trainer_state.json parses, and every file it
    lists is there with its size (checkpoints written before the list: an optimizer state is there)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"no {STATE_FILE}"
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} is unreadable ({type(exc).__name__})"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{STATE_FILE} has no global_step"
    files = state.get("files")
    if files is None:  # written before the list: the model and optimizer files Accelerate restores
        names = [p.name for p in path.iterdir()]
        if not any(name.startswith(("model", "pytorch_model")) for name in names):
            return "no model weights"
        deepspeed = (path / "pytorch_model").is_dir()  # DeepSpeed keeps the optimizer inside its pytorch_model/
        return None if deepspeed or any(n.startswith("optimizer") for n in names) else "no optimizer state"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of a complete checkpoint; a UserError naming what is wrong otherwise."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise UserError(
            f"resume_from_checkpoint: '{path}' is not a complete checkpoint ({problem}); a run killed while writing "
            "it leaves such a folder: use `auto` (the newest complete checkpoint) or an earlier checkpoint-N"
        )
    return json.loads((path / STATE_FILE).read_text())


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (see :func:`checkpoint_problem`), oldest first."""
    folder = Path(output_dir)
    found = []
    for path in folder.glob(f"{CHECKPOINT_PREFIX}*") if folder.is_dir() else []:
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
        if match and checkpoint_problem(path) is None:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume(output_dir: str, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the newest complete one (``auto``), or an explicit directory."""
    if resume is None:
        return None
    if resume == "auto":
        checkpoints = list_checkpoints(output_dir)
        if checkpoints:
            return checkpoints[-1]  # damaged newer ones (a kill mid-write) are skipped
        folder = Path(output_dir)
        damaged = sorted(folder.glob(f"{CHECKPOINT_PREFIX}*")) if folder.is_dir() else []
        damaged = [p for p in damaged if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)]
        if damaged:  # only damaged ones: starting over would throw away what the user may mean to recover
            raise UserError(
                f"resume_from_checkpoint: auto found no complete checkpoint in {output_dir}: {damaged[-1].name} is "
                f"incomplete ({checkpoint_problem(damaged[-1])}); delete it to start over, or restore it"
            )
        return None
    path = Path(resume)
    problem = checkpoint_problem(path) if path.is_dir() else "no such directory"
    if problem is not None:
        raise UserError(
            f"resume_from_checkpoint: '{resume}' is not a complete checkpoint ({problem}); "
            f"use `auto` or one of: {', '.join(str(p) for p in list_checkpoints(output_dir)) or 'none found'}"
        )
    return path


def finished_summary(output_dir: str | Path) -> dict[str, Any] | None:
    """The run_summary.json of a stage that finished in ``output_dir``, or None."""
    try:
        summary = json.loads((Path(output_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("saved_as") else None


def skips_finished(output_dir: str, resume: str | None, in_pipeline: bool) -> dict[str, Any] | None:
    """A pipeline stage to skip on a rerun with resume: its summary, when it finished already."""
    return finished_summary(output_dir) if in_pipeline and resume is not None else None


def project_roots(start: Path | None = None) -> list[Path]:
    """The nearest folder at or above ``start`` (default: cwd) holding pyproject.toml or .git, and the
    checkout rlfactory itself runs from (when it is one)."""
    here = (start or Path.cwd()).resolve()
    roots = [p for p in (here, *here.parents) if any((p / name).exists() for name in PROJECT_FILES)][:1]
    own = Path(__file__).resolve().parents[3]
    if (own / "pyproject.toml").is_file():
        roots.append(own)
    return roots


def check_output_location(output_dir: str) -> Path:
    """Refuse an empty output_dir, or one that is (or contains) the working directory, the home directory
    or a project root: wiping or filling it would hit files that are not the run's. Returns it resolved."""
    if not str(output_dir).strip():
        raise UserError("output_dir is empty; give a folder for this run, e.g. output_dir: outputs/run")
    target = Path(output_dir).expanduser().resolve()
    protected = {"the working directory": Path.cwd().resolve(), "the home directory": Path.home().resolve()}
    protected |= {f"the project root {root}": root for root in project_roots()}
    for name, place in protected.items():
        if place == target or target in place.parents:
            where = "is" if place == target else "contains"
            raise UserError(f"output_dir '{output_dir}' {where} {name}; choose a folder of its own, e.g. outputs/run")
    return target


PSEUDO_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))  # the kernel's views: nothing can be saved there


def check_creatable(folder: Path) -> None:
    """The run could create ``folder``: its nearest existing ancestor is a writable directory on a real filesystem
    (checked before the run starts, so a bad output_dir fails before any model loads, and nothing is created)."""
    target = folder.expanduser().absolute()
    for place in PSEUDO_FILESYSTEMS:
        if target == place or place in target.parents:
            raise UserError(f"output_dir '{folder}' is under {place}, a kernel filesystem; choose a normal folder")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"output_dir '{folder}' cannot be created: '{existing}' is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"output_dir '{folder}' cannot be created: '{existing}' is not writable")


def has_marker(folder: Path) -> bool:
    """``folder`` holds a valid ``run.json`` written by rlfactory."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("tool") == "rlfactory" and bool(marker.get("run_id"))


def is_our_run(folder: Path) -> bool:
    """``folder`` holds our marker, or is a run written by an older rlfactory (see the module docstring)."""
    if has_marker(folder):
        return True
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    has_progress = (folder / LOG_FILE).is_file() or any(folder.glob(f"{CHECKPOINT_PREFIX}*"))
    return isinstance(config, dict) and "stage" in config and has_progress


def _check_deletable(output_dir: str) -> None:
    """Refuse to wipe anything but a run of ours or an empty folder (a symlink is never followed)."""
    folder = Path(output_dir)
    if folder.is_symlink():
        raise UserError(
            f"output_dir '{output_dir}' is a symbolic link; overwrite_output_dir does not follow links: "
            "point output_dir at the real folder"
        )
    if folder.is_dir() and any(folder.iterdir()) and not is_our_run(folder):
        raise UserError(
            f"output_dir '{output_dir}' holds files that are not an rlfactory run (no {MARKER_FILE}); "
            "overwrite_output_dir only deletes earlier runs: choose another output_dir or empty that folder yourself"
        )


def check_output_dir(output_dir: str, overwrite: bool, resume_from: Path | None) -> None:
    """Refuse an output_dir that holds another run, unless overwriting or resuming, and an output_dir that
    is not a folder of its own; overwriting is refused for a folder that is not a run. Writes nothing."""
    check_output_location(output_dir)
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"output_dir '{output_dir}' is a file; choose a directory")
    check_creatable(folder)
    holds_run = (
        folder.is_dir()
        and not never_trained(folder)
        and (
            any((folder / marker).exists() for marker in RUN_MARKERS)
            or bool(list(folder.glob(f"{CHECKPOINT_PREFIX}*")))
        )
    )
    if holds_run and not overwrite and resume_from is None:
        raise UserError(
            f"output_dir '{output_dir}' already holds a run; set overwrite_output_dir: true to replace it, "
            "resume_from_checkpoint: auto to continue it, or choose another output_dir"
        )
    if overwrite and resume_from is None:
        _check_deletable(output_dir)


RESTARTABLE = START_FILES | {"rollouts", "loss.png"}  # what a run that saved nothing may leave besides checkpoints


def never_trained(folder: Path) -> bool:
    """``folder`` holds one of our runs that saved nothing to continue from: our marker, start files, a log, traces,
    but no complete checkpoint and no model (it failed, or was killed, before its first checkpoint). Rerunning the
    same command starts it again."""
    if not has_marker(folder) or list_checkpoints(folder):
        return False
    checkpoint_folders = re.compile(rf"{CHECKPOINT_PREFIX}\d+({re.escape(PARTIAL_SUFFIX)})?")
    leftovers = lambda name: name in RESTARTABLE or checkpoint_folders.fullmatch(name) or name.endswith(".tmp")
    return all(leftovers(p.name) for p in folder.iterdir())


def prepare_output_dir(output_dir: str, overwrite: bool, resume_from: Path | None) -> Path:
    """Create (or wipe, when overwriting and not resuming) the output dir and mark it as a run.
    Call after all checks; the deletion rules are checked again here, right before deleting. What a run that
    never trained left behind is removed first (a new run, a new marker)."""
    folder = Path(output_dir)
    if overwrite and resume_from is None and folder.exists():
        check_output_location(output_dir)
        _check_deletable(output_dir)
        shutil.rmtree(folder)
    elif resume_from is None and folder.is_dir() and not folder.is_symlink() and never_trained(folder):
        for path in folder.iterdir():  # what never_trained allows: start files, traces, incomplete checkpoints
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder)
    return folder


def write_marker(folder: Path) -> None:
    """``run.json``: marks ``folder`` as an rlfactory run (kept as it is when the run is resumed)."""
    if has_marker(folder):
        return
    from rlfactory import __version__

    marker = {"tool": "rlfactory", "run_id": uuid.uuid4().hex, "version": __version__, "created": time.time()}
    write_atomic(folder / MARKER_FILE, json.dumps(marker, indent=2) + "\n")


def rotate_checkpoints(output_dir: str | Path, keep: int | None) -> None:
    """Keep the newest ``keep`` complete checkpoints. Also removes any checkpoint folder older than the oldest
    kept one, complete or not: a run killed while deleting (or writing) a checkpoint leaves a partial folder
    that ``list_checkpoints`` no longer sees, and it would stay forever."""
    if keep is None:
        return
    complete = list_checkpoints(output_dir)
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    kept = complete[-keep:]
    if not kept:
        return
    oldest_kept = _step_of(kept[0])
    for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*"):
        step = _step_of(path)
        if step is not None and step < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int | None:
    match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
    return int(match.group(1)) if match else None


def read_log(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of trainer_log.jsonl. A last line cut by a kill is left out; a bad line elsewhere raises."""
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number == len(lines):  # torn by a kill mid-write
                break
            raise UserError(f"{path} line {number} is not JSON: the log is damaged; remove that line") from None
    return records


def truncate_log(output_dir: str | Path, last_step: int) -> None:
    """On resume, drop log lines written after the checkpoint (they will be written again) and a torn last line."""
    path = Path(output_dir) / LOG_FILE
    if path.exists():
        kept = [r for r in read_log(output_dir) if r.get("step", 0) <= last_step]
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def append_log(output_dir: str | Path, record: dict[str, Any]) -> None:
    with open(Path(output_dir) / LOG_FILE, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def plot_log(output_dir: str | Path, keys: tuple[str, ...] = ("loss", "eval_loss")) -> Path | None:
    """loss.png from trainer_log.jsonl (matplotlib imported lazily, headless backend)."""
    records = read_log(output_dir)
    series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
    if not any(series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, points in series.items():
        if points:
            ax.plot(*zip(*points, strict=True), marker="o" if len(points) < 30 else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    path = Path(output_dir) / "loss.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
