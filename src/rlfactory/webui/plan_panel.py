"""The Train tab's memory estimate, next to Start: `rlfactory plan` on the form's config, before anything loads.

The same path as the CLI: the form is validated as Start validates it (``runner.validate``), then
``engine.plan_report.plan_runs`` estimates it (config.json on the meta device, the memory terms, the step time and
the changes that would make it fit) and ``render`` prints the same table ``rlfactory plan`` prints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from rlfactory.errors import UserError


def estimate(raw: dict[str, Any], gpu_memory_gb: float | None, gpus: float | None) -> str:
    """Markdown: fits or not, the per-GPU peak, what to change, and the full table. Raises UserError."""
    from rlfactory.engine import plan_terms as t
    from rlfactory.engine.plan import detect_gpu
    from rlfactory.engine.plan_report import plan_runs, render, verdict
    from rlfactory.webui import runner

    config = runner.validate(raw)
    memory = float(gpu_memory_gb) if gpu_memory_gb else None
    count = int(gpus) if gpus else None
    plan = plan_runs(config, detect_gpu(count, memory))[0]
    if plan.fits is None:
        head = "? **no GPU here**: enter the GPU memory to see whether it fits"
    else:
        head = f"{'✓' if plan.fits else '✗'} **{verdict(plan).rstrip(':')}**"
    lines = [head]
    lines.append(f"per-GPU peak {plan.peak / t.GiB:.2f} GiB ({plan.peak_phase}), stage {plan.stage}, {plan.strategy}")
    for i, sug in enumerate(plan.suggestions, 1):
        result = "fits" if sug["fits"] else "still too large"
        lines.append(
            f"{i}. `{' '.join(sug['overrides'])}`: -{sug['saves_gb']:.2f} GiB -> {sug['peak_gb']:.2f} GiB, {result} "
            f"({sug['why']})"
        )
    return "\n\n".join(lines) + f"\n\n```text\n{render(plan)}\n```"


class PlanPanel:
    """The inputs (GPU memory and count; blank: this machine's) and the answer, under the Start row."""

    def __init__(self) -> None:
        with gr.Row():
            self.memory = gr.Number(
                None,
                label="GPU memory (GiB) for the estimate",
                info="0 or blank: this machine's GPU",
                elem_id="plan-gpu-memory",
                scale=2,
            )
            self.gpus = gr.Number(
                None, label="GPUs", info="0 or blank: those visible", precision=0, elem_id="plan-gpus", scale=1
            )
            self.button = gr.Button("Estimate memory (plan)", elem_id="btn-plan", scale=1)
        self.answer = gr.Markdown(elem_id="plan-estimate")

    def on_estimate(
        self, raw: Callable[[tuple[Any, ...]], dict[str, Any]], memory: Any, gpus: Any, *values: Any
    ) -> str:
        try:
            return estimate(raw(values), memory, gpus)
        except UserError as exc:
            return f"✗ **no estimate**\n```text\n{exc}\n```"

    def wire(self, inputs: list[Any], raw: Callable[[tuple[Any, ...]], dict[str, Any]], *buttons: Any) -> None:
        """The estimate on its own button and on each of ``buttons`` (Validate): shown before Start."""
        for button in (self.button, *buttons):
            button.click(
                lambda memory, gpus, *v: self.on_estimate(raw, memory, gpus, *v),
                [self.memory, self.gpus, *inputs],
                self.answer,
            )
