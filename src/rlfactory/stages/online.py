"""The online loop of ppo and grpo: set up once, then repeat step -> log -> trace -> validate ->
checkpoint, then save. What one step does is ``stages/online_step.py``; the tensor math is
``stages/online_update.py``.

Design notes:
- one process for now (a clear error under ``accelerate launch`` with several processes);
  Accelerate still owns device placement, mixed precision, backward, clipping and checkpoints.
- generation runs on the policy itself (hf backend, no weight sync) or on a vLLM engine in this process
  (vllm backend): that one gets the policy's weights once at the start (after a resume they differ from
  the checkpoint on disk) and after every update (``online_step``), and its log-probs are compared with
  the trainer's every step.
- validation is greedy on ``evaluation.dataset``: ``val/score`` (``evaluation.metric``, i.e. accuracy
  for answer_match) and ``val/reward/*`` (the reward stack), at step 0, every ``train.eval_steps`` and
  at the end; the first and last give the before/after line of the summary.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from rlfactory.config.schema import RunConfig
from rlfactory.engine import online as engine
from rlfactory.engine.trainer import TrainResult, build_accelerator
from rlfactory.errors import UserError
from rlfactory.rewards.stack import RewardStack, Sample, score_metrics
from rlfactory.rollout.backends import build_backend
from rlfactory.rollout.base import SamplingParams
from rlfactory.stages import online_agent
from rlfactory.stages import online_update as ops
from rlfactory.stages.online_setup import Reference, needs_reference
from rlfactory.stages.online_step import Run, step, trace_rows

log = logging.getLogger(__name__)


def _kl_controller(cfg: RunConfig) -> Any:
    from rlfactory.algos.kl import AdaptiveKLController, FixedKLController

    alg = cfg.algorithm
    assert alg is not None
    if alg.kl_controller == "adaptive":
        return AdaptiveKLController(alg.kl_in_reward_coef, alg.kl_target, alg.kl_horizon)
    return FixedKLController(alg.kl_in_reward_coef)


def _updater(accelerator: Any, model: Any, lr: float, cfg: RunConfig, updates: int) -> tuple[Any, ops.Updater]:
    optimizer = engine.make_optimizer(model, lr, cfg.train)
    scheduler = engine.make_scheduler(optimizer, cfg.train, updates)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # as the offline engine: drop Accelerate's fp32 output wrapper (it would copy (B, T, V) logits to fp32)
    # and autocast the forward passes ourselves
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if cfg.train.torch_compile:
        from rlfactory.engine.trainer import compile_layers

        # in place (nn.Module.compile): parameter names, PEFT's adapter switch and the weight sync are unchanged
        log.info("torch.compile: %d layers", compile_layers(accelerator.unwrap_model(model)))
    return model, ops.Updater(accelerator, model, optimizer, scheduler, cfg.train.max_grad_norm)


def build_run(
    cfg: RunConfig, policy: Any, tokenizer: Any, prompts: list[dict], eval_prompts: list[dict], critic: Any = None
) -> Run:
    """Accelerator, optimizers, reference, reward stack and backend: everything before the first step."""
    from accelerate.utils import set_seed

    ro, alg = cfg.rollout, cfg.algorithm
    assert ro is not None and alg is not None and cfg.reward is not None
    accelerator = build_accelerator(cfg)
    if accelerator.num_processes > 1:
        raise UserError(f"stage {cfg.stage} runs on one process for now; launch it without accelerate launch")
    set_seed(cfg.seed)
    total = cfg.train.max_steps or max(1, math.ceil(cfg.train.num_epochs * len(prompts) / ro.prompts_per_step))
    updates = total * alg.ppo_epochs * alg.num_mini_batches
    reference = Reference(cfg, policy) if needs_reference(cfg) else None  # holds the unwrapped policy
    # train mode for gradient checkpointing; generation switches to eval itself. Dropout would make the
    # old and new log-probs of the same tokens differ, so it should be 0 (it is by default)
    policy.train()
    if critic is not None:
        critic.train()
    if cfg.model.finetuning == "lora" and cfg.lora.dropout > 0:
        log.warning("lora.dropout=%g adds noise to the PPO ratio; 0 is recommended for ppo/grpo", cfg.lora.dropout)
    policy, actor = _updater(accelerator, policy, cfg.train.learning_rate, cfg, updates)
    critic_updater = None
    if critic is not None:
        assert cfg.critic is not None
        critic, critic_updater = _updater(accelerator, critic, cfg.critic.learning_rate, cfg, updates)
    accelerator.register_save_state_pre_hook(engine.keep_trainable_weights)
    if accelerator.log_with:
        import json

        accelerator.init_trackers(cfg.name or cfg.stage, config=json.loads(cfg.model_dump_json()))
    reward_model = None
    if cfg.reward.reward_model:
        from rlfactory.rewards.model import RewardModelScorer

        reward_model = RewardModelScorer(
            cfg.reward.reward_model, accelerator.device, cfg.reward.reward_model_batch_size
        )
    for example in prompts + eval_prompts:
        example["prompt_text"] = tokenizer.decode(example["prompt_ids"])
    backend = build_backend(cfg, accelerator.unwrap_model(policy), tokenizer)
    from rlfactory.stages.online_agent import build_agent

    return Run(
        cfg=cfg,
        accelerator=accelerator,
        tokenizer=tokenizer,
        out=Path(cfg.output_dir),
        policy=policy,
        actor=actor,
        backend=backend,
        rewards=RewardStack(cfg.reward, ro.max_response_len, reward_model),
        prompts=prompts,
        eval_prompts=eval_prompts,
        kl_ctrl=_kl_controller(cfg),
        total_steps=total,
        reference=reference,
        agent=build_agent(cfg, backend, tokenizer),
        critic=critic,
        critic_updater=critic_updater,
    )


def validate(run: Run) -> tuple[dict[str, float], list[dict]]:
    """Greedy completions of the held-out prompts: val/score (evaluation.metric) and val/reward/* (the stack)."""
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    ev = run.cfg.evaluation
    metric = REWARD_FUNCTIONS.get(ev.metric)
    with run.accelerator.autocast():  # multi-turn evaluation runs the same agent loop, greedy
        params = SamplingParams(ev.max_new_tokens, 0)
        completions, finals, seen = online_agent.generate(run.agent, run.backend, run.eval_prompts, params)
    samples = [
        Sample(
            p["prompt_text"],
            run.tokenizer.decode(c.token_ids, skip_special_tokens=True) if f is None else f,
            p.get("answer"),
            p,
            len(c.token_ids),
        )
        for p, c, f in zip(seen, completions, finals, strict=True)
    ]
    scores = run.rewards.score(samples)
    values = []
    for s in samples:
        value = metric(s.prompt, s.completion, s.answer, s.example)
        values.append(float(sum(value.values()) if isinstance(value, dict) else value))
    metrics = {
        "val/score": sum(values) / len(values),
        "val/reward/mean": sum(scores.total) / len(samples),
        "val/response_length/mean": sum(s.response_length for s in samples) / len(samples),
        **score_metrics(scores, "val/reward"),
        **online_agent.metrics(seen, "val/"),
    }
    rows = [
        {
            "prompt": s.example["messages"][-1]["content"],
            "completion": s.completion,
            "answer": s.answer,
            "score": v,
            **online_agent.trace_fields(s.example),
        }
        for s, v in zip(samples, values, strict=True)
    ]
    return metrics, rows


def _mean(window: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for record in window for k in record}
    return {k: sum(r[k] for r in window if k in r) / sum(1 for r in window if k in r) for k in sorted(keys)}


def _validate_and_log(run: Run, step_index: int) -> dict[str, float]:
    metrics, rows = validate(run)
    engine.log_record(run.accelerator, run.out, {"step": step_index, **metrics})
    if run.cfg.logging.rollout_trace_steps:
        engine.write_trace(run.out, f"val_step_{step_index:05d}", rows)
    log.info(
        "step %d: val/score %.3f, val/reward/mean %.3f", step_index, metrics["val/score"], metrics["val/reward/mean"]
    )
    return metrics


def train(
    cfg: RunConfig,
    policy: Any,
    tokenizer: Any,
    prompts: list[dict],
    eval_prompts: list[dict],
    critic: Any = None,
    resume_from: Path | None = None,
) -> tuple[TrainResult, dict[str, Any]]:
    """Run the loop; returns the result (as the offline engine's) and the before/after validation summary."""
    from tqdm.auto import tqdm

    run = build_run(cfg, policy, tokenizer, prompts, eval_prompts, critic)
    if resume_from is not None:
        run.state = engine.load_checkpoint(run.accelerator, resume_from, run.out)
        run.kl_ctrl.value = run.state.get("kl_coef", run.kl_ctrl.value)
        run.accelerator.print(f"resumed from {resume_from} at step {run.state['step']}")
    if run.backend.syncs_weights:  # merged adapter_paths, a resumed policy: the engine loaded other weights
        run.backend.sync_weights(run.accelerator.unwrap_model(run.policy))
    ro = cfg.rollout
    assert ro is not None
    run.accelerator.print(
        f"stage {cfg.stage}: {len(prompts)} prompts, {run.total_steps} steps of {ro.prompts_per_step} prompts x "
        f"{ro.num_samples} samples, estimator {cfg.algorithm.adv_estimator}, policy loss {cfg.algorithm.policy_loss}"
    )
    before = after = None
    if eval_prompts and cfg.evaluation.before_training and resume_from is None:
        before = _validate_and_log(run, 0)
    elif resume_from is not None:  # the step-0 validation of the interrupted run, if it made one
        from rlfactory.engine.run_dir import read_log

        before = next((r for r in read_log(run.out) if r["step"] == 0 and "val/score" in r), None)
    bar = tqdm(total=run.total_steps, initial=run.state["step"], desc=cfg.stage, disable=not cfg.logging.progress_bar)
    window: list[dict[str, float]] = []
    last: dict[str, float] = {}
    for index in range(run.state["step"], run.total_steps):
        metrics, samples, batch = step(run, index)
        done = run.state["step"] = index + 1
        window.append(metrics)
        bar.update(1)
        bar.set_postfix(score=f"{metrics['score/mean']:.3f}")
        if done % cfg.logging.logging_steps == 0 or done == run.total_steps:
            last = _mean(window)
            engine.log_record(run.accelerator, run.out, {"step": done, "epoch": run.state["epoch"], **last})
            window = []
        if cfg.logging.rollout_trace_steps and (done == 1 or done % cfg.logging.rollout_trace_steps == 0):
            engine.write_trace(run.out, f"step_{done:05d}", trace_rows(done, samples, batch))
        if eval_prompts and cfg.train.eval_steps and done % cfg.train.eval_steps == 0 and done < run.total_steps:
            _validate_and_log(run, done)
        if cfg.train.save_steps and done % cfg.train.save_steps == 0 and done < run.total_steps:
            state = {**run.state, "kl_coef": run.kl_ctrl.value}
            engine.save_checkpoint(run.accelerator, run.out, done, state, cfg.train.save_total_limit)
    bar.close()
    if eval_prompts:
        after = _validate_and_log(run, run.state["step"])
    return _finish(run, last, before, after)


def _finish(run: Run, last: dict, before: dict | None, after: dict | None) -> tuple[TrainResult, dict[str, Any]]:
    from rlfactory.engine import run_dir
    from rlfactory.model.loader import save_model

    accelerator, cfg = run.accelerator, run.cfg
    accelerator.wait_for_everyone()
    policy = accelerator.unwrap_model(run.policy)
    saved_as = save_model(policy, run.tokenizer, run.out)
    if run.critic is not None:
        from rlfactory.model.value_head import save_value_model

        save_value_model(accelerator.unwrap_model(run.critic), run.out / "critic")
    if cfg.logging.plot_loss:
        run_dir.plot_log(run.out, ("loss", "score/mean", "val/score"))
    accelerator.end_training()
    run.backend.close()
    extra: dict[str, Any] = {}
    if after is not None:
        n = len(run.eval_prompts)
        for key, label in (("val/score", cfg.evaluation.metric), ("val/reward/mean", "reward")):
            extra[f"{label} ({cfg.evaluation.dataset})"] = {
                "before": None if before is None else before[key],
                "after": after[key],
                "n": n,
            }
    result = TrainResult(run.state["step"], policy, run.out, saved_as, last, after or {})
    return result, extra
