"""The OpenAI chat completions wire format of ``rlfactory serve``'s HF server: requests in, bodies and chunks out.

Pure functions, no model: a request body is validated (pydantic) into a ``ChatRequest`` and its messages turned
into what the chat template renders (the form the training rows have: tool-call arguments as objects, content as
text); replies become ``chat.completion`` bodies or ``chat.completion.chunk`` server-sent events. Anything a
client asks for that this server would not honour (log-probs, penalties, a forced tool choice, JSON mode) is a 400
naming the parameter, never silently ignored; the few parameters that change nothing here (``user``,
``metadata``, ``store``, ``parallel_tool_calls``) are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlfactory.errors import did_you_mean

MAX_N = 16  # choices per request: they are generated one after the other
MAX_STOPS = 4  # OpenAI's limit

# parameter -> the values that mean "not asked for" (anything else is refused with a 400)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "response_format": (None, {"type": "text"}),
    "functions": (None,),
    "function_call": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}


class ApiError(Exception):
    """An error the client gets as OpenAI's error JSON with this status (no traceback ever leaves the server)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # other keys go to the template as they are (it may render them)


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class _Function(_Open):
    name: str
    arguments: str | dict[str, Any]


class _ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class _Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class _FunctionSpec(_Open):
    name: str
    parameters: dict[str, Any] | None = None


class _ToolSpec(_Open):
    type: Literal["function"]
    function: _FunctionSpec


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The parameters this server honours (defaults as OpenAI's)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[_Message] = Field(min_length=1)
    tools: list[_ToolSpec] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    # accepted, and change nothing here
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def uses_tools(self) -> bool:
        """Whether replies are parsed for tool calls (tools offered and not switched off)."""
        return bool(self.tools) and self.tool_choice != "none"


def _where(loc: tuple[Any, ...]) -> str:
    # pydantic adds the union member it tried ("str", "list[_TextPart]"): not a key the client wrote
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and ("[" in part or part == "str")))


def parse_request(body: Any) -> ChatRequest:
    """A request body -> ChatRequest, or an ApiError(400) naming the parameter and what is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, harmless in UNSUPPORTED.items():
        if key in body and body[key] not in harmless:
            raise ApiError(400, f"'{key}' is not supported by rlfactory's HF server (--backend vllm has it)", key)
    if isinstance(body.get("tool_choice"), dict) or body.get("tool_choice") == "required":
        raise ApiError(400, "tool_choice: only 'auto' and 'none' (a forced call needs --backend vllm)", "tool_choice")
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = _where(error["loc"])
        if error["type"] == "extra_forbidden":
            known = ChatRequest.model_fields
            raise ApiError(400, f"unknown parameter '{where}'{did_you_mean(where, known)}", where) from None
        raise ApiError(400, f"{where}: {error['msg']}", where) from None
    if len(request.stops) > MAX_STOPS or any(not s for s in request.stops):
        raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    return request


def template_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template gets them: the training rows' form.

    Content parts are joined into one text; tool-call arguments (a JSON string on the wire) become objects, as
    in the training data (a template that writes ``arguments | tojson`` would quote a string twice); a tool
    result gets the name of the call it answers when it has none (some templates print it)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        row = {k: v for k, v in message.model_dump(exclude_unset=True).items() if v is not None}
        if isinstance(message.content, list):
            row["content"] = "".join(part.text for part in message.content)
        row.setdefault("content", "")
        if message.tool_calls:
            row["tool_calls"] = [
                _call_row(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(row["tool_calls"])
            ]
            names.update({c["id"]: c["function"]["name"] for c in row["tool_calls"] if c.get("id")})
        if message.role == "tool" and "name" not in row and message.tool_call_id in names:
            row["name"] = names[message.tool_call_id]
        out.append(row)
    return out


def _call_row(call: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{where}.function.arguments: not valid JSON ({exc.msg})", where) from None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments: must be a JSON object", where)
    return {**call, "function": {**call["function"], "arguments": arguments}}


# --------------------------------------------------------------------------- replies
@dataclass
class Choice:
    """One finished reply: its text outside any tool calls, the calls (name, arguments), why it ended."""

    index: int
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    finish_reason: Literal["stop", "length", "tool_calls"]
    tokens: int  # generated tokens, the end-of-turn token included


@dataclass
class Reply:
    """Identity of one response (shared by a body or all chunks of a stream)."""

    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())


def tool_call_entries(calls: list[tuple[str, dict[str, Any]]], stream: bool = False) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls``: fresh ids, arguments as a JSON string (a stream's entries carry their index)."""
    entries = []
    for k, (name, arguments) in enumerate(calls):
        entry = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        entries.append({"index": k, **entry} if stream else entry)
    return entries


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def completion_body(reply: Reply, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    """A ``chat.completion`` object (content is null when the reply is only tool calls, as OpenAI sends it)."""

    def message(choice: Choice) -> dict[str, Any]:
        body: dict[str, Any] = {"role": "assistant", "content": choice.content or (None if choice.calls else "")}
        if choice.calls:
            body["tool_calls"] = tool_call_entries(choice.calls)
        return body

    return {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "choices": [
            {"index": c.index, "message": message(c), "finish_reason": c.finish_reason, "logprobs": None}
            for c in choices
        ],
        "usage": usage(prompt_tokens, sum(c.tokens for c in choices)),
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event (``data: [DONE]`` ends a stream)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def chunk(reply: Reply, index: int, delta: dict[str, Any], finish_reason: str | None = None) -> str:
    """One ``chat.completion.chunk`` event for choice ``index``."""
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return sse(_chunk_body(reply, [choice]))


def usage_chunk(reply: Reply, prompt_tokens: int, completion_tokens: int) -> str:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage of the whole request."""
    return sse({**_chunk_body(reply, []), "usage": usage(prompt_tokens, completion_tokens)})


def _chunk_body(reply: Reply, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": reply.id,
        "object": "chat.completion.chunk",
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
    }
