"""The Evaluate tab: ``rlfactory eval`` on a model or a run, before/after, with its report and per-sample traces."""

from __future__ import annotations

from typing import Any

import gradio as gr

from rlfactory.errors import UserError
from rlfactory.webui import evaluation, preview, workspace
from rlfactory.webui.chat_tab import model_choices, model_dropdown
from rlfactory.webui.train_tab import error_md

MODES = ("greedy", "sampled")


def _metric_choices() -> list[tuple[str, str]]:
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    return [("(the run's, else answer_match)", ""), *[(name, name) for name in REWARD_FUNCTIONS.names()]]


class EvaluateTab:
    def __init__(self) -> None:
        gr.Markdown(
            "Evaluate a model, LoRA adapter or run with `rlfactory eval` (the command runs here; its `report.json` "
            "is what the table shows). Tick **before/after** on a run to evaluate the model it started from too."
        )
        choices = model_choices()
        with gr.Row():
            self.path = model_dropdown(choices, "eval-model")
            datasets = [("(the run's evaluation.dataset)", ""), *[(d, d) for d in preview.registered_datasets()]]
            self.dataset = gr.Dropdown(datasets, value="", label="dataset", scale=2, elem_id="eval-dataset")
            self.metric = gr.Dropdown(_metric_choices(), value="", label="metric", scale=2, elem_id="eval-metric")
        with gr.Row():
            self.mode = gr.Radio(list(MODES), value="greedy", label="decoding", elem_id="eval-mode")
            self.samples = gr.Number(4, precision=0, label="k (samples per prompt, sampled)", elem_id="eval-k")
            self.temperature = gr.Number(1.0, label="temperature (sampled)", elem_id="eval-temperature")
            self.max_samples = gr.Textbox("", label="max prompts (blank: the run's, else all)", elem_id="eval-max")
            self.max_new = gr.Textbox("", label="max_new_tokens (blank: the run's, else 64)", elem_id="eval-max-new")
        with gr.Row():
            self.before = gr.Checkbox(False, label="before/after (a run: also its base model)", elem_id="eval-before")
            self.out = gr.Textbox(
                "", label="output folder (blank: outputs/eval/<name>-<dataset>)", scale=3, elem_id="eval-out"
            )
            self.run_btn = gr.Button("Evaluate", variant="primary", scale=1, elem_id="eval-run")
            self.stop_btn = gr.Button("Stop", variant="stop", scale=1, elem_id="eval-stop")
        self.status = gr.Markdown(elem_id="eval-status")
        self.report = gr.HTML(elem_id="eval-report")
        self.traces = gr.Dataframe(label="per-sample traces", visible=False, wrap=True, elem_id="eval-traces")
        self.job = gr.State(None)  # the key of the evaluation this page follows (evaluation.EvalJob.key)
        self.timer = gr.Timer(evaluation.POLL_S * 2)

    def request(self, path, dataset, metric, mode, k, temperature, max_samples, max_new, before, out) -> Any:
        sampled = mode == "sampled"
        return evaluation.EvalRequest(
            path=str(path or ""),
            dataset=str(dataset or ""),
            metric=str(metric or ""),
            samples=int(k or 0) if sampled else 1,
            temperature=float(temperature) if sampled and temperature is not None else None,
            max_samples=_count(max_samples, "max prompts"),
            max_new_tokens=_count(max_new, "max_new_tokens"),
            out=str(out or ""),
            before=bool(before),
        )

    def on_run(self, *values: Any) -> list[Any]:
        """Check and start the evaluation in the server; the timer follows it (``on_tick``)."""
        try:
            job = evaluation.start(self.request(*values))
        except UserError as exc:
            return [error_md(exc), "", gr.Dataframe(visible=False), None]
        return [job.line, "", gr.Dataframe(visible=False), job.key]

    def on_tick(self, key: str | None) -> list[Any]:
        """The followed evaluation's status line while it runs; at its end its report and traces (or its error),
        and the page stops following it."""
        job = evaluation.job(key)
        if job is None:
            return [gr.skip()] * 4
        if not job.done:
            return [job.line, gr.skip(), gr.skip(), key]
        if job.error:
            return [error_md(UserError(job.error)), "", gr.Dataframe(visible=False), None]
        results = {c.label: evaluation.read_result(c.out) for c in job.commands}
        after, rows = results["after"]
        before, before_rows = results.get("before", (None, None))
        headers, table = evaluation.trace_rows(rows, before_rows)
        root = workspace.current().root  # the folders as the page names paths: inside the workspace, relative
        written = ", ".join(
            f"`{c.out.relative_to(root) if c.out.is_relative_to(root) else c.out}`" for c in job.commands
        )
        return [
            f"✓ evaluated: {len(rows)} completion(s); report.json and samples.jsonl in {written}",
            evaluation.report_html(after, before),
            gr.Dataframe(value=table, headers=headers, visible=True, wrap=True),
            None,
        ]

    def on_stop(self, key: str | None, *values: Any) -> str:
        """Stop the evaluation this page follows (started here or found on reload), else the form's."""
        job = evaluation.job(key)
        try:
            commands = job.commands if job and not job.done else evaluation.plan(self.request(*values))
        except UserError as exc:
            return error_md(exc)
        return evaluation.stop(commands)

    def on_load(self) -> list[Any]:
        """A page opening: the model list, and an evaluation going on in this server reattached (its form
        settings, its status; the timer follows it to its report and Stop stops it)."""
        job = evaluation.live_job()
        if job is None:
            return [gr.Dropdown(choices=model_choices()), *[gr.skip()] * 9, gr.skip(), None]
        req = job.request
        sampled = req.samples > 1
        form = [
            gr.Dropdown(choices=model_choices(), value=req.path), req.dataset, req.metric,
            "sampled" if sampled else "greedy", req.samples if sampled else gr.skip(),
            req.temperature if req.temperature is not None else gr.skip(), _text(req.max_samples),
            _text(req.max_new_tokens), req.before, req.out,
        ]  # fmt: skip
        return [*form, f"{job.line} · reattached: this page follows it again", job.key]

    def on_refresh(self) -> Any:
        return gr.Dropdown(choices=model_choices())

    def wire(self) -> None:
        inputs = [
            self.path,
            self.dataset,
            self.metric,
            self.mode,
            self.samples,
            self.temperature,
            self.max_samples,
            self.max_new,
            self.before,
            self.out,
        ]
        shown = [self.status, self.report, self.traces, self.job]
        self.run_btn.click(self.on_run, inputs, shown)
        self.timer.tick(self.on_tick, self.job, shown, show_progress="hidden")
        self.stop_btn.click(self.on_stop, [self.job, *inputs], self.status)
        self.inputs = inputs

    def reattach_outputs(self) -> list[Any]:
        """What ``on_load`` fills (the app calls it when a page opens)."""
        return [*self.inputs, self.status, self.job]


def _text(count: int | None) -> str:
    return "" if count is None else str(count)


def _count(text: Any, what: str) -> int | None:
    """A blank-or-positive-integer box."""
    text = str(text if text is not None else "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{what}: '{text}' is not a whole number (leave it blank for the default)") from None
