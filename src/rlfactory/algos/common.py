"""Shared tensor mechanics used by every stage: masked reductions and token log-probs.

Kept in one tested place so SFT, preference and RL stages compute them identically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true. Shapes broadcast; ``dim=None`` sums all."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true (0 where the mask is empty)."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    """Log-probability of each label token: ``log_softmax(logits)[..., labels]``.

    logits: (B, T, V); labels: (B, T) int64 (any value where unused, e.g. 0 for -100 positions).
    Returns (B, T) float32. Works row-chunked as ``logit[label] - logsumexp(logit)`` so a full
    (B, T, V) float32 log-softmax is never materialised (the vocabulary can be 150k wide).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = flat_logits[start : start + chunk_size].float()
        picked = rows.gather(-1, flat_labels[start : start + chunk_size, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).reshape(labels.shape) if out else flat_logits.new_zeros(labels.shape, dtype=torch.float32)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    """Per-token entropy of the categorical distribution given by ``logits`` (B, T, V) -> (B, T)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_size):
        rows = flat[start : start + chunk_size].float()
        log_p = F.log_softmax(rows, dim=-1)
        out.append(-(log_p.exp() * log_p).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def shift_for_causal_lm(labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Align labels with next-token logits: returns (targets, mask), both (B, T).

    Position t of the logits predicts token t+1, so targets are labels shifted left by one
    and the last position is masked. Masked targets are replaced by 0 so they can index.
    """
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    mask = targets != ignore_index
    return targets.masked_fill(~mask, 0), mask


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is true (scalar).

    ``unbiased`` applies Bessel's correction n/(n-1) when n > 1 (as verl's ``masked_var``);
    with n <= 1 the biased value (0) is returned instead of raising.
    """
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        bessel = torch.where(count > 1, count / (count - 1).clamp(min=1.0), torch.ones_like(count))
        variance = variance * bessel
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Standardise ``values`` with the masked mean and unbiased masked variance: (x - mu) / sqrt(var + eps).

    Statistics come from masked positions only (as verl's ``masked_whiten``); every position is
    transformed, so multiply by the mask afterwards to zero padding.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + eps)
