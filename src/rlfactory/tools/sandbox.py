"""Child process of a ``runs_code`` tool: set limits, resolve the function, call it, print one JSON line.

Reads ``{"ref", "arguments", "memory_mb", "cpu_s"}`` on stdin. Limits are set before the tool module is
imported: RLIMIT_AS (address space) and RLIMIT_CPU (CPU seconds; the parent also kills at the wall timeout).
What the tool prints goes to a buffer, so only the reply line reaches stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def _limit(memory_mb: int, cpu_s: float) -> None:
    try:
        import resource
    except ImportError:  # not POSIX: only the parent's wall-clock timeout applies
        return
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = max(1, int(cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def _resolve(ref: str):
    import importlib
    import importlib.util

    if ":" not in ref:
        from rlfactory.tools.builtin import BUILTIN_TOOLS

        return BUILTIN_TOOLS[ref][0]
    target, _, name = ref.rpartition(":")
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location("rlfactory_sandboxed_tool", target)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        _limit(request["memory_mb"], request["cpu_s"])
        fn = _resolve(request["ref"])
        with contextlib.redirect_stdout(io.StringIO()):
            value = fn(**request["arguments"])
        result = value if isinstance(value, str) else json.dumps(value, default=str)
        reply = {"ok": True, "result": result}
    except MemoryError:
        reply = {"ok": False, "error": f"MemoryError: the tool exceeded its {request['memory_mb']} MB memory limit"}
    except BaseException as exc:  # everything the tool raises is reported, never a crash
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
