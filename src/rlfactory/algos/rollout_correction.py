"""Rollout/trainer mismatch: measure it, and correct the policy gradient with importance sampling.

A separate sampler (vLLM: other kernels, other precision, a synced copy of the weights) does not sample from
exactly the policy the trainer differentiates. The trainer's log-prob of a sampled token (pi_old, at the
weights that produced the batch) and the sampler's (pi_sampler) differ; the policy gradient assumes they do
not. Reference: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(truncated importance sampling, https://fengyao.notion.site/off-policy-rl); Liu, Li et al. 2025, "When Speed
Kills Stability" (masked IS, https://richardli.xyz/rl-collapse).

Every entry of ``IS_CORRECTIONS`` has the signature::

    fn(old_log_prob, sampler_log_prob, response_mask, *, threshold) -> (weights (B, T), metrics)

with detached weights that multiply the per-token policy-gradient loss (0 at masked positions). The ratio is
r = exp(old_log_prob - sampler_log_prob), its log clamped to [-20, 20]; token_* modes weigh each token by its
own r, seq_* modes every token of a sequence by the geometric mean of its r (exp of the mean log-ratio, so
the weight does not explode with length). truncate: min(r, threshold) (TIS); mask: r, or 0 above threshold
(MIS: the sample is rejected). Same definitions as ms-swift's ``rollout_importance_sampling_mode``.
"""

from __future__ import annotations

import math

import torch

from rlfactory.algos.common import masked_mean
from rlfactory.plugins import Registry

IS_CORRECTIONS = Registry("importance-sampling correction")


def _log_ratio(old_log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    log_ratio = (old_log_prob - sampler_log_prob).clamp(min=-20.0, max=20.0)
    return torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).detach()


def _seq_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token log-ratios -> (B, T): each sequence's geometric-mean ratio on all its tokens."""
    fmask = mask.to(log_ratio.dtype)
    mean = (log_ratio * fmask).sum(-1) / fmask.sum(-1).clamp(min=1.0)
    return torch.exp(mean)[:, None].expand_as(log_ratio)


def _finish(ratio: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_corrected_frac": masked_mean((weights != ratio).float(), mask),  # truncated or masked tokens
    }
    return weights, metrics


@IS_CORRECTIONS.register("none")
def no_correction(old_log_prob, sampler_log_prob, response_mask, *, threshold=2.0):
    """No correction: weight 1 on every response token (the mismatch is still measured and logged)."""
    mask = response_mask.bool()
    ratio = torch.exp(_log_ratio(old_log_prob, sampler_log_prob, mask))
    weights, metrics = _finish(ratio, torch.ones_like(ratio), mask)
    metrics["is_corrected_frac"] = weights.new_zeros(())
    return weights, metrics


@IS_CORRECTIONS.register("token_truncate")
def token_truncate(old_log_prob, sampler_log_prob, response_mask, *, threshold=2.0):
    """Truncated IS per token: w_t = min(r_t, threshold). Shapes (B, T) -> (B, T)."""
    mask = response_mask.bool()
    ratio = torch.exp(_log_ratio(old_log_prob, sampler_log_prob, mask))
    return _finish(ratio, ratio.clamp(max=threshold), mask)


@IS_CORRECTIONS.register("token_mask")
def token_mask(old_log_prob, sampler_log_prob, response_mask, *, threshold=2.0):
    """Masked IS per token: w_t = r_t where r_t <= threshold, else 0. Shapes (B, T) -> (B, T)."""
    mask = response_mask.bool()
    ratio = torch.exp(_log_ratio(old_log_prob, sampler_log_prob, mask))
    return _finish(ratio, torch.where(ratio <= threshold, ratio, torch.zeros_like(ratio)), mask)


@IS_CORRECTIONS.register("seq_truncate")
def seq_truncate(old_log_prob, sampler_log_prob, response_mask, *, threshold=2.0):
    """Truncated IS per sequence: w_i = min(exp(mean_t log r_i,t), threshold) on every token of i."""
    mask = response_mask.bool()
    ratio = _seq_ratio(_log_ratio(old_log_prob, sampler_log_prob, mask), mask)
    return _finish(ratio, ratio.clamp(max=threshold), mask)


@IS_CORRECTIONS.register("seq_mask")
def seq_mask(old_log_prob, sampler_log_prob, response_mask, *, threshold=2.0):
    """Masked IS per sequence: w_i = exp(mean_t log r_i,t), or 0 for the whole sequence above threshold."""
    mask = response_mask.bool()
    ratio = _seq_ratio(_log_ratio(old_log_prob, sampler_log_prob, mask), mask)
    return _finish(ratio, torch.where(ratio <= threshold, ratio, torch.zeros_like(ratio)), mask)


def mismatch_metrics(
    trainer_log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, mask: torch.Tensor, threshold: float | None = None
) -> dict:
    """rollout/logprob_diff_mean, rollout/logprob_diff_max (|trainer - sampler| over response tokens),
    rollout/prob_pearson (Pearson correlation of the two token probabilities; 1 = the same policy) and, given the IS
    ``threshold``, rollout/ratio_over_cap (the share of tokens whose ratio trainer / sampler is above it: the tokens
    a truncating correction cuts and a masking one drops).

    Shapes (B, T) -> floats. With fewer than two tokens or no variance the correlation is reported as 1.
    """
    keep = mask.bool()
    trainer, sampler = trainer_log_prob[keep].double(), sampler_log_prob[keep].double()
    if trainer.numel() == 0:
        return {}
    diff = (trainer - sampler).abs()
    p, q = trainer.exp(), sampler.exp()
    p, q = p - p.mean(), q - q.mean()
    denom = (p.norm() * q.norm()).item()
    pearson = float((p * q).sum() / denom) if denom > 1e-12 else 1.0
    metrics = {
        "rollout/logprob_diff_mean": float(diff.mean()),
        "rollout/logprob_diff_max": float(diff.max()),
        "rollout/prob_pearson": pearson,
    }
    if threshold is not None:
        metrics["rollout/ratio_over_cap"] = float((trainer - sampler > math.log(threshold)).double().mean())
    return metrics
