"""The Evaluate tab: ``rlfactory eval`` on a model or a run, before/after, with its report and per-sample traces."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gradio as gr

from rlfactory.errors import UserError
from rlfactory.webui import evaluation, preview
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

    def on_run(self, *values: Any) -> Iterator[list[Any]]:
        """Check, run (a status line while it runs), then the report and the traces."""
        hidden = gr.Dataframe(visible=False)
        try:
            req = self.request(*values)
            commands = evaluation.plan(req)
            yield ["● starting `rlfactory eval`", "", hidden]
            for line in evaluation.run(commands, evaluation.options(req)):
                yield [line, gr.skip(), gr.skip()]
            results = {c.label: evaluation.read_result(c.out) for c in commands}
        except UserError as exc:
            yield [error_md(exc), "", hidden]
            return
        after, rows = results["after"]
        before, before_rows = results.get("before", (None, None))
        headers, table = evaluation.trace_rows(rows, before_rows)
        written = ", ".join(f"`{c.out}`" for c in commands)
        yield [
            f"✓ evaluated: {len(rows)} completion(s); report.json and samples.jsonl in {written}",
            evaluation.report_html(after, before),
            gr.Dataframe(value=table, headers=headers, visible=True, wrap=True),
        ]

    def on_stop(self, *values: Any) -> str:
        try:
            return evaluation.stop(evaluation.plan(self.request(*values)))
        except UserError as exc:
            return error_md(exc)

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
        self.run_btn.click(self.on_run, inputs, [self.status, self.report, self.traces])
        self.stop_btn.click(self.on_stop, inputs, self.status)


def _count(text: Any, what: str) -> int | None:
    """A blank-or-positive-integer box."""
    text = str(text if text is not None else "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{what}: '{text}' is not a whole number (leave it blank for the default)") from None
