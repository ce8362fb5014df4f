"""Next-token log-probs of chosen positions without the (N, T, V) logits: the LM head runs chunked, on those
positions only (``algos.common.linear_token_logprobs``).

The call still goes through the outer model (DDP, PEFT, a compiled layer stack), but asks for one position of
logits (``logits_to_keep=1``) and takes the decoder's last hidden state from a forward hook. dpo, kto, orpo
and the reference pass use it; a model without a decoder/head split (or a head with a bias, or a ZeRO-3
partitioned head) falls back to its full logits. sft's loss, a plain token sum, goes the same way through
``nll_sum`` (gradients formed in the forward, ``algos.common.linear_nll_sum``). Both take the run's
``HeadKernels`` (compiled chunk, Liger's log-prob kernel, rows per chunk), decided once from the config by
``model.loader.head_kernels``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from rlfactory.algos.common import HeadKernels, linear_nll_sum, linear_token_logprobs, token_logprobs


def unwrapped(model: Any) -> Any:
    """The transformers model under its DDP and PEFT wrappers."""
    base = getattr(model, "module", model)  # DDP
    return base.get_base_model() if hasattr(base, "get_base_model") else base  # PEFT


def lm_parts(model: Any) -> tuple[Any, Any] | None:
    """(decoder, output embedding) of a causal LM under its DDP/PEFT wrappers; None if it has no such split."""
    base = unwrapped(model)
    if not hasattr(base, "get_decoder") or "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    head = base.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return None
    # ZeRO-3 keeps each weight partitioned outside its module's forward (an empty local tensor, ``ds_id`` set):
    # the chunked head would read that empty shard, so such a model returns its full logits instead. (FSDP2's
    # root module, which owns the head, stays unsharded from its forward to its backward, so it keeps the split.)
    if hasattr(head.weight, "ds_id"):
        return None
    return base.get_decoder(), head


def final_hidden(model: Any, decoder: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder's last hidden state (N, T, H), through the outer model, with one position of logits."""
    captured: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured[-1]


class _SelectRows(torch.autograd.Function):
    """``source.index_select(0, rows)`` for distinct ``rows``, whose backward writes each row's gradient once
    (``index_copy_``) where ``index_select``'s own adds with atomics (``index_add_``). Written by hand because torch
    has no gather with a copying backward; measured no slower, and faster in some runs (docs/BENCHMARKS.md,
    thirteenth session: sft LoRA 0.369 against 0.489 and 0.414 s/step, within a run-to-run spread of up to 30%)."""

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.source_shape = source.shape
        return source.index_select(0, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return grad.new_zeros(ctx.source_shape).index_copy_(0, rows, grad), None


def select_rows(source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``rows`` (distinct flat indices, e.g. from the collate) of a (R, H) tensor, differentiably."""
    return _SelectRows.apply(source, rows)


def nll_sum(
    model: Any,
    inputs: dict[str, torch.Tensor],
    labels: torch.Tensor,
    rows: torch.Tensor | None = None,
    kernels: HeadKernels = HeadKernels(),
) -> torch.Tensor:
    """Summed next-token NLL of the labelled tokens (``labels`` (N, T), -100 = not trained), float32 scalar.

    ``rows``: the flat (N x T) indices of the positions whose next token is labelled, when the caller has
    them (sft's collate does, on the host); without them a boolean mask selects the rows, which syncs.
    """
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    parts = lm_parts(model)
    if parts is None:  # the model's own loss; ``num_items_in_batch=1`` makes transformers' loss a sum
        return model(**inputs, labels=labels, num_items_in_batch=1, use_cache=False).loss.float()
    decoder, head = parts
    if rows is None:
        rows = (targets != -100).flatten().nonzero().squeeze(1)
    hidden = final_hidden(model, decoder, inputs)
    return linear_nll_sum(
        select_rows(hidden.flatten(0, 1), rows),
        head.weight,
        targets.flatten().index_select(0, rows),
        kernels=kernels,
    )


def logps_at(
    model: Any,
    inputs: dict[str, torch.Tensor],
    rows: torch.Tensor,
    targets: torch.Tensor,
    kernels: HeadKernels = HeadKernels(),
) -> torch.Tensor:
    """(M,) float32: the log-prob of ``targets[i]`` at flat position ``rows[i]`` of the forward over ``inputs``.

    For layouts where a position predicts more than one trained token (a shared prompt's last position predicts
    both responses' first tokens: ``stages.preference_data.collate_shared_pairs``), so the targets are given rather
    than read from the next column, and the rows are taken with ``index_select``, whose backward adds a repeated
    row's gradients (``select_rows`` writes each row once).
    """
    parts = lm_parts(model)
    if parts is None:
        logits = model(**inputs, use_cache=False).logits
        return token_logprobs(logits.flatten(0, 1).index_select(0, rows)[None], targets[None])[0]
    decoder, head = parts
    hidden = final_hidden(model, decoder, inputs).flatten(0, 1).index_select(0, rows)
    return linear_token_logprobs(hidden, head.weight, targets, kernels=kernels)


def next_token_logps(
    model: Any,
    inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
    kernels: HeadKernels = HeadKernels(),
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, T) float32: at each position t with ``mask[:, t]`` the log-prob of ``input_ids[:, t + 1]``, else 0.

    ``inputs``: the model's keyword inputs (``input_ids`` plus ``attention_mask`` / ``position_ids`` when
    present); ``mask``: (N, T) bool, False in the last column (nothing follows it). ``rows``: the flat (N x T)
    indices of ``mask``'s True positions when the caller has them from the host (the preference collates do):
    selecting by a boolean mask on the GPU waits for it (the count of rows decides the output's size), and each
    such wait leaves the GPU idle while the host launches what follows.
    """
    ids = inputs["input_ids"]
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    parts = lm_parts(model)
    if parts is None:
        logits = model(**inputs, use_cache=False).logits
        return token_logprobs(logits, targets) * mask
    decoder, head = parts
    if rows is None:  # found on the device: a wait
        rows = mask.flatten().nonzero().squeeze(1)
    hidden = final_hidden(model, decoder, inputs)
    flat = select_rows(hidden.flatten(0, 1), rows)
    picked = linear_token_logprobs(flat, head.weight, targets.flatten().index_select(0, rows), kernels=kernels)
    out = torch.zeros(mask.numel(), dtype=picked.dtype, device=picked.device)
    return out.index_put((rows,), picked).view(mask.shape)
