"""Rollout/trainer mismatch: the importance-sampling corrections against hand-computed weights, the mismatch
metrics, the weights reaching the actor loss, and the config rules (main venv: no vLLM needed)."""

from __future__ import annotations

import math

import pytest
import torch

from rlfactory.algos.rollout_correction import IS_CORRECTIONS, mismatch_metrics
from rlfactory.config.schema import AlgorithmConfig, RunConfig

# two sequences; log-ratios old - sampler: row 0 = [ln 3, ln 0.5, (pad)], row 1 = [ln 1.5, ln 1.5, ln 1.5]
SAMPLER = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -0.5, -0.5]])
OLD = SAMPLER + torch.log(torch.tensor([[3.0, 0.5, 100.0], [1.5, 1.5, 1.5]]))
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
GEO0 = math.sqrt(3.0 * 0.5)  # geometric mean ratio of row 0: sqrt(1.5) = 1.2247


@pytest.mark.parametrize(
    "name, expected",
    [
        ("none", [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        ("token_truncate", [[2.0, 0.5, 0.0], [1.5, 1.5, 1.5]]),  # 3 -> capped at 2
        ("token_mask", [[0.0, 0.5, 0.0], [1.5, 1.5, 1.5]]),  # 3 > 2 -> rejected token
        ("seq_truncate", [[GEO0, GEO0, 0.0], [1.5, 1.5, 1.5]]),  # both below 2: unchanged
        ("seq_mask", [[GEO0, GEO0, 0.0], [1.5, 1.5, 1.5]]),
    ],
)
def test_is_weights_by_hand(name: str, expected: list[list[float]]):
    weights, metrics = IS_CORRECTIONS.get(name)(OLD, SAMPLER, MASK, threshold=2.0)
    assert torch.allclose(weights, torch.tensor(expected), atol=1e-6)
    assert not weights.requires_grad
    assert float(metrics["is_weight_mean"]) == pytest.approx(sum(map(sum, expected)) / 5, abs=1e-6)


def test_sequence_modes_act_on_whole_sequences():
    """Threshold 1.3: row 1 (geometric ratio 1.5) is capped / rejected as a whole; row 0 (1.22) is kept."""
    truncated, _ = IS_CORRECTIONS.get("seq_truncate")(OLD, SAMPLER, MASK, threshold=1.3)
    masked, metrics = IS_CORRECTIONS.get("seq_mask")(OLD, SAMPLER, MASK, threshold=1.3)
    assert torch.allclose(truncated, torch.tensor([[GEO0, GEO0, 0.0], [1.3, 1.3, 1.3]]), atol=1e-6)
    assert torch.allclose(masked, torch.tensor([[GEO0, GEO0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert float(metrics["is_corrected_frac"]) == pytest.approx(3 / 5)


def test_unknown_correction_lists_the_valid_ones():
    from rlfactory.errors import UserError

    with pytest.raises(UserError, match="seq_mask, seq_truncate, token_mask, token_truncate"):
        IS_CORRECTIONS.get("tis")


def test_mismatch_metrics_by_hand():
    """|old - sampler| over the 5 response tokens: ln 3, ln 2, 3 x ln 1.5; Pearson of the token probabilities."""
    metrics = mismatch_metrics(OLD, SAMPLER, MASK)
    diffs = [math.log(3), math.log(2)] + [math.log(1.5)] * 3
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(sum(diffs) / 5, abs=1e-6)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(math.log(3), abs=1e-6)
    p = OLD.exp()[MASK.bool()].double()
    q = SAMPLER.exp()[MASK.bool()].double()
    expected = float(torch.corrcoef(torch.stack([p, q]))[0, 1])
    assert metrics["rollout/prob_pearson"] == pytest.approx(expected, abs=1e-6)
    same = mismatch_metrics(SAMPLER, SAMPLER, MASK)
    assert same["rollout/logprob_diff_max"] == 0.0 and same["rollout/prob_pearson"] == pytest.approx(1.0)


def test_is_weights_scale_the_policy_gradient_in_the_actor_loss():
    """On-policy (old = current), ppo_clip's per-token loss is -A; token_truncate multiplies it by w. The actor
    loss with the correction equals the hand-weighted aggregate, and the on-policy forward is kept as the
    trainer's log-probs (for the mismatch metrics) without an extra pass."""
    from rlfactory.engine.online.update import MiniBatch, actor_loss_fn
    from rlfactory.rollout.batch import RolloutBatch

    logits = torch.zeros(2, 3, 4, requires_grad=True)

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0):
            out = torch.cat([logits.new_zeros(2, input_ids.shape[1] - 3, 4), logits], 1)
            return type("Out", (), {"logits": out[:, -logits_to_keep:]})()

    batch = RolloutBatch(
        input_ids=torch.tensor([[1, 2, 3, 0], [1, 2, 3, 1]]),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        position_ids=torch.arange(4).repeat(2, 1),
        responses=torch.tensor([[2, 3], [2, 3]]),
        response_mask=torch.ones(2, 2),
        loss_mask=torch.ones(2, 2),
        response_length=torch.tensor([2.0, 2.0]),
        truncated=torch.tensor([False, False]),
        sampler_logprobs=torch.log(torch.tensor([[0.25 / 3, 0.25], [0.25, 0.5]])),  # uniform policy: 0.25
        advantages=torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
    )
    alg = AlgorithmConfig(adv_estimator="grpo", loss_agg="token-mean")
    loss_fn = actor_loss_fn(Model(), batch, alg, 1.0, 2, "token_truncate", 2.0)
    rows = torch.arange(2)
    part = loss_fn(rows, rows, MiniBatch.local(rows, batch.loss_mask))
    loss, metrics = part.loss, part.metrics
    weights = torch.tensor([[2.0, 1.0], [1.0, 0.5]])  # ratios 3 (capped at 2), 1, 1, 0.5
    assert float(loss) == pytest.approx(float((-batch.advantages * weights).mean()), abs=1e-6)
    assert torch.allclose(part.logprobs, torch.full((2, 2), math.log(0.25)), atol=1e-6)
    assert float(metrics["is_corrected_frac"]) == pytest.approx(0.25)


def _grpo(**rollout) -> dict:
    return {
        "stage": "grpo",
        "model": {"name_or_path": "m"},
        "data": {"dataset": "d"},
        "reward": {"functions": {"answer_match": 1.0}},
        "rollout": rollout,
    }


def test_is_correction_needs_a_separate_sampler():
    with pytest.raises(ValueError, match="rollout.is_correction 'token_mask' .* needs rollout.backend: vllm"):
        RunConfig.model_validate(_grpo(is_correction="token_mask"))
    cfg = RunConfig.model_validate(_grpo(backend="vllm", is_correction="seq_truncate", lora_sync="merged"))
    assert cfg.rollout is not None and cfg.rollout.lora_sync == "merged"


def test_is_correction_needs_the_sampler_log_probs_on_every_step():
    with pytest.raises(ValueError, match=r"mismatch_every: 3 asks for them on one step in 3 only; set rollout"):
        RunConfig.model_validate(_grpo(backend="vllm", is_correction="token_truncate", mismatch_every=3))
    cfg = RunConfig.model_validate(_grpo(backend="vllm", mismatch_every=3))
    assert cfg.rollout.mismatch_every == 3


def test_the_sampler_is_asked_for_log_probs_on_every_nth_step():
    from rlfactory.engine.online.phases import step_sampling

    ro = RunConfig.model_validate(_grpo(backend="vllm", mismatch_every=3)).rollout
    assert [step_sampling(ro, i).logprobs for i in range(7)] == [True, False, False, True, False, False, True]
    assert step_sampling(ro, 1).max_tokens == ro.max_response_len  # the rest of the settings as from_rollout
