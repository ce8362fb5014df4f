"""Converters from alpaca / sharegpt / openai rows into ONE canonical example.

Canonical example (a plain dict; every stage reads only this):

    messages: [{role: system|user|assistant|tool, content: str,
                tool_calls?: [{type: function, function: {name, arguments: dict}}], tool_call_id?, name?}]
    tools:    [JSON schema, ...] | None
    chosen / rejected: [assistant message(s)] | None      (preference data, continue `messages`)
    label:    bool | None                                  (KTO: desirable or not)
    answer:   str | None                                   (ground truth for verifiable rewards)
    margin:   float | None                                 (optional reward-model margin)

A converter raises RowError with a message naming the column; the loader adds file and row.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rlfactory.data.registry import DatasetSpec

ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """A malformed row; the message names the column and the problem."""


def _column(row: dict[str, Any], column: str | None, required: bool = False) -> Any:
    if column is None:
        return None
    if column not in row:
        if required:
            raise RowError(f"missing column '{column}' (row has: {', '.join(sorted(row)) or 'nothing'})")
        return None
    return row[column]


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(f"{what} must be a string, got {type(value).__name__}")
    return value


def parse_json_field(value: Any, what: str) -> Any:
    """Fields like `tools` or tool arguments may be stored as JSON strings; decode them."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(f"{what} is not valid JSON ({exc.msg} at char {exc.pos})") from None
    return value


def normalize_tool_call(call: Any) -> dict[str, Any]:
    """Accept OpenAI `{type, function: {name, arguments}}` or plain `{name, arguments}`."""
    if not isinstance(call, dict):
        raise RowError(f"a tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RowError("a tool call needs a string `name`")
    arguments = parse_json_field(fn.get("arguments", {}), f"arguments of tool call '{fn['name']}'") or {}
    if not isinstance(arguments, dict):
        raise RowError(f"arguments of tool call '{fn['name']}' must be an object")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if call.get("id"):
        out["id"] = call["id"]
    return out


def normalize_tool_schema(tool: Any) -> Any:
    """A bare function schema ``{name, description, parameters}`` (LLaMA-Factory's glaive rows) becomes the OpenAI
    form ``{type: function, function: {...}}`` that chat templates expect; other shapes pass unchanged."""
    if isinstance(tool, dict) and "function" not in tool and isinstance(tool.get("name"), str):
        return {"type": "function", "function": tool}
    return tool


def normalize_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RowError(f"{where} must be an object with `role` and `content`")
    role = message.get("role")
    if role not in ROLES:
        raise RowError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), f"{where}.content")}
    calls = parse_json_field(message.get("tool_calls"), f"{where}.tool_calls")
    if calls:
        if role != "assistant":
            raise RowError(f"{where}: only assistant messages may have tool_calls")
        out["tool_calls"] = [normalize_tool_call(c) for c in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _response_messages(value: Any, what: str, as_message) -> list[dict[str, Any]]:
    """chosen/rejected: a string, one message, or a list of messages."""
    if value is None or value == "" or value == []:
        raise RowError(f"'{what}' is missing or empty")
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    items = value if isinstance(value, list) else [value]
    return [as_message(item, f"{what}[{i}]") for i, item in enumerate(items)]


def _margin(value: Any, column: str) -> float:
    """A reward-model margin: a finite number (a numeric string is accepted)."""
    try:
        margin = float(value)
    except (TypeError, ValueError):
        raise RowError(f"'{column}' (the margin) must be a number, got {value!r}") from None
    if not math.isfinite(margin):
        raise RowError(f"'{column}' (the margin) must be a finite number, got {value!r}")
    return margin


def _label(value: Any, column: str) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise RowError(f"column '{column}' must be true/false, got {value!r}")


def _common(row: dict[str, Any], spec: DatasetSpec, messages: list[dict[str, Any]], as_message) -> dict:
    cols = spec.columns
    system = _column(row, cols.system)
    if system and messages and messages[0]["role"] == "system":
        if messages[0]["content"] != system:
            raise RowError(f"the conversation starts with a system turn and column '{cols.system}' holds another one")
    elif system:
        messages = [{"role": "system", "content": _text(system, f"column '{cols.system}'")}, *messages]
    tools = parse_json_field(_column(row, cols.tools), f"column '{cols.tools}'")
    if isinstance(tools, dict):  # one schema
        tools = [tools]
    if tools is not None and not isinstance(tools, list):
        raise RowError(f"column '{cols.tools}' must be a list of tool schemas")
    example: dict[str, Any] = {"messages": messages, "tools": [normalize_tool_schema(t) for t in tools or []] or None}
    if spec.ranking:
        example["chosen"] = _response_messages(_column(row, cols.chosen, True), cols.chosen, as_message)
        example["rejected"] = _response_messages(_column(row, cols.rejected, True), cols.rejected, as_message)
    if cols.kto_tag:
        example["label"] = _label(_column(row, cols.kto_tag, True), cols.kto_tag)
    answer = _column(row, cols.answer, required=cols.answer is not None)
    example["answer"] = None if answer is None else str(answer)
    margin = _column(row, cols.margin)
    example["margin"] = None if margin is None else _margin(margin, cols.margin)
    return example


def from_openai(row: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
    column = spec.columns.messages or "messages"
    raw = parse_json_field(_column(row, column, True), f"column '{column}'")
    if not isinstance(raw, list):
        raise RowError(f"column '{column}' must be a list of messages")
    messages = [normalize_message(m, f"{column}[{i}]") for i, m in enumerate(raw)]
    return _common(row, spec, messages, normalize_message)


def from_alpaca(row: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
    cols = spec.columns
    prompt = _text(_column(row, cols.prompt or "instruction", True), f"column '{cols.prompt or 'instruction'}'")
    query = _text(_column(row, cols.query or "input"), f"column '{cols.query or 'input'}'")
    messages: list[dict[str, Any]] = []
    for i, pair in enumerate(_column(row, cols.history) or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise RowError(f"column '{cols.history}'[{i}] must be a [instruction, answer] pair")
        messages += [{"role": "user", "content": str(pair[0])}, {"role": "assistant", "content": str(pair[1])}]
    # LLaMA-Factory's way: the instruction, then the input on the next line (either may be empty)
    messages.append({"role": "user", "content": "\n".join(text for text in (prompt, query) if text)})
    if not spec.ranking:  # SFT and KTO rows carry the response; preference rows carry chosen/rejected
        column = cols.response or "output"
        response = _column(row, column, required=cols.response is not None)
        if response is not None:  # prompt-only rows (RL) have no response
            messages.append({"role": "assistant", "content": _text(response, f"column '{column}'")})
    return _common(row, spec, messages, normalize_message)


def from_sharegpt(row: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
    """sharegpt turns; a `function_call` turn becomes tool_calls of the assistant message before it
    (so one assistant turn may carry both text and tool calls), `observation` becomes a tool message."""
    tags = spec.tags
    column = spec.columns.messages or "conversations"
    turns = parse_json_field(_column(row, column, True), f"column '{column}'")
    if not isinstance(turns, list):
        raise RowError(f"column '{column}' must be a list of turns")
    roles = {
        tags.user_tag: "user",
        tags.assistant_tag: "assistant",
        tags.observation_tag: "tool",
        tags.function_tag: "function_call",
        tags.system_tag: "system",
    }

    def as_message(turn: Any, where: str) -> dict[str, Any]:
        if not isinstance(turn, dict) or turn.get(tags.role_tag) not in roles:
            raise RowError(f"{where}: '{tags.role_tag}' must be one of {', '.join(roles)}")
        role = roles[turn[tags.role_tag]]
        content = _text(turn.get(tags.content_tag), f"{where}.{tags.content_tag}")
        if role != "function_call":
            return {"role": role, "content": content}
        calls = parse_json_field(content, f"{where} (function call)")
        calls = calls if isinstance(calls, list) else [calls]
        return {"role": "assistant", "content": "", "tool_calls": [normalize_tool_call(c) for c in calls]}

    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        msg = as_message(turn, f"{column}[{i}]")
        prev = messages[-1] if messages else None
        if msg.get("tool_calls") and prev and prev["role"] == "assistant" and not prev.get("tool_calls"):
            prev["tool_calls"] = msg["tool_calls"]  # text + call in one assistant turn
        else:
            messages.append(msg)
    return _common(row, spec, messages, as_message)


CONVERTERS = {"openai": from_openai, "alpaca": from_alpaca, "sharegpt": from_sharegpt}
# the column each converter reads when the entry names none (LLaMA-Factory's defaults)
DEFAULT_COLUMNS = {
    "openai": {"messages": "messages"},
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output"},
    "sharegpt": {"messages": "conversations"},
}


def read_columns(spec: DatasetSpec) -> set[str]:
    """Every source column a converter reads for this entry (for the report of columns nobody reads)."""
    named = {value for value in spec.columns.model_dump().values() if value}
    return named | {
        column for key, column in DEFAULT_COLUMNS.get(spec.formatting, {}).items() if not getattr(spec.columns, key)
    }
