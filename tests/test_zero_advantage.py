"""``algorithm.skip_zero_advantage_backward``: the actor's rows whose advantages are all zero (GRPO groups whose
samples all got one reward) run their forward only. The optimizer step, the metrics and the trainer's log-probs must
be those of the update that runs every row's backward (the bundled model in float64), including a mini-batch where
no row has an advantage (the optimizer still steps on its momentum), and the skip must not apply where a zero
advantage still leaves a gradient (a KL or entropy term, a policy loss without the trait).

Tolerances: the chunked LM head (the path without an entropy bonus) computes each chunk's log-softmax in float32,
and a different micro-batch composition cuts different chunks, so gradients agree to float32 rounding (about 1e-8
of the largest, measured; two runs without the skip but with other micro-batch sizes differ as much): parameters
within 100 x float32's eps of the step's largest change, metrics and log-probs within 64 x that eps. Skipping a
row that has an advantage changes the step by the order of the step itself."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.conftest import TINY_MODEL

from rlfactory.config.schema import AlgorithmConfig
from rlfactory.engine.online.update import MicroBatching, Updater, actor_loss_fn, rows_with_gradient
from rlfactory.plugins import Registry
from rlfactory.rollout.base import Completion
from rlfactory.rollout.batch import pack_rollouts

EPS32 = torch.finfo(torch.float32).eps
MAX_LEN = 40
PROMPTS = [[5, 6, 7], [5, 6, 7], [10, 11, 12, 13], [10, 11, 12, 13], [19], [19], [20, 21], [20, 21]]
LENGTHS = [4, 17, 40, 2, 9, 9, 30, 1]
ZERO_ROWS = [2, 3, 6, 7]  # two groups whose samples got one reward


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation="sdpa").to(torch.float64)


def _batch(zero_rows: list[int]):
    torch.manual_seed(0)
    completions = [Completion([40 + (i * 7 + j) % 50 for j in range(n)], "stop") for i, n in enumerate(LENGTHS)]
    batch = pack_rollouts(PROMPTS, completions, pad_id=0, mask_truncated=False)
    mask = batch.response_mask.to(torch.float64)
    batch.advantages = torch.randn(batch.responses.shape, dtype=torch.float64) * mask
    batch.advantages[zero_rows] = 0.0
    # a separate sampler's log-probs: the update hands back the trainer's own for every row it saw
    batch.sampler_logprobs = -torch.rand(batch.responses.shape, dtype=torch.float64) * mask
    return batch


def _update(model, batches, alg: AlgorithmConfig, skip: bool, micro=MicroBatching(3)):
    """Updater.run over ``batches`` in turn (SGD with momentum, which carries over: a step is linear in the gradient,
    so rounding stays rounding); returns the model, each update's result, and every loss_fn call as (rows, whether
    it ran with a gradient)."""
    from accelerate import Accelerator

    net = copy.deepcopy(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    updater = Updater(Accelerator(cpu=True), net, optimizer, scheduler, max_grad_norm=None)
    results, calls = [], []
    for batch in batches:
        inner = actor_loss_fn(net, batch, alg, 0.7, MAX_LEN)

        def loss_fn(rows, pos, mini, width, packed, inner=inner, **kwargs):
            calls.append((rows.tolist(), torch.is_grad_enabled()))
            return inner(rows, pos, mini, width, packed, **kwargs)

        needs_grad = rows_with_gradient(alg, batch, batch.loss_mask) if skip else None
        torch.manual_seed(1)  # the update's shuffle of the rows
        results.append(updater.run(batch, alg, micro, batch.loss_mask, loss_fn, "actor", needs_grad=needs_grad))
    return net, results, calls


def _assert_same_parameters(a, b, before) -> None:
    with torch.no_grad():
        moved = max(
            float((y - start).abs().max()) for y, start in zip(b.parameters(), before.parameters(), strict=True)
        )
        assert moved > 1e-3  # the step did something
        for x, y in zip(a.parameters(), b.parameters(), strict=True):
            assert (x - y).abs().max() <= 100 * EPS32 * moved


def test_rows_without_advantage_run_forward_only_and_the_step_is_the_same(model):
    alg = AlgorithmConfig(adv_estimator="grpo", num_mini_batches=2)
    batch = _batch(ZERO_ROWS)
    full, (full_result,), full_calls = _update(model, [batch], alg, skip=False)
    skipped, (skip_result,), skip_calls = _update(model, [batch], alg, skip=True)
    _assert_same_parameters(skipped, full, model)
    assert all(grad for _, grad in full_calls)
    forward_only = sorted(r for rows, grad in skip_calls if not grad for r in rows)
    with_grad = sorted(r for rows, grad in skip_calls if grad for r in rows)
    assert sorted(forward_only + with_grad) == list(range(8))  # every row seen once
    assert set(with_grad) >= {0, 1, 4, 5} and forward_only  # the informative rows always with a gradient
    assert set(forward_only) <= set(ZERO_ROWS)
    metrics, expected = skip_result.metrics, full_result.metrics
    assert metrics.pop("actor/rows_forward_only") == pytest.approx(len(forward_only) / 8)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():  # entropy, clip fractions, ppo_kl, loss: over every row, as before
        assert metrics[key] == pytest.approx(value, rel=64 * EPS32, abs=64 * EPS32), key
    mine, theirs = skip_result.logprobs, full_result.logprobs
    assert torch.equal(mine.isnan(), theirs.isnan()) and not theirs[batch.response_mask.bool()].isnan().any()
    assert (mine - theirs).nan_to_num().abs().max() <= 64 * EPS32 * theirs.nan_to_num().abs().max()


def test_a_mini_batch_without_advantage_still_steps_on_the_optimizers_momentum(model):
    """The second update's rows all have zero advantage: one micro-batch still runs a (zero) backward, so the
    optimizer steps on the first update's momentum as without the skip (a skipped step would leave the weights)."""
    alg = AlgorithmConfig(adv_estimator="grpo")
    batches = [_batch(ZERO_ROWS), _batch(list(range(8)))]
    full, _, _ = _update(model, batches, alg, skip=False)
    skipped, results, calls = _update(model, batches, alg, skip=True)
    _assert_same_parameters(skipped, full, model)
    after_first, _, _ = _update(model, batches[:1], alg, skip=True)
    changed = max(
        float((a - b).abs().max()) for a, b in zip(skipped.parameters(), after_first.parameters(), strict=True)
    )
    assert changed > 1e-3  # the all-zero update moved the weights (momentum)
    second = calls[-3:]  # 8 rows in micro-batches of 3: 3 calls, the last of them with a (zero) gradient
    assert [grad for _, grad in second] == [False, False, True]
    assert results[1].metrics["actor/rows_forward_only"] == pytest.approx(6 / 8)


@pytest.mark.parametrize(
    "setting",
    [{"kl_loss_coef": 0.1}, {"entropy_coef": 0.01}, {"skip_zero_advantage_backward": False}, "a plugin's loss"],
)
def test_the_skip_applies_only_where_a_zero_advantage_means_no_gradient(setting, monkeypatch):
    batch = _batch(ZERO_ROWS)
    plain = rows_with_gradient(AlgorithmConfig(adv_estimator="grpo"), batch, batch.loss_mask)
    assert plain.tolist() == [row not in ZERO_ROWS for row in range(8)]
    if setting == "a plugin's loss":  # registered without the zero_at_zero_advantage trait
        from rlfactory.algos import policy_loss

        registry = Registry("policy loss")
        registry.register("mine")(lambda *args, **kwargs: None)
        monkeypatch.setattr(policy_loss, "POLICY_LOSSES", registry)
        alg = AlgorithmConfig(adv_estimator="grpo", policy_loss="mine")
    else:
        alg = AlgorithmConfig(adv_estimator="grpo", **setting)
    assert rows_with_gradient(alg, batch, batch.loss_mask) is None
