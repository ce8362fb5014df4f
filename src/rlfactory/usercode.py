"""Run user code (reward functions, tools) where a failure cannot take the run down.

A call of a user function (``path/to/file.py:name`` or ``module:name``) runs in a persistent worker process
(``python -m rlfactory.usercode``), one call at a time per worker, up to ``size`` workers. Whatever the call does
comes back as an :class:`Outcome`: its value, or an error string — it raised (``SystemExit`` and
``KeyboardInterrupt`` too), it ran past its timeout (the worker is killed: a CPU-bound loop really stops, which a
thread cannot do), or the worker died (``os._exit``, a segfault). What the code prints is captured and never
reaches the run's output. Workers are reused across calls and steps, so a call costs one pipe round trip
(well under a millisecond), not a process start; a killed worker is replaced at the next call.

Why by hand rather than ``concurrent.futures.ProcessPoolExecutor``: the executor cannot kill one hung call (a
timed-out future keeps its worker busy forever) and a dying worker breaks the whole pool; ``multiprocessing``'s
spawn re-imports the parent's ``__main__``. Only the standard library is imported here: the worker starts fast.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("!Q")
LOAD_TIMEOUT_S = 120.0  # starting a worker and importing the user's module (it may import heavy packages)


@dataclass
class Outcome:
    """One call's result: ``error`` is None when it returned ``value``."""

    value: Any = None
    error: str | None = None
    seconds: float = 0.0
    printed: str = ""  # what the call wrote to stdout/stderr (captured, not shown)
    timed_out: bool = False


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; TimeoutError past ``deadline`` (monotonic), EOFError when the writer is gone."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None = None) -> Any:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


def resolve(ref: str) -> Callable[..., Any]:
    """``path/to/file.py:name`` or ``module:name`` -> the object (imported once per process)."""
    import importlib
    import importlib.util

    target, _, name = ref.rpartition(":")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"rlfactory_user_{Path(target).stem}", target)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self) -> None:
        package_root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlfactory.usercode"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_fd, self.from_fd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.loaded: set[str] = set()  # refs this worker has imported

    def call(self, ref: str, args: tuple, kwargs: dict[str, Any], timeout: float) -> Outcome:
        if ref not in self.loaded:  # the first call: import the module first, outside the call's timeout
            loaded = self._request((ref, None, None), LOAD_TIMEOUT_S)
            if loaded.error is not None:
                return Outcome(error=f"loading {ref}: {loaded.error}", seconds=loaded.seconds, printed=loaded.printed)
            self.loaded.add(ref)
        return self._request((ref, args, kwargs), timeout)

    def _request(self, request: tuple, timeout: float) -> Outcome:
        start = time.monotonic()
        try:
            _send(self.to_fd, request)
            ok, value, printed = _receive(self.from_fd, start + timeout)
        except TimeoutError:
            self.kill()
            return Outcome(
                error=f"timed out after {timeout:g}s (its worker process was killed)", seconds=timeout, timed_out=True
            )
        except (EOFError, BrokenPipeError, OSError, pickle.UnpicklingError):
            code = self.kill()
            return Outcome(error=f"its worker process died (exit code {code})", seconds=time.monotonic() - start)
        return Outcome(value if ok else None, None if ok else value, time.monotonic() - start, printed)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]
        return code


class UserCodePool:
    """Up to ``size`` worker processes, started on first use and kept for the run; thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self._idle: list[_Worker] = []
        self._started = 0
        self._cond = threading.Condition()

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and self._started >= self.size:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Worker()
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if worker.alive:
                self._idle.append(worker)
            else:
                self._started -= 1
            self._cond.notify()

    def call(self, ref: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float = 10.0) -> Outcome:
        """``ref(*args, **kwargs)`` in a worker; never raises for anything the user code does."""
        worker = self._acquire()
        try:
            return worker.call(ref, args, kwargs or {}, timeout)
        finally:
            self._release(worker)

    def map(self, ref: str, calls: list[tuple[tuple, dict[str, Any]]], timeout: float) -> list[Outcome]:
        """Every ``(args, kwargs)`` call of ``ref``, ``size`` at a time; outcomes in order."""
        if len(calls) <= 1 or self.size == 1:
            return [self.call(ref, a, k, timeout) for a, k in calls]
        with ThreadPoolExecutor(min(self.size, len(calls))) as threads:
            return list(threads.map(lambda call: self.call(ref, call[0], call[1], timeout), calls))

    def close(self) -> None:
        """Stop the idle workers (a later call starts new ones)."""
        with self._cond:
            workers, self._idle = self._idle, []
            self._started -= len(workers)
            self._cond.notify_all()
        for worker in workers:
            worker.kill()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _die_with_parent() -> None:
    """Exit when the run's process is gone, even while a user call is spinning: a watchdog thread (Python switches
    threads every few milliseconds). Not PR_SET_PDEATHSIG: it fires when the parent *thread* that started the
    worker exits, and workers are started from short-lived threads."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _serve() -> None:
    """The worker's loop: one request in, one reply out, until the parent closes the pipe."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the run's to handle: it stops the worker itself
    requests, replies = os.dup(0), os.dup(1)
    # user code writing straight to the file descriptors (os.write(1, ...), a child process) must not corrupt the
    # replies: fd 0 reads nothing, fd 1 goes where the run's stderr goes
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    functions: dict[str, Callable[..., Any]] = {}
    while True:
        try:
            ref, args, kwargs = _receive(requests)
        except EOFError:
            return
        buffer = io.StringIO()
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                if ref not in functions:
                    functions[ref] = resolve(ref)
                value = None if args is None else functions[ref](*args, **kwargs)  # args None: load only
                if hasattr(value, "__await__"):  # an ``async def`` function: run it here
                    import asyncio

                    value = asyncio.run(_awaited(value))
            reply = (True, value, buffer.getvalue())
        except BaseException as exc:  # everything user code raises (SystemExit too) is its outcome, never a crash
            reply = (False, f"{type(exc).__name__}: {exc}", buffer.getvalue())
        try:
            _send(replies, reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _send(replies, (False, f"returned a value that cannot be sent back ({exc})", reply[2]))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


if __name__ == "__main__":
    _serve()
