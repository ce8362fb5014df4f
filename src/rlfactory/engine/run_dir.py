"""The output directory of a run: refuse to clobber another run, find and rotate checkpoints, log lines."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from rlfactory.errors import UserError

CHECKPOINT_PREFIX = "checkpoint-"
LOG_FILE = "trainer_log.jsonl"
RUN_MARKERS = ("config.yaml", LOG_FILE)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with trainer_state.json), oldest first."""
    folder = Path(output_dir)
    found = []
    for path in folder.glob(f"{CHECKPOINT_PREFIX}*") if folder.is_dir() else []:
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
        if match and (path / "trainer_state.json").is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume(output_dir: str, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the latest (``auto``), or an explicit directory."""
    if resume is None:
        return None
    if resume == "auto":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UserError(
            f"resume_from_checkpoint: '{resume}' is not a checkpoint directory (no trainer_state.json); "
            f"use `auto` or one of: {', '.join(str(p) for p in list_checkpoints(output_dir)) or 'none found'}"
        )
    return path


def check_output_dir(output_dir: str, overwrite: bool, resume_from: Path | None) -> None:
    """Refuse an output_dir that holds another run, unless overwriting or resuming. Writes nothing."""
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"output_dir '{output_dir}' is a file; choose a directory")
    holds_run = folder.is_dir() and (
        any((folder / marker).exists() for marker in RUN_MARKERS) or bool(list(folder.glob(f"{CHECKPOINT_PREFIX}*")))
    )
    if holds_run and not overwrite and resume_from is None:
        raise UserError(
            f"output_dir '{output_dir}' already holds a run; set overwrite_output_dir: true to replace it, "
            "resume_from_checkpoint: auto to continue it, or choose another output_dir"
        )


def prepare_output_dir(output_dir: str, overwrite: bool, resume_from: Path | None) -> Path:
    """Create (or wipe, when overwriting and not resuming) the output dir. Call after all checks."""
    folder = Path(output_dir)
    if overwrite and resume_from is None and folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
