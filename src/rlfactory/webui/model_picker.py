"""The Train tab's model picker: local model folders and cached hub models (``webui.models``), labelled with their
chat template; picking one fills ``model.name_or_path`` and ``model.template``."""

from __future__ import annotations

from typing import Any

import gradio as gr

from rlfactory.webui import models, workspace


def _choices() -> list[tuple[str, str]]:
    ws = workspace.current()
    return [(choice.label, choice.name) for choice in models.all_models(ws.root, ws.read_roots)]


class ModelPicker:
    def __init__(self) -> None:
        with gr.Row():
            self.pick = gr.Dropdown(
                _choices(),
                value=None,
                label="pick a model: local folders and the Hugging Face cache (fills model.name_or_path and template)",
                elem_id="model-picker",
                scale=5,
            )
            self.refresh_btn = gr.Button("↻ models", size="sm", scale=1, elem_id="model-picker-refresh")
        self.note = gr.Markdown(elem_id="model-picker-note")

    def on_pick(self, name: str | None) -> list[Any]:
        """The model's path and template for the form, and a line saying what was filled."""
        if not name:
            return [gr.skip(), gr.skip(), ""]
        ws = workspace.current()
        found = {c.name: c for c in models.all_models(ws.root, ws.read_roots)}
        choice = found.get(name)
        if choice is None:
            return [gr.skip(), gr.skip(), f"✗ `{name}` is no longer listed: press ↻ models"]
        template = "the tokenizer's own" if choice.template else (choice.fill_template or "none: set one")
        note = f"✓ model.name_or_path `{choice.name}` ({choice.where}) · model.template: {template}"
        return [choice.name, choice.fill_template, note]

    def on_refresh(self) -> Any:
        return gr.Dropdown(choices=_choices())

    def wire(self, name_or_path: Any, template: Any) -> None:
        self.pick.change(self.on_pick, self.pick, [name_or_path, template, self.note])
        self.refresh_btn.click(self.on_refresh, None, self.pick)
