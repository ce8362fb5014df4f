"""The online loop (ppo, grpo and every other estimator): set up once, then repeat step -> log -> trace ->
validate -> checkpoint, then save. What one step does is ``phases.py``; the tensor math is ``update.py``.

Design notes:
- one process or several (torchrun / ``accelerate launch``, data parallel with DDP: ``ranks.py``, and
  docs/ARCHITECTURE.md "Online RL on several processes"); what writes (log lines, traces, the final model) writes
  on rank 0 only, what counts is reduced over the ranks. Accelerate owns device placement, mixed precision,
  backward, clipping and checkpoints, through the same helpers as the offline loop (``engine.shared``).
- generation runs on the policy itself (hf backend, no weight sync) or on a vLLM engine in this process
  (vllm backend): that one gets the policy's weights once at the start (after a resume they differ from
  the checkpoint on disk) and after every update (``phases.update_models``), and its log-probs are compared
  with the trainer's every step.
- validation is greedy on ``evaluation.dataset``: ``val/score`` (``evaluation.metric``, i.e. accuracy
  for answer_match) and ``val/reward/*`` (the reward stack), at step 0, every ``train.eval_steps`` and
  at the end; the first and last give the before/after line of the summary. Several processes split the
  prompts and gather the scored samples, so every rank computes the same numbers.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfactory.config.schema import RunConfig
from rlfactory.data.packing import SPARSE_ATTENTION
from rlfactory.engine import health, run_dir, shared
from rlfactory.engine.offline import TrainResult
from rlfactory.engine.online.overlap import Prefetch
from rlfactory.engine.online.phases import LoopState, Run, step, sync_sampler, trace_rows
from rlfactory.engine.online.ranks import Ranks
from rlfactory.engine.online.update import PackLayout, Updater
from rlfactory.errors import RunStopped, UserError
from rlfactory.model.attention import resolved_attention
from rlfactory.rewards.stack import FailureStreaks, RewardStack, score_metrics
from rlfactory.rollout.agent import build_rollouts, episode_metrics
from rlfactory.rollout.base import SamplingParams

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rlfactory.algos.kl import AdaptiveKLController, FixedKLController

log = logging.getLogger(__name__)


def _kl_controller(cfg: RunConfig) -> FixedKLController | AdaptiveKLController:
    from rlfactory.algos.kl import AdaptiveKLController, FixedKLController

    alg = cfg.algorithm
    if alg.kl_controller == "adaptive":
        return AdaptiveKLController(alg.kl_in_reward_coef, alg.kl_target, alg.kl_horizon)
    return FixedKLController(alg.kl_in_reward_coef)


def _updater(accelerator: Accelerator, model: Any, lr: float, cfg: RunConfig, updates: int, ranks: Ranks) -> Updater:
    optimizer = shared.make_optimizer(model, lr, cfg.train)
    scheduler = shared.make_scheduler(optimizer, cfg.train, updates)
    model, optimizer, scheduler = shared.prepare_model(
        accelerator, model, optimizer, scheduler, torch_compile=cfg.train.torch_compile
    )
    return Updater(accelerator, model, optimizer, scheduler, cfg.train.max_grad_norm, ranks)


def packing_on(cfg: RunConfig) -> PackLayout:
    """``rollout.packing``: whether micro-batches run as padding-free rows (``packed_rows.PackedRows``), and how: one
    row for a kernel in ``SPARSE_ATTENTION`` (the row's document boundaries go with it: ``PackedRows.inputs``), else
    rows as long as the longest sample (``packed_rows.PackLayout``).

    Exact wherever the model builds its attention mask from the position ids when none is given: transformers' own
    models do for every ``model.attn_implementation`` (sdpa / eager / flex: a block-diagonal mask; flash-attention:
    varlen). auto packs transformers' own models; a model with its own code may not separate packed samples at all,
    and stays padded."""
    setting, model = cfg.rollout.packing, cfg.model
    if setting == "auto" and model.trust_remote_code:
        log.info(
            "rollout.packing auto: off, the model runs its own code (model.trust_remote_code), which may not separate "
            "packed samples; set rollout.packing: on if its attention builds the mask from position ids"
        )
        return None
    if setting == "off":
        return None
    if setting == "shared":  # each group's prompt once per micro-batch: keys read through kv_index (sdpa_varlen)
        from rlfactory.model.attention import NAME

        if (attention := resolved_attention(model)) != NAME:
            raise UserError(
                f"rollout.packing shared needs model.attn_implementation {NAME} (this run resolves to {attention}): "
                f"set model.attn_implementation: {NAME}, or rollout.packing: auto"
            )
        log.info("rollout.packing shared: micro-batches train as one row, each prompt computed once per micro-batch")
        return "shared"
    layout = "row" if resolved_attention(model) in SPARSE_ATTENTION else "rows"
    log.info("rollout.packing %s: micro-batches train as padding-free %s (their real tokens)", setting, layout)
    return layout


def check_processes(accelerator: Accelerator, cfg: RunConfig) -> None:
    """What several processes need (the launcher's settings are known only once the Accelerator exists)."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes > 1 and accelerator.distributed_type not in (
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_CPU,
    ):
        raise UserError(
            f"stage {cfg.stage} runs on several processes with DDP only (this launch uses "
            f"{accelerator.distributed_type.value}); drop the DeepSpeed / FSDP settings for ppo and grpo"
        )
    check_world(cfg, accelerator.num_processes)


def check_world(cfg: RunConfig, world: int) -> None:
    """The step's prompts split evenly over ``world`` processes; one vLLM engine per process, on its own GPU."""
    ro = cfg.rollout
    assert ro is not None
    if world > 1 and ro.prompts_per_step % world:
        raise UserError(
            f"rollout.prompts_per_step ({ro.prompts_per_step}) must divide by the number of processes ({world}): "
            "each process generates an equal share of the step's prompts; e.g. prompts_per_step: "
            f"{-(-ro.prompts_per_step // world) * world}"
        )
    if world > 1 and ro.backend == "vllm" and ro.tensor_parallel_size > 1:
        raise UserError(
            f"rollout.tensor_parallel_size: {ro.tensor_parallel_size} with {world} processes is not supported: "
            "each process runs its own vLLM engine on its own GPU (tensor_parallel_size: 1); for a model that "
            "needs several GPUs to generate, run one process with tensor_parallel_size > 1"
        )
    if world > 1 and cfg.train.deepspeed:
        raise UserError(
            f"train.deepspeed: stage {cfg.stage} runs on several processes with DDP only; remove train.deepspeed"
        )
    strategy = getattr(getattr(cfg, "distributed", None), "strategy", "ddp")  # the launcher's section, where it exists
    if world > 1 and strategy != "ddp":
        raise UserError(f"distributed.strategy: {strategy}: stage {cfg.stage} runs on several processes with ddp only")


def build_run(
    cfg: RunConfig,
    policy: Any,
    tokenizer: Any,
    prompts: list[dict],
    eval_prompts: list[dict],
    critic: Any = None,
) -> Run:
    """Accelerator, optimizers, reference, reward stack and rollouts: everything before the first step."""
    from accelerate.utils import set_seed

    from rlfactory.model.loader import head_kernels
    from rlfactory.model.reference import build_reference

    ro, alg = cfg.rollout, cfg.algorithm
    accelerator = shared.build_accelerator(cfg)
    check_processes(accelerator, cfg)
    ranks = Ranks(accelerator)
    set_seed(cfg.seed)
    total = cfg.train.max_steps or max(1, math.ceil(cfg.train.num_epochs * len(prompts) / ro.prompts_per_step))
    updates = total * alg.ppo_epochs * alg.num_mini_batches
    # a KL term needs the reference: the LoRA policy with its adapter disabled (no copy), or a frozen copy
    reference = build_reference(cfg, policy) if alg.kl_loss_coef > 0 or alg.kl_in_reward_coef > 0 else None
    # train mode for gradient checkpointing; generation switches to eval itself. Dropout would make the
    # old and new log-probs of the same tokens differ, so it should be 0 (it is by default)
    policy.train()
    if cfg.model.finetuning == "lora" and cfg.lora.dropout > 0:
        log.warning("lora.dropout=%g adds noise to the PPO ratio; 0 is recommended for ppo/grpo", cfg.lora.dropout)
    actor = _updater(accelerator, policy, cfg.train.learning_rate, cfg, updates, ranks)
    critic_updater = None
    if critic is not None:
        critic.train()
        _ddp_ignore_unused(critic)
        critic_updater = _updater(accelerator, critic, cfg.critic.learning_rate, cfg, updates, ranks)
    actor.packing = packing_on(cfg)
    if critic_updater is not None:
        critic_updater.packing = actor.packing
    actor.guard = shared.NonFiniteGuard(cfg.train, accelerator, Path(cfg.output_dir))
    if critic_updater is not None:
        critic_updater.guard = actor.guard
    accelerator.register_save_state_pre_hook(shared.keep_trainable_weights)
    shared.init_trackers(accelerator, cfg)
    reward_model = None
    if cfg.reward.reward_model:
        from rlfactory.rewards.model import RewardModelScorer

        reward_model = RewardModelScorer(
            cfg.reward.reward_model, accelerator.device, cfg.reward.reward_model_batch_size
        )
    for example in prompts + eval_prompts:
        example["prompt_text"] = tokenizer.decode(example["prompt_ids"])
    unwrapped = accelerator.unwrap_model(actor.model)
    rollouts, sampler = build_rollouts(cfg, unwrapped, tokenizer), None
    if ro.overlap and rollouts.syncs_weights:  # vllm: the engine holds its own weights, so it is the sampler
        sampler = rollouts
    elif ro.overlap:  # hf: validation keeps generating with the policy itself; a copy makes the training rollouts
        from rlfactory.rollout.backends import build_overlap_sampler

        copy = build_overlap_sampler(cfg, unwrapped, tokenizer, cfg.seed + ranks.rank)
        sampler = build_rollouts(cfg, unwrapped, tokenizer, backend=copy)
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        ranks=ranks,
        tokenizer=tokenizer,
        out=Path(cfg.output_dir),
        actor=actor,
        critic=critic_updater,
        reference=reference,
        rollouts=rollouts,
        rewards=RewardStack(cfg.reward, ro.max_response_len, reward_model),
        kl_ctrl=_kl_controller(cfg),
        prompts=prompts,
        eval_prompts=eval_prompts,
        total_steps=total,
        health=health.HealthMonitor(cfg.health, Path(cfg.output_dir), accelerator.is_main_process),
        sampler=sampler,
        prefetch=Prefetch(ro.overlap_update_sms) if sampler is not None else None,
        kernels=head_kernels(cfg.model, cfg.train),
    )


def _ddp_ignore_unused(critic: Any) -> None:
    """The critic never runs its LM's output head (values come from the decoder's hidden states); an untied,
    trained head would get no gradient, which DDP reports as an error at the next step. DDP is told to leave
    such parameters out (``_set_params_and_buffers_to_ignore_for_model``, read when it wraps the model); a
    head tied to the input embeddings is used, and stays in."""
    from torch.nn.parallel import DistributedDataParallel

    used = {id(p) for p in critic.lm.get_decoder().parameters()} | {id(p) for p in critic.value_head.parameters()}
    unused = [name for name, p in critic.named_parameters() if p.requires_grad and id(p) not in used]
    if unused:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(critic, unused)


def engine_current(run: Run) -> None:
    """Before validation: an overlapped vLLM engine (``run.sampler is run.rollouts``) finishes the round it is
    generating for the next step (kept for that step) and takes the weights trained so far. Without overlap the
    engine was synced after the last update, and hf validates with the policy itself."""
    if run.prefetch is None or run.sampler is not run.rollouts:
        return
    run.prefetch.finish()
    sync_sampler(run, run.state.step)


def validate(run: Run) -> tuple[dict[str, float], list[dict]]:
    """Greedy completions of the held-out prompts: val/score (evaluation.metric) and val/reward/* (the stack).

    The one evaluation path (``engine.evaluate``) with the run's sampler (its backend, through the agent loop when
    tools are configured) and its reward stack. Several processes: each generates and scores its part of the
    prompts, and the scored samples are gathered in rank order, so every rank returns the same numbers (those of
    one process, up to batching's float rounding)."""
    from rlfactory.engine.evaluate import evaluate

    ev = run.cfg.evaluation
    params = SamplingParams(max_tokens=ev.max_new_tokens, temperature=0)
    result = evaluate(
        run.rollouts, run.tokenizer, run.eval_prompts, params, ev.metric, rewards=run.rewards,
        autocast=run.accelerator.autocast,
    )  # fmt: skip
    samples, scores = [s.sample for s in result.scored], result.reward_scores()
    metrics = {
        "val/score": result.mean_score(),
        "val/reward/mean": sum(scores.total) / len(samples),
        "val/response_length/mean": sum(s.response_length for s in samples) / len(samples),
        **score_metrics(scores, "val/reward"),
        **episode_metrics([s.example for s in samples], "val/"),
    }
    return metrics, [s.row() for s in result.scored]


def write_trace(out: Path, name: str, rows: list[dict[str, Any]]) -> Path:
    """``rollouts/<name>.jsonl``: one replayable line per sample."""
    import json

    folder = out / "rollouts"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.jsonl"
    run_dir.write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def _trace(run: Run, done: int, result: Any) -> bool:
    """``rollouts/step_XXXXX.jsonl`` at the first step, every ``logging.rollout_trace_steps``, and at a step where a
    health rule fired (the WebUI opens that step's samples from the alert); by the main process. True if due."""
    every = run.cfg.logging.rollout_trace_steps
    alerted = run.health is not None and done in run.health.alert_steps
    if not every or not (done == 1 or done % every == 0 or alerted):
        return False
    if run.accelerator.is_main_process:
        rows = trace_rows(done, result.samples, result.advantages, run.tokenizer, run.cfg.rollout.mask_truncated)
        write_trace(run.out, f"step_{done:05d}", rows)
    return True


def _log(run: Run, record: dict[str, Any]) -> None:
    """One trainer_log.jsonl line, then the health rules on it (their alerts follow it in the log)."""
    record = {k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}
    shared.log_record(run.accelerator, run.out, record)
    if run.health is not None:
        run.health.observe(record)


def _mean(window: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for record in window for k in record}
    return {k: sum(r[k] for r in window if k in r) / sum(1 for r in window if k in r) for k in sorted(keys)}


def _validate_and_log(run: Run, step_index: int) -> dict[str, float]:
    engine_current(run)
    metrics, rows = validate(run)
    _log(run, {"step": step_index, **metrics})
    if run.accelerator.is_main_process:
        if run.cfg.logging.rollout_trace_steps:
            write_trace(run.out, f"val_step_{step_index:05d}", rows)
        log.info(
            "step %d: val/score %.3f, val/reward/mean %.3f",
            step_index,
            metrics["val/score"],
            metrics["val/reward/mean"],
        )
    return metrics


def _resume(run: Run, resume_from: Path) -> dict[str, float] | None:
    """Restore the checkpoint; returns the interrupted run's step-0 validation, if it made one."""
    from rlfactory.engine.run_dir import read_log

    saved = shared.load_checkpoint(run.accelerator, resume_from, run.out)
    run.accelerator.wait_for_everyone()  # every rank has cut the log to the checkpoint before rank 0 appends to it
    known = {k: v for k, v in saved.items() if k in LoopState.__dataclass_fields__}
    run.state = LoopState(**known)
    if run.state.kl_coef is not None:
        run.kl_ctrl.value = run.state.kl_coef
    run.accelerator.print(f"resumed from {resume_from} at step {run.state.step}")
    records = read_log(run.out)
    if run.health is not None:
        run.health.replay(records)
    return next((r for r in records if r["step"] == 0 and "val/score" in r), None)


def train(
    cfg: RunConfig,
    policy: Any,
    tokenizer: Any,
    prompts: list[dict],
    eval_prompts: list[dict],
    critic: Any = None,
    resume_from: Path | None = None,
) -> tuple[TrainResult, dict[str, Any]]:
    """Run the loop; returns the result (as the offline loop's) and the before/after validation summary."""
    from tqdm.auto import tqdm

    run = build_run(cfg, policy, tokenizer, prompts, eval_prompts, critic)
    before = after = None
    if resume_from is not None:
        before = _resume(run, resume_from)
    # merged adapter_paths, a resumed policy: other weights loaded (a vLLM sampler is run.rollouts itself)
    for sampler in (run.rollouts, None if run.sampler is run.rollouts else run.sampler):
        if sampler is not None and sampler.syncs_weights:
            sampler.sync_weights(run.accelerator.unwrap_model(run.actor.model))
    run.sampler_version = run.state.step
    ro, alg = cfg.rollout, cfg.algorithm
    run.accelerator.print(
        f"stage {cfg.stage}: {len(prompts)} prompts, {run.total_steps} steps of {ro.prompts_per_step} prompts x "
        f"{ro.num_samples} samples, estimator {alg.adv_estimator}, policy loss {alg.policy_loss}"
    )
    if eval_prompts and cfg.evaluation.before_training and resume_from is None:
        before = _validate_and_log(run, 0)
    bar = tqdm(
        total=run.total_steps,
        initial=run.state.step,
        desc=cfg.stage,
        disable=not (cfg.logging.progress_bar and run.accelerator.is_main_process),
    )
    try:
        with shared.StopSignals() as stop, shared.log_lines_above(bar):
            last = _loop(run, bar, stop, bool(eval_prompts))
        bar.close()
        if eval_prompts:
            after = _validate_and_log(run, run.state.step)
        return _finish(run, last, before, after)
    finally:
        run.rewards.close()  # the user functions' worker processes


def _trained_state(run: Run) -> dict[str, Any]:
    """The loop state as of the steps trained: a round generating in the overlap thread has drawn the next step's
    prompts already, which a checkpoint must not count (a resumed run draws them again)."""
    state = asdict(run.state)
    return {**state, **(run.prefetch.rewind() if run.prefetch is not None else {})}


def _checkpoint(run: Run, done: int) -> Path:
    run.state.kl_coef = run.kl_ctrl.value
    state, limit = _trained_state(run), run.cfg.train.save_total_limit
    return shared.save_checkpoint(run.accelerator, run.out, done, state, limit)


def _loop(run: Run, bar: Any, stop: shared.StopSignals, validates: bool) -> dict[str, float]:
    """The steps from the current one to the end; returns the last logged metrics. Stops (after a checkpoint) on
    SIGTERM/SIGINT and when a reward function failed ``reward.max_failures_in_a_row`` calls in a row."""
    cfg = run.cfg
    streaks = FailureStreaks(cfg.reward.max_failures_in_a_row)
    tool_streak = FailureStreaks(cfg.agent.max_tool_errors_in_a_row if cfg.agent is not None else None)
    window: list[dict[str, float]] = []
    last: dict[str, float] = {}
    start, start_step = time.time(), run.state.step  # elapsed and ETA on each log line (the WebUI's progress bar)
    for index in range(run.state.step, run.total_steps):
        result = step(run, index)
        done = run.state.step = index + 1
        # the next step would sample from these weights: non-finite ones stop the run here, with a message
        shared.check_finite_weights(run.accelerator, run.accelerator._models, "model", step=done)
        window.append({**result.metrics, **run.actor.guard.pop_skipped()})
        bar.update(1)
        bar.set_postfix(score=f"{result.metrics['score/mean']:.3f}")
        if done % cfg.logging.logging_steps == 0 or done == run.total_steps:
            last = _mean(window)
            elapsed = time.time() - start
            eta = elapsed / (done - start_step) * (run.total_steps - done)
            epoch = _trained_state(run)["epoch"]
            _log(run, {"step": done, "epoch": epoch, **last, "elapsed_s": elapsed, "eta_s": eta})
            window = []
        if validates and cfg.train.eval_steps and done % cfg.train.eval_steps == 0 and done < run.total_steps:
            _validate_and_log(run, done)
        traced = _trace(run, done, result)
        saved = None
        if cfg.train.save_steps and done % cfg.train.save_steps == 0 and done < run.total_steps:
            saved = _checkpoint(run, done)
        failures = {n: int(result.metrics.get(f"reward/{n}/failures", 0)) for n in run.rewards.names}
        failing = streaks.update(failures, int(result.metrics["rollout/generated_samples"]))
        executed, failed = tool_call_counts(result.metrics)  # over every rank's samples: every rank decides alike
        broken_tool = tool_streak.update({"tools": failed}, executed) is not None
        hung_env = result.metrics.get("env/hung_steps", 0.0) > 0  # reduced over ranks: every rank stops alike
        signum = stop.requested(run.accelerator)
        unhealthy = run.health.stop if run.health is not None else None  # a rule with action stop fired
        stopping = failing is not None or broken_tool or hung_env or signum or unhealthy is not None
        if not stopping or done == run.total_steps:
            continue
        if done % cfg.logging.logging_steps:  # the step's metrics (and failure counts) reach the log first
            _log(run, {"step": done, "epoch": _trained_state(run)["epoch"], **_mean(window)})
            traced = traced or _trace(run, done, result)  # an alert of that record points to this step
        saved = saved or _checkpoint(run, done)
        if unhealthy is not None:
            raise health.stopped(unhealthy, saved)
        if hung_env:
            raise RunStopped(
                f"an environment step (agent.env: {cfg.agent.env}) ran past agent.env_step_timeout_s "
                f"({cfg.agent.env_step_timeout_s:g} s); its thread cannot be stopped and would keep using the CPU, so "
                f"the run stopped; saved {saved}: fix the step (or make it async, or raise the timeout) and continue "
                "with resume_from_checkpoint=auto",
                exit_code=2,
            )
        if broken_tool:
            raise RunStopped(
                f"tool calls failed {tool_streak.counts['tools']} times in a row (agent.max_tool_errors_in_a_row: "
                f"{cfg.agent.max_tool_errors_in_a_row}), the last: {last_tool_error(result.samples)}; saved {saved}: "
                "fix the tool (or raise the limit) and continue with resume_from_checkpoint=auto",
                exit_code=2,
            )
        if failing is not None:
            last_error = run.rewards.last_errors.get(failing, "see the log")
            raise RunStopped(
                f"reward function '{failing}' failed {streaks.counts[failing]} calls in a row "
                f"(reward.max_failures_in_a_row: {cfg.reward.max_failures_in_a_row}), the last: {last_error}; "
                f"saved {saved}: fix the function and continue with resume_from_checkpoint=auto",
                exit_code=2,
            )
        raise shared.StopSignals.stopped(signum, done, saved)
    return last


def tool_call_counts(metrics: dict[str, float]) -> tuple[int, int]:
    """Executed tool calls of a step (well-formed calls of a known tool) and how many of them failed, read from the
    step's episode metrics (``tool_calls/<tool>`` counts and ``tool_errors/rate``)."""
    executed = sum(v for k, v in metrics.items() if k.startswith("tool_calls/") and k != "tool_calls/mean")
    return int(executed), round(metrics.get("tool_errors/rate", 0.0) * executed)


def last_tool_error(samples: list[Any]) -> str:
    """The last failed tool call's error among the step's trained samples (for the stop message)."""
    for sample in reversed(samples):
        for turn in reversed(sample.example.get("agent", {}).get("turns", [])):
            for call in reversed(turn["calls"]):
                if call.get("tool_error"):
                    return str(call["tool_error"])
    return "see the log (tool calls failed: ...)"


def _finish(run: Run, last: dict, before: dict | None, after: dict | None) -> tuple[TrainResult, dict[str, Any]]:
    from rlfactory.model.loader import save_model

    accelerator, cfg = run.accelerator, run.cfg
    accelerator.wait_for_everyone()
    shared.check_finite_weights(accelerator, accelerator._models, "final model")
    policy = accelerator.unwrap_model(run.actor.model)  # DDP keeps the weights the same on every rank
    saved_as = None
    if accelerator.is_main_process:
        run_dir.rotate_checkpoints(run.out, cfg.train.save_total_limit)  # see the offline engine's _finish
        saved_as = save_model(policy, run.tokenizer, run.out)
        if run.critic is not None:
            from rlfactory.model.value_head import save_value_model

            save_value_model(accelerator.unwrap_model(run.critic.model), run.out / "critic")
        if cfg.logging.plot_loss:
            run_dir.plot_log(run.out, ("loss", "score/mean", "val/score"))
    saved_as = run.ranks.first(saved_as)  # every rank returns the same result; the model is written once
    shared.end_run(accelerator)
    if run.prefetch is not None:
        run.prefetch.wait()
    run.rollouts.close()
    if run.sampler is not None and run.sampler is not run.rollouts:
        run.sampler.close()
    extra: dict[str, Any] = {}
    if after is not None:
        for key, label in (("val/score", cfg.evaluation.metric), ("val/reward/mean", "reward")):
            name = f"{label} ({cfg.evaluation.dataset})"
            extra[name] = shared.before_after(
                None if before is None else before[key], after[key], len(run.eval_prompts)
            )
    result = TrainResult(run.state.step, policy, run.out, saved_as, last, after or {})
    return result, extra
