"""Policy losses and the PPO value loss: hand-derived values, properties, parity with TRL 1.16.

TRL parity (what was compared): ``trl.GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) is called
on a bare ``SimpleNamespace`` "self" whose ``_get_per_token_logps_and_entropies`` returns our log-probs
(a leaf tensor), with ``old_per_token_logps`` and per-sequence advantages (B,) in ``inputs``, eval mode,
one process, no KL, no entropy bonus. So TRL's own loss code runs on exactly the numbers we feed ours,
and both the scalar loss and its gradient w.r.t. the log-probs are compared:

* loss_type ``grpo`` / ``bnpo`` / ``dr_grpo`` / ``dapo`` (token-level ratio, epsilon 0.2, epsilon_high 0.28)
  vs ``ppo_clip`` (clip_c=None) aggregated with ``seq-mean-token-mean`` / ``token-mean`` /
  ``seq-mean-token-sum-norm`` / ``token-mean``;
* ``importance_sampling_level="sequence"`` with loss_type ``grpo`` (TRL's GSPO) vs ``gspo`` with
  ``seq-mean-token-mean`` (TRL differentiates exp(mean log-ratio) directly; ours uses the stop-gradient
  token form, so equal gradients check the documented equivalence);
* loss_type ``cispo`` (epsilon_high=5.0, i.e. weight <= 5) vs ``cispo`` (clip_low=None, clip_high=4.0)
  with ``token-mean``.
TRL has no dual clip and no value loss (no PPO trainer in 1.16); those are checked by hand.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlfactory.algos.aggregation import LOSS_AGG
from rlfactory.algos.policy_loss import POLICY_LOSSES, value_loss
from rlfactory.errors import UserError

TOL = 1e-6
NAMES = ["cispo", "gspo", "ppo_clip"]


def t(rows) -> torch.Tensor:
    return torch.as_tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert (actual.double() - expected).abs().max().item() <= TOL, (actual, expected)


def leaf(rows) -> torch.Tensor:
    return t(rows).requires_grad_(True)


# ---------------------------------------------------------------- ppo_clip


def test_ppo_clip_asymmetric_clip():
    # ratios r = [1.5, 0.5, 1.5, 0.5], advantages [1, 1, -1, -1], clip 0.2 / 0.28 (range 0.8 .. 1.28)
    # tok0: max(-1.5, -1.28) = -1.28 (clipped); tok1: max(-0.5, -0.8) = -0.5
    # tok2: max(1.5, 1.28) = 1.5;               tok3: max(0.5, 0.8) = 0.8 (clipped)
    old = t([[-1.0, -1.0, -2.0, -2.0]])
    logp = leaf(old + torch.log(t([[1.5, 0.5, 1.5, 0.5]])))
    adv, mask = t([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4, dtype=torch.bool)
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask, config={"clip_low": 0.2, "clip_high": 0.28})
    close(loss, [[-1.28, -0.5, 1.5, 0.8]])
    close(m["pg_clipfrac"], 0.5)
    close(m["pg_clipfrac_lower"], 0.0)
    close(m["ppo_kl"], -0.5 * math.log(0.75))  # mean(-log r) = -(2 log 1.5 + 2 log 0.5) / 4
    loss.sum().backward()
    close(logp.grad, [[0.0, -0.5, 1.5, 0.0]])  # d(-A r)/dlogp = -A r where unclipped, 0 where clipped


def test_ppo_clip_dual_clip():
    # clip 0.2/0.2, clip_c 3: tok0 A=-1 r=5: max(5, 1.2) = 5 -> capped at 3 (lower clip);
    # tok1 A=-2 r=2: max(4, 2.4) = 4 < cap 6; tok2 A=+1 r=5: max(-5, -1.2) = -1.2 (no cap for A>0);
    # tok3 A=-1 r=1: 1
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = leaf(torch.log(t([[5.0, 2.0, 5.0, 1.0]])))
    adv, mask = t([[-1.0, -2.0, 1.0, -1.0]]), torch.ones(1, 4)
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, mask, config={"clip_c": 3.0})
    close(loss, [[3.0, 4.0, -1.2, 1.0]])
    close(m["pg_clipfrac"], 0.25)  # only tok2 has the clipped term active
    close(m["pg_clipfrac_lower"], 0.25)
    loss.sum().backward()
    close(logp.grad, [[0.0, 4.0, 0.0, 1.0]])


def test_dual_clip_caps_negative_advantages():
    gen = torch.Generator().manual_seed(0)
    adv = -torch.rand(3, 4, generator=gen, dtype=torch.float64) - 0.1
    old = torch.zeros(3, 4, dtype=torch.float64)
    logp = torch.rand(3, 4, generator=gen, dtype=torch.float64) * 8 - 2  # ratios e^-2 .. e^6
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, torch.ones(3, 4), config={"clip_c": 3.0})
    assert (loss <= -adv * 3.0 + 1e-12).all()
    unbounded, _ = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, torch.ones(3, 4), config={})
    assert (unbounded > -adv * 3.0).any()  # the cap is active somewhere
    with pytest.raises(UserError, match="clip_c"):
        POLICY_LOSSES.get("ppo_clip")(logp, old, adv, torch.ones(3, 4), config={"clip_c": 0.9})


@pytest.mark.parametrize("name", ["ppo_clip", "gspo"])
def test_ratio_one_equals_minus_advantage(name):
    gen = torch.Generator().manual_seed(3)
    logp = leaf(-torch.rand(2, 3, generator=gen, dtype=torch.float64))
    adv = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    loss, m = POLICY_LOSSES.get(name)(logp, logp.detach(), adv, torch.ones(2, 3), config={"clip_c": 3.0})
    close(loss, -adv)
    close(m["pg_clipfrac"], 0.0)
    close(m["ppo_kl"], 0.0)
    loss.sum().backward()
    close(logp.grad, -adv)


# ---------------------------------------------------------------- gspo


def test_gspo_sequence_ratio():
    # row 0 token log-ratios [0.3, -0.1, 0.1] -> mean 0.1, s0 = e^0.1 = 1.10517 > 1 + 4e-4; A=+1
    #   -> loss = max(-1.10517, -1.0004) = -1.0004 on every token (clipped, no gradient)
    # row 1 log-ratios [2e-4, -1e-4, (pad)] -> mean 5e-5, s1 = e^5e-5 in (0.9997, 1.0004); A=-1 -> loss = s1
    old = t([[-1.0, -2.0, -0.5], [-0.7, -0.2, -3.0]])
    logp = leaf(old + t([[0.3, -0.1, 0.1], [2e-4, -1e-4, 4.0]]))
    adv = t([[1.0] * 3, [-1.0] * 3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss, m = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, config={})  # defaults 3e-4 / 4e-4
    s1 = math.exp(5e-5)
    close(loss, [[-1.0004] * 3, [s1, s1, 0.0]])
    close(m["pg_clipfrac"], 0.6)  # 3 of 5 response tokens
    close(m["ppo_kl"], -(0.3 - 0.1 + 0.1 + 2e-4 - 1e-4) / 5)
    agg = LOSS_AGG.get("seq-mean-token-mean")(loss, mask)
    close(agg, (-1.0004 + s1) / 2)
    agg.backward()
    # d/dlogp_t of mean_i mean_t: 1/2 * 1/2 * (-A) * s1 for row 1's tokens = s1 / 4; zero elsewhere
    close(logp.grad, [[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]])


# ---------------------------------------------------------------- cispo


def test_cispo():
    # ratios [1.5, 0.5, 6.0], A [1, -1, 1], log_prob [-1, -2, -0.5]
    # default (no lower bound, clip_high 4 -> weight <= 5): w = [1.5, 0.5, 5.0]
    # loss = -w A logp = [1.5, -1.0, 2.5]; gradient -w A = [-1.5, 0.5, -5.0]
    logp = leaf([[-1.0, -2.0, -0.5]])
    old = logp.detach() - torch.log(t([[1.5, 0.5, 6.0]]))
    adv, mask = t([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, m = POLICY_LOSSES.get("cispo")(logp, old, adv, mask, config={})
    close(loss, [[1.5, -1.0, 2.5]])
    close(m["pg_clipfrac"], 1 / 3)
    loss.sum().backward()
    close(logp.grad, [[-1.5, 0.5, -5.0]])
    # clip 0.2 / 0.28: w = [1.28, 0.8, 1.28] -> loss [1.28, -1.6, 0.64]; every token still has a gradient
    loss, m = POLICY_LOSSES.get("cispo")(logp, old, adv, mask, config={"clip_low": 0.2, "clip_high": 0.28})
    close(loss, [[1.28, -1.6, 0.64]])
    close(m["pg_clipfrac"], 1.0)


# ---------------------------------------------------------------- value loss


def test_value_loss():
    # tok0: (1-0)^2 = 1 vs V_clip = 0.5 + 0.2 = 0.7 -> 0.49: 0.5 * 1 = 0.5
    # tok1: (1-2)^2 = 1 vs (0.7-2)^2 = 1.69 -> 0.5 * 1.69 = 0.845 (clipped term larger)
    # tok2: V = old: (2-3)^2 = 1 -> 0.5; tok3 padded
    values = leaf([[1.0, 1.0, 2.0, 9.0]])
    old, ret = t([[0.5, 0.5, 2.0, -9.0]]), t([[0.0, 2.0, 3.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, old, ret, mask, clip_range=0.2)
    close(loss, [[0.5, 0.845, 0.5, 0.0]])
    close(m["vf_clipfrac"], 1 / 3)
    loss.sum().backward()
    close(values.grad, [[1.0, 0.0, -1.0, 0.0]])  # d 0.5 (V - R)^2 = V - R where unclipped
    loss, _ = value_loss(values, old, ret, mask, clip_range=None)
    close(loss, [[0.5, 0.5, 0.5, 0.0]])


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_padding_never_changes_loss(name, agg):
    gen = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    logp = old + 0.3 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=gen, dtype=torch.float64).expand(3, 4)
    cfg = {"clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0}
    junk = torch.where(mask, 0.0, torch.rand(3, 3, 4, generator=gen, dtype=torch.float64) * 10 - 5)
    results = []
    for j in (torch.zeros_like(junk), junk):
        lp = (logp + j[0]).requires_grad_(True)
        loss, metrics = POLICY_LOSSES.get(name)(lp, old + j[1], adv + j[2], mask, config=cfg)
        total = LOSS_AGG.get(agg)(loss, mask, max_response_length=6)
        total.backward()
        assert not lp.grad[~mask].any() and not loss[~mask].any()
        results.append((loss.detach(), total.detach(), lp.grad, metrics))
    (l0, t0, g0, m0), (l1, t1, g1, m1) = results
    assert torch.equal(l0, l1) and torch.equal(t0, t1) and torch.equal(g0, g1)
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)


def test_registry_names_and_errors():
    assert POLICY_LOSSES.names() == NAMES
    for name in NAMES:
        assert "arxiv.org" in POLICY_LOSSES.get(name).__doc__, name
    with pytest.raises(UserError, match="valid names: cispo, gspo, ppo_clip"):
        POLICY_LOSSES.get("ppo")


# ---------------------------------------------------------------- parity with TRL 1.16

MAX_DIFF: dict[str, float] = {}


def record(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    diff = (ours.double() - theirs.double()).abs().max().item()
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)
    print(f"max |ours - trl| {key}: {diff:.3g}")
    assert diff <= TOL, (key, diff)


def trl_grpo_loss(logp, old, adv, mask, *, loss_type, eps_low, eps_high, level="token", max_len=None):
    """Scalar loss from ``trl.GRPOTrainer._compute_loss`` run on a namespace "self" (eval mode, 1 process)."""
    from trl import GRPOTrainer

    B, T = logp.shape
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False,
        model=SimpleNamespace(training=False),
        max_completion_length=max_len,
        current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    return GRPOTrainer._compute_loss(fake, None, inputs)


def random_case(seed: int, spread: float):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 5
    lengths = torch.tensor([5, 3, 1, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = old + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


PPO_CFG = {"clip_low": 0.2, "clip_high": 0.28}  # DAPO clip-higher
GSPO_CFG = {"clip_low": 3e-4, "clip_high": 4e-4}
CISPO_CFG = {"clip_low": None, "clip_high": 4.0}  # weight <= 5 == TRL epsilon_high=5.0
CASES = [
    # (TRL loss_type, TRL IS level, TRL eps_low, eps_high, our loss, our config, our aggregation, spread)
    ("grpo", "token", 0.2, 0.28, "ppo_clip", PPO_CFG, "seq-mean-token-mean", 0.3),
    ("bnpo", "token", 0.2, 0.28, "ppo_clip", PPO_CFG, "token-mean", 0.3),
    ("dr_grpo", "token", 0.2, 0.28, "ppo_clip", PPO_CFG, "seq-mean-token-sum-norm", 0.3),
    ("dapo", "token", 0.2, 0.28, "ppo_clip", PPO_CFG, "token-mean", 0.3),
    ("grpo", "sequence", 3e-4, 4e-4, "gspo", GSPO_CFG, "seq-mean-token-mean", 2e-3),
    ("cispo", "token", 0.2, 5.0, "cispo", CISPO_CFG, "token-mean", 1.5),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_loss_and_gradient_match_trl_grpo_trainer(case, seed):
    pytest.importorskip("trl")
    trl_type, level, eps_low, eps_high, name, cfg, agg, spread = case
    logp, old, adv, mask = random_case(seed, spread)
    max_len = 7

    ours_lp = logp.clone().requires_grad_(True)
    per_token, metrics = POLICY_LOSSES.get(name)(ours_lp, old, adv[:, None].expand_as(logp), mask, config=cfg)
    assert 0.0 < metrics["pg_clipfrac"].item() < 1.0  # both clipped and unclipped tokens are exercised
    ours = LOSS_AGG.get(agg)(per_token, mask, max_response_length=max_len)
    ours.backward()

    trl_lp = logp.clone().requires_grad_(True)
    theirs = trl_grpo_loss(trl_lp, old, adv, mask, loss_type=trl_type, eps_low=eps_low, eps_high=eps_high,
                           level=level, max_len=max_len)  # fmt: skip
    theirs.backward()
    key = f"{trl_type}/{level} vs {name}+{agg}"
    record(f"{key} loss", ours, theirs)
    record(f"{key} grad", ours_lp.grad, trl_lp.grad)


def test_entropy_metric_and_loss_paths_equal_the_definition():
    """The logged entropy (no gradient: 1,024-row chunks, in place) and the entropy bonus's (with gradient) against
    torch's Categorical in float64, over 2,100 rows (two full chunks and a partial one)."""
    from rlfactory.algos.common import entropy_from_logits

    torch.manual_seed(0)
    logits = torch.randn(3, 700, 50, dtype=torch.float64) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    with torch.no_grad():
        metric = entropy_from_logits(logits)
    bonus = entropy_from_logits(logits.clone().requires_grad_())
    assert bonus.requires_grad and not metric.requires_grad
    for got in (metric, bonus.detach()):  # both compute in float32
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
