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
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from rlfactory.errors import UserError

CHECKPOINT_PREFIX = "checkpoint-"
LOG_FILE = "trainer_log.jsonl"
RUN_MARKERS = ("config.yaml", LOG_FILE)
MARKER_FILE = "run.json"
STATE_FILE = "trainer_state.json"  # a checkpoint's loop state, written last
START_FILES = {MARKER_FILE, "config.yaml", LOG_FILE}  # all a run writes before its first step
PROJECT_FILES = ("pyproject.toml", ".git")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with trainer_state.json), oldest first."""
    folder = Path(output_dir)
    found = []
    for path in folder.glob(f"{CHECKPOINT_PREFIX}*") if folder.is_dir() else []:
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume(output_dir: str, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the latest (``auto``), or an explicit directory."""
    if resume is None:
        return None
    if resume == "auto":
        checkpoints = list_checkpoints(output_dir)
        if checkpoints:
            check_checkpoint(checkpoints[-1])
        return checkpoints[-1] if checkpoints else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(
            f"resume_from_checkpoint: '{resume}' is not a checkpoint directory (no {STATE_FILE}); "
            f"use `auto` or one of: {', '.join(str(p) for p in list_checkpoints(output_dir)) or 'none found'}"
        )
    check_checkpoint(path)
    return path


def check_checkpoint(path: Path) -> None:
    """A checkpoint to resume from is complete: its state file parses with a step, and the model and optimizer files
    that Accelerate restores are there. A bad one (cut by a crash, edited by hand) is an error naming it."""
    fix = "delete it to resume from an earlier checkpoint, or set resume_from_checkpoint to another one"
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise UserError(f"checkpoint '{path}': {STATE_FILE} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise UserError(f"checkpoint '{path}': {STATE_FILE} holds no global_step; {fix}")
    names = [p.name for p in path.iterdir()]
    needed = {"model weights": ("model", "pytorch_model")}
    if not (path / "pytorch_model").is_dir():  # DeepSpeed keeps the optimizer inside its pytorch_model/ folder
        needed["optimizer state"] = ("optimizer",)
    missing = [what for what, prefixes in needed.items() if not any(name.startswith(prefixes) for name in names)]
    if missing:
        raise UserError(f"checkpoint '{path}' is incomplete (no {' and no '.join(missing)}); {fix}")


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


def never_trained(folder: Path) -> bool:
    """``folder`` holds only what one of our runs writes before its first step: our marker, with at most
    config.yaml and a trainer_log.jsonl without a trained step (a step-0 eval line is not one)."""
    if not has_marker(folder) or any(p.name not in START_FILES for p in folder.iterdir()):
        return False
    try:
        return not any("loss" in record for record in read_log(folder) if record.get("step", 0) > 0)
    except ValueError:  # a log line cut by a kill: it was writing, so it may have trained
        return False


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
        for name in START_FILES:
            (folder / name).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder)
    return folder


def write_marker(folder: Path) -> None:
    """``run.json``: marks ``folder`` as an rlfactory run (kept as it is when the run is resumed)."""
    if has_marker(folder):
        return
    from rlfactory import __version__

    marker = {"tool": "rlfactory", "run_id": uuid.uuid4().hex, "version": __version__, "created": time.time()}
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


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
    path = Path(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_log(output_dir: str | Path, last_step: int) -> None:
    """On resume, drop log lines written after the checkpoint (they will be written again)."""
    kept = [r for r in read_log(output_dir) if r.get("step", 0) <= last_step]
    path = Path(output_dir) / LOG_FILE
    if path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


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
