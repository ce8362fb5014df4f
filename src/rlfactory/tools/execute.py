"""Run parsed tool calls concurrently: asyncio, a concurrency limit, a per-call timeout, errors as strings.

A tool never crashes a run: an invalid call, an exception or a timeout becomes the tool result the model
reads (``"Error: ..."``) and is counted as a tool error. The user's tools (``file.py:function``,
``module:function``, sync or ``async def``) run in persistent worker processes (``rlfactory.usercode``): one that
hangs, even in a CPU-bound loop, is killed at its timeout, one that calls ``sys.exit`` or dies is an error result,
and what one prints never reaches the run's output (a tool that prints and returns nothing returns what it
printed). Bundled tools (bounded, ours) run on threads. Tools flagged ``runs_code`` run in a fresh Python
subprocess (``rlfactory.tools.sandbox``) with a CPU-time and address-space limit, killed at the timeout.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlfactory.tools.parsers import ToolCall
from rlfactory.tools.spec import Tool
from rlfactory.usercode import UserCodePool


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
        except Exception as exc:  # the tool's own error: reported to the model
            value, error = None, exc
        except BaseException as exc:  # SystemExit, KeyboardInterrupt from a tool: an error, never the run's exit
            value, error = None, RuntimeError(f"{type(exc).__name__}: {exc}")
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


class UserToolFailed(Exception):
    """A user tool's call failed in its worker: the message is the outcome's (``ValueError: ...``, timed out, ...)."""


class _Workers:
    """The worker processes of user tools, and the threads that wait on them (one per call in flight)."""

    def __init__(self, size: int):
        self.size, self.pool, self.threads = size, UserCodePool(size), ThreadPoolExecutor(size)

    async def call(self, tool: Tool, arguments: dict[str, Any], timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(self.threads, self.pool.call, tool.source, (), arguments, timeout)
        if outcome.timed_out:
            raise TimeoutError
        if outcome.error is not None:
            raise UserToolFailed(outcome.error)
        return outcome.printed if outcome.value is None and outcome.printed else outcome.value


_workers: _Workers | None = None


def _user_workers(size: int) -> _Workers:
    global _workers
    if _workers is None or _workers.size != size:
        close_workers()
        _workers = _Workers(size)
    return _workers


def close_workers() -> None:
    """Stop the user tools' worker processes (the run's end; the next call starts new ones)."""
    global _workers
    if _workers is not None:
        _workers.pool.close()
        _workers.threads.shutdown(wait=False)
        _workers = None


def is_user_tool(tool: Tool) -> bool:
    return ":" in tool.source


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
            elif is_user_tool(tool):
                value = await _user_workers(limits.max_concurrency).call(tool, arguments, timeout)
            else:
                value = await asyncio.wait_for(_in_thread(tool.fn, arguments), timeout)
            return ToolResult(_cut(as_text(value), limits.max_chars), None, time.monotonic() - start)
        except (asyncio.TimeoutError, TimeoutError):
            error = f"tool '{tool.name}' timed out after {timeout:g}s"
        except UserToolFailed as exc:
            error = str(exc)
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
