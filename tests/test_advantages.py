"""Advantage estimators: hand-derived values, masking invariance, registry names/traits, parity with TRL 1.16.

TRL parity (what was compared): TRL computes advantages inline in
``GRPOTrainer._generate_and_score_completions`` and ``RLOOTrainer._generate_and_score_completions``
(trl/trainer/grpo_trainer.py, trl/trainer/rloo_trainer.py), so the tests reproduce those exact lines
(sum_then_normalize branch, no NaN rewards, ``normalize_advantages=False`` for RLOO) with TRL's own
``trl.trainer.utils.nanstd`` and compare them with ``grpo`` (scale group/batch/none; TRL's epsilon
1e-4 passed via config) and ``rloo`` on random scores, contiguous groups of 4. TRL has no GAE or
REINFORCE++ in 1.16 (the PPO trainer was removed), so those are checked by hand only.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from rlfactory.algos.advantages import ADV_ESTIMATORS
from rlfactory.errors import UserError

TOL = 1e-6
NAMES = ["gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]


def t(rows) -> torch.Tensor:
    return torch.as_tensor(rows, dtype=torch.float64)


def outcome_rewards(scores, lengths, width) -> tuple[torch.Tensor, torch.Tensor]:
    """token_rewards with each score at the last response token, and the matching mask."""
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    for i, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, length - 1] = score
    return rewards, mask


def run(name, rewards, mask, **kwargs):
    kwargs.setdefault("config", {})
    return ADV_ESTIMATORS.get(name)(rewards, mask, **kwargs)


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= TOL, (actual, expected)


# ---------------------------------------------------------------- hand-derived values

# scores [1, 0 | 2, 5] in groups [0, 0 | 1, 1], lengths 3, 2, 1, 3 (T=3)
SCORES, LENGTHS, INDEX = [1.0, 0.0, 2.0, 5.0], [3, 2, 1, 3], torch.tensor([0, 0, 1, 1])
MASK = outcome_rewards(SCORES, LENGTHS, 3)[1].double()


def test_grpo_group_scale():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    adv, ret = run("grpo", rewards, mask, index=INDEX, config={"scale": "group"})
    # group 0: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5) -> +-0.5 / (sqrt(0.5) + 1e-6)
    # group 1: mean 3.5, unbiased std sqrt((2.25 + 2.25) / 1) = sqrt(4.5) -> -+1.5 / (sqrt(4.5) + 1e-6)
    a, b = 0.5 / (math.sqrt(0.5) + 1e-6), 1.5 / (math.sqrt(4.5) + 1e-6)
    close(adv, t([[a] * 3, [-a] * 3, [-b] * 3, [b] * 3]) * MASK)
    close(ret, adv)


def test_grpo_batch_scale_and_dr_grpo():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    # batch mean 2, deviations -1, -2, 0, 3 -> unbiased var 14 / 3; numerator uses the *group* mean
    adv, _ = run("grpo", rewards, mask, index=INDEX, config={"scale": "batch"})
    s = math.sqrt(14 / 3) + 1e-6
    close(adv, t([[0.5 / s] * 3, [-0.5 / s] * 3, [-1.5 / s] * 3, [1.5 / s] * 3]) * MASK)
    # Dr.GRPO: no std division, just score - group mean
    adv, _ = run("grpo", rewards, mask, index=INDEX, config={"scale": "none"})
    close(adv, t([[0.5] * 3, [-0.5] * 3, [-1.5] * 3, [1.5] * 3]) * MASK)


def test_grpo_score_includes_per_token_kl_penalty():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    rewards = rewards - 0.1 * mask  # per-token penalty -0.1: scores become 0.7, -0.2, 1.9, 4.7
    adv, _ = run("grpo", rewards, mask, index=INDEX, config={"scale": "none"})
    # group 0 mean 0.25 -> 0.45, -0.45; group 1 mean 3.3 -> -1.4, 1.4
    close(adv, t([[0.45] * 3, [-0.45] * 3, [-1.4] * 3, [1.4] * 3]) * MASK)


def test_rloo():
    # group 0 = [1, 2, 6]: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5 -> -3, -1.5, 4.5
    # group 1 = [4] is a singleton: baseline 0, keeps 4
    rewards, mask = outcome_rewards([1.0, 2.0, 6.0, 4.0], [2, 2, 1, 2], 2)
    adv, ret = run("rloo", rewards, mask, index=[3, 3, 3, 8])
    close(adv, t([[-3.0, -3.0], [-1.5, -1.5], [4.5, 0.0], [4.0, 4.0]]))
    close(ret, adv)


def test_gae():
    # gamma 0.9, lam 0.8 (gamma*lam = 0.72); row 1 has a padded last token with junk reward/value
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = t([[0.5, 0.4, 0.6], [0.1, 0.3, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv, ret = run("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    # row 0: t2 delta = 1 - 0.6 = 0.4; t1 delta = 0.9*0.6 - 0.4 = 0.14, A = 0.14 + 0.72*0.4 = 0.428;
    #        t0 delta = 0.9*0.4 - 0.5 = -0.14, A = -0.14 + 0.72*0.428 = 0.16816
    # row 1: t2 skipped; t1 delta = 2 - 0.3 = 1.7;
    #        t0 delta = 0.9*0.3 - 0.1 = 0.17, A = 0.17 + 0.72*1.7 = 1.394
    raw = [0.16816, 0.428, 0.4, 1.394, 1.7]
    close(ret, t([[0.66816, 0.828, 1.0], [1.494, 2.0, 0.0]]))  # returns = A + V before whitening
    mean, std = sum(raw) / 5, math.sqrt(statistics.variance(raw) + 1e-8)  # unbiased (Bessel) variance
    w = [(x - mean) / std for x in raw]
    close(adv, t([w[:3], w[3:] + [0.0]]))


def test_reinforce_plus_plus():
    # gamma 0.5; row 0 rewards [-0.1, 0, 1] (KL penalty + score), row 1 [0, 2, pad]
    rewards = t([[-0.1, 0.0, 1.0], [0.0, 2.0, 50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = run("reinforce_plus_plus", rewards, mask, gamma=0.5)
    # returns-to-go: row 0: 1, 0.5, -0.1 + 0.25 = 0.15; row 1: 2, 0 + 0.5*2 = 1
    close(ret, t([[0.15, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    # whitening over 5 tokens: mean 4.65/5 = 0.93, squared deviations sum 1.948, unbiased var 0.487
    std = math.sqrt(0.487 + 1e-8)
    close(adv, t([[-0.78 / std, -0.43 / std, 0.07 / std], [0.07 / std, 1.07 / std, 0.0]]))


def test_reinforce_plus_plus_baseline():
    # scores [1, 0 | 4], groups [0, 0 | 1], lengths 3, 1, 2
    # minus group mean -> 0.5, -0.5, 4 (singleton group: baseline 0)
    rewards, mask = outcome_rewards([1.0, 0.0, 4.0], [3, 1, 2], 3)
    adv, ret = run("reinforce_plus_plus_baseline", rewards, mask, index=np.array([0, 0, 1]))
    # tokens [0.5, 0.5, 0.5, -0.5, 4, 4]: mean 1.5, deviations -1, -1, -1, -2, 2.5, 2.5
    # -> unbiased var 19.5 / 5 = 3.9
    s = math.sqrt(3.9 + 1e-8)
    close(adv, t([[-1 / s, -1 / s, -1 / s], [-2 / s, 0, 0], [2.5 / s, 2.5 / s, 0]]))
    close(ret, adv)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("name", NAMES)
def test_padding_never_changes_outputs(name):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]
    kwargs = dict(index=torch.tensor([0, 0, 1, 1]), values=values, gamma=0.9, lam=0.95)
    adv, ret = run(name, rewards, mask, **kwargs)
    junk = torch.where(~mask, 1e3 * torch.rand(2, 4, 5, generator=gen, dtype=torch.float64) - 500.0, 0.0)
    kwargs["values"] = values + junk[1]
    adv2, ret2 = run(name, rewards + junk[0], mask, **kwargs)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert not adv[~mask].any() and not ret[~mask].any()
    assert adv.shape == ret.shape == (4, 5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_identical_rewards_give_zero_advantage(scale):
    rewards, mask = outcome_rewards([0.7, 0.7, 0.7, 0.7], [2, 3, 1, 3], 3)
    for index in ([0, 0, 0, 0], [0, 0, 1, 1]):
        adv, _ = run("grpo", rewards, mask, index=torch.tensor(index), config={"scale": scale})
        assert adv.abs().max().item() == 0.0
    adv, _ = run("rloo", rewards, mask, index=torch.tensor([0, 0, 1, 1]))
    assert adv.abs().max().item() == 0.0


def test_group_ids_any_type():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    ref, _ = run("grpo", rewards, mask, index=INDEX)
    for index in (["a", "a", "b", "b"], np.array([7, 7, 2, 2]), torch.tensor([9, 9, -1, -1])):
        assert torch.equal(run("grpo", rewards, mask, index=index)[0], ref)


def test_registry_names_traits_and_errors():
    assert ADV_ESTIMATORS.names() == sorted(NAMES)
    for name in NAMES:
        traits = ADV_ESTIMATORS.traits(name)
        assert traits["needs_values"] is (name == "gae"), name
        assert traits["needs_groups"] is (name in {"grpo", "rloo", "reinforce_plus_plus_baseline"}), name
        assert "arxiv.org" in ADV_ESTIMATORS.get(name).__doc__, name
    with pytest.raises(UserError, match="valid names: gae, grpo, reinforce_plus_plus"):
        ADV_ESTIMATORS.get("grpoo")
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 3)
    with pytest.raises(UserError, match="group, batch, none"):
        run("grpo", rewards, mask, index=INDEX, config={"scale": "std"})


# ---------------------------------------------------------------- parity with TRL 1.16

MAX_DIFF: dict[str, float] = {}


def record(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    diff = (ours - theirs).abs().max().item()
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)
    print(f"max |ours - trl| {key}: {diff:.3g}")
    assert diff <= TOL, (key, diff)


def random_batch(seed: int, n_prompts: int = 3, g: int = 4, width: int = 5):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_prompts * g, generator=gen, dtype=torch.float64) * 4 - 1
    lengths = torch.randint(1, width + 1, (n_prompts * g,), generator=gen).tolist()
    rewards, mask = outcome_rewards(scores.tolist(), lengths, width)
    return scores, rewards, mask, torch.arange(n_prompts * g) // g, g


def trl_grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions, sum_then_normalize branch."""
    from trl.trainer.utils import nanstd

    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:  # "batch"
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


def trl_rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """trl/trainer/rloo_trainer.py, RLOOTrainer._generate_and_score_completions (no normalization)."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    advantages = rewards - baselines.view(-1)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_matches_trl(seed, scale):
    pytest.importorskip("trl")
    scores, rewards, mask, index, g = random_batch(seed)
    adv, _ = run("grpo", rewards, mask, index=index, config={"scale": scale, "epsilon": 1e-4})
    # TRL keeps (B,) advantages and broadcasts them over the completion tokens in the loss
    theirs = trl_grpo_advantages(scores, g, scale)[:, None] * mask
    record(f"grpo advantages (scale={scale})", adv, theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_trl(seed):
    pytest.importorskip("trl")
    scores, rewards, mask, index, g = random_batch(seed)
    adv, _ = run("rloo", rewards, mask, index=index)
    record("rloo advantages", adv, trl_rloo_advantages(scores, g)[:, None] * mask)
