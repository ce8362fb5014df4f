"""Does a high-priority CUDA stream keep a chain of small kernels fast beside large ones? (overlapped generation)

A stand-in for ``rollout.overlap`` on one GPU: a thread runs a decode-like chain (``--chain`` steps of small
matrix products, each step's result feeding the next, one host sync per ``--sync-every`` steps as a sampler's token
readback) while the main thread keeps the GPU busy with an update-like loop of large matrix products. The chain is
timed alone, beside the loop on a stream of default priority, and beside it on a stream of the highest priority.

    python bench/priority_probe.py            # a CUDA GPU; prints one table
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


def busy_loop(stop: threading.Event) -> int:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    done = 0
    while not stop.is_set():
        for _ in range(4):
            a = torch.tanh(a @ a * 1e-4)
        torch.cuda.synchronize()
        done += 4
    return done


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=3000)
    parser.add_argument("--sync-every", type=int, default=24)
    args = parser.parse_args()
    torch.cuda.init()
    normal, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-100)
    chain(300, args.sync_every, normal)  # warm up kernels and the allocator
    rows = [("alone", chain(args.chain, args.sync_every, normal), 0)]
    for name, stream in (("beside the loop, default priority", normal), ("beside the loop, highest priority", high)):
        stop, counted = threading.Event(), {}
        worker = threading.Thread(target=lambda s=stop, c=counted: c.setdefault("n", busy_loop(s)))
        worker.start()
        time.sleep(0.5)
        start = time.perf_counter()
        seconds = chain(args.chain, args.sync_every, stream)
        stop.set()
        worker.join()
        loop_rate = counted["n"] / (time.perf_counter() - start + 0.5)
        rows.append((name, seconds, loop_rate))
    print(f"{torch.cuda.get_device_name()}, chain of {args.chain} steps, a readback every {args.sync_every}")
    print("| chain | s | vs alone | big products/s beside it |\n|---|---|---|---|")
    for name, seconds, rate in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / rows[0][1]:.2f}x | {rate:.1f} |")


if __name__ == "__main__":
    main()
