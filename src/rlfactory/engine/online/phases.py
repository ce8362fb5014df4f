"""One online RL step, phase by phase; the loop around it is ``engine/online/loop.py``.

1. rollout   ``prompts_per_step`` prompts x ``num_samples`` samples through the run's ``Rollouts`` (a backend,
             through the agent loop when tools are set; dynamic sampling: drop groups whose rewards are all
             equal, refill, up to a limit). With ``rollout.overlap`` the first round was generated during the
             previous step's update (``overlap.py``); the sampler is then synced and the next step's round launched
             before this step's passes run. Every sample records the policy version that generated it
2. reward    the reward stack scores every sample (components logged separately)      -> batch.scores, .group
3. ref       reference log-probs, only with a KL term                                 -> batch.ref_logprobs
4. old       pi_old log-probs, only with > 1 update per batch or an in-reward KL       -> batch.old_logprobs
5. values    critic values, only with a critic                                        -> batch.values
6. adv       token rewards (score on the last token, minus the in-reward KL) -> the estimator
                                                                  -> batch.token_rewards, .advantages, .returns
7. update    critic, then actor: ppo_epochs x num_mini_batches optimizer steps (``update.Updater``), the
             policy gradient importance-weighted by ``rollout.is_correction`` when a separate sampler generated
8. sync      a backend with its own copy of the policy (vllm) gets the updated weights (an overlapped sampler, the
             hf copy or the vLLM engine itself: at the next step, once its round is taken)
9. metrics   verl names: actor/*, critic/*, reward/<name>/*, score/*, advantages/*, response_length/*,
             timing_s/*, perf/*, rollout/staleness; with a separate sampler rollout/logprob_diff_{mean,max},
             rollout/prob_pearson, rollout/ratio_over_cap

Each phase fills named fields of the typed :class:`RolloutBatch`; whether it runs is decided by what the run
has (a reference, a critic) and by the registry entries' traits, never by a stage name.

On several processes (``ranks.py``): each rank generates and scores its share of the step's prompts, and every
rank gathers the step's samples (phases 1-2), so dynamic sampling and the metrics decide on the same global list
everywhere; each rank packs its equal share of the trained samples into its batch (phases 3-5 run on it), the
estimator runs on every rank's rows (phase 6) and the update aggregates over every rank's rows (phase 7).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlfactory.algos.common import HeadKernels
from rlfactory.config.schema import RunConfig
from rlfactory.data.packing import ALIGN_COLUMNS, MicroBatching
from rlfactory.engine.health import HealthMonitor
from rlfactory.engine.online import update as ops
from rlfactory.engine.online.overlap import Prefetch, Round, generate_round
from rlfactory.engine.online.ranks import Ranks
from rlfactory.engine.shared import allocator_flushes, peak_memory_gb
from rlfactory.rewards.stack import RewardStack, Sample, Scores, score_metrics
from rlfactory.rollout.agent import Rollouts, episode_metrics, episode_trace_fields
from rlfactory.rollout.base import SamplingParams
from rlfactory.rollout.batch import RolloutBatch, pack_rollouts

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rlfactory.algos.kl import AdaptiveKLController, FixedKLController
    from rlfactory.model.reference import ReferencePolicy


@dataclass
class LoopState:
    """What a checkpoint must restore besides the weights: the seeded prompt order is resumed from ``cursor``."""

    step: int = 0
    cursor: int = 0  # prompts drawn so far
    group: int = 0  # the next prompt group's id
    epoch: float = 0.0
    kl_coef: float | None = None  # the adaptive controller's value


class PhaseTimer:
    """``with timer("gen"):`` adds the seconds to ``timing_s/gen`` (phases may repeat within a step, and nest in
    "step"), and counts the CUDA allocator's cache flushes inside each phase (``shared.allocator_flushes``; an
    overlapped sampler's flushes count in whichever phase the main thread is in)."""

    def __init__(self, flushes: Callable[[], int] = allocator_flushes) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flushes: dict[str, int] = defaultdict(int)
        self._flush_count = flushes

    @contextmanager
    def __call__(self, phase: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # attribute GPU work to the phase that queued it
        start, flushed = time.perf_counter(), self._flush_count()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start
            self.flushes[phase] += self._flush_count() - flushed

    def pop(self) -> dict[str, float]:
        out = {f"timing_s/{k}": round(v, 4) for k, v in self.seconds.items()}
        self.seconds.clear()
        return out

    def pop_flushes(self) -> dict[str, int]:
        """The phases that flushed since the last call, with their counts."""
        out = {k: n for k, n in self.flushes.items() if n}
        self.flushes.clear()
        return out


@dataclass
class Run:
    """Everything a step touches, built once by ``loop.build_run``."""

    cfg: RunConfig
    accelerator: Accelerator
    ranks: Ranks  # this process among the run's (one: every collective is a no-op)
    tokenizer: Any
    out: Path
    actor: ops.Updater  # the policy and its optimizer
    critic: ops.Updater | None  # exactly when the estimator needs values
    reference: ReferencePolicy | None  # exactly when a KL term is on
    rollouts: Rollouts
    rewards: RewardStack
    kl_ctrl: FixedKLController | AdaptiveKLController
    prompts: list[dict]
    eval_prompts: list[dict]
    total_steps: int
    state: LoopState = field(default_factory=LoopState)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    health: HealthMonitor | None = None  # the health rules, fed every logged record (``engine/health.py``)
    # rollout.overlap: the sampler generating the next step while this one trains (a copy of the policy), the round
    # in flight, and the version of the sampler's weights (the steps done when it was last synced)
    sampler: Rollouts | None = None
    prefetch: Prefetch | None = None
    sampler_version: int = 0
    kernels: HeadKernels = HeadKernels()  # the LM head's kernels in every policy pass (``model.loader.head_kernels``)


@dataclass
class Rollout:
    """One scored sample of a step."""

    example: dict[str, Any]  # as rewards saw it (multi-turn: with the episode under "agent")
    prompt_ids: list[int]
    completion: Any  # rollout.base.Completion
    text: str  # what rewards read as the completion
    group: int
    score: float
    rewards: dict[str, float]  # per component (and dict part)
    version: int = 0  # the policy version that generated it: the optimizer steps (RL steps) done on those weights


@dataclass
class StepResult:
    metrics: dict[str, float]
    samples: list[Rollout]  # the trained samples (after dynamic sampling), of every rank
    batch: RolloutBatch  # this rank's share of them
    advantages: list[float]  # per trained sample (of every rank): its mean advantage over its response


# --------------------------------------------------------------------------- 1-2: rollout + reward
def next_prompts(run: Run, k: int) -> list[dict]:
    """The next k prompts of a seeded per-epoch order (resumable: the cursor is checkpointed)."""
    n, out, state = len(run.prompts), [], run.state
    for _ in range(k):
        epoch, index = divmod(state.cursor, n)
        order = list(range(n))
        if run.cfg.data.shuffle:
            random.Random(run.cfg.seed + epoch).shuffle(order)
        out.append(run.prompts[order[index]])
        state.cursor += 1
    state.epoch = state.cursor / n
    return out


def draw_round(run: Run, prompts: int, copies: int) -> Round:
    """The next ``prompts`` prompts and their fresh group ids, on the main thread (the prompt order and the group ids
    are the loop's state); this rank's contiguous share of them (whole groups), each repeated ``copies`` times."""
    state = run.state
    rewind = {"cursor": state.cursor, "group": state.group, "epoch": state.epoch}
    examples = next_prompts(run, prompts)
    first_group = state.group
    state.group += len(examples)
    mine = run.ranks.share(examples)
    first_group += run.ranks.rank * len(mine)
    repeated = [ex for ex in mine for _ in range(copies)]
    groups = [first_group + i // copies for i in range(len(repeated))]
    return Round(repeated, groups, run.sampler_version, rewind)


def score_round(run: Run, round_: Round) -> tuple[list[Rollout], dict[str, int]]:
    """The generated round scored; the samples of every rank gathered in rank order (every rank returns the same
    list, in the order one process would have made it), and reward failures per component."""
    decode = run.tokenizer.decode
    samples = [  # multi-turn: rewards read the last assistant turn (``final``)
        Sample(
            ex["prompt_text"],
            decode(c.token_ids, skip_special_tokens=True) if final is None else final,
            ex.get("answer"),
            ex,
            len(c.token_ids),
            list(c.token_ids),
        )
        for ex, c, final in zip(round_.seen, round_.completions, round_.finals, strict=True)
    ]
    with run.timer("reward"):
        scores = run.rewards.score(samples)
    parts = {**scores.components, **scores.parts}
    rollouts = [
        Rollout(
            s.example,
            ex["prompt_ids"],
            c,
            s.completion,
            g,
            scores.total[i],
            {k: v[i] for k, v in parts.items()},
            round_.version,
        )  # fmt: skip
        for i, (s, ex, c, g) in enumerate(zip(samples, round_.examples, round_.completions, round_.groups, strict=True))
    ]
    return run.ranks.gather_objects(rollouts), run.ranks.sum_counts(scores.failures)


def generate_and_score(
    run: Run, prompts: int, params: SamplingParams, copies: int
) -> tuple[list[Rollout], dict[str, int]]:
    """``copies`` samples for each of the next ``prompts`` prompts, scored, of every rank; and reward failures per
    component. The first round of a step comes from the overlapped sampler when one is in flight."""
    round_ = None
    if run.prefetch is not None and run.prefetch.pending is not None:
        with run.timer("gen"):  # what generation still costs the step: the wait for the thread
            round_ = run.prefetch.take()
        run.timer.seconds["gen_overlapped"] += round_.seconds
    if round_ is None:
        round_ = draw_round(run, prompts, copies)
        with run.timer("gen"):
            generate_round(run.sampler or run.rollouts, round_, params, run.accelerator.autocast)
    return score_round(run, round_)


def step_sampling(ro: Any, index: int) -> SamplingParams:
    """The rollout section's sampling settings for step ``index`` (0-based): the sampler's log-probs on every
    ``rollout.mismatch_every``-th step, starting with the first."""
    return replace(SamplingParams.from_rollout(ro), logprobs=index % ro.mismatch_every == 0)


def collect(run: Run, index: int) -> tuple[list[Rollout], list[Rollout], dict[str, int]]:
    """(trained samples, all generated samples, reward failures), each of every rank.

    Dynamic sampling prefers groups whose rewards are not all equal (an all-equal group has zero advantage: nothing
    to learn from): it samples rounds of prompts until ``prompts_per_step`` such groups are found or
    ``max_sampling_rounds`` ran. The trained batch is always ``prompts_per_step`` groups -- the informative groups
    first, then, if fewer were found, uninformative ones in the order they were generated -- so that it splits
    evenly over the processes. On several processes a round draws the prompts still needed rounded up to a multiple
    of the number of processes (so each rank gets its share); the decisions are made on the gathered samples,
    identically on every rank, so every rank runs the same rounds.
    """
    ro = run.cfg.rollout
    assert ro is not None
    params = step_sampling(ro, index)
    informative: list[Rollout] = []
    uninformative: list[Rollout] = []
    generated: list[Rollout] = []
    failures: dict[str, int] = {}
    wanted = ro.prompts_per_step * ro.num_samples
    for _ in range(ro.max_sampling_rounds if ro.dynamic_sampling else 1):
        needed = run.ranks.round_up(ro.prompts_per_step - len(informative) // ro.num_samples)
        samples, failed = generate_and_score(run, needed, params, ro.num_samples)
        generated += samples
        failures = {k: failures.get(k, 0) + n for k, n in failed.items()}
        if not ro.dynamic_sampling:
            return samples, generated, failures
        for start in range(0, len(samples), ro.num_samples):
            group = samples[start : start + ro.num_samples]
            (informative if len({s.score for s in group}) > 1 else uninformative).extend(group)
        if len(informative) >= wanted:
            break
    return (informative + uninformative)[:wanted], generated, failures


def informative_samples(samples: list[Rollout], group_size: int) -> int:
    """How many of ``samples`` (whole groups in order) belong to groups whose rewards are not all equal."""
    groups = [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
    return sum(len(g) for g in groups if len({s.score for s in g}) > 1)


def to_batch(run: Run, samples: list[Rollout]) -> RolloutBatch:
    """This rank's equal share of the trained samples (all of them on one process), packed."""
    assert run.cfg.rollout is not None
    samples = run.ranks.share(samples)
    batch = pack_rollouts(
        [s.prompt_ids for s in samples],
        [s.completion for s in samples],
        run.tokenizer.pad_token_id,
        run.cfg.rollout.mask_truncated,
        align_columns=ALIGN_COLUMNS,
    )
    batch.scores = torch.tensor([s.score for s in samples], dtype=torch.float32)
    batch.group = torch.tensor([s.group for s in samples])
    return batch.to(run.accelerator.device)


def micro_batching(cfg: Any) -> MicroBatching:
    """Every pass's micro-batches: ``train.per_device_batch_size`` samples, and at most ``rollout.micro_batch_tokens``
    tokens where set."""
    return MicroBatching(cfg.train.per_device_batch_size, cfg.rollout.micro_batch_tokens)


# --------------------------------------------------------------------------- 3-6: scoring passes, no gradient
def reference_logprobs(run: Run, batch: RolloutBatch) -> None:
    """batch.ref_logprobs: the response under the reference policy (the run has one only with a KL term)."""
    if run.reference is None:
        return
    temperature, micro = run.cfg.rollout.temperature, micro_batching(run.cfg)
    with run.timer("ref"), run.reference.weights(batch.input_ids.device) as model:
        batch.ref_logprobs = ops.logprob_pass(model, batch, temperature, micro, run.actor.packing, run.kernels)


def old_logprobs(run: Run, batch: RolloutBatch) -> None:
    """batch.old_logprobs: pi_old must be kept once the first update moved the policy, and the in-reward KL needs
    it now; with a single on-policy update and no in-reward KL the actor reuses its own detached log-probs."""
    alg = run.cfg.algorithm
    if alg.ppo_epochs * alg.num_mini_batches == 1 and alg.kl_in_reward_coef == 0:
        return
    policy = run.accelerator.unwrap_model(run.actor.model)
    temperature, micro = run.cfg.rollout.temperature, micro_batching(run.cfg)
    with run.timer("old_logprob"):
        batch.old_logprobs = ops.logprob_pass(policy, batch, temperature, micro, run.actor.packing, run.kernels)


def critic_values(run: Run, batch: RolloutBatch) -> None:
    """batch.values: the critic's value of each response position (only a run with a critic has one)."""
    if run.critic is None:
        return
    critic = run.accelerator.unwrap_model(run.critic.model)  # no gradient: past DDP, as the other passes
    with run.timer("values"):
        forward = lambda rows, width, packed: ops.value_forward(critic, batch, rows, width, packed)
        batch.values = ops.full_pass(forward, batch, micro_batching(run.cfg), run.critic.packing)


def compute_advantages(run: Run, batch: RolloutBatch) -> tuple[dict[str, float], list[float]]:
    """batch.token_rewards, .advantages, .returns; the in-reward KL penalty (and its controller) when set.

    Returns the metrics (advantages/*, the KL and the critic's explained variance) and each trained sample's mean
    advantage (for the traces), over the samples of every rank. On several processes the estimator reads what it
    needs of every rank's rows (batch-wide statistics: reinforce_plus_plus and gae whiten over the batch) and each
    rank keeps its own rows: exact for every estimator.
    """
    alg, metrics, ranks = run.cfg.algorithm, {}, run.ranks
    with run.timer("adv"):
        kl = None
        if alg.kl_in_reward_coef > 0:
            from rlfactory.algos.kl import KL_ESTIMATORS

            kl = KL_ESTIMATORS.get(alg.kl_reward_estimator)(batch.old_logprobs, batch.ref_logprobs)
            kl = kl * batch.response_mask
            seq_kl = float(ranks.gather_rows(kl.sum(-1)).mean())
            metrics.update({"actor/reward_kl": seq_kl, "actor/kl_coef": run.kl_ctrl.value})
        batch.token_rewards = ops.token_rewards(batch, kl, run.kl_ctrl.value)
        mask = ranks.gather_rows(batch.response_mask)
        values = None if batch.values is None else ranks.gather_rows(batch.values)
        group = None if batch.group is None else ranks.gather_rows(batch.group)
        advantages, returns = ops.advantages(alg, ranks.gather_rows(batch.token_rewards), mask, group, values)
        rows, width = len(batch), batch.responses.shape[1]
        batch.advantages = ranks.local_rows(advantages, rows, width)
        batch.returns = ranks.local_rows(returns, rows, width)
        if kl is not None:
            run.kl_ctrl.update(seq_kl, len(mask))
    adv = advantages[mask > 0]
    metrics.update(
        {
            "advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
            "advantages/max": float(adv.max()) if adv.numel() else 0.0,
            "advantages/min": float(adv.min()) if adv.numel() else 0.0,
        }
    )
    if values is not None:
        metrics["critic/vf_explained_var"] = ops.explained_variance(values, returns, mask)
    per_sample = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return metrics, per_sample.tolist()


def score_batch(run: Run, batch: RolloutBatch) -> tuple[dict[str, float], list[float]]:
    """Phases 3-6 under autocast: every pass that reads the batch without a gradient, then the advantages."""
    with run.accelerator.autocast():
        reference_logprobs(run, batch)
        old_logprobs(run, batch)
        critic_values(run, batch)
        return compute_advantages(run, batch)


# --------------------------------------------------------------------------- 7-8: update, sync
def update_models(run: Run, batch: RolloutBatch, step: int) -> tuple[dict[str, float], torch.Tensor | None]:
    """Critic then actor updates (the actor waits ``critic.warmup_steps``); returns the metrics and the trainer's
    log-probs of a single on-policy update (for the sampler mismatch), then syncs the sampler's weights."""
    cfg, alg, micro = run.cfg, run.cfg.algorithm, micro_batching(run.cfg)
    ro, metrics, trainer_logprobs = cfg.rollout, {}, None
    if run.critic is not None:
        with run.timer("update_critic"):
            loss_fn = ops.critic_loss_fn(run.critic.model, batch, alg, ro.max_response_len)
            metrics.update(run.critic.run(batch, alg, micro, batch.response_mask, loss_fn, "critic", step + 1).metrics)
    if step >= (cfg.critic.warmup_steps if run.critic is not None else 0):
        with run.timer("update_actor"):
            loss_fn = ops.actor_loss_fn(
                run.actor.model,
                batch,
                alg,
                ro.temperature,
                ro.max_response_len,
                ro.is_correction,
                ro.is_threshold,
                run.kernels,
            )
            needs_grad = ops.rows_with_gradient(alg, batch, batch.loss_mask)
            result = run.actor.run(batch, alg, micro, batch.loss_mask, loss_fn, "actor", step + 1, needs_grad)
        metrics.update(result.metrics)
        trainer_logprobs = result.logprobs
    # an overlapped engine is generating the next step right now: it is synced before its next round (prefetch_next)
    if run.rollouts.syncs_weights and run.sampler is not run.rollouts:
        with run.timer("sync"):
            run.rollouts.sync_weights(run.accelerator.unwrap_model(run.actor.model))
    return metrics, trainer_logprobs


# --------------------------------------------------------------------------- 9: metrics
def mismatch(
    ranks: Ranks, batch: RolloutBatch, trainer_logprobs: torch.Tensor | None, is_threshold: float
) -> dict[str, float]:
    """Sampler vs trainer log-probs of the same tokens (only when a separate sampler produced the batch), over the
    tokens of every rank; with the share of tokens whose ratio is above the IS cap (``rollout.is_threshold``)."""
    from rlfactory.algos.rollout_correction import mismatch_metrics

    trainer = batch.old_logprobs if batch.old_logprobs is not None else trainer_logprobs
    if batch.sampler_logprobs is None or trainer is None:
        return {}
    seen = torch.isfinite(trainer)  # rows of a skipped mini-batch (nothing in the loss) have no trainer log-probs
    return mismatch_metrics(
        ranks.gather_rows(trainer.nan_to_num(0.0)),
        ranks.gather_rows(batch.sampler_logprobs),
        ranks.gather_rows(batch.response_mask * seen),
        threshold=is_threshold,
    )


def batch_metrics(
    samples: list[Rollout], generated: list[Rollout], failures: dict[str, int], kept: int, estimator: str
) -> dict:
    """score/, reward/<name>/ and response_length/ over every sample generated this step (the policy as it
    is, before dynamic sampling filters groups), of every rank; ``kept``: the informative samples trained."""
    scores = [s.score for s in generated]
    lengths = [len(s.completion.token_ids) for s in generated]
    components: dict[str, list[float]] = {}
    for sample in generated:
        for name, value in sample.rewards.items():
            components.setdefault(name, []).append(value)
    return {
        **score_metrics(Scores(scores, components, {}, failures)),
        "score/mean": sum(scores) / len(scores),
        "score/max": max(scores),
        "score/min": min(scores),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/clip_ratio": sum(s.completion.finish_reason == "length" for s in generated) / len(lengths),
        "rollout/kept_samples": float(kept),
        "rollout/generated_samples": float(len(generated)),
        **zero_advantage_groups(samples, estimator),
        **episode_metrics([s.example for s in generated]),
    }


def zero_advantage_groups(samples: list[Rollout], estimator: str) -> dict[str, float]:
    """rollout/zero_adv_groups: the share of the trained groups whose samples all got the same reward (a group
    estimator gives them zero advantage: no learning signal). Only with groups (num_samples >= 2) and an estimator
    that compares a prompt's samples: a critic's (gae) or the batch's (reinforce_plus_plus) baseline still gives
    such a group an advantage, so the share says nothing about its signal there."""
    from rlfactory.algos.advantages import ADV_ESTIMATORS

    if not ADV_ESTIMATORS.traits(estimator)["needs_groups"]:
        return {}
    scores: dict[int, set[float]] = defaultdict(set)
    sizes: dict[int, int] = defaultdict(int)
    for sample in samples:
        scores[sample.group].add(sample.score)
        sizes[sample.group] += 1
    if not sizes or max(sizes.values()) < 2:
        return {}
    return {"rollout/zero_adv_groups": sum(len(s) == 1 for s in scores.values()) / len(scores)}


def sync_sampler(run: Run, version: int) -> None:
    """The overlapped sampler takes the policy's weights after ``version`` steps, unless it has them already (call
    only while it generates nothing)."""
    if run.sampler is not None and run.sampler_version != version:
        with run.timer("sync"):
            run.sampler.sync_weights(run.accelerator.unwrap_model(run.actor.model))
        run.sampler_version = version


def prefetch_next(run: Run, index: int) -> None:
    """rollout.overlap: sync the idle sampler to the policy's weights (the ``index`` steps done so far), then launch
    the next step's first round on it in the thread; this step trains on while it generates."""
    ro = run.cfg.rollout
    assert run.prefetch is not None and run.sampler is not None
    sync_sampler(run, index)
    round_ = draw_round(run, run.ranks.round_up(ro.prompts_per_step), ro.num_samples)
    params, sampler, autocast = step_sampling(ro, index + 1), run.sampler, run.accelerator.autocast
    run.prefetch.launch(round_, lambda r: generate_round(sampler, r, params, autocast))


def step(run: Run, index: int) -> StepResult:
    """One RL step: the phases above, in order."""
    ro = run.cfg.rollout
    if run.prefetch is None:
        run.sampler_version = index  # the policy itself generates (or vLLM, synced after every update)
    with run.timer("step"):
        samples, generated, failures = collect(run, index)
        if run.prefetch is not None and index + 1 < run.total_steps:
            prefetch_next(run, index)
        with run.prefetch.confined() if run.prefetch is not None else nullcontext():  # overlap_update_sms
            batch = to_batch(run, samples)
            metrics, advantages = score_batch(run, batch)
            update_metrics, trainer_logprobs = update_models(run, batch, index)
        metrics.update(update_metrics)
    kept = informative_samples(samples, ro.num_samples) if ro.dynamic_sampling else len(samples)
    metrics.update(batch_metrics(samples, generated, failures, kept, run.cfg.algorithm.adv_estimator))
    metrics.update(mismatch(run.ranks, batch, trainer_logprobs, ro.is_threshold))
    metrics["rollout/staleness"] = sum(index - s.version for s in samples) / len(samples)  # steps behind the policy
    timing = run.timer.pop()
    tokens = sum(len(s.prompt_ids) + len(s.completion.token_ids) for s in generated)
    metrics.update(timing)
    metrics["perf/throughput"] = tokens / max(timing["timing_s/step"], 1e-9)  # every rank's tokens: the run's
    metrics["perf/max_memory_gb"] = run.ranks.max(peak_memory_gb())  # the fullest process
    flushes = run.timer.pop_flushes()
    if torch.cuda.is_available():  # the same on every rank: the max is a collective (memory_pressure reads it)
        metrics["perf/alloc_flushes"] = run.ranks.max(flushes.pop("step", 0))
        metrics.update({f"perf/alloc_flushes/{phase}": n for phase, n in flushes.items()})  # this process's
    metrics["loss"] = metrics.get("actor/loss", metrics.get("critic/vf_loss", 0.0))
    return StepResult(metrics, samples, batch, advantages)


def token_kinds(completion: Any, mask_truncated: bool) -> list[str]:
    """Each response token's part: ``trained`` (in the loss), ``observation`` (not sampled by the policy: tool
    results, environment text; mask 0) or ``masked`` (sampled, but out of the loss: a response cut at the cap under
    rollout.mask_truncated); the masks ``pack_rollouts`` gives the loss."""
    cut = mask_truncated and completion.finish_reason == "length"
    return ["observation" if not m else "masked" if cut else "trained" for m in completion.policy_mask()]


def response_segments(tokenizer: Any, token_ids: list[int], kinds: list[str]) -> list[list[str]]:
    """The response as runs of ``[text, kind]`` (the WebUI's rollout browser shows which tokens were trained)."""
    segments, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            segments.append([tokenizer.decode(token_ids[start:i]), kinds[start]])
            start = i
    return segments


def trace_rows(
    step_index: int, samples: list[Rollout], advantages: list[float], tokenizer: Any, mask_truncated: bool
) -> list[dict]:
    """One line per trained sample of the step (``rollouts/step_XXXXX.jsonl``)."""
    rows = []
    for s, advantage in zip(samples, advantages, strict=True):
        kinds = token_kinds(s.completion, mask_truncated)
        rows.append(
            {
                "step": step_index,
                "policy_version": s.version,
                "group": s.group,
                "source": s.example.get("source"),
                "prompt": s.example["prompt_text"],
                "completion": s.text,
                "answer": s.example.get("answer"),
                "prompt_tokens": len(s.prompt_ids),
                "response_tokens": len(s.completion.token_ids),
                "trained_tokens": kinds.count("trained"),
                "finish_reason": s.completion.finish_reason,
                "rewards": s.rewards,
                "score": s.score,
                "advantage": advantage,
                "segments": response_segments(tokenizer, s.completion.token_ids, kinds),
                **episode_trace_fields(s.example),
            }
        )
    return rows
