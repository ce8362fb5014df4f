"""A warm start for the CLI in tests: one process per pytest worker imports torch, transformers and the project once,
then forks a child for each `rlfactory ...` command the tests run.

Why: most of the suite's ~600 CLI runs are short (bad input answered in a second, a few training steps), and each
paid 5-25 s of imports on the busy 2-core CI machine. A forked child is still a separate process that runs
``python -m rlfactory`` exactly (``runpy``, its own cwd, argv, environment and standard streams, the interpreter's
own exit: atexit handlers, the exit code, a traceback on an uncaught exception), so tests still see what a user sees.
Only import-time state is shared, which is why ``tests/conftest.py`` keeps one warm process per environment and
falls back to a plain subprocess where a test needs a cold start.

Protocol (one command at a time, over two pipes whose fds are the arguments): after ``{"ready"}``, the client writes
one JSON line ``{"args", "cwd", "env", "stdout", "stderr"}`` and reads ``{"pid"}`` then ``{"returncode"}``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _warm_up() -> None:
    """Import what nearly every command imports, without starting a thread (forking a threaded process is unsafe)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import rlfactory.cli  # noqa: F401
    import rlfactory.config.loader  # noqa: F401
    import rlfactory.stages.pipeline  # noqa: F401


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(request: dict, *channels: Any) -> None:
    """Become ``python -m rlfactory ARGS`` run from ``cwd``; never returns (SystemExit unwinds to the interpreter)."""
    for channel in channels:
        channel.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = ["rlfactory", *request["args"]]
    import runpy

    runpy.run_module("rlfactory", run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve(requests_fd: int, replies_fd: int) -> None:
    _warm_up()
    replies = os.fdopen(replies_fd, "w", buffering=1)
    threads = _threads()
    replies.write(json.dumps({"ready": threads == 1, "threads": threads}) + "\n")
    if threads != 1:
        return
    with os.fdopen(requests_fd, "r") as requests:
        for line in requests:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request, requests, replies)
            replies.write(json.dumps({"pid": pid}) + "\n")
            _, status = os.waitpid(pid, 0)
            replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
