"""The Chat tab (load a model / adapter / run and talk to it) and the Export tab (merge an adapter)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio as gr

from rlfactory.errors import UserError
from rlfactory.webui import chat, monitor
from rlfactory.webui.train_tab import error_md


def model_choices() -> list[str]:
    """Bundled models under data/models, then runs under outputs/ (newest first)."""
    bundled = sorted(str(p.parent) for p in Path("data/models").glob("*/config.json"))
    return bundled + [row["run"] for row in monitor.list_runs()]


def model_dropdown(choices: list[str], elem_id: str) -> Any:
    """A model, adapter or run to use: the first choice picked, any path may be typed (Chat, Evaluate)."""
    return gr.Dropdown(
        choices,
        value=choices[0] if choices else None,
        allow_custom_value=True,
        scale=3,
        label="model dir, LoRA adapter dir or run output dir",
        elem_id=elem_id,
    )


def _template_dropdown(elem_id: str) -> Any:
    from rlfactory.render.templates import TEMPLATES

    choices = [("(auto)", ""), *[(t, t) for t in TEMPLATES]]
    info = "auto: the run's template, else the tokenizer's own"
    return gr.Dropdown(choices, value="", label="template", info=info, elem_id=elem_id)


class ChatTab:
    def __init__(self) -> None:
        choices = model_choices()
        with gr.Row():
            self.path = model_dropdown(choices, "chat-model")
            self.base = gr.Textbox(
                label="base model (adapters only; blank: from the run)", scale=2, elem_id="chat-base"
            )
            self.template = _template_dropdown("chat-template")
            self.load_btn = gr.Button("Load model", variant="primary", scale=1, elem_id="chat-load")
        self.status = gr.Markdown("pick a model and press Load model", elem_id="chat-status")
        with gr.Row():
            self.system = gr.Textbox("Solve the problem. End with 'The answer is N.'", label="system prompt", scale=3)
            self.max_new = gr.Number(64, label="max_new_tokens", precision=0, scale=1)
            self.temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0: greedy)", scale=1)
        with gr.Accordion("tools offered to the model (JSON list of schemas; empty: none)", open=False):
            self.tools = gr.Code("", language="json", elem_id="chat-tools")
            self.example_tool_btn = gr.Button("insert an example tool (calculator)", size="sm")
        self.bot = gr.Chatbot(label="chat", height=380, elem_id="chat-bot")
        with gr.Row():
            self.text = gr.Textbox(
                placeholder="Type a message (after a tool call: the tool's result)",
                show_label=False,
                scale=5,
                elem_id="chat-input",
            )
            self.send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
            self.clear_btn = gr.Button("Clear", scale=1, elem_id="chat-clear")
        self.messages = gr.State([])

    def on_load(self, path: str, base: str, template: str) -> str:
        try:
            return "✓ " + chat.load(path or "", base or "", template or "")
        except UserError as exc:
            return error_md(exc)

    def on_send(self, messages: list, text: str, system: str, tools: str, max_new: float, temperature: float):
        if not text.strip():
            return messages, chat.to_display(messages), "", gr.skip()
        last = messages[-1] if messages else {}
        role = "tool" if last.get("tool_calls") else "user"  # answer a tool call with its result
        head = [{"role": "system", "content": system}] if system.strip() and not messages else []
        convo = [*head, *messages, {"role": role, "content": text.strip()}]
        try:
            convo.append(chat.reply(convo, chat.parse_tools(tools or ""), int(max_new or 64), float(temperature)))
        except UserError as exc:
            return messages, chat.to_display(messages), text, error_md(exc)
        return convo, chat.to_display(convo), "", gr.skip()

    def on_refresh(self) -> Any:
        return gr.Dropdown(choices=model_choices())

    def wire(self) -> None:
        self.load_btn.click(self.on_load, [self.path, self.base, self.template], self.status)
        inputs = [self.messages, self.text, self.system, self.tools, self.max_new, self.temperature]
        outputs = [self.messages, self.bot, self.text, self.status]
        self.send_btn.click(self.on_send, inputs, outputs)
        self.text.submit(self.on_send, inputs, outputs)
        example = json.dumps([chat.CALCULATOR_TOOL], indent=1)
        self.example_tool_btn.click(lambda: example, None, self.tools)
        self.clear_btn.click(lambda: ([], [], ""), None, [self.messages, self.bot, self.text])


class ExportTab:
    def __init__(self) -> None:
        gr.Markdown("Merge a LoRA adapter (or a LoRA run's output dir) into its base model and save a full model.")
        with gr.Row():
            self.path = gr.Dropdown(
                [row["run"] for row in monitor.list_runs()],
                allow_custom_value=True,
                scale=3,
                label="LoRA adapter dir or run output dir",
                elem_id="export-adapter",
            )
            self.base = gr.Textbox(label="base model (blank: from the run)", scale=2, elem_id="export-base")
            self.template = _template_dropdown("export-template")
        with gr.Row():
            self.out = gr.Textbox("outputs/export/merged", label="export folder", scale=3, elem_id="export-out")
            self.overwrite = gr.Checkbox(False, label="overwrite a non-empty folder", scale=1)
            self.btn = gr.Button("Merge and save", variant="primary", scale=1, elem_id="export-btn")
        self.message = gr.Markdown(elem_id="export-message")

    def on_export(self, path: str, base: str, template: str, out: str, overwrite: bool) -> str:
        try:
            return "✓ " + chat.export_merged(path or "", base or "", out or "", template or "", overwrite)
        except UserError as exc:
            return error_md(exc)

    def on_refresh(self) -> Any:
        return gr.Dropdown(choices=[row["run"] for row in monitor.list_runs()])

    def wire(self) -> None:
        self.btn.click(self.on_export, [self.path, self.base, self.template, self.out, self.overwrite], self.message)
