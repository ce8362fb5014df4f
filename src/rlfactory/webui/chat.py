"""Chat with a model, a LoRA adapter or a run's output dir, and merge an adapter into its base model.

Uses the training code paths: ``model.loader`` (tokenizer + template, adapters merged), ``render_prompt``
(the same rendering as rollouts) and ``rollout.hf.generate_ids``. Tool calls the model emits in the
``<tool_call>{json}</tool_call>`` format are parsed and returned separately, so the page can show them.
"""

from __future__ import annotations

import html
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import yaml

from rlfactory.errors import UserError
from rlfactory.use import source as source_module
from rlfactory.use.source import ModelSource, load_source
from rlfactory.webui import workspace

# a call cut off by max_new_tokens has no closing tag: it runs to the end of the text
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@dataclass
class Loaded:
    source: ModelSource
    model: Any
    tokenizer: Any


_CURRENT: dict[str, Loaded] = {}
_LOCK = threading.Lock()


def _workspace_check(path: str, what: str) -> None:
    """The page reads only from the workspace's allowed roots (a Hub name passes: it is not a path)."""
    ws = workspace.current()
    if what == "model":
        ws.readable(path, what)
    else:
        ws.readable_model(path, what)


def resolve_source(path: str, base: str = "", template: str = "") -> ModelSource:
    """``use.source.resolve_source`` with every path checked against the workspace."""
    return source_module.resolve_source(path, base, template, check=_workspace_check)


def load(path: str, base: str = "", template: str = "") -> str:
    """Load (and keep) the chat model; returns a description for the page."""
    source = resolve_source(path, base, template)
    model, tokenizer = load_source(source)
    with _LOCK:
        _CURRENT["chat"] = Loaded(source, model, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    merged = f" + adapter(s) {', '.join(source.adapters)}" if source.adapters else ""
    template_name = source.template or "the tokenizer's own"
    return f"loaded {source.base}{merged} · {params:,} parameters · template: {template_name}"


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated text into its plain content and its tool calls ({name, arguments} or {raw})."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
        except (ValueError, KeyError, TypeError):
            calls.append({"name": "?", "arguments": {}, "raw": body})
    return TOOL_CALL.sub("", text).strip(), calls


def parse_tools(text: str) -> list[dict[str, Any]] | None:
    """The tools box: a JSON (or YAML) list of tool schemas; empty means no tools."""
    if not text.strip():
        return None
    try:
        tools = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"tools: not valid JSON/YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError("tools: expected a list of tool schemas like [{type: function, function: {name: ...}}]")
    return tools


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """Text of generated ids without special tokens, except tool-call tags (special in some tokenizers)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    keep = {i for i in special if "tool_call" in tokenizer.convert_ids_to_tokens(i)}
    return tokenizer.decode([i for i in ids if i not in special - keep], skip_special_tokens=False)


def reply(messages: list[dict[str, Any]], tools: list | None, max_new_tokens: int, temperature: float) -> dict:
    """Generate the next assistant message for ``messages`` (canonical chat messages)."""
    from rlfactory.render.chat import render_prompt
    from rlfactory.rollout.hf import generate_ids

    with _LOCK:
        loaded = _CURRENT.get("chat")
    if loaded is None:
        raise UserError("load a model first")
    prompt = render_prompt(loaded.tokenizer, messages, tools)
    out = generate_ids(loaded.model, loaded.tokenizer, [prompt], int(max_new_tokens), float(temperature))[0]
    text = _decode(loaded.tokenizer, out)
    content, calls = parse_tool_calls(text)
    if any("raw" in call for call in calls):  # a broken call stays text: it is what the model wrote
        content, calls = text.strip(), []
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ]
    return message


def export_merged(path: str, base: str, out_dir: str, template: str = "", overwrite: bool = False) -> str:
    """Merge the adapter(s) of ``path`` into the base model and save a plain HF model dir to ``out_dir``
    (``use.export.export``, what `rlfactory export` runs; every path checked against the workspace)."""
    from rlfactory.use.export import export

    if not out_dir.strip():
        raise UserError("choose an export folder")
    target = workspace.current().writable(out_dir.strip(), "export folder")
    if not resolve_source(path, base, template).adapters:
        raise UserError(f"'{path}' is already a full model (no adapter_config.json): nothing to merge")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise UserError(f"export folder '{out_dir}' is not empty; tick overwrite or choose another folder")
    result = export(path, str(target), base, template, overwrite=overwrite, check=_workspace_check)
    size = sum(size for _, size in result.files)
    return (
        f"merged {', '.join(result.source.adapters)} into {result.source.base} and saved the full model to "
        f"{result.target} ({size / 2**20:.1f} MiB, {len(result.files)} files); load it with model.name_or_path: "
        f"{result.target}"
    )


def to_display(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical chat messages -> Chatbot messages; each tool call becomes a titled bubble."""
    shown: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "system":
            continue
        if role == "tool":
            shown.append({"role": "user", "content": f"↳ tool result: {message['content']}"})
            continue
        if message.get("content") or role == "user":
            # escaped: generated text may hold tags (<think>, a broken <tool_call>) the page would swallow
            shown.append({"role": role, "content": html.escape(message.get("content") or "", quote=False)})
        for call in message.get("tool_calls") or []:
            shown.append(_tool_call_bubble(call))
    return shown


def _tool_call_bubble(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    body, title = json.dumps(function["arguments"], ensure_ascii=False), f"⚙ tool call: {function['name']}"
    return {"role": "assistant", "content": f"`{html.escape(body, quote=False)}`", "metadata": {"title": title}}
