"""The test side of ``tests/cli_zygote.py``: a warm CLI process per environment, started on first use."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARYING = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_TESTRUNUID")  # change per test, read by no library at import time
MAX_WARM = 3  # environments kept warm per pytest worker (each a ~1 GB process, mostly shared pages)


class WarmCli:
    """One warm process for one environment; commands run one at a time."""

    def __init__(self, env: dict[str, str]):
        self.lock = threading.Lock()
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        self.log = tempfile.NamedTemporaryFile(prefix="cli-zygote-", suffix=".log", delete=False)
        # its stdout is unused, its stderr is the log
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "cli_zygote.py"), str(requests_read), str(replies_write)],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
            pass_fds=(requests_read, replies_write),
        )  # fmt: skip
        os.close(requests_read)
        os.close(replies_write)
        self.pending = b""  # replies read but not yet taken (two may come in one read)
        hello = self._reply(600)
        self.ready = bool(hello and hello.get("ready"))

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        """The next reply line, or None when none came in ``timeout`` s (or the warm process is gone)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, command: list[str], args: tuple[str, ...], cwd: Path, env: dict[str, str], timeout: float):
        with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"args": list(args), "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            try:
                os.write(self.requests, (json.dumps(request) + "\n").encode())
            except BrokenPipeError:  # the warm process is gone
                return None
            started = self._reply(60)
            if started is None:  # the warm process is gone (or hung): the command never started
                return None
            done = self._reply(timeout)
            if done is None:
                os.kill(started["pid"], signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(command, done["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        os.close(self.requests)  # end of requests: the warm process exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.replies)
        os.unlink(self.log.name)


_warm: dict[str, WarmCli] = {}
_refused: set[str] = set()
_lock = threading.Lock()


def run_warm(command, args, cwd, env, timeout) -> subprocess.CompletedProcess | None:
    """The command's result from a warm process, or None where there is none to use (then run it cold)."""
    key = json.dumps({k: v for k, v in sorted(env.items()) if k not in VARYING})
    with _lock:
        if key in _refused:
            return None
        warm = _warm.get(key)
        if warm is None:
            if len(_warm) >= MAX_WARM:
                _warm.pop(next(iter(_warm))).close()
            warm = _warm[key] = WarmCli(env)
            if not warm.ready:
                _refused.add(key)
                _warm.pop(key).close()
                return None
    if not warm.lock.acquire(blocking=False):  # another thread's command is running in it: start this one cold
        return None
    try:
        result = warm.run(command, args, cwd, env, timeout)
    finally:
        warm.lock.release()
    if result is None:  # start it cold, and this environment's next command in a new warm process
        with _lock:
            if _warm.get(key) is warm:
                _warm.pop(key).close()
    return result


@atexit.register
def _close_all() -> None:
    for warm in _warm.values():
        warm.close()
