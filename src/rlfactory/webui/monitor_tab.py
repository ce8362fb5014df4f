"""The Monitor tab: pick a run (live or old), watch its progress, health alerts, log, charts and rollouts."""

from __future__ import annotations

import html
import time
from typing import Any

import gradio as gr
import pandas as pd

from rlfactory.errors import UserError
from rlfactory.webui import monitor, rollout_view, workspace
from rlfactory.webui.health_panel import HealthPanel
from rlfactory.webui.train_tab import error_md, stop_message

TICK_S = 1.0
CHART_REFRESH_S = 5.0  # a live run's charts: redrawn at most this often (see MonitorTab.update)
CHARTS_PER_ROW = 3
ROLLOUT_WIDTHS = ["30%", "34%"]  # prompt, completion; the numeric columns share the rest
# Vega's own category colours; an alert's marker is red
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#eeca3b", "#9d755d", "#ff9da6", "#bab0ac")
ALERT_COLOR = "#e45756"


def _progress_html(fraction: float, line: str) -> str:
    return (
        f'<div class="rf-progress"><div class="rf-progress-bar" style="width:{fraction * 100:.1f}%"></div></div>'
        f'<div class="rf-progress-text">{html.escape(line)}</div>'
    )


def series_colors(rows: list[dict[str, Any]]) -> dict[str, str]:
    """Each series' colour, in the order the series first appear (alert markers red): the chart draws its lines
    with these and the legend under it names them."""
    names = list(dict.fromkeys(str(row["series"]) for row in rows))
    plain = [name for name in names if not name.startswith("⚠")]
    colors = {name: PALETTE[index % len(PALETTE)] for index, name in enumerate(plain)}
    return {name: colors.get(name, ALERT_COLOR) for name in names}


def legend_html(colors: dict[str, str]) -> str:
    """The chart's legend as HTML that wraps: Vega's own (Gradio puts it below the chart on one line) ran past a
    third-of-the-page chart's edge with the five reward parts or the seven phase timings of a grpo run."""
    item = (
        '<span class="rf-legend-item" style="white-space:nowrap">'
        '<i style="display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:4px;background:{}"></i>'
        "{}</span>"
    )
    items = "".join(item.format(color, html.escape(name)) for name, color in colors.items())
    return f'<div class="rf-legend" style="display:flex;flex-wrap:wrap;gap:2px 14px;font-size:12px">{items}</div>'


def _runs_table() -> pd.DataFrame:
    rows = monitor.list_runs()
    return pd.DataFrame(rows, columns=["run", "stage", "status", "step", "modified"])


class MonitorTab:
    def __init__(self) -> None:
        runs = [row["run"] for row in monitor.list_runs()]
        with gr.Row():
            self.run = gr.Dropdown(
                runs, value=None, label="run (output dir)", allow_custom_value=True, elem_id="monitor-run", scale=4
            )
            self.refresh_btn = gr.Button("↻ refresh runs", size="sm", scale=1, elem_id="monitor-refresh")
            self.stop_btn = gr.Button("Stop this run", variant="stop", size="sm", scale=1, elem_id="monitor-stop")
        # Stop answers in its own line: the status line is redrawn by the timer and would hide the answer
        self.stop_message = gr.Markdown(elem_id="monitor-stop-message")
        self.status = gr.Markdown("pick a run, or press Start on the Train tab", elem_id="monitor-status")
        self.progress = gr.HTML(elem_id="monitor-progress")
        self.health = HealthPanel()
        self.charts: list[tuple[gr.Column, gr.LinePlot, gr.HTML]] = []  # each chart: its box, plot and legend
        for start in range(0, monitor.MAX_CHARTS, CHARTS_PER_ROW):
            with gr.Row():
                for index in range(start, min(start + CHARTS_PER_ROW, monitor.MAX_CHARTS)):
                    with gr.Column(visible=False, elem_id=f"chart-{index}", min_width=160) as column:
                        plot = gr.LinePlot(
                            x="step", y="value", color="series", colors_in_legend=[], elem_id=f"plot-{index}",
                            height=240,
                        )  # fmt: skip
                        legend = gr.HTML(elem_id=f"legend-{index}")
                    self.charts.append((column, plot, legend))
        self.log = gr.Textbox(
            label="console log (tail)", lines=12, max_lines=12, autoscroll=True, elem_id="monitor-log"
        )
        self.rollouts = gr.Dataframe(label="latest rollouts", visible=False, wrap=True, elem_id="monitor-rollouts")
        with gr.Accordion("Runs under outputs/", open=True):
            self.runs = gr.Dataframe(_runs_table(), interactive=False, elem_id="runs-table")
        self.fingerprint = gr.State(None)
        self.timer = gr.Timer(TICK_S)

    def outputs(self) -> list[Any]:
        charts = [part for chart in self.charts for part in chart]
        return [
            self.status, self.progress, *charts, self.log, self.rollouts, self.runs, self.fingerprint,
            *self.health.outputs(),
        ]  # fmt: skip

    def update(self, run: str | None, seen: dict[str, Any] | None, request: gr.Request | None = None) -> list[Any]:
        """What changed on disk since ``seen`` (the parts of ``monitor.fingerprint`` last shown), redrawn; gr.skip()
        for the rest.

        Each part is sent only when its file changed: the status line and the runs table with the run's state, the
        log tail with the console log, the rollouts table with the newest rollouts file, the progress bar and the
        health alerts with trainer_log.jsonl. The charts follow trainer_log.jsonl too, but at most every
        ``CHART_REFRESH_S`` while the run is live: every chart sent is drawn again in the browser, and a CI machine
        with busy cores fell behind when a tick redrew them all each second (the page stopped answering).

        A tick of a page (``request``) whose Monitor was switched to another run since the tick fired answers
        nothing (``is_stale``): drawn after the switch's own answer, it would bring the old run's charts back."""
        outputs = self.outputs()
        if not run or monitor.is_stale(request, run):
            return [gr.skip()] * len(outputs)
        try:
            workspace.current().readable(run, "run")
        except UserError as exc:
            shown = {self.status: error_md(exc), self.fingerprint: None}  # readable again: everything redrawn
            return [shown.get(component, gr.skip()) for component in outputs]
        parts = monitor.fingerprint(run)
        seen = seen if seen and seen.get("where") == parts["where"] else {}  # another run or stage: redraw it all
        changed = {key for key, value in parts.items() if seen.get(key, ()) != value}
        # the charts lag the log while throttled: they are due once the log moved past what they show
        charts_behind = seen.get("charted", ()) != parts["records"]
        charts_due = (
            "charted" not in seen or "state" in changed or time.monotonic() - seen["charted_at"] >= CHART_REFRESH_S
        )
        if not changed and not (charts_behind and charts_due):
            return [gr.skip()] * len(outputs)
        out: dict[Any, Any] = {self.fingerprint: dict(seen, **parts)}
        if "state" in changed:
            out[self.status] = monitor.status_line(run)
        if "console" in changed:
            out[self.log] = monitor.log_text(run)
        if "rollouts" in changed:
            out[self.rollouts] = self._rollouts_table(run)
        if "records" in changed or (charts_behind and charts_due):
            records = monitor.read_records(run)
            if "records" in changed:
                out[self.progress] = _progress_html(*monitor.progress(run, records))
                out.update(zip(self.health.outputs(), self.health.update(run, records), strict=True))
            if charts_behind and charts_due:
                out.update(self._charts(records))
                out[self.runs] = _runs_table()  # the run's step changed: so did its row
                out[self.fingerprint].update(charted=parts["records"], charted_at=time.monotonic())
        if "state" in changed:
            out[self.runs] = _runs_table()  # the run's status changed: so did its row
        if monitor.is_stale(request, run):  # switched while this tick was drawing (seconds, on busy cores)
            return [gr.skip()] * len(outputs)
        return [out.get(component, gr.skip()) for component in outputs]

    def on_switch(self, run: str | None, request: gr.Request) -> list[Any]:
        """The run chosen (dropdown, runs table, Start): drawn whole; the page's ticks for another run go stale."""
        monitor.shown_run(request, run)
        return self.update(run, None)

    def _charts(self, records: list[dict[str, Any]]) -> dict[Any, Any]:
        charts = monitor.alert_markers(monitor.chart_series(records), rollout_view.alerts(records))
        out: dict[Any, Any] = {}
        for index, (column, plot, legend) in enumerate(self.charts):
            if index < len(charts):
                title, rows = charts[index]
                colors = series_colors(rows)
                out[column] = gr.Column(visible=True)
                out[plot] = gr.LinePlot(value=pd.DataFrame(rows), label=title, title=title, color_map=colors)
                out[legend] = legend_html(colors)
            else:
                out[column] = gr.Column(visible=False)
        return out

    @staticmethod
    def _rollouts_table(run: str) -> Any:
        name, rows = monitor.rollouts(run)
        if not rows:
            return gr.Dataframe(visible=False)
        return gr.Dataframe(
            value=pd.DataFrame(rows).round(3),
            label=f"latest rollouts ({name})",
            visible=True,
            column_widths=ROLLOUT_WIDTHS,  # prompt and completion wrap; the numbers stay in view
        )

    def on_stop(self, run: str | None) -> str:
        return stop_message(run) if run else "pick a run first"

    def on_refresh(self) -> tuple[Any, pd.DataFrame]:
        return gr.Dropdown(choices=[row["run"] for row in monitor.list_runs()]), _runs_table()

    def on_select(self, table: pd.DataFrame, evt: gr.SelectData) -> Any:
        return table.iloc[evt.index[0]]["run"] if evt.index is not None else gr.skip()

    def wire(self) -> None:
        outputs = self.outputs()
        self.timer.tick(self.update, [self.run, self.fingerprint], outputs, show_progress="hidden")
        self.run.change(self.on_switch, self.run, outputs, show_progress="hidden")
        self.stop_btn.click(self.on_stop, self.run, self.stop_message)
        self.refresh_btn.click(self.on_refresh, None, [self.run, self.runs])
        self.runs.select(self.on_select, self.runs, self.run)
        self.health.wire(self.run)
