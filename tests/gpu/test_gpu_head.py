"""sft's LM-head chunk kernels on a GPU: Liger's cross-entropy kernel and the compiled chunk give the float64 loss
and gradients within bf16's rounding, and the run's choice reaches the kernel that runs."""

from __future__ import annotations

import pytest
import torch

from rlfactory.algos import common
from rlfactory.algos.common import HeadKernels, linear_nll_sum

VOCAB, HIDDEN, ROWS = 151_936, 896, 3_000  # the Qwen2.5-0.5B head; rows past one 1024-row chunk


@pytest.mark.parametrize("logprobs", ["liger", "torch"])
def test_chunk_kernels_match_float64(logprobs: str, monkeypatch):
    pytest.importorskip("liger_kernel")
    ran: list[str] = []
    liger, compiled = common._liger_nll_and_dlogits_, common._compiled_nll_and_dlogits_()
    monkeypatch.setattr(common, "_liger_nll_and_dlogits_", lambda *a: ran.append("liger") or liger(*a))
    monkeypatch.setattr(common, "_compiled_nll_and_dlogits_", lambda: lambda *a: ran.append("compiled") or compiled(*a))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=g)

    loss = linear_nll_sum(hidden, weight, labels, chunk_size=1024, kernels=HeadKernels(True, logprobs))
    loss.backward()
    assert set(ran) == {"liger" if logprobs == "liger" else "compiled"} and len(ran) == 3

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, reduction="sum")
    want.backward()
    # bf16 logits (8 bits of mantissa) and bf16 gradients: relative 2**-8 on the loss, the gradients' scale on each
    assert abs(loss.double() - want).item() <= 2**-8 * want.item()
    for got, ref in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        err = (got.double() - ref).abs().max().item()
        assert err <= 2**-6 * ref.abs().max().item(), (err, ref.abs().max().item())
