"""KL estimators, KL controllers and loss aggregations: hand-derived values, masking, parity with TRL 1.16.

TRL parity (what was compared), all through ``trl.GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py)
called on a bare ``SimpleNamespace`` "self" (eval mode, one process, no entropy bonus):

* aggregations: with ``old_per_token_logps == per_token_logps`` (ratio 1, nothing clipped) and (B, T)
  advantages ``-L``, TRL's per-token loss is exactly ``L``; TRL's ``grpo`` / ``bnpo`` / ``dr_grpo``
  (max_completion_length) / ``dapo`` (num_items_in_batch = number of response tokens) reductions are
  compared with ``seq-mean-token-mean`` / ``token-mean`` / ``seq-mean-token-sum-norm`` / ``token-mean``;
* ``k3``: with ``beta > 0`` TRL adds ``beta * per_token_kl`` (its inline k3) to the loss and logs its
  masked mean as metric ``kl``; both the metric and the full loss + gradient are compared with
  ``masked_mean(k3)`` and ``seq-mean-token-mean(ppo_clip + beta * k3)``;
* ``k1``: TRL's RLOOTrainer penalty lines (``per_token_kl = old - ref``, summed over the completion,
  trl/trainer/rloo_trainer.py ``_generate_and_score_completions``) are reproduced and compared.
TRL 1.16 has no KL controllers; those are checked by hand.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlfactory.algos.aggregation import LOSS_AGG
from rlfactory.algos.common import masked_mean, masked_sum
from rlfactory.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController
from rlfactory.algos.policy_loss import POLICY_LOSSES
from rlfactory.errors import UserError

TOL = 1e-6
AGG_NAMES = ["seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean"]


def t(rows) -> torch.Tensor:
    return torch.as_tensor(rows, dtype=torch.float64)


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert (actual.double() - expected).abs().max().item() <= TOL, (actual, expected)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    # log_prob - ref = [0.5, -1.0]; x = ref - log_prob = [-0.5, 1.0]
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    ref = t([[-1.5, -1.0]])
    close(KL_ESTIMATORS.get("k1")(logp, ref), [[0.5, -1.0]])
    close(KL_ESTIMATORS.get("k2")(logp, ref), [[0.125, 0.5]])  # 0.5 * 0.25, 0.5 * 1
    k3 = KL_ESTIMATORS.get("k3")(logp, ref)
    # e^-0.5 + 0.5 - 1 = 0.1065306597; e^1 - 1 - 1 = 0.7182818285
    close(k3, [[math.exp(-0.5) - 0.5, math.e - 2.0]])
    k3.sum().backward()
    close(logp.grad, [[1 - math.exp(-0.5), 1 - math.e]])  # d/dlogp = 1 - e^(ref - logp)


def test_k3_is_clamped_like_verl():
    # x = 15: e^15 - 16 ~ 3.3e6 -> 10; x = -30 -> clamped to -20: e^-20 + 19 ~ 19 -> 10; x = 0 -> 0
    out = KL_ESTIMATORS.get("k3")(t([[0.0, 0.0, -2.0]]), t([[15.0, -30.0, -2.0]]))
    close(out, [[10.0, 10.0, 0.0]])
    assert (KL_ESTIMATORS.get("k3")(torch.randn(3, 4), torch.randn(3, 4)) >= 0).all()


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    # e = clip(9/6 - 1 = 0.5, +-0.2) = 0.2 -> value x (1 + 0.2 * 256 / 1e4) = x 1.00512
    ctl.update(current_kl=9.0, n_steps=256)
    assert abs(ctl.value - 0.201024) <= 1e-12
    ctl.update(current_kl=torch.tensor(5.4), n_steps=100)  # e = -0.1 -> x (1 - 0.1 * 100 / 1e4) = 0.999
    assert abs(ctl.value - 0.201024 * 0.999) <= 1e-9
    with pytest.raises(UserError, match="target and horizon"):
        AdaptiveKLController(init_kl_coef=0.1, target=0.0, horizon=100)


# ---------------------------------------------------------------- aggregation

# rows of length 3, 1, 2 (T = 4); masked slots hold junk
LOSS = t([[1.0, 2.0, 3.0, 7.0], [4.0, -9.0, 8.0, 5.0], [5.0, 6.0, 11.0, -3.0]])
MASK = torch.arange(4)[None, :] < torch.tensor([3, 1, 2])[:, None]


def test_aggregations_by_hand():
    # token-mean: (1 + 2 + 3 + 4 + 5 + 6) / 6 = 3.5
    close(LOSS_AGG.get("token-mean")(LOSS, MASK), 3.5)
    # seq-mean-token-mean: (6/3 + 4/1 + 11/2) / 3 = (2 + 4 + 5.5) / 3
    close(LOSS_AGG.get("seq-mean-token-mean")(LOSS, MASK), 11.5 / 3)
    # seq-mean-token-sum-norm: (6 + 4 + 11) / (3 * 5) = 1.4 ; with no constant, T = 4: 21 / 12 = 1.75
    close(LOSS_AGG.get("seq-mean-token-sum-norm")(LOSS, MASK, max_response_length=5), 1.4)
    close(LOSS_AGG.get("seq-mean-token-sum-norm")(LOSS, MASK), 1.75)


def test_empty_sequences():
    loss, mask = t([[1.0, 2.0], [8.0, 9.0]]), torch.tensor([[1, 1], [0, 0]])
    close(LOSS_AGG.get("seq-mean-token-mean")(loss, mask), 1.5)  # the empty row is left out of the mean
    close(LOSS_AGG.get("token-mean")(loss, mask), 1.5)
    close(LOSS_AGG.get("seq-mean-token-sum-norm")(loss, mask, max_response_length=2), 0.75)  # 3 / (2 * 2)
    for name in AGG_NAMES:
        close(LOSS_AGG.get(name)(loss, torch.zeros(2, 2)), 0.0)


@pytest.mark.parametrize("name", AGG_NAMES)
def test_padding_never_changes_aggregate(name):
    grads, values = [], []
    for junk in (0.0, float("nan"), float("inf"), -1e9):
        loss = torch.where(MASK, LOSS, junk).requires_grad_(True)
        out = LOSS_AGG.get(name)(loss, MASK.float(), max_response_length=5)
        out.backward()
        values.append(out.detach())
        grads.append(loss.grad)
    assert all(torch.equal(v, values[0]) for v in values)
    assert all(torch.equal(g, grads[0]) for g in grads)
    assert not grads[0][~MASK].any() and grads[0][MASK].all()


def test_registry_names_and_errors():
    assert LOSS_AGG.names() == AGG_NAMES
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    for registry in (LOSS_AGG, KL_ESTIMATORS):
        for name in registry.names():
            assert "http" in registry.get(name).__doc__, name
    with pytest.raises(UserError, match=f"valid names: {', '.join(AGG_NAMES)}"):
        LOSS_AGG.get("seq-mean")
    with pytest.raises(UserError, match="valid names: k1, k2, k3"):
        KL_ESTIMATORS.get("low_var_kl")


# ---------------------------------------------------------------- parity with TRL 1.16

MAX_DIFF: dict[str, float] = {}


def record(key: str, ours, theirs) -> None:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    diff = (ours - theirs).abs().max().item()
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)
    print(f"max |ours - trl| {key}: {diff:.3g}")
    assert diff <= TOL, (key, diff)


def trl_grpo_loss(logp, old, adv, mask, *, loss_type, max_len=None, beta=0.0, ref=None):
    """(loss, logged metrics) of ``trl.GRPOTrainer._compute_loss`` on a namespace "self" (eval, 1 process)."""
    from trl import GRPOTrainer

    B, T = logp.shape
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.2,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False,
        model=SimpleNamespace(training=False),
        max_completion_length=max_len,
        current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
        "ref_per_token_logps": ref,
    }
    return GRPOTrainer._compute_loss(fake, None, inputs), metrics["eval"]


def random_case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1])[:, None]
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    per_token = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    return logp, old, ref, per_token, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("loss_type", "ours"),
    [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm"),
     ("dapo", "token-mean")],
)  # fmt: skip
def test_aggregation_matches_trl(loss_type, ours, seed):
    pytest.importorskip("trl")
    logp, _, _, per_token, _, mask = random_case(seed)
    # ratio 1 and (B, T) advantages -L: TRL's per-token loss is -min(1 * A, clip(1) * A) = L
    theirs, _ = trl_grpo_loss(logp, logp, -per_token, mask, loss_type=loss_type, max_len=7)
    record(f"{loss_type} vs {ours}", LOSS_AGG.get(ours)(per_token, mask, max_response_length=7), theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k3_matches_trl_grpo_kl_term(seed):
    pytest.importorskip("trl")
    logp, old, ref, _, adv, mask = random_case(seed)
    beta = 0.04
    ours_lp = logp.clone().requires_grad_(True)
    pg, _ = POLICY_LOSSES.get("ppo_clip")(ours_lp, old, adv[:, None].expand_as(logp), mask, config={})
    kl = KL_ESTIMATORS.get("k3")(ours_lp, ref)
    ours = LOSS_AGG.get("seq-mean-token-mean")(pg + beta * kl, mask)
    ours.backward()
    trl_lp = logp.clone().requires_grad_(True)
    theirs, metrics = trl_grpo_loss(trl_lp, old, adv, mask, loss_type="grpo", beta=beta, ref=ref)
    theirs.backward()
    record("k3 masked mean vs TRL metric 'kl'", masked_mean(kl.detach(), mask), metrics["kl"][0])
    record("grpo loss with beta*k3", ours, theirs)
    record("grpo loss with beta*k3 grad", ours_lp.grad, trl_lp.grad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_matches_trl_rloo_penalty(seed):
    _, old, ref, _, _, mask = random_case(seed)
    # trl/trainer/rloo_trainer.py, RLOOTrainer._generate_and_score_completions:
    per_token_kl = old - ref
    theirs = (per_token_kl * mask).sum(-1)
    ours = masked_sum(KL_ESTIMATORS.get("k1")(old, ref), mask, dim=-1)
    record("k1 sequence sum vs RLOO penalty", ours, theirs)
