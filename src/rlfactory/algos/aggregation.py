"""Loss aggregation modes: reduce a per-token loss (B, T) to the scalar that is back-propagated.

Signature: ``fn(per_token_loss (B, T), response_mask (B, T), *, max_response_length=None) -> scalar``.
Masked positions never contribute, whatever they hold (they are selected out, not multiplied by 0).
The choice matters: it decides how sequences of different lengths are weighted (GRPO vs DAPO vs Dr.GRPO).
"""

from __future__ import annotations

import torch

from rlfactory.plugins import Registry

LOSS_AGG = Registry("loss aggregation")


def _masked(per_token_loss: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    mask = response_mask.bool()
    return torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))


@LOSS_AGG.register("token-mean")
def token_mean(per_token_loss, response_mask, *, max_response_length=None):
    """Token-level mean: sum of all response-token losses / number of response tokens in the batch.

    Paper: DAPO token-level policy-gradient loss (Yu et al. 2025, https://arxiv.org/abs/2503.14476).
    Shapes: (B, T), (B, T) -> (). Every token weighs the same, so long responses count more than in
    ``seq-mean-token-mean``. Equals TRL's ``bnpo`` and (one process, no accumulation) ``dapo``.
    """
    count = response_mask.to(per_token_loss.dtype).sum().clamp(min=1.0)
    return _masked(per_token_loss, response_mask).sum() / count


@LOSS_AGG.register("seq-mean-token-mean")
def seq_mean_token_mean(per_token_loss, response_mask, *, max_response_length=None):
    """Sequence-level mean of per-sequence token means (the original GRPO objective).

    Paper: GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300). Shapes: (B, T), (B, T) -> ().
    Each sequence weighs the same whatever its length, so tokens of short responses weigh more
    (the length bias Dr.GRPO points out). Sequences without response tokens are left out of the mean.
    Equals TRL's ``grpo`` loss_type when no sequence is empty; needed for GSPO's sequence objective.
    """
    tokens = response_mask.to(per_token_loss.dtype).sum(-1)
    seq_loss = _masked(per_token_loss, response_mask).sum(-1) / tokens.clamp(min=1.0)
    nonempty = (tokens > 0).to(per_token_loss.dtype)
    return (seq_loss * nonempty).sum() / nonempty.sum().clamp(min=1.0)


@LOSS_AGG.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(per_token_loss, response_mask, *, max_response_length=None):
    """Dr.GRPO: per-sequence token *sum* divided by a constant length, then mean over sequences.

    Paper: Dr.GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783). Shapes: (B, T), (B, T) -> ().
    loss = sum_i sum_t l_i,t / (B * max_response_length): no per-sequence length normalisation, so no
    length bias. ``max_response_length`` should be the constant generation budget; if None, the padded
    width T is used (which changes with the batch, so pass it). Equals TRL's ``dr_grpo`` loss_type.
    """
    norm = per_token_loss.shape[-1] if max_response_length is None else max_response_length
    return _masked(per_token_loss, response_mask).sum() / (per_token_loss.shape[0] * norm)
