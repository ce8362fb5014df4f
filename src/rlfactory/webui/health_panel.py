"""Monitor's run health panel: the alerts table, and the rollout browser an alert opens at the samples it points to
(``rollout_view``). Built inside the Monitor tab; its outputs join the tab's redraw."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from rlfactory.webui import rollout_view as rv

ALERT_WIDTHS = ["6%", "12%", "6%", "7%", "39%", "30%"]


def _step_choices(run: str | Path) -> list[tuple[str, int]]:
    return [(f"step {s}", s) for s in rv.trace_steps(run)]


class HealthPanel:
    def __init__(self) -> None:
        self.header = gr.Markdown(elem_id="monitor-health")
        self.alerts = gr.Dataframe(
            pd.DataFrame(columns=rv.ALERT_COLUMNS),
            label="health alerts (click one to open the rollouts it points to)",
            interactive=False,
            wrap=True,
            visible=False,
            column_widths=ALERT_WIDTHS,
            elem_id="monitor-alerts",
        )
        with gr.Accordion("Rollout browser", open=False, elem_id="rollout-browser") as self.accordion:
            with gr.Row():
                self.step = gr.Dropdown([], label="trace", elem_id="rollout-step", scale=1)
                choices = [(pick.label, name) for name, pick in rv.PICKS.items()]
                self.pick = gr.Dropdown(choices, value="highest_reward", label="show", elem_id="rollout-pick", scale=2)
            self.note = gr.Markdown(elem_id="rollout-note")
            gr.HTML(rv.kinds_legend())
            self.samples = gr.HTML(elem_id="rollout-samples")
        self.found = gr.State([])

    def outputs(self) -> list[Any]:
        return [self.header, self.alerts, self.step, self.found]

    def update(self, run: str, records: list[dict[str, Any]]) -> list[Any]:
        """The alerts of ``run`` and its traced steps (Monitor's redraw)."""
        found = rv.alerts(records)
        steps = gr.Dropdown(choices=_step_choices(run))
        if not found:
            rl = any("score/mean" in r for r in records)
            header = "✓ **run health**: no alerts" if rl else ""
            return [header, gr.Dataframe(visible=False), steps, []]
        stops = sum(1 for a in found if a.get("action") == "stop")
        header = f"⚠ **run health**: {len(found)} alert(s)" + (f", {stops} stopped the run" if stops else "")
        table = pd.DataFrame(rv.alert_rows(found), columns=rv.ALERT_COLUMNS)
        return [header, gr.Dataframe(value=table, visible=True), steps, found]

    def on_alert(self, run: str | None, found: list[dict[str, Any]], evt: gr.SelectData) -> list[Any]:
        """An alert clicked: the browser opens on its step, ordered by what its rule points to."""
        if not run or evt.index is None or evt.index[0] >= len(found):
            return [gr.skip()] * 5
        step, pick, note, body = rv.for_alert(run, found[evt.index[0]])
        return [gr.Accordion(open=True), step, pick, note, body]

    def on_browse(self, run: str | None, step: int | None, pick: str | None) -> tuple[str, str]:
        if not run:
            return "pick a run first", ""
        steps = rv.trace_steps(run)
        shown = step if step in steps else (steps[-1] if steps else None)
        return rv.browse(run, shown, pick or "highest_reward")

    def wire(self, run: Any) -> None:
        browser = [self.accordion, self.step, self.pick, self.note, self.samples]
        self.alerts.select(self.on_alert, [run, self.found], browser)
        for chooser in (self.step, self.pick):
            chooser.input(self.on_browse, [run, self.step, self.pick], [self.note, self.samples])
        self.accordion.expand(self.on_browse, [run, self.step, self.pick], [self.note, self.samples])
