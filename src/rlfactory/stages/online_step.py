"""One online RL step (ppo, grpo), phase by phase; the loop around it is ``stages/online.py``.

1. rollout   ``prompts_per_step`` prompts x ``num_samples`` samples through the generation backend
             (dynamic sampling: drop groups whose rewards are all equal, refill, up to a limit)
2. reward    the reward stack scores every sample (components logged separately)
3. ref/old   reference log-probs (only with a KL term), old log-probs (only with > 1 update per batch)
4. values    critic values (only with a critic, i.e. stage ppo)
5. adv       token rewards (score on the last token, minus the in-reward KL) -> advantage estimator
6. update    critic, then actor: ppo_epochs x num_mini_batches optimizer steps (``online_update``), the
             policy gradient importance-weighted by ``rollout.is_correction`` when a separate sampler generated
7. sync      a backend with its own copy of the policy (vllm) gets the updated weights
8. metrics   verl names: actor/*, critic/*, reward/<name>/*, score/*, advantages/*, response_length/*,
             timing_s/*, perf/*; with a separate sampler rollout/logprob_diff_{mean,max}, rollout/prob_pearson

Every algorithmic choice is a registry entry chosen by name; the step asks the entry's traits
(e.g. whether the estimator needs a critic) and never branches on a name.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlfactory.config.schema import RunConfig
from rlfactory.engine import online as engine
from rlfactory.rewards.stack import RewardStack, Sample, Scores, score_metrics
from rlfactory.rollout.base import SamplingParams
from rlfactory.rollout.batch import pack_rollouts
from rlfactory.stages import online_agent
from rlfactory.stages import online_update as ops
from rlfactory.stages.online_setup import Reference

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a step touches (built once by ``stages.online.build_run``)."""

    cfg: RunConfig
    accelerator: Any
    tokenizer: Any
    out: Path
    policy: Any
    actor: ops.Updater
    backend: Any
    rewards: RewardStack
    prompts: list[dict]
    eval_prompts: list[dict]
    kl_ctrl: Any
    total_steps: int
    reference: Reference | None = None
    agent: Any = None  # the multi-turn agent loop (rollout/agent.py), None for single-turn rollouts
    critic: Any = None
    critic_updater: ops.Updater | None = None
    state: dict[str, Any] = field(default_factory=lambda: {"step": 0, "cursor": 0, "group": 0, "epoch": 0.0})
    timer: engine.PhaseTimer = field(default_factory=engine.PhaseTimer)


# --------------------------------------------------------------------------- rollout + reward
def next_prompts(run: Run, k: int) -> list[dict]:
    """The next k prompts of a seeded per-epoch order (resumable: the cursor is checkpointed)."""
    n, out = len(run.prompts), []
    for _ in range(k):
        epoch, index = divmod(run.state["cursor"], n)
        order = list(range(n))
        if run.cfg.data.shuffle:
            random.Random(run.cfg.seed + epoch).shuffle(order)
        out.append(run.prompts[order[index]])
        run.state["cursor"] += 1
    run.state["epoch"] = run.state["cursor"] / n
    return out


def repeat(examples: list[dict], copies: int) -> list[dict]:
    return [ex for ex in examples for _ in range(copies)]


def generate_and_score(
    run: Run, examples: list[dict], params: SamplingParams, copies: int
) -> tuple[list[dict], dict[str, int]]:
    """``copies`` samples per example, scored: one dict per sample (group ids are fresh per prompt), and the
    reward failures per component."""
    prompt_ids = [ex["prompt_ids"] for ex in examples for _ in range(copies)]
    with run.timer("gen"), run.accelerator.autocast():  # multi-turn: the agent loop (stages/online_agent.py)
        completions, finals, seen = online_agent.generate(run.agent, run.backend, repeat(examples, copies), params)
    groups = []
    for _ in examples:
        groups += [run.state["group"]] * copies
        run.state["group"] += 1
    decode = run.tokenizer.decode
    samples = [  # multi-turn: rewards read the last assistant turn (``final``)
        Sample(
            ex["prompt_text"],
            decode(c.token_ids, skip_special_tokens=True) if final is None else final,
            ex.get("answer"),
            ex,
            len(c.token_ids),
        )
        for ex, c, final in zip(seen, completions, finals, strict=True)
    ]
    with run.timer("reward"):
        scores = run.rewards.score(samples)
    rows = [
        {
            "example": s.example,
            "prompt_ids": p,
            "completion": c,
            "text": s.completion,
            "group": g,
            "score": scores.total[i],
            "rewards": {k: v[i] for k, v in {**scores.components, **scores.parts}.items()},
        }
        for i, (s, p, c, g) in enumerate(zip(samples, prompt_ids, completions, groups, strict=True))
    ]
    return rows, scores.failures


def collect(run: Run) -> tuple[list[dict], list[dict], dict[str, int]]:
    """(kept samples, all generated samples, reward failures). Dynamic sampling keeps only groups whose
    rewards are not all equal (an all-equal group has zero advantage: nothing to learn from)."""
    ro = run.cfg.rollout
    assert ro is not None
    params = SamplingParams.from_rollout(ro)
    kept: list[dict] = []
    generated: list[dict] = []
    failures: dict[str, int] = {}
    for _ in range(ro.max_sampling_rounds if ro.dynamic_sampling else 1):
        needed = ro.prompts_per_step - len(kept) // ro.num_samples
        samples, failed = generate_and_score(run, next_prompts(run, needed), params, ro.num_samples)
        generated += samples
        failures = {k: failures.get(k, 0) + n for k, n in failed.items()}
        if not ro.dynamic_sampling:
            return samples, generated, failures
        for start in range(0, len(samples), ro.num_samples):
            group = samples[start : start + ro.num_samples]
            if len({s["score"] for s in group}) > 1:
                kept += group
        if len(kept) >= ro.prompts_per_step * ro.num_samples:
            break
    # nothing informative at all: train on the last round (advantages are 0, only KL/entropy act)
    return kept or samples, generated, failures


def to_batch(run: Run, samples: list[dict]) -> dict[str, torch.Tensor]:
    assert run.cfg.rollout is not None
    batch = pack_rollouts(
        [s["prompt_ids"] for s in samples],
        [s["completion"] for s in samples],
        run.tokenizer.pad_token_id,
        run.cfg.rollout.mask_truncated,
    )
    batch["scores"] = torch.tensor([s["score"] for s in samples], dtype=torch.float32)
    batch["group"] = torch.tensor([s["group"] for s in samples])
    return {k: v.to(run.accelerator.device) for k, v in batch.items()}


# --------------------------------------------------------------------------- the step
def _score_phase(run: Run, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """ref / old log-probs, values, token rewards and advantages, written into ``batch``."""
    with run.accelerator.autocast():
        return _score_passes(run, batch)


def _score_passes(run: Run, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    cfg, alg, micro = run.cfg, run.cfg.algorithm, run.cfg.train.per_device_batch_size
    assert alg is not None and cfg.rollout is not None
    temp = cfg.rollout.temperature
    policy = run.accelerator.unwrap_model(run.policy)
    metrics: dict[str, float] = {}
    policy_logprobs = lambda rows, width: ops.policy_forward(policy, batch, rows, temp, width=width)[0]
    if run.reference is not None:
        with run.timer("ref"):
            batch["ref_logprobs"] = ops.full_pass(
                lambda rows, width: run.reference.logprobs(
                    lambda model, b, r: ops.policy_forward(model, b, r, temp, width=width)[0], batch, rows
                ),
                batch,
                micro,
            )
    if alg.ppo_epochs * alg.num_mini_batches > 1 or alg.kl_in_reward_coef > 0:
        # pi_old must be kept once the first update moved the policy, and the in-reward KL needs it now;
        # with a single on-policy update and no in-reward KL the actor reuses its own detached log-probs
        with run.timer("old_logprob"):
            batch["old_logprobs"] = ops.full_pass(policy_logprobs, batch, micro)
    if run.critic is not None:
        with run.timer("values"):
            batch["values"] = ops.full_pass(
                lambda rows, width: ops.value_forward(run.critic, batch, rows, width), batch, micro
            )
    with run.timer("adv"):
        kl = None
        if alg.kl_in_reward_coef > 0:
            from rlfactory.algos.kl import KL_ESTIMATORS

            kl_fn = KL_ESTIMATORS.get(alg.kl_reward_estimator)
            kl = kl_fn(batch["old_logprobs"], batch["ref_logprobs"]) * batch["response_mask"]
            seq_kl = float(kl.sum(-1).mean())
            metrics.update({"actor/reward_kl": seq_kl, "actor/kl_coef": run.kl_ctrl.value})
        batch["token_rewards"] = ops.token_rewards(batch, kl, run.kl_ctrl.value)
        batch["advantages"], batch["returns"] = ops.advantages(batch, alg)
        if kl is not None:
            run.kl_ctrl.update(seq_kl, len(batch["scores"]))
    return metrics


def _update_phase(run: Run, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    cfg, alg, micro = run.cfg, run.cfg.algorithm, run.cfg.train.per_device_batch_size
    assert alg is not None and cfg.rollout is not None
    metrics: dict[str, float] = {}
    max_len = cfg.rollout.max_response_len
    if run.critic_updater is not None:
        metrics["critic/vf_explained_var"] = ops.explained_variance(
            batch["values"], batch["returns"], batch["response_mask"]
        )
        with run.timer("update_critic"):
            loss_fn = ops.critic_loss_fn(run.critic, batch, alg, max_len)
            metrics.update(run.critic_updater.run(batch, alg, micro, "response_mask", loss_fn, "critic"))
    warmup = cfg.critic.warmup_steps if cfg.critic is not None else 0
    if step >= warmup:
        with run.timer("update_actor"):
            ro = cfg.rollout
            loss_fn = ops.actor_loss_fn(
                run.policy, batch, alg, ro.temperature, max_len, ro.is_correction, ro.is_threshold
            )
            metrics.update(run.actor.run(batch, alg, micro, "loss_mask", loss_fn, "actor"))
    if run.backend.syncs_weights:
        with run.timer("sync"):
            run.backend.sync_weights(run.accelerator.unwrap_model(run.policy))
    return metrics


def mismatch(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sampler vs trainer log-probs of the same tokens (only when a separate sampler produced the batch)."""
    from rlfactory.algos.rollout_correction import mismatch_metrics

    trainer = batch.get("old_logprobs", batch.get("trainer_logprobs"))
    if "sampler_logprobs" not in batch or trainer is None:
        return {}
    seen = torch.isfinite(trainer)  # rows of a skipped mini-batch (nothing in the loss) have no trainer log-probs
    return mismatch_metrics(trainer.nan_to_num(0.0), batch["sampler_logprobs"], batch["response_mask"] * seen)


def batch_metrics(samples: list[dict], generated: list[dict], failures: dict[str, int], batch: dict) -> dict:
    """score/, reward/<name>/ and response_length/ over every sample generated this step (the policy as it
    is, before dynamic sampling filters groups); advantages/ over the trained batch."""
    scores = [s["score"] for s in generated]
    lengths = [len(s["completion"].token_ids) for s in generated]
    components: dict[str, list[float]] = {}
    for sample in generated:
        for name, value in sample["rewards"].items():
            components.setdefault(name, []).append(value)
    adv = batch["advantages"][batch["response_mask"] > 0]
    return {
        **score_metrics(Scores(scores, components, {}, failures)),
        "score/mean": sum(scores) / len(scores),
        "score/max": max(scores),
        "score/min": min(scores),
        "advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
        "advantages/max": float(adv.max()) if adv.numel() else 0.0,
        "advantages/min": float(adv.min()) if adv.numel() else 0.0,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/clip_ratio": sum(s["completion"].finish_reason == "length" for s in generated) / len(lengths),
        "rollout/kept_samples": float(len(samples)),
        "rollout/generated_samples": float(len(generated)),
        **online_agent.metrics([s["example"] for s in generated]),
    }


def step(run: Run, index: int) -> tuple[dict[str, float], list[dict], dict]:
    """One RL step; returns (metrics, kept samples, batch)."""
    with run.timer("step"):
        samples, generated, failures = collect(run)
        batch = to_batch(run, samples)
        metrics = _score_phase(run, batch)
        metrics.update(_update_phase(run, batch, index))
    metrics.update(batch_metrics(samples, generated, failures, batch))
    metrics.update(mismatch(batch))
    timing = run.timer.pop()
    tokens = sum(len(s["prompt_ids"]) + len(s["completion"].token_ids) for s in generated)
    metrics.update(timing)
    metrics["perf/throughput"] = tokens / max(timing["timing_s/step"], 1e-9)
    metrics["perf/max_memory_gb"] = engine.peak_memory_gb()
    metrics["loss"] = metrics.get("actor/loss", metrics.get("critic/vf_loss", 0.0))
    return metrics, samples, batch


def trace_rows(step_index: int, samples: list[dict], batch: dict) -> list[dict]:
    adv = (batch["advantages"] * batch["response_mask"]).sum(-1) / batch["response_mask"].sum(-1).clamp(min=1)
    return [
        {
            "step": step_index,
            "group": s["group"],
            "source": s["example"].get("source"),
            "prompt": s["example"]["prompt_text"],
            "completion": s["text"],
            "answer": s["example"].get("answer"),
            "prompt_tokens": len(s["prompt_ids"]),
            "response_tokens": len(s["completion"].token_ids),
            "finish_reason": s["completion"].finish_reason,
            "rewards": s["rewards"],
            "score": s["score"],
            "advantage": float(adv[i]),
            **online_agent.trace_fields(s["example"]),
        }
        for i, s in enumerate(samples)
    ]
