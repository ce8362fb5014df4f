"""Advantage estimators for online RL stages (verl ``core_algos`` style), looked up by name.

Every entry has the signature::

    fn(token_rewards, response_mask, *, index=None, values=None, gamma=1.0, lam=1.0, config=None)
        -> (advantages (B, T), returns (B, T))

``token_rewards`` (B, T) holds the sequence score at the last response token plus any per-token
KL penalty; ``response_mask`` (B, T) bool/float marks response tokens; ``index`` (B,) holds group
ids (samples of one prompt share an id); ``values`` (B, T) are critic values. Outputs are zero at
masked positions and never depend on what masked positions hold. Traits: ``needs_values``
(a critic is required), ``needs_groups`` (several samples per prompt are required).
"""

from __future__ import annotations

from typing import Any

import torch

from rlfactory.algos.common import masked_sum, masked_whiten
from rlfactory.errors import UserError
from rlfactory.plugins import Registry

ADV_ESTIMATORS = Registry("advantage estimator")

GRPO_SCALES = ("group", "batch", "none")


def _group_inverse(index: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (tensor, array or list) to 0..G-1; returns (inverse (B,), G)."""
    if index is None:
        raise ValueError("this advantage estimator needs group ids (`index`)")
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    lookup: dict[Any, int] = {}
    inverse = [lookup.setdefault(key, len(lookup)) for key in keys]
    return torch.tensor(inverse, dtype=torch.long, device=device), len(lookup)


def _group_stats(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, unbiased group std), each (B,).

    Singleton groups get mean 0 and std 1 (as verl), i.e. their baseline is 0 and they are not scaled.
    """
    inverse, n_groups = _group_inverse(index, scores.device)
    zeros = scores.new_zeros(n_groups)
    counts = zeros.index_add(0, inverse, torch.ones_like(scores))
    means = zeros.index_add(0, inverse, scores) / counts
    sq_dev = zeros.index_add(0, inverse, (scores - means[inverse]) ** 2)
    stds = (sq_dev / (counts - 1).clamp(min=1)).sqrt()
    single = counts < 2
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)
    return counts[inverse], means[inverse], stds[inverse]


def _scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence score (B,): sum of the token rewards over the response (ignores padding)."""
    return masked_sum(token_rewards, response_mask.bool(), dim=-1)


@ADV_ESTIMATORS.register("gae", needs_values=True, needs_groups=False)
@torch.no_grad()
def gae(token_rewards, response_mask, *, index=None, values=None, gamma=1.0, lam=1.0, config=None):
    """PPO generalised advantage estimation over response tokens, then whitening over the batch.

    Paper: Schulman et al. 2015, https://arxiv.org/abs/1506.02438 (used for LMs by Ouyang et al. 2022).
    Shapes: token_rewards, values, response_mask (B, T) -> advantages, returns (B, T).
    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where masked
    positions are skipped (their value and TD error are not used). ``returns = A + V`` is taken
    *before* the advantages are whitened with the masked mean/variance of the whole batch.
    Unlike the outcome estimators below, this one needs a critic (``values``) and uses gamma/lam.
    """
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values (`values`)")
    mask = response_mask.to(token_rewards.dtype)
    next_value = token_rewards.new_zeros(token_rewards.shape[0])
    last_gae = token_rewards.new_zeros(token_rewards.shape[0])
    reversed_adv = []
    for t in reversed(range(token_rewards.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last_gae
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        last_gae = torch.where(mask[:, t] > 0, candidate, last_gae)
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = torch.where(mask > 0, advantages + values, torch.zeros_like(values))
    advantages = masked_whiten(advantages * mask, mask) * mask
    return advantages, returns


@ADV_ESTIMATORS.register("grpo", needs_values=False, needs_groups=True)
@torch.no_grad()
def grpo(token_rewards, response_mask, *, index=None, values=None, gamma=1.0, lam=1.0, config=None):
    """GRPO outcome advantage: sequence score minus its group mean, optionally divided by a std.

    Papers: GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300); Dr.GRPO (Liu et al. 2025,
    https://arxiv.org/abs/2503.20783); batch-std scaling (Liu et al. 2025, https://arxiv.org/abs/2508.08221).
    Shapes: token_rewards, response_mask (B, T), index (B,) -> advantages == returns (B, T).
    ``config['scale']``: ``group`` (GRPO: divide by the unbiased std of the group), ``batch`` (divide
    by the unbiased std of all scores in the batch) or ``none`` (Dr.GRPO: no division, which removes
    the difficulty bias of std scaling). ``config['epsilon']`` (default 1e-6) is added to the std.
    The scalar per sequence is broadcast over its response tokens. Singleton groups keep the raw score.
    """
    cfg = config or {}
    scale = cfg.get("scale", "group")
    if scale not in GRPO_SCALES:
        raise UserError(f"unknown grpo scale '{scale}'; valid values: {', '.join(GRPO_SCALES)}")
    epsilon = cfg.get("epsilon", 1e-6)
    scores = _scores(token_rewards, response_mask)
    _, mean, std = _group_stats(scores, index)
    adv = scores - mean
    if scale == "group":
        adv = adv / (std + epsilon)
    elif scale == "batch":
        batch_std = scores.std() if scores.numel() > 1 else scores.new_zeros(())
        adv = adv / (batch_std + epsilon)
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("rloo", needs_values=False, needs_groups=True)
@torch.no_grad()
def rloo(token_rewards, response_mask, *, index=None, values=None, gamma=1.0, lam=1.0, config=None):
    """REINFORCE leave-one-out: score minus the mean score of the *other* samples of the group.

    Papers: Kool et al. 2019 (https://openreview.net/forum?id=r1lgTGL5DE); Ahmadian et al. 2024,
    https://arxiv.org/abs/2402.14740. Shapes: token_rewards, response_mask (B, T), index (B,)
    -> advantages == returns (B, T). With group size n: A_i = s_i - (sum_j s_j - s_i) / (n - 1)
    = n / (n - 1) * (s_i - mean), i.e. GRPO's ``none`` scaling times n/(n-1), with an unbiased
    baseline that excludes the sample itself. No std scaling. Singleton groups keep the raw score.
    """
    scores = _scores(token_rewards, response_mask)
    counts, mean, _ = _group_stats(scores, index)
    factor = torch.where(counts > 1, counts / (counts - 1).clamp(min=1), torch.ones_like(counts))
    adv = (scores - mean) * factor
    adv = adv[:, None] * response_mask.to(adv.dtype)
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_plus_plus", needs_values=False, needs_groups=False)
@torch.no_grad()
def reinforce_plus_plus(token_rewards, response_mask, *, index=None, values=None, gamma=1.0, lam=1.0, config=None):
    """REINFORCE++: discounted return-to-go of the token rewards, whitened over the whole batch.

    Paper: Hu 2025, https://arxiv.org/abs/2501.03262. Shapes: token_rewards, response_mask (B, T)
    -> advantages, returns (B, T). G_t = r_t + gamma * G_{t+1} (restarting after the response);
    advantages = (G - mean) / std over all masked tokens of the batch. No critic and no groups:
    the batch statistics replace the baseline (global normalisation instead of GRPO's per-group one).
    """
    mask = response_mask.to(token_rewards.dtype)
    rewards = token_rewards * mask
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[-1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline", needs_values=False, needs_groups=True)
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards, response_mask, *, index=None, values=None, gamma=1.0, lam=1.0, config=None
):
    """REINFORCE++-baseline: group-mean baseline on the score, then batch whitening over tokens.

    Paper: Hu 2025, https://arxiv.org/abs/2501.03262 (the "baseline" variant for k samples per prompt).
    Shapes: token_rewards, response_mask (B, T), index (B,) -> advantages == returns (B, T).
    (s_i - group mean) is broadcast over the response tokens and then whitened with the masked
    mean/std of all tokens in the batch (so, unlike GRPO, the scale is global, not per group, and
    longer responses weigh more in the statistics). Singleton groups have baseline 0. gamma is unused.
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = _scores(token_rewards, response_mask)
    _, mean, _ = _group_stats(scores, index)
    adv = (scores - mean)[:, None] * mask
    adv = masked_whiten(adv, mask) * mask
    return adv, adv
