"""Per-token policy-gradient losses (verl ``core_algos`` style), looked up by name, plus the PPO value loss.

Every registered entry has the signature::

    fn(log_prob, old_log_prob, advantages, response_mask, *, config=None)
        -> (per_token_loss (B, T), metrics: dict[str, Tensor])

All tensors are (B, T) over response tokens. ``config`` keys: ``clip_low`` / ``clip_high`` (ratio
clip range 1 - clip_low .. 1 + clip_high; DAPO clip-higher uses e.g. clip_high=0.28) and ``clip_c``
(dual-clip constant, None = off). The loss is *not* reduced here: aggregate it with an entry of
``rlfactory.algos.aggregation.LOSS_AGG``. Per-token losses are 0 at masked positions, and masked
positions receive no gradient. Metrics are detached scalars (masked means over response tokens).

Trait ``zero_at_zero_advantage``: a row whose advantages are all zero has a per-token loss of exactly zero and no
gradient, so the update may skip its backward (``engine.online.update.rows_with_gradient``). A loss without the trait
(a plugin's, say) always runs every row's backward.
"""

from __future__ import annotations

import torch

from rlfactory.algos.common import masked_mean, masked_sum
from rlfactory.errors import UserError
from rlfactory.plugins import Registry

POLICY_LOSSES = Registry("policy loss")


def _clip_range(config: dict | None, low: float | None, high: float | None) -> tuple[float | None, ...]:
    """(clip_low, clip_high) from config with per-loss defaults; clip_high=None falls back to clip_low."""
    cfg = config or {}
    clip_low = cfg.get("clip_low", low)
    clip_high = cfg.get("clip_high", high)
    return clip_low, clip_low if clip_high is None else clip_high


def _ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token log-ratio clamped to [-20, 20] for stability as in verl, ratio = exp(log-ratio))."""
    log_ratio = (log_prob - old_log_prob).clamp(min=-20.0, max=20.0)
    return log_ratio, torch.exp(log_ratio)


def _zero_masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, per_token, torch.zeros_like(per_token))


@POLICY_LOSSES.register("ppo_clip", zero_at_zero_advantage=True)
def ppo_clip(log_prob, old_log_prob, advantages, response_mask, *, config=None):
    """PPO clipped surrogate with asymmetric (clip-higher) and dual clipping, per token.

    Papers: PPO (Schulman et al. 2017, https://arxiv.org/abs/1707.06347); dual clip (Ye et al. 2020,
    https://arxiv.org/abs/1912.09729); clip-higher (DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476).
    Shapes: log_prob, old_log_prob, advantages, response_mask (B, T) -> per_token_loss (B, T).
    loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with r = exp(log_prob - old_log_prob);
    with ``clip_c`` set, tokens with A < 0 are further capped at -A * clip_c (so a huge ratio on a
    bad token cannot blow up the loss). Same as verl's ``compute_policy_loss``. This is the GRPO/DAPO
    token-level objective; GRPO vs DAPO vs Dr.GRPO differ only in the aggregation and advantages.
    Metrics: pg_clipfrac (share of tokens where the clipped term is active), pg_clipfrac_lower
    (share where the dual clip is active), ppo_kl (mean old_log_prob - log_prob).
    """
    clip_low, clip_high = _clip_range(config, 0.2, 0.2)
    clip_c = (config or {}).get("clip_c")
    if clip_c is not None and clip_c <= 1.0:
        raise UserError(f"policy loss 'ppo_clip': clip_c must be > 1.0 (dual clip), got {clip_c}")
    mask = response_mask.bool()
    log_ratio, ratio = _ratio(log_prob, old_log_prob)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    if clip_c is not None:
        loss_cap = -advantages * clip_c
        lower = (loss > loss_cap) & (advantages < 0)
        clipfrac_lower = masked_mean(lower.float(), mask)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss_cap), loss)
    else:
        clipfrac_lower = clipfrac.new_zeros(())
    metrics = {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return _zero_masked(loss, mask), metrics


@POLICY_LOSSES.register("gspo", zero_at_zero_advantage=True)
def gspo(log_prob, old_log_prob, advantages, response_mask, *, config=None):
    """GSPO: clipped surrogate on the *sequence-level* importance ratio (token-level stop-gradient form).

    Paper: Zheng et al. 2025, Group Sequence Policy Optimization, https://arxiv.org/abs/2507.18071.
    Shapes: log_prob, old_log_prob, advantages, response_mask (B, T) -> per_token_loss (B, T).
    s_i = exp(mean_t (log_prob - old_log_prob)) over the response of sequence i. As in the paper's
    GSPO-token, each token uses s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose
    gradient is s_i * grad log pi(y_t). loss_i,t = max(-A s_i,t, -A clip(s_i,t, 1 - clip_low, 1 + clip_high)).
    With a per-sequence advantage every token of sequence i holds the sequence loss l_i, so aggregating
    with ``seq-mean-token-mean`` gives mean_i l_i, whose gradient (1/|y_i|) sum_t s_i grad log pi(y_t)
    = grad s_i is exactly the paper's sequence objective (other aggregations re-weight sequences).
    Clip ranges are ~1e3 times smaller than PPO's: defaults clip_low=3e-4, clip_high=4e-4 when the
    config omits them. log s is clamped at 10 (as verl). Metrics: pg_clipfrac, ppo_kl.
    """
    clip_low, clip_high = _clip_range(config, 3e-4, 4e-4)
    mask = response_mask.bool()
    fmask = mask.to(log_prob.dtype)
    log_ratio = torch.where(mask, log_prob - old_log_prob, torch.zeros_like(log_prob))
    seq_log_ratio = masked_sum(log_ratio, fmask, dim=-1) / fmask.sum(-1).clamp(min=1.0)
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    seq_ratio = torch.exp(log_seq_ratio.clamp(max=10.0))
    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return _zero_masked(loss, mask), metrics


@POLICY_LOSSES.register("cispo", zero_at_zero_advantage=True)
def cispo(log_prob, old_log_prob, advantages, response_mask, *, config=None):
    """CISPO: REINFORCE with a clipped, detached importance weight, so no token's gradient is dropped.

    Paper: MiniMax-M1 (MiniMax 2025), https://arxiv.org/abs/2506.13585.
    Shapes: log_prob, old_log_prob, advantages, response_mask (B, T) -> per_token_loss (B, T).
    loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log_prob. Unlike ppo_clip, which zeroes
    the gradient of tokens whose ratio leaves the trust region, CISPO only bounds their weight.
    The paper sets no lower bound: clip_low defaults to None (= no lower bound) and clip_high to 4.0
    (weight <= 5, ScaleRL's epsilon_max) when the config omits them. Metrics: pg_clipfrac (share of
    tokens whose weight was clipped), ppo_kl.
    """
    clip_low, clip_high = _clip_range(config, None, 4.0)
    mask = response_mask.bool()
    log_ratio, ratio = _ratio(log_prob, old_log_prob)
    lower = None if clip_low is None else 1.0 - clip_low
    upper = None if clip_high is None else 1.0 + clip_high
    weight = ratio.detach()
    if lower is not None or upper is not None:
        weight = weight.clamp(min=lower, max=upper)
    clipped = weight != ratio.detach()
    loss = -weight * advantages * log_prob
    metrics = {
        "pg_clipfrac": masked_mean(clipped.float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return _zero_masked(loss, mask), metrics


def value_loss(values, old_values, returns, response_mask, *, clip_range):
    """PPO clipped value loss per token: 0.5 * max((V - R)^2, (V_clip - R)^2).

    Paper: PPO (https://arxiv.org/abs/1707.06347), value clipping as in OpenAI baselines / verl
    ``compute_value_loss``. Shapes: values, old_values, returns, response_mask (B, T) ->
    per_token_loss (B, T). V_clip = old_values + clamp(values - old_values, -clip_range, clip_range);
    ``clip_range=None`` disables clipping (plain 0.5 * MSE). Aggregate with ``LOSS_AGG`` as the policy
    loss. Metric: vf_clipfrac (share of tokens where the clipped term is the larger one).
    """
    mask = response_mask.bool()
    loss_unclipped = (values - returns) ** 2
    if clip_range is None:
        loss_clipped = loss_unclipped
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    metrics = {"vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()}
    return _zero_masked(loss, mask), metrics
