"""An LM head alone, on CPU in bf16: its peak resident memory above the start, in bytes per logit, for the
planner's head terms (tests/test_plan.py).

    python tests/head_memory_probe.py ROWS_PER_SEQUENCE online       # the online update's head
    python tests/head_memory_probe.py ROWS_PER_SEQUENCE model_loss   # a model's own loss (the ZeRO-3 fallback)

``online``, as ``policy_forward`` runs it: logits for T + 1 positions, the last dropped, ``token_logprobs``, the
logged entropy (no gradient), then backward. ``model_loss``: transformers' ``ForCausalLMLoss`` on the logits, whose
model output the caller drops (``model.lm_head.nll_sum``), then backward.
"""

import ctypes
import json
import re
import sys

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from rlfactory.algos.common import entropy_from_logits, token_logprobs

B, V, H = 8, 8192, 16


def rss(field: str) -> int:
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def main(t: int, head: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = torch.randn(B, t + 1, H, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, V, (B, t))
    small = token_logprobs((hidden[:, :3] @ weight.T)[:, :-1], targets[:, :2])  # allocator and kernels warm
    small.sum().backward()
    hidden.grad = None
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = rss("VmRSS")
    if head == "online":
        logits = (hidden @ weight.T)[:, :-1]
        loss = token_logprobs(logits, targets).sum()
        with torch.no_grad():
            entropy_from_logits(logits.detach())
        del logits
    else:
        loss = ForCausalLMLoss(hidden[:, :-1] @ weight.T, targets, V)
    loss.backward()
    print(json.dumps({"bytes_per_logit": (rss("VmHWM") - start) / (B * t * V)}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
