"""What the Monitor tab shows, read from a run's output dir: progress and ETA, the log tail, the metric
series of trainer_log.jsonl grouped into charts, the list of past runs and the latest rollouts.

Everything is read from files (never from the training process), so a finished or old run is viewed
exactly like a live one. Files being written are read tolerantly: a half-written last line is skipped.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlfactory.engine.run_dir import LOG_FILE
from rlfactory.webui import runner


@dataclass(frozen=True)
class Chart:
    title: str
    patterns: tuple[str, ...]  # trainer_log.jsonl keys (fnmatch patterns); each matching key is one series


# Plot whichever of these keys the log has, in this order (one chart per entry, several series each).
CHARTS: tuple[Chart, ...] = (
    Chart("loss", ("loss", "eval_loss")),
    Chart("learning rate", ("lr",)),
    Chart("grad norm", ("grad_norm",)),
    Chart("reward margin", ("rewards/margins", "eval_rewards/margins")),
    Chart("preference accuracy", ("rewards/accuracies", "eval_rewards/accuracies")),
    Chart("score", ("score/mean", "val/score")),
    Chart("reward components", ("reward/*/mean",)),
    Chart("KL to the reference", ("actor/kl_loss", "actor/reward_kl")),  # the kl_loss term, the KL in the reward
    Chart("policy KL (to the rollout policy)", ("actor/ppo_kl",)),
    Chart("entropy", ("actor/entropy",)),
    Chart("response length", ("response_length/mean",)),
    Chart("clip fraction", ("actor/pg_clipfrac",)),
    # the rate metrics the health rules read (engine/health.py RATE_RULES)
    Chart("responses cut at the cap", ("response_length/clip_ratio",)),
    Chart("zero-advantage groups", ("rollout/zero_adv_groups", "actor/rows_forward_only")),  # the update skips them
    Chart("sampler mismatch (tokens over the IS cap)", ("rollout/ratio_over_cap",)),
    Chart("phase timings (s)", ("timing_s/*",)),
)
MAX_CHARTS = len(CHARTS)
RUNS_ROOT = runner.RUNS_ROOT


def pipeline_stages(output_dir: str | Path) -> list[Path]:
    """A pipeline started from the page (its ``webui_run.yaml`` has ``stages:``): each stage's folder, in order;
    [] for a single run. Validated as ``rlfactory train`` reads it, so the folders are the ones it writes."""
    path = Path(output_dir) / runner.YAML_NAME
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return []
    return [Path(folder) for folder in _stage_folders(str(path), stamp)]


@functools.lru_cache(maxsize=64)
def _stage_folders(path: str, stamp: int) -> tuple[str, ...]:
    """Cached by the file's modification time: the Monitor asks every second."""
    from rlfactory.config.loader import read_yaml, validate_config
    from rlfactory.config.schema import PipelineConfig
    from rlfactory.errors import UserError

    try:
        raw = read_yaml(path)
        config = validate_config(raw, path) if "stages" in raw else None
    except UserError:
        return ()
    return tuple(run.output_dir for run in config.stages) if isinstance(config, PipelineConfig) else ()


def stage_dir(output_dir: str | Path) -> Path:
    """Where the run's trainer_log.jsonl and rollouts are: its own folder, or for a pipeline the stage trained last
    (the last stage folder that exists; the first before any does)."""
    stages = pipeline_stages(output_dir)
    if not stages:
        return Path(output_dir)
    started = [folder for folder in stages if folder.is_dir()]
    return started[-1] if started else stages[0]


def read_records(output_dir: str | Path) -> list[dict[str, Any]]:
    """trainer_log.jsonl lines (a pipeline's: its current stage's); a line still being written (not valid JSON) is
    skipped."""
    path = stage_dir(output_dir) / LOG_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def series_name(key: str, pattern: str) -> str:
    """A key's legend entry: what its pattern's ``*`` matched (``reward/tool_call_validity/mean`` ->
    ``tool_call_validity`` in "reward components"), else the key. A chart is a third of the page wide: full keys ran
    out of its legend."""
    if "*" not in pattern:
        return key
    head, _, tail = pattern.partition("*")
    return key[len(head) : len(key) - len(tail)] or key


def chart_series(records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """[(chart title, rows of {step, value, series})] for each chart that has data, in CHARTS order."""
    keys: list[str] = []
    for record in records:
        keys += [k for k in record if k not in keys]
    charts = []
    for chart in CHARTS:
        matched = {k: series_name(k, p) for p in chart.patterns for k in keys if fnmatch.fnmatchcase(k, p)}
        rows = [
            {"step": r["step"], "value": float(r[k]), "series": name}
            for k, name in matched.items()
            for r in records
            if isinstance(r.get(k), int | float)
        ]
        if rows:
            charts.append((chart.title, rows))
    return charts


def alert_markers(
    charts: list[tuple[str, list[dict[str, Any]]]], alerts: list[dict[str, Any]]
) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each health alert as a vertical line at its step, a series of its own (``⚠ rule @ step``), on the chart of
    the metric it judged (a metric without a chart, e.g. skipped_steps: the first chart, the loss)."""
    patterns = {chart.title: chart.patterns for chart in CHARTS}
    marked = [(title, list(rows)) for title, rows in charts]
    for alert in alerts if marked else []:
        metric = str(alert.get("metric"))
        index = next(
            (i for i, (title, _) in enumerate(marked) if any(fnmatch.fnmatchcase(metric, p) for p in patterns[title])),
            0,
        )
        rows = marked[index][1]
        values = [row["value"] for row in rows if not str(row["series"]).startswith("⚠")]
        low, high = (min(values), max(values)) if values else (0.0, 1.0)
        if high == low:
            low, high = low - 0.5, high + 0.5
        name = f"⚠ {alert.get('rule')} @ {alert['step']}"
        rows += [{"step": alert["step"], "value": value, "series": name} for value in (low, high)]
    return marked


def configured_steps(output_dir: str | Path) -> int | None:
    """Total optimizer steps: train.max_steps from the run's YAML, else the count the trainer printed."""
    folder = stage_dir(output_dir)
    for name in ("config.yaml", runner.YAML_NAME):
        try:
            raw = yaml.safe_load((folder / name).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        steps = (raw.get("train") or {}).get("max_steps") if isinstance(raw, dict) else None
        if steps:
            return int(steps)
    counts = re.findall(r"\b(\d+) steps, batch", log_text(output_dir, 200))
    return int(counts[-1]) if counts else None  # a pipeline's log: the stage started last


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else (f"{minutes}m {secs:02d}s" if minutes else f"{secs}s")


def progress(output_dir: str | Path, records: list[dict[str, Any]]) -> tuple[float, str]:
    """(fraction done, one line: step k/n, percent, elapsed, ETA) from the last log record with timing."""
    timed = [r for r in records if "eta_s" in r]
    total = configured_steps(output_dir)
    if not timed:
        return 0.0, f"step 0/{total or '?'}: waiting for the first log line"
    last = timed[-1]
    step = int(last["step"])
    total = total or step + 1
    fraction = min(step / total, 1.0)
    line = (
        f"step {step}/{total} ({fraction:.0%}) · elapsed {_duration(last.get('elapsed_s'))}"
        f" · ETA {_duration(last.get('eta_s'))}"
    )
    return fraction, line


def log_text(output_dir: str | Path, max_lines: int = 40) -> str:
    """The last lines of the run's console log; progress-bar redraws (\\r) keep only their last state."""
    path = Path(output_dir) / runner.LOG_NAME
    if not path.is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - 64_000))
        text = handle.read().decode("utf-8", errors="replace")
    # split on newlines only: str.splitlines() would also split at the \r of every progress-bar redraw
    lines = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]
    return "\n".join(lines[-max_lines:]).rstrip("\n")


def summary(output_dir: str | Path) -> dict[str, Any]:
    path = Path(output_dir) / "run_summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def status_line(output_dir: str | Path) -> str:
    """Markdown: the run's output dir and state and, when finished, where the model went and what it scored."""
    state = runner.status(output_dir)
    words = {
        "running": "● **running**",
        "finished": "✓ **finished**",
        "failed": f"✗ **failed** (exit code {state.get('returncode')}): see the log below",
        "stopped": "■ **stopped** (checkpoints kept; `resume_from_checkpoint: auto` continues the run)",
        "interrupted": "⚠ **interrupted** (the WebUI that started it went away)",
    }
    line = f"`{output_dir}` · " + words.get(state["status"], f"**{state['status']}**")  # which run is shown
    stages = pipeline_stages(output_dir)
    if stages:
        current = stage_dir(output_dir)
        line += f" · pipeline stage {stages.index(current) + 1}/{len(stages)}: `{current}`"
    done = summary(current if stages else output_dir)
    if state["status"] == "finished" and done:
        line += f": saved {done.get('saved_as')} model to `{done.get('output_dir')}` at step {done.get('global_step')}"
        eval_loss = (done.get("eval") or {}).get("eval_loss")
        if eval_loss is not None:
            line += f", eval loss {eval_loss:.4f}"
    return line


def fingerprint(output_dir: str | Path) -> dict[str, Any]:
    """What the Monitor tab shows may have changed when one of these parts changed (cheap: stat calls only): ``where``
    (the run and, for a pipeline, the stage folder shown), ``records`` (trainer_log.jsonl), ``console`` (the console
    log), ``state`` (the runner's state file and the run summary) and ``rollouts`` (the newest rollouts file). The tab
    redraws only the parts whose files changed."""
    folder, data = Path(output_dir), stage_dir(output_dir)

    def stat(path: Path) -> tuple[int, int] | None:
        try:
            info = path.stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    rollouts = sorted((data / "rollouts").glob("step_*.jsonl")) if (data / "rollouts").is_dir() else []
    return {
        "where": (str(folder), str(data)),
        "records": stat(data / LOG_FILE),
        "console": stat(folder / runner.LOG_NAME),
        "state": (stat(folder / runner.STATE_NAME), stat(folder / "run_summary.json")),
        "rollouts": (rollouts[-1].name, stat(rollouts[-1])) if rollouts else None,
    }


def list_runs(root: str | Path = RUNS_ROOT) -> list[dict[str, Any]]:
    """Run folders under ``root`` (a pipeline's stages one level deeper), newest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    markers = (LOG_FILE, "config.yaml", runner.STATE_NAME)
    folders = {p.parent for marker in markers for p in [*base.glob(f"*/{marker}"), *base.glob(f"*/*/{marker}")]}
    rows = []
    for folder in folders:
        records = read_records(folder)
        mtime = max((folder / m).stat().st_mtime for m in markers if (folder / m).exists())
        rows.append(
            {
                "run": str(folder),
                "stage": _stage_of(folder),
                "status": runner.status(folder)["status"],
                "step": records[-1]["step"] if records else 0,
                "modified": time.strftime("%Y-%m-%d %H:%M", time.localtime(mtime)),
                "_mtime": mtime,
            }
        )
    rows.sort(key=lambda row: row.pop("_mtime"), reverse=True)
    return rows


def _stage_of(folder: Path) -> str:
    for name in ("config.yaml", runner.YAML_NAME):
        try:
            raw = yaml.safe_load((folder / name).read_text()) or {}
            return "pipeline" if "stages" in raw else str(raw.get("stage", "?"))
        except (OSError, yaml.YAMLError, AttributeError):
            continue
    return "?"


def rollouts(output_dir: str | Path, limit: int = 20) -> tuple[str, list[dict[str, Any]]]:
    """(file name, rows) of the newest ``rollouts/step_*.jsonl``: prompt, completion, reward, one column
    per reward component."""
    folder = stage_dir(output_dir) / "rollouts"
    files = sorted(folder.glob("step_*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        return "", []
    rows = []
    for line in files[-1].read_text(errors="replace").splitlines()[:limit]:
        try:
            rows.append(_rollout_row(json.loads(line)))
        except (ValueError, AttributeError):
            continue
    return files[-1].name, rows


TEMPLATE_TOKEN = re.compile(r"<\|[^|<>]{1,40}\|>|</?s>|\[/?INST\]")  # <|im_start|>, <|eot_id|>, <s>, [INST]
PROMPT_CHARS = 240  # the prompt's tail shown: a system prompt and tool schemas come first, the question last


def prompt_text(value: Any) -> str:
    """A rollout's prompt for the table: the last user message (chat messages), or the rendered prompt without its
    template tokens, its tail when long (the question is at the end)."""
    if isinstance(value, list):
        users = [m for m in value if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1].get("content")) if users else _text_of(value)
    text = re.sub(r"\n{2,}", "\n", TEMPLATE_TOKEN.sub("", _text_of(value))).strip()
    return text if len(text) <= PROMPT_CHARS else "…" + text[-PROMPT_CHARS:].lstrip()


def _text_of(value: Any) -> str:
    """A prompt/completion field: plain text, or a list of chat messages shown as 'role: content'."""
    if isinstance(value, list):
        return "\n".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in value)
    return "" if value is None else str(value)


def _rollout_row(record: dict[str, Any]) -> dict[str, Any]:
    row = {
        "prompt": prompt_text(record.get("prompt", record.get("messages"))),
        "completion": _text_of(record.get("completion", record.get("response"))),
        "reward": record.get("reward", record.get("score")),
    }
    for key in ("answer", "advantage"):
        if key in record:
            row[key] = record[key]
    components = record.get("rewards") or record.get("reward_components") or {}
    for name, value in components.items() if isinstance(components, dict) else []:
        row[f"reward/{name}"] = value
    for key, value in record.items():
        if key.startswith("reward/"):
            row[key] = value
    return row


# browser session -> the run its Monitor tab was last switched to (``MonitorTab.on_switch``, a Start)
_SHOWN: dict[str, str | None] = {}


def shown_run(request: Any, run: str | None) -> None:
    """Record that the page of ``request`` now shows ``run``."""
    if request is not None and request.session_hash:
        _SHOWN[request.session_hash] = run


def is_stale(request: Any, run: str | None) -> bool:
    """Whether the page of ``request`` was switched to another run than ``run`` (a tick that fired before)."""
    if request is None or not request.session_hash or request.session_hash not in _SHOWN:
        return False
    return _SHOWN[request.session_hash] != run
