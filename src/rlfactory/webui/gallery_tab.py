"""The Start tab (the page opens on it): every bundled quickstart and the pipeline one click from running, the other
examples with what this machine lacks to run them; Start runs the file as ``rlfactory train FILE`` would (a
pipeline included), "Open in the form" loads it into the Train tab."""

from __future__ import annotations

from typing import Any

import gradio as gr
import pandas as pd

from rlfactory.errors import UserError
from rlfactory.webui import gallery, runner, workspace
from rlfactory.webui import schema_form as sf
from rlfactory.webui.train_tab import error_md

CARDS_PER_ROW = 4
INTRO = (
    "### Start here\n"
    "The **quickstarts** train the bundled tiny model on arithmetic word problems: they run offline on a CPU in "
    "minutes, one per stage, and the **pipeline** (sft, then grpo with a calculator tool) is what `make demo` runs. "
    "**▶ Start** runs the file as `rlfactory train FILE` does and opens Monitor; **Open in the form** loads it into "
    "the Train tab to change it first. The real-model examples below need their model on this machine."
)


def _table(examples: list[gallery.Example]) -> pd.DataFrame:
    rows = [
        {"example": e.path, "stages": " → ".join(e.stages), "what": e.title, "on this machine": gallery.status_text(e)}
        for e in examples
    ]
    return pd.DataFrame(rows, columns=["example", "stages", "what", "on this machine"])


class GalleryTab:
    def __init__(self) -> None:
        self.examples = gallery.examples()
        quick = [e for e in self.examples if e.quickstart]
        gr.Markdown(INTRO)
        self.buttons: list[tuple[Any, str, str]] = []  # (button, action, example path)
        for start in range(0, len(quick), CARDS_PER_ROW):
            with gr.Row(equal_height=True):
                for example in quick[start : start + CARDS_PER_ROW]:
                    self._card(example)
        self.overwrite = gr.Checkbox(
            False,
            label="replace the example's earlier results (overwrite_output_dir: true, as `make demo` does)",
            elem_id="gallery-overwrite",
        )
        self.message = gr.Markdown(elem_id="gallery-message")
        with gr.Accordion("Every example, and what this machine lacks to run it", open=True):
            self.table = gr.Dataframe(
                _table(self.examples),
                interactive=False,
                wrap=True,
                column_widths=["26%", "10%", "38%", "26%"],
                elem_id="gallery-table",
            )
            with gr.Row():
                self.pick = gr.Dropdown(
                    [e.path for e in self.examples], label="example", allow_custom_value=True, elem_id="gallery-pick"
                )
                self.recheck_btn = gr.Button("↻ check again", size="sm", elem_id="gallery-recheck")
                start_btn = gr.Button("▶ Start", variant="primary", size="sm", elem_id="gallery-pick-start")
                open_btn = gr.Button("Open in the form", size="sm", elem_id="gallery-pick-open")
        self.pick_buttons = ((start_btn, "start"), (open_btn, "open"))

    def _card(self, example: gallery.Example) -> None:
        with gr.Column(min_width=220, variant="panel"):
            name = "pipeline" if example.pipeline else example.stages[0]
            gr.Markdown(f"**{name}** · {example.title}\n\n`{example.path}` · {gallery.status_text(example)}")
            with gr.Row():
                start = gr.Button("▶ Start", variant="primary", size="sm", elem_id=f"gallery-start-{example.key}")
                self.buttons.append((start, "start", example.path))
                if not example.pipeline:  # the form edits one run
                    opened = gr.Button("Open in the form", size="sm", elem_id=f"gallery-open-{example.key}")
                    self.buttons.append((opened, "open", example.path))

    # ------------------------------------------------------------------ handlers
    def on_start(self, monitor: Any, path: str, overwrite: bool) -> list[Any]:
        """Run the example as it is (with overwrite_output_dir: true when asked); Monitor opens on it."""
        from rlfactory.config.loader import apply_overrides, read_yaml

        skipped = [gr.skip(), gr.skip(), *[gr.skip()] * len(monitor.outputs())]
        try:
            raw = read_yaml(workspace.current().readable(path or "", "example"))
            if overwrite:
                raw = apply_overrides(raw, ["overwrite_output_dir=true"], "the Start page")
            config = runner.start(raw, sf.raw_to_yaml(raw))
        except UserError as exc:
            return [error_md(exc), *skipped]
        what = "pipeline" if "stages" in raw else f"{config.stage} run"
        message = f"▶ started the {what} `{path}` in `{config.output_dir}`: see Monitor"
        return [message, gr.Tabs(selected="monitor"), config.output_dir, *monitor.update(config.output_dir, None)]

    def on_recheck(self) -> tuple[pd.DataFrame, Any]:
        """The table again (a model downloaded since, a package installed)."""
        self.examples = gallery.examples()
        return _table(self.examples), gr.Dropdown(choices=[e.path for e in self.examples])

    def wire(self, tabs: Any, monitor: Any, train: Any) -> None:
        started = [self.message, tabs, monitor.run, *monitor.outputs()]
        opened = [*train.inputs, *train.stage_groups.values(), train.message, tabs]

        def open_form(path: str) -> list[Any]:
            return [*train.form_from(path, f"✓ loaded `{path}` from the Start page"), gr.Tabs(selected="train")]

        for button, action, path in self.buttons:
            if action == "start":
                button.click(lambda o, p=path: self.on_start(monitor, p, o), self.overwrite, started)
            else:
                button.click(lambda p=path: open_form(p), None, opened)
        (start_btn, _), (open_btn, _) = self.pick_buttons
        start_btn.click(lambda p, o: self.on_start(monitor, p, o), [self.pick, self.overwrite], started)
        open_btn.click(open_form, self.pick, opened)
        self.recheck_btn.click(self.on_recheck, None, [self.table, self.pick])
