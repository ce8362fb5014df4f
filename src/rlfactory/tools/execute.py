"""Run parsed tool calls concurrently: asyncio, a concurrency limit, a per-call timeout, errors as strings.

A tool never crashes a run: an invalid call, an exception or a timeout becomes the tool result the model
reads (``"Error: ..."``) and is counted as a tool error. Plain functions run on daemon threads (a hung one
is abandoned at its timeout, as in the reward stack); ``async def`` tools are awaited; tools flagged
``runs_code`` run in a fresh Python subprocess (``rlfactory.tools.sandbox``) with a CPU-time and
address-space limit, killed at the timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from rlfactory.tools.parsers import ToolCall
from rlfactory.tools.spec import Tool


@dataclass(frozen=True)
class ExecLimits:
    timeout_s: float = 10.0
    max_concurrency: int = 16
    memory_mb: int = 1024  # runs_code tools: address-space limit of the subprocess
    max_chars: int = 2000  # longer results are cut (the rest costs tokens and teaches nothing)


@dataclass
class ToolResult:
    content: str  # what the model reads
    error: str | None = None  # None: the tool ran and returned
    seconds: float = 0.0


def as_text(value: Any) -> str:
    """A tool's return value as the string the model reads (JSON for anything but a string)."""
    return value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} characters cut]"


async def _in_thread(fn: Any, kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)`` on a daemon thread (abandoned, not joined, if the caller times out)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            value, error = fn(**kwargs), None
        except BaseException as exc:  # the tool's own error: reported to the model
            value, error = None, exc
        if not loop.is_closed():
            loop.call_soon_threadsafe(
                lambda: future.done() or (future.set_exception(error) if error else future.set_result(value))
            )

    threading.Thread(target=target, daemon=True).start()
    return await future


async def _in_subprocess(tool: Tool, arguments: dict[str, Any], limits: ExecLimits, timeout: float) -> str:
    payload = json.dumps({"ref": tool.source, "arguments": arguments, "memory_mb": limits.memory_mb, "cpu_s": timeout})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlfactory.tools.sandbox",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(payload.encode()), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        proc.kill()
        await proc.wait()
        raise
    try:
        reply = json.loads(out.decode().strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"the tool process died ({tail[0][:200]})") from None
    if not reply["ok"]:
        raise RuntimeError(reply["error"])
    return reply["result"]


async def run_call(call: ToolCall, tools: dict[str, Tool], limits: ExecLimits, gate: asyncio.Semaphore) -> ToolResult:
    """One call -> its result; never raises."""
    if not call.valid:
        return ToolResult(f"Error: {call.error}", call.error)
    tool = tools[str(call.name)]
    timeout = tool.timeout_s or limits.timeout_s
    arguments = call.arguments or {}
    async with gate:
        start = time.monotonic()
        try:
            if tool.runs_code:
                value: Any = await _in_subprocess(tool, arguments, limits, timeout)
            elif inspect.iscoroutinefunction(tool.fn):
                value = await asyncio.wait_for(tool.fn(**arguments), timeout)
            else:
                value = await asyncio.wait_for(_in_thread(tool.fn, arguments), timeout)
            return ToolResult(_cut(as_text(value), limits.max_chars), None, time.monotonic() - start)
        except (asyncio.TimeoutError, TimeoutError):
            error = f"tool '{tool.name}' timed out after {timeout:g}s"
        except Exception as exc:  # the tool failed: the model reads why
            error = f"{type(exc).__name__}: {exc}"
        return ToolResult(_cut(f"Error: {error}", limits.max_chars), error, time.monotonic() - start)


async def run_calls_async(
    batches: list[list[ToolCall]], tools: dict[str, Tool], limits: ExecLimits
) -> list[list[ToolResult]]:
    """Every call of every conversation at once (``limits.max_concurrency`` in flight); results in order."""
    gate = asyncio.Semaphore(limits.max_concurrency)
    flat = [run_call(call, tools, limits, gate) for calls in batches for call in calls]
    results = await asyncio.gather(*flat)
    out, start = [], 0
    for calls in batches:
        out.append(list(results[start : start + len(calls)]))
        start += len(calls)
    return out


def run_calls(batches: list[list[ToolCall]], tools: dict[str, Tool], limits: ExecLimits) -> list[list[ToolResult]]:
    """Synchronous wrapper of :func:`run_calls_async` (its own event loop)."""
    return asyncio.run(run_calls_async(batches, tools, limits))
