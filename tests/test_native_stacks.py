"""The suite's crash diagnostics: a test's child process that aborts in a thread without Python frames (a C++
thread's std::terminate) prints that thread's native stack (tests/native/abort_backtrace.c, preloaded by
tests/conftest.py), after faulthandler's Python stacks, and still dies of the same signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ABORT_IN_A_THREAD = """
import ctypes, faulthandler, threading
faulthandler.enable()
thread = threading.Thread(target=ctypes.CDLL(None).abort)
thread.start()
thread.join()
"""


def test_a_child_that_aborts_in_a_thread_prints_its_native_stack():
    if "rlfactory-abort-backtrace" not in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("no C compiler here: tests/conftest.py could not build the diagnostics library")
    result = subprocess.run([sys.executable, "-c", ABORT_IN_A_THREAD], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in result.stderr  # faulthandler's part comes first
    native = result.stderr.split("native stack of the thread that got a fatal signal")[1]
    assert "abort" in native and "libc" in native, native


def test_a_failure_message_keeps_the_native_stack_that_the_tail_would_cut():
    from tests.conftest import failure_output

    stack = "*** native stack of the thread that got a fatal signal (tests/native) ***\nlibgloo.so(+0x1)\n"
    report = "torchrun: rank 1 failed\n" * 400  # ~10k characters after the stack
    message = failure_output("start\n" + stack + report)
    assert message.startswith(stack) and message.endswith(report[-4000:])
    assert failure_output("short") == "short"
