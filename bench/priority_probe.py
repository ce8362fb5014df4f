"""Does a high-priority CUDA stream keep a chain of small kernels fast beside large ones? (overlapped generation)

A stand-in for ``rollout.overlap`` on one GPU: a thread runs a decode-like chain (``--chain`` steps of small
matrix products, each step's result feeding the next, one host sync per ``--sync-every`` steps as a sampler's token
readback) while the main thread keeps the GPU busy with an update-like loop of large matrix products. The chain is
timed alone, beside the loop on a stream of default priority, and beside it on a stream of the highest priority;
with ``--green-sms``, also beside the loop confined to that many SMs (a CUDA green context: the chain keeps the
rest to itself), and the loop's rate alone on those SMs. The loop waits for its own stream only (until the
twenty-fourth session it synchronized the whole device, so it also waited for the chain).

    python bench/priority_probe.py --green-sms 100,116     # a CUDA GPU; prints one table
"""

from __future__ import annotations

import argparse
import threading
import time


def chain(steps: int, sync_every: int, stream) -> float:
    import torch

    x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 896, device="cuda", dtype=torch.bfloat16) * 0.03
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
        start = time.perf_counter()
        for i in range(steps):
            x = torch.tanh(x @ w)
            if (i + 1) % sync_every == 0:
                x[0, 0].item()  # the token readback of a decode step
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - start


def busy_loop(stop: threading.Event, stream=None) -> int:
    """Large products until ``stop``; ``stream`` may be a green context (made current in this thread, so the
    runtime launches into it) or a stream."""
    import torch

    context = stream if hasattr(stream, "set_context") else None
    if context is not None:
        context.set_context()  # this thread's current context and stream become the green context's
        stream = torch.cuda.current_stream()
    stream = stream or torch.cuda.current_stream()
    try:
        return _products(stop, stream)
    finally:
        if context is not None:
            context.pop_context()


def _products(stop: threading.Event, stream) -> int:
    import torch

    with torch.cuda.stream(stream):
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        done = 0
        while not stop.is_set():
            for _ in range(4):
                a = torch.tanh(a @ a * 1e-4)
            stream.synchronize()
            done += 4
    return done


CONTEXTS: list = []


def green_stream(sms: int, current: bool = False):
    """A stream whose kernels run on ``sms`` SMs only (torch's beta green contexts; None where unavailable); with
    ``current`` the context itself, which the loop's thread makes current."""
    import torch

    try:
        from torch.cuda.green_contexts import GreenContext

        context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
        CONTEXTS.append(context)  # a green context's streams die with it
        return context if current else context.Stream()
    except Exception as exc:  # an older torch (no Stream()), a driver without green contexts
        print(f"green context of {sms} SMs: {type(exc).__name__}: {exc}")
        return None


def loop_rate(stream, seconds: float = 2.0) -> float:
    """Large products per second of the loop alone on ``stream``."""
    stop, counted = threading.Event(), {}
    worker = threading.Thread(target=lambda: counted.setdefault("n", _guarded(busy_loop, stop, stream)))
    start = time.perf_counter()
    worker.start()
    time.sleep(seconds)
    stop.set()
    worker.join()
    return counted["n"] / (time.perf_counter() - start)


def _guarded(loop, *args) -> float:
    """The loop's count, or NaN after printing what it raised (a green context the driver refuses)."""
    try:
        return loop(*args)
    except Exception as exc:
        import traceback

        traceback.print_exc(limit=3)
        print(f"the loop raised {type(exc).__name__}: {str(exc)[:300]}")
        return float("nan")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=3000)
    parser.add_argument("--sync-every", type=int, default=24)
    parser.add_argument("--green-sms", default="", help="comma-separated SM counts for the loop's green context")
    parser.add_argument("--green-current", action="store_true", help="make the context current in the loop's thread")
    args = parser.parse_args()
    torch.cuda.init()
    normal, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-100)
    chain(300, args.sync_every, normal)  # warm up kernels and the allocator
    rows = [("alone", chain(args.chain, args.sync_every, normal), loop_rate(None))]
    cases = [("beside the loop, default priority", normal, None), ("beside the loop, highest priority", high, None)]
    for sms in [int(n) for n in args.green_sms.split(",") if n]:
        loop_stream = green_stream(sms, args.green_current)
        if loop_stream is not None:
            print(f"the loop alone on {sms} SMs: {loop_rate(loop_stream):.1f} big products/s")
            cases.append((f"beside the loop on {sms} SMs, highest priority", high, loop_stream))
    for name, stream, loop_stream in cases:
        stop, counted = threading.Event(), {}
        worker = threading.Thread(
            target=lambda s=stop, c=counted, ls=loop_stream: c.setdefault("n", _guarded(busy_loop, s, ls))
        )
        worker.start()
        time.sleep(0.5)
        start = time.perf_counter()
        seconds = chain(args.chain, args.sync_every, stream)
        stop.set()
        worker.join()
        rate = counted["n"] / (time.perf_counter() - start + 0.5)
        rows.append((name, seconds, rate))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), chain of {args.chain} steps, readback every {args.sync_every}")
    print("| chain | s | vs alone | big products/s beside it (alone: the loop by itself) |\n|---|---|---|---|")
    for name, seconds, rate in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / rows[0][1]:.2f}x | {rate:.1f} |")


if __name__ == "__main__":
    main()
