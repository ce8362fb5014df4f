"""One optimizer step of the offline loop under torch.profiler, and a summary of where its time went.

    python bench/train_bench.py --cases dpo_lora --impls ours_compile --gpus 1,2 --trace-step 4   # on a GPU host
    python bench/step_trace.py $OUT/trace_dpo_lora_ours_compile_2gpu_r0.json.gz                  # summary again

``train_bench.py --trace-step N`` records the N-th optimizer step of every process (``record_step``) and writes
``trace_<case>_<impl>_<world>gpu_r<rank>.json.gz`` (Chrome trace: chrome://tracing or ui.perfetto.dev) and
the summary below to stdout, each line starting with ``TRACE``. The summary answers "is this GPU waiting, and
on what": the step's wall time, the time the GPU ran kernels, the collectives' share, the host's waits for the
GPU (synchronize / copies to the host), and the longest stretches without a kernel with the host operation
that launched the kernel after each stretch.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def record_step(step: int, path_for: Any) -> None:
    """Profile the ``step``-th call of the offline loop's ``_train_window`` (one optimizer step) in this process;
    ``path_for(rank)`` names the trace file. Patches the module function, so call it before ``train``."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rlfactory.engine import offline

    window = offline._train_window
    calls = {"n": 0}

    def traced(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] != step:
            return window(*args, **kwargs)
        gpu = torch.cuda.is_available()
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])) as prof:
            out = window(*args, **kwargs)
            sync()
        rank = int(os.environ.get("RANK", "0"))
        path = Path(path_for(rank))
        raw = path.with_suffix("")  # .json
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        raw.unlink()
        for line in summarize(path).splitlines():
            print(f"TRACE r{rank} {line}", flush=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
        for line in table.splitlines():
            print(f"TRACE r{rank} cpu| {line}", flush=True)
        return out

    offline._train_window = traced


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def summarize(path: str | Path, gaps: int = 8) -> str:
    """The step's time budget from a Chrome trace written by torch.profiler (times in ms)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    if not kernels:
        return "no kernels in the trace"
    start = min(e["ts"] for e in ops + kernels)
    end = max(e["ts"] + e["dur"] for e in ops + kernels)
    busy = _merged([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    busy_us = sum(b - a for a, b in busy)
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    syncs = [r for r in runtime if r["name"].startswith(SYNC_CALLS)]
    lines = [
        f"wall {(end - start) / 1e3:.1f} ms, GPU busy {busy_us / 1e3:.1f} ms ({busy_us / max(end - start, 1):.0%}), "
        f"{len(kernels)} kernels, collectives {sum(k['dur'] for k in nccl) / 1e3:.1f} ms in {len(nccl)} kernels",
        f"host waits for the GPU: {sum(r['dur'] for r in syncs) / 1e3:.1f} ms in {len(syncs)} calls "
        f"(longest {max((r['dur'] for r in syncs), default=0) / 1e3:.1f} ms: "
        f"{max(syncs, key=lambda r: r['dur'])['name'] if syncs else '-'})",
    ]
    by_correlation = {r["args"].get("correlation"): r for r in runtime if "args" in r}
    idle = []
    for before, after in zip(kernels, kernels[1:], strict=False):
        gap = after["ts"] - (before["ts"] + before["dur"])
        if gap > 0:
            idle.append((gap, before, after))
    idle.sort(key=lambda t: t[0], reverse=True)
    over = [g for g, _, _ in idle if g > 100]
    lines.append(f"GPU idle stretches > 0.1 ms: {len(over)}, {sum(over) / 1e3:.1f} ms in all")
    for gap, before, after in idle[:gaps]:
        launch = by_correlation.get(after.get("args", {}).get("correlation"))
        where = "?"
        if launch is not None:
            t = launch["ts"]
            around = [o for o in ops if o["ts"] <= t <= o["ts"] + o["dur"]]
            around.sort(key=lambda o: o["dur"])
            where = " < ".join(o["name"][:40] for o in around[:3]) or launch["name"]
        lines.append(
            f"  {gap / 1e3:7.2f} ms at +{(before['ts'] + before['dur'] - start) / 1e3:.1f} ms, before "
            f"{after['name'][:50]} (launched in: {where})"
        )
    lines.extend(_kernel_shares(kernels))
    return "\n".join(lines)


KERNEL_KINDS = (  # (kind, substrings of a kernel's name), first match wins
    ("collective", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "splitk")),
    ("triton", ("triton",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy/fill", ("copy", "fill", "memset", "memcpy", "cat")),
)


def _kernel_shares(kernels: list[dict[str, Any]], top: int = 12) -> list[str]:
    """Kernel time of the step by kind and the longest kernels by name: where the GPU's busy time goes."""
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        name = k["name"].lower()
        kind = next((kind for kind, keys in KERNEL_KINDS if any(key in name for key in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"]
        by_name.setdefault(k["name"], []).append(k["dur"])
    total = sum(by_kind.values()) or 1.0
    kinds = sorted(by_kind.items(), key=lambda x: -x[1])
    lines = ["kernel time by kind: " + ", ".join(f"{kind} {t / 1e3:.1f} ms ({t / total:.0%})" for kind, t in kinds)]
    for name, durs in sorted(by_name.items(), key=lambda x: -sum(x[1]))[:top]:
        lines.append(f"  {sum(durs) / 1e3:7.2f} ms in {len(durs):4d} x {name[:90]}")
    return lines


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}\n{summarize(name)}")
