"""The Evaluate tab's logic: ``rlfactory eval`` on a model or a run (and its base model), in a subprocess.

The page runs the CLI command itself (``python -m rlfactory eval PATH --out OUT ...``), as the Train tab runs
``rlfactory train``: one evaluation path, the numbers on the page are those of the ``report.json`` it writes, the
server stays responsive, and Stop kills the process. The commands run in a thread of the server (``start``), not in
the page's event: a reloaded page or a second tab finds the evaluation going on (``live_job``), follows it to its
report and can stop it, as the Train tab reattaches to a run. "Before/after" runs it twice: on the run's output dir
(after) and on the run's own ``config.yaml`` (before: ``rlfactory eval`` of a run YAML evaluates the model the run
started from, base and adapters), with the same options, into ``OUT`` and ``OUT-before``.

Every path is checked against the workspace first (``webui.workspace``); everything else (dataset, metric, sampling
options) is checked by the command, whose one-line error the page shows.
"""

from __future__ import annotations

import html
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlfactory.errors import UserError
from rlfactory.use.evaluate import REPORT, SAMPLES
from rlfactory.webui import workspace

EVAL_ROOT = "outputs/eval"
LOG_NAME = "webui_eval.log"  # beside the --out folder: the command's output (a finished --out holds only its two files)
POLL_S = 0.5
TRACE_ROWS = 200  # trace rows shown; samples.jsonl holds them all
TRACE_TEXT = 400  # characters of a completion shown in the table

_RUNNING: dict[Path, subprocess.Popen] = {}  # output folder -> its command while it runs (Stop finds it here)
_STOPPED: set[Path] = set()  # output folders whose command Stop killed


@dataclass(frozen=True)
class EvalRequest:
    """What the page asks for; a blank or None option is left to the command (the run's setting, else its
    default)."""

    path: str
    dataset: str = ""
    metric: str = ""
    samples: int = 1  # 1: greedy
    temperature: float | None = None
    max_samples: int | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    out: str = ""
    before: bool = False


@dataclass(frozen=True)
class EvalCommand:
    label: str  # "after" (the model given) or "before" (the run's starting model)
    target: str  # what `rlfactory eval` is given
    out: Path

    def argv(self, options: list[str]) -> list[str]:
        return [sys.executable, "-m", "rlfactory", "eval", self.target, *options, "--out", str(self.out)]


def default_out(path: str, dataset: str) -> str:
    """outputs/eval/<model or run name>[-<dataset>], as the CLI names it."""
    name = Path(path.strip()).name or "model"
    return f"{EVAL_ROOT}/{name}-{dataset}" if dataset else f"{EVAL_ROOT}/{name}"


def options(req: EvalRequest) -> list[str]:
    """The command's options for ``req`` (shared by before and after)."""
    given = {
        "--dataset": req.dataset.strip(),
        "--metric": req.metric.strip(),
        "--samples": req.samples,
        "--temperature": req.temperature,
        "--max-samples": req.max_samples,
        "--max-new-tokens": req.max_new_tokens,
        "--seed": req.seed,
    }
    return [part for flag, value in given.items() if value not in (None, "") for part in (flag, str(value))]


def run_model_section(path: str) -> dict[str, Any] | None:
    """The model section of a run dir's config.yaml (None for a model dir that is not a run's output)."""
    file = Path(path) / "config.yaml"
    try:
        raw = yaml.safe_load(file.read_text()) if file.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    model = raw.get("model") if isinstance(raw, dict) else None
    return model if isinstance(model, dict) and model.get("name_or_path") else None


def plan(req: EvalRequest) -> list[EvalCommand]:
    """The commands to run, every path checked against the workspace; UserError names the field."""
    from rlfactory.webui.chat import resolve_source

    path = req.path.strip()
    if not path:
        raise UserError("model: pick a model dir, a LoRA adapter dir or a run's output dir")
    resolve_source(path)  # the model, or the run's base and adapters, from the workspace's allowed roots
    if req.samples < 1:
        raise UserError(f"samples: {req.samples}; give 1 (greedy) or more (sampled)")
    out = workspace.current().writable(req.out.strip() or default_out(path, req.dataset.strip()), "output folder")
    commands = [EvalCommand("after", path, out)]
    if req.before:
        model = run_model_section(path)
        if model is None:
            raise UserError(
                f"before/after: '{path}' is not a run's output dir (no config.yaml naming model.name_or_path), so "
                "it has no base model; untick before/after or pick a run"
            )
        ws = workspace.current()
        ws.readable_model(str(model["name_or_path"]), "the run's model.name_or_path")
        for i, adapter in enumerate(model.get("adapter_paths") or []):
            ws.readable_model(str(adapter), f"the run's model.adapter_paths.{i}")
        before = out.with_name(out.name + "-before")
        commands.insert(0, EvalCommand("before", str(Path(path) / "config.yaml"), before))
    return commands


def last_error(log: Path) -> str:
    """The command's message: the last line of its output (``error: ...`` for bad input)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "the command exited without output"


def run(commands: list[EvalCommand], options_: list[str]) -> Iterator[str]:
    """Run the commands one after another; yields a status line every ``POLL_S`` while they run. Raises UserError
    with the command's own message when one fails. A caller that stops iterating (Stop, a closed page) kills the
    running command."""
    from rlfactory.webui.runner import kill_tree

    root = workspace.current().root
    for number, command in enumerate(commands, start=1):
        log = command.out.with_name(command.out.name + "." + LOG_NAME)
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = command.argv(options_)
        started = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "w") as sink:
            process = subprocess.Popen(
                argv,
                cwd=root,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _RUNNING[command.out] = process
        try:
            while process.poll() is None:
                elapsed = time.monotonic() - started
                yield f"● evaluating ({command.label}, {number}/{len(commands)}) `{command.target}` · {elapsed:.0f} s"
                time.sleep(POLL_S)
        finally:
            _RUNNING.pop(command.out, None)
            if process.poll() is None:
                kill_tree(process.pid, grace_s=2)
        if command.out in _STOPPED:
            _STOPPED.discard(command.out)
            raise UserError(f"stopped: `rlfactory eval {command.target}` was ended before it wrote its report")
        if process.returncode != 0:
            raise UserError(f"{command.label}: `rlfactory eval {command.target}` failed: {last_error(log)}")


@dataclass
class EvalJob:
    """One evaluation going on (or ended) in this server: its request, its commands, the latest status line, and
    at the end its error (None: the reports are in the commands' folders)."""

    request: EvalRequest
    commands: list[EvalCommand]
    line: str = "● starting `rlfactory eval`"
    error: str | None = None
    done: bool = False
    started: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        """How a page names the job it follows: the folder of the model's report."""
        return str(self.commands[-1].out)


_JOBS: dict[str, EvalJob] = {}  # key -> job, the latest per output folder
_JOBS_LOCK = threading.Lock()


def start(req: EvalRequest) -> EvalJob:
    """Plan ``req`` and run its commands in a thread of the server; refused while an evaluation into the same
    folder is going on."""
    commands = plan(req)
    job = EvalJob(req, commands)
    with _JOBS_LOCK:
        earlier = _JOBS.get(job.key)
        if earlier is not None and not earlier.done:
            raise UserError(f"output folder: an evaluation into '{job.key}' is going on; Stop it or wait for it")
        _JOBS[job.key] = job
    threading.Thread(target=_work, args=(job,), name=f"eval {job.key}", daemon=True).start()
    return job


def _work(job: EvalJob) -> None:
    try:
        for line in run(job.commands, options(job.request)):
            job.line = line
    except UserError as exc:
        job.error = str(exc)
    except Exception as exc:  # noqa: BLE001  (the page shows it; the server goes on)
        job.error = f"the evaluation failed: {type(exc).__name__}: {exc}"
    finally:
        job.done = True


def job(key: str | None) -> EvalJob | None:
    with _JOBS_LOCK:
        return _JOBS.get(key) if key else None


def live_job() -> EvalJob | None:
    """The newest evaluation still going on in this server (a reloaded page or a second tab follows it)."""
    with _JOBS_LOCK:
        going = [j for j in _JOBS.values() if not j.done]
    return max(going, key=lambda j: j.started) if going else None


def stop(commands: list[EvalCommand]) -> str:
    """Kill the running command of these output folders (the caller's generator then ends with its error)."""
    from rlfactory.webui.runner import kill_tree

    running = [_RUNNING.get(c.out) for c in commands]
    for command, process in zip(commands, running, strict=True):
        if process is not None and process.poll() is None:
            _STOPPED.add(command.out)
            kill_tree(process.pid, grace_s=2)
    return "■ evaluation stopped" if any(running) else "no evaluation is going on for these settings"


def read_result(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """report.json and samples.jsonl of a finished evaluation."""
    report = json.loads((out / REPORT).read_text())
    rows = [json.loads(line) for line in (out / SAMPLES).read_text().splitlines() if line.strip()]
    return report, rows


def number(value: float) -> str:
    """How the page shows a metric (the test reads it back and compares it with report.json)."""
    return f"{value:.4f}"


def report_html(after: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The report's metrics as a table (one metric a row); with ``before``: before, after and the change."""
    from rlfactory.use.evaluate import format_table

    head = ["metric", *(["before", "after", "change"] if before else ["value"])]
    rows = []
    for name, value in sorted(after["metrics"].items(), key=lambda item: _order(item[0])):
        cells = [f'<td data-metric="{html.escape(name)}" data-run="after">{number(value)}</td>']
        if before:
            old = before["metrics"].get(name)
            shown = number(old) if old is not None else "–"
            change = f"{value - old:+.4f}" if old is not None else "–"
            old_cell = f'<td data-metric="{html.escape(name)}" data-run="before">{shown}</td>'
            cells = [old_cell, *cells, f"<td>{change}</td>"]
        rows.append(f"<tr><td>{html.escape(name)}</td>{''.join(cells)}</tr>")
    described = [format_table(r).splitlines()[0] for r in ([before] if before else []) + [after]]
    caption = "<br>".join(html.escape(line) for line in described)
    header = "".join(f"<th>{h}</th>" for h in head)
    style = "<style>#eval-report td, #eval-report th {padding: 2px 12px; font-variant-numeric: tabular-nums}</style>"
    return (
        f'{style}<div style="font-size: 13px; margin-bottom: 6px">{caption}</div>'
        f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


ORDER = ("mean_score", "pass", "maj", "mean_length", "truncation_rate")  # shown first, in this order; then the rest


def _order(name: str) -> tuple[int, int, str]:
    """Sort key of a metric row: ORDER, then per-k metrics by k."""
    base, _, k = name.partition("@")
    return (ORDER.index(base) if base in ORDER else len(ORDER), int(k) if k.isdigit() else 0, name)


def _clip(text: Any) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= TRACE_TEXT else text[:TRACE_TEXT] + "…"


def trace_rows(after: list[dict[str, Any]], before: list[dict[str, Any]] | None = None) -> tuple[list[str], list[list]]:
    """(headers, rows) of the per-sample table: problem, prompt, answer, and per model its completion, extracted
    answer, score, length, how it ended and its tool calls; before and after side by side (same prompts, same
    order)."""
    full = ("completion", "extracted", "score", "length", "finish_reason", "tool_calls")
    runs = [("", after, full)]
    if before is not None:  # side by side: the before columns kept short, the table stays readable
        runs = [("before ", before, ("completion", "score", "tool_calls")), ("after ", after, full)]
    headers = ["problem", "prompt", "answer"] + [label + f for label, _, fields in runs for f in fields]
    rows = []
    for i, row in enumerate(after[:TRACE_ROWS]):
        cells: list[Any] = [row["problem"], _clip(row["prompt"]), row.get("answer")]
        for _, samples, fields in runs:
            other = samples[i] if i < len(samples) else {}
            cells += [_clip(other.get(f)) if f == "completion" else other.get(f) for f in fields]
        rows.append(cells)
    return headers, rows
