"""Does this torch's ``varlen_attn`` take grouped-query key/value heads as they are (no ``enable_gqa``, torch < 2.12)?

Runs the kernel on 28 query / 4 key-value heads without repeating them and compares with the repeated call; prints one
JSON line. ``model/attention.py`` repeats the heads on torch < 2.12; if this says ``native_gqa: true`` the copy can go.
"""

from __future__ import annotations

import inspect
import json
import time

import torch
from torch.nn.attention.varlen import varlen_attn


def _time(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    torch.manual_seed(0)
    lengths = [32 + (i * 977) % 993 for i in range(16)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, 28, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    report: dict = {"torch": torch.__version__, "params": list(inspect.signature(varlen_attn).parameters)}
    repeated = varlen_attn(q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), cu, cu, longest, longest)
    try:
        native = varlen_attn(q, k, v, cu, cu, longest, longest)
        report["native_gqa"] = bool(torch.equal(native, repeated))
        report["native_max_diff"] = (native.float() - repeated.float()).abs().max().item()
        report["native_fwd_ms"] = 1000 * _time(lambda: varlen_attn(q, k, v, cu, cu, longest, longest))
    except Exception as error:  # the answer we are looking for, whatever the kernel raises
        report["native_gqa"] = False
        report["native_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    report["repeat_fwd_ms"] = 1000 * _time(
        lambda: varlen_attn(q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), cu, cu, longest, longest)
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
