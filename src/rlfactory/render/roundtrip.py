"""Reading a render back: every message text, tool call (name and arguments) and tool schema the user gave must be
in the text the chat template wrote, or the row is refused (never trained with the content silently gone).

Templates differ in how they write things (``| trim``, JSON escaping through ``tojson``, calls as JSON or as
``name(args)``, schemas as JSON or as TypeScript), so the check is deliberately format-free: each value must occur
in the rendered text, compared without whitespace, written as is or JSON-escaped. Real templates that drop content
do it wholesale (Llama 3 writes no call and no schema; Llama 3.1 and Mistral drop a turn's text when it has a call),
which this catches; a message is read back in the render of its own turn, so a turn that keeps only its end token
is never trained.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from rlfactory.errors import UserError


def _squash(text: str) -> str:
    return "".join(text.split())


def _forms(value: Any) -> set[str]:
    """How a template may write a value: as is, or JSON-escaped (``tojson``, ASCII or not)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return {_squash(text), _squash(json.dumps(text, ensure_ascii=False)[1:-1]), _squash(json.dumps(text)[1:-1])}


def _kept(value: Any, rendered: str) -> bool:
    return any(form in rendered for form in _forms(value))


def _leaves(value: Any) -> Iterator[Any]:
    """Keys and scalar values of a JSON value (what a call's arguments or a schema are made of)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif value is not None and value != "":
        yield value


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _lost(template: str, what: str, value: Any, where: str) -> UserError:
    return UserError(
        f"{template} drops {what} ('{_short(value)}') of {where}: it is not in the rendered "
        "text, so it would not be trained. Use a template that renders it: set `model.template` (e.g. chatml, "
        "gemma_tools, a TRL template name or a .jinja file), or leave that content out of the rows"
    )


def _missing_in_message(message: dict[str, Any], squashed: str) -> tuple[str, Any] | None:
    """(what, value) of the first part of ``message`` missing from ``squashed`` (the render, no whitespace)."""
    for key in ("content", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str) and value.strip() and not _kept(value, squashed):
            return ("the text" if key == "content" else "the reasoning"), value
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        if not _kept(function["name"], squashed):
            return "the tool call", function["name"]
        for leaf in _leaves(function.get("arguments")):
            if not _kept(leaf, squashed):
                return f"an argument of the tool call '{function['name']}'", leaf
    return None


def check_turn(template: str, message: dict[str, Any], index: int, generated: str) -> None:
    """An assistant turn's text and calls must be in what it is trained on (its own generated text)."""
    missing = _missing_in_message(message, _squash(generated))
    if missing is not None:
        raise _lost(template, missing[0], missing[1], f"message {index} (assistant)")


def check_kept(template: str, messages: list[dict], indices: range, rendered: str) -> None:
    """Messages that are not trained turns (system, user, tool) must be in the text rendered up to them."""
    squashed = _squash(rendered) if indices else ""
    for index in indices:
        missing = _missing_in_message(messages[index], squashed)
        if missing is not None:
            raise _lost(template, missing[0], missing[1], f"message {index} ({messages[index]['role']})")


def check_tools(template: str, tools: list | None, rendered: str) -> None:
    """Each tool schema's name, description and parameter names and descriptions must be rendered."""
    squashed = _squash(rendered)
    for tool in tools or []:
        function = tool.get("function", tool)
        parts = [function.get("name"), function.get("description")]
        for name, spec in ((function.get("parameters") or {}).get("properties") or {}).items():
            parts += [name, spec.get("description") if isinstance(spec, dict) else None]
        for part in parts:
            if part and not _kept(part, squashed):
                raise _lost(template, "part of the tool schema", part, f"the tool '{function.get('name')}'")
