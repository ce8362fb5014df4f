"""Tool calls parsed from an assistant turn in the model's own format, looked up by name (``agent.parser``).

Every parser has the signature ``fn(text) -> ParsedTurn``: ``text`` is the decoded assistant turn without its
end-of-turn string. A call that does not parse is kept as a call with ``error_kind="malformed"`` (so the
invalid-call rate and the validity reward see it, and the model gets the error back as the tool result);
``validate_calls`` then marks unknown tools and arguments that do not fit the tool's schema.

- ``hermes``: Qwen2.5 / Hermes / the bundled model, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (several per turn allowed); the text before the first block is the message content.
- ``json``: plain JSON function calls (Llama 3.x style): the whole turn (or a fenced ```json block) is
  ``{"name": ..., "arguments"|"parameters": {...}}`` or a list of them; other text is a final answer.
- ``harmony``: GPT-OSS, ``... to=functions.NAME ... <|message|>{json}<|call|>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfactory.plugins import Registry

TOOL_PARSERS = Registry("tool-call parser")

ErrorKind = Literal["malformed", "unknown_tool", "bad_arguments"]


@dataclass
class ToolCall:
    name: str | None
    arguments: dict[str, Any] | None
    raw: str  # the text the call was parsed from
    error: str | None = None  # why the call cannot run (also the tool result the model gets back)
    error_kind: ErrorKind | None = None

    @property
    def valid(self) -> bool:
        return self.error is None

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry for this call (what render/chat.py renders)."""
        return {"type": "function", "function": {"name": self.name or "", "arguments": self.arguments or {}}}


@dataclass
class ParsedTurn:
    content: str  # the message text without the calls
    calls: list[ToolCall] = field(default_factory=list)


def _malformed(raw: str, why: str) -> ToolCall:
    return ToolCall(None, None, raw, f"malformed tool call: {why}", "malformed")


def call_from_json(raw: str, obj: Any = None) -> ToolCall:
    """A ToolCall from the JSON text of one call: ``{"name", "arguments"|"parameters"}`` (arguments may be a
    JSON string, as OpenAI sends them)."""
    if obj is None:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return _malformed(raw, f"invalid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return _malformed(raw, 'expected {"name": <function-name>, "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(
                obj["name"], None, raw, f"malformed tool call: arguments are not valid JSON ({exc.msg})", "malformed"
            )
    if not isinstance(args, dict):
        return ToolCall(obj["name"], None, raw, "malformed tool call: arguments must be a JSON object", "malformed")
    return ToolCall(obj["name"], args, raw)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@TOOL_PARSERS.register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """``<tool_call>{json}</tool_call>`` blocks; an unclosed last block (cut by the length limit) is malformed.

    >>> call = '{"name": "calculator", "arguments": {"expression": "1+2"}}'
    >>> turn = parse_hermes(f"Let me see.\\n<tool_call>\\n{call}\\n</tool_call>")
    >>> turn.content, turn.calls[0].name, turn.calls[0].arguments
    ('Let me see.', 'calculator', {'expression': '1+2'})
    """
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedTurn(text)
    calls = []
    for match in _HERMES.finditer(text, start):
        raw = match.group(1).strip()
        closed = match.group(0).endswith("</tool_call>")
        calls.append(call_from_json(raw) if closed else _malformed(raw, "<tool_call> is not closed"))
    return ParsedTurn(text[:start].removesuffix("\n"), calls)  # templates put a newline between text and call


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


@TOOL_PARSERS.register("json")
def parse_json_calls(text: str) -> ParsedTurn:
    """The turn is a JSON call (or a list of calls), bare or in a ```json fence; any other text is an answer.

    >>> parse_json_calls('{"name": "calculator", "parameters": {"expression": "2*3"}}').calls[0].arguments
    {'expression': '2*3'}
    >>> parse_json_calls("The answer is 6.").calls
    []
    """
    fence = _FENCE.search(text)
    body = (fence.group(1) if fence else text).strip()
    if not body.startswith(("{", "[")):
        return ParsedTurn(text)
    content = text[: fence.start()].strip() if fence else ""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedTurn(content, [_malformed(body, f"invalid JSON ({exc.msg} at char {exc.pos})")])
    items = obj if isinstance(obj, list) else [obj]
    return ParsedTurn(content, [call_from_json(json.dumps(item), item) for item in items])


_HARMONY = re.compile(r"to=functions\.([\w.\-]+)[^\n]*?<\|message\|>(.*?)(?:<\|call\|>|$)", re.DOTALL)


@TOOL_PARSERS.register("harmony")
def parse_harmony(text: str) -> ParsedTurn:
    """GPT-OSS calls: the recipient is in the header, the arguments are the message body.

    >>> text = '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2"}<|call|>'
    >>> parse_harmony(text).calls[0].name
    'calculator'
    """
    calls = []
    for name, body in _HARMONY.findall(text):
        calls.append(call_from_json(json.dumps({"name": name, "arguments": body.strip()})))
    final = text.rsplit("<|message|>", 1)[-1] if not calls and "<|message|>" in text else text
    content = final if not calls else text[: text.find("to=functions.")]
    return ParsedTurn(re.sub(r"<\|[^|]*\|>", "", content).strip(), calls)


def validate_calls(calls: list[ToolCall], tools: dict[str, Any]) -> list[ToolCall]:
    """Mark calls to unknown tools and calls whose arguments do not fit the tool's schema (in place)."""
    from rlfactory.tools.spec import check_arguments

    for call in calls:
        if call.error is not None:
            continue
        if call.name not in tools:
            call.error_kind = "unknown_tool"
            call.error = f"unknown tool '{call.name}'; available: {', '.join(tools) or 'none'}"
            continue
        why = check_arguments(call.arguments, tools[call.name].parameters)
        if why is not None:
            call.error_kind = "bad_arguments"
            call.error = f"bad arguments for '{call.name}': {why}"
    return calls
