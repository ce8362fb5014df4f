"""Next-token log-probs of chosen positions without the (N, T, V) logits: the LM head runs chunked, on those
positions only (``algos.common.linear_token_logprobs``).

The call still goes through the outer model (DDP, PEFT, a compiled layer stack), but asks for one position of
logits (``logits_to_keep=1``) and takes the decoder's last hidden state from a forward hook. dpo, kto, orpo
and the reference pass use it; a model without a decoder/head split (or a head with a bias) falls back to
its full logits. sft does not: its loss is a plain token sum, for which the model's own loss (Liger's fused
cross-entropy for full fine-tuning) measured faster (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from rlfactory.algos.common import linear_token_logprobs, token_logprobs


def lm_parts(model: Any) -> tuple[Any, Any] | None:
    """(decoder, output embedding) of a causal LM under its DDP/PEFT wrappers; None if it has no such split."""
    base = getattr(model, "module", model)  # DDP
    base = base.get_base_model() if hasattr(base, "get_base_model") else base  # PEFT
    if not hasattr(base, "get_decoder") or "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    head = base.get_output_embeddings()
    return (base.get_decoder(), head) if head is not None and getattr(head, "bias", None) is None else None


def next_token_logps(model: Any, inputs: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """(N, T) float32: at each position t with ``mask[:, t]`` the log-prob of ``input_ids[:, t + 1]``, else 0.

    ``inputs``: the model's keyword inputs (``input_ids`` plus ``attention_mask`` / ``position_ids`` when
    present); ``mask``: (N, T) bool, False in the last column (nothing follows it).
    """
    ids = inputs["input_ids"]
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    parts = lm_parts(model)
    if parts is None:
        logits = model(**inputs, use_cache=False).logits
        return token_logprobs(logits, targets) * mask
    decoder, head = parts
    captured: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    picked = linear_token_logprobs(captured[-1][mask], head.weight, targets[mask])
    return torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked)
