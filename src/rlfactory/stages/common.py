"""Wiring shared by the stages: checks before anything is written, the output dir, generation eval,
and the closing summary. Each stage module reads top to bottom and calls these.

Several processes: every process runs the stage; the main process alone writes (output dir, config.yaml,
run.json, run_summary.json, the printed summary), the others wait for it where they would read what it wrote.
The generation-based evaluation is sharded over the processes and gathered, so all of them return the same score.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfactory.config.loader import dump_config
from rlfactory.config.schema import EvaluationConfig, RunConfig
from rlfactory.engine import run_dir
from rlfactory.engine.environment import environment_problems
from rlfactory.engine.shared import check_deepspeed_file, check_strategy, process_state
from rlfactory.errors import UserError

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig) -> Path | None:
    """Checks that need no model: resume target and output dir. Returns the checkpoint to resume."""
    from transformers import set_seed

    check_deepspeed_file(cfg)
    for warning in cfg.unused_sections():
        log.warning("%s", warning)
    for problem in environment_problems(cfg):  # `config check` warns about these; train cannot go on
        raise UserError(problem)
    check_strategy(cfg)
    resume_from = run_dir.resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    run_dir.check_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resume_from)
    set_seed(cfg.seed)  # before any model is built: LoRA initialisation is random too
    return resume_from


def start_output_dir(cfg: RunConfig, resume_from: Path | None) -> Path:
    """Create the output dir (all checks passed) and save the resolved config in it: the main process, after every
    process has run its checks on the untouched folder (an overwrite's rmtree happens once, before anyone writes)."""
    state = process_state()
    state.wait_for_everyone()
    if state.is_main_process:
        out = run_dir.prepare_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resume_from)
        run_dir.write_atomic(out / "config.yaml", dump_config(cfg))
    state.wait_for_everyone()
    return Path(cfg.output_dir)


def split_eval(examples: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Hold out a seeded fraction of the examples for evaluation."""
    if fraction <= 0:
        return examples, []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, int(len(examples) * fraction))
    held = set(order[:n_eval])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def load_eval_prompts(cfg: RunConfig) -> list[dict[str, Any]]:
    """Prompt+answer examples for generation-based evaluation (empty when not configured)."""
    from rlfactory.data.loader import load_examples
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    ev = cfg.evaluation
    if ev.dataset is None:
        return []
    REWARD_FUNCTIONS.get(ev.metric)  # unknown metric: clear error before any model loads
    prompts = load_examples([ev.dataset], "prompt", cfg.data.dataset_dir, ev.max_samples, cfg.data.max_bad_rows)
    needs = [f"evaluation.metric {ev.metric}"] if REWARD_FUNCTIONS.traits(ev.metric).get("needs_answer") else []
    check_columns(prompts, needs, ev.dataset)  # without answers every prompt would score 0
    if ev.tools:  # tools load and rows are checked here, before any model
        from rlfactory.rollout.agent import offer_tools

        offer_tools(ev.tools, ev.parser, prompts)
    return prompts


def check_columns(examples: list[dict[str, Any]], needs_answer: list[str], dataset: str) -> None:
    """Every example must carry the ground truth a reward (or metric) reads."""
    missing = [ex for ex in examples if ex.get("answer") is None]
    if needs_answer and missing:
        raise UserError(
            f"{', '.join(needs_answer)} needs a reference answer, but {len(missing)} of {len(examples)} examples of "
            f"'{dataset}' have none (first: {missing[0].get('source')}); map the answer column with "
            "columns: {answer: <column>} in dataset_info.yaml, or choose a reward that needs no answer"
        )


def evaluate_generation(model: Any, tokenizer: Any, prompts: list[dict[str, Any]], ev: EvaluationConfig) -> dict:
    """Greedy generation on held-out prompts, scored by a reward function (mean score = accuracy): the one
    evaluation path (``engine.evaluate``) on the model itself (hf backend), through the agent loop with
    ``evaluation.tools``, as ppo/grpo validate (the tool results are fed back and the last turn is scored).

    Several processes: call it on every process with the same prompts and the model on its device; every process
    returns the same result (see ``engine.evaluate``).
    """
    from rlfactory.engine.evaluate import evaluate, render_eval_prompts
    from rlfactory.render.plain import tokenizer_for
    from rlfactory.rollout.base import SamplingParams

    tokenizer = tokenizer_for(tokenizer, prompts)  # standard TRL prompts: plain text, ended by eos
    rollouts = eval_rollouts(model, tokenizer, ev)
    params = SamplingParams(max_tokens=ev.max_new_tokens, temperature=0)
    result = evaluate(rollouts, tokenizer, render_eval_prompts(tokenizer, prompts), params, ev.metric)
    samples = [s.row() for s in result.scored]
    return {"score": result.mean_score(), "n": len(samples), "samples": samples}


def eval_rollouts(model: Any, tokenizer: Any, ev: EvaluationConfig) -> Any:
    """The sampler of an offline stage's evaluation: ``generate`` on the model itself, through the agent loop (the
    default tools environment and limits) when ``evaluation.tools`` are set."""
    from rlfactory.rollout.agent import AgentSettings, Rollouts, agent_rollouts
    from rlfactory.rollout.hf import HFBackend

    backend = HFBackend(model, tokenizer, ev.batch_size)
    if not ev.tools:
        return Rollouts(backend, None)
    return agent_rollouts(backend, tokenizer, ev.tools, AgentSettings(ev.max_turns, ev.parser))


def score_before(cfg: RunConfig, tokenizer: Any, prompts: list[dict[str, Any]]) -> Callable[[Any], float] | None:
    """``StageParts.before_training``: the generation score of the starting model, run by the engine on the prepared
    model (on its device, per process) before the first step; None when there is nothing to score."""
    if not prompts or not cfg.evaluation.before_training:
        return None
    return lambda model: evaluate_generation(model, tokenizer, prompts, cfg.evaluation)["score"]


def score_after(cfg: RunConfig, result: Any, tokenizer: Any, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """The same score after training, next to the one before, as ``{name: {before, after, n}}`` for the summary."""
    if not prompts:
        return {}
    from rlfactory.engine.shared import before_after

    scored = evaluate_generation(result.model, tokenizer, prompts, cfg.evaluation)
    return {
        f"{cfg.evaluation.metric} ({cfg.evaluation.dataset})": before_after(result.before, scored["score"], scored["n"])
    }


def finish(cfg: RunConfig, result: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Write run_summary.json and print where the model went and what it scored (the main process); every process
    returns the summary."""
    summary = {
        "stage": cfg.stage,
        "output_dir": str(result.final_dir),
        "saved_as": result.saved_as,
        "global_step": result.global_step,
        "train": result.last_metrics,
        "eval": result.eval_metrics,
        **extra,
    }
    if not process_state().is_main_process:
        return summary
    # written last, atomically: its presence means the stage finished (a pipeline rerun with resume skips it)
    run_dir.write_atomic(Path(result.final_dir, run_dir.SUMMARY_FILE), json.dumps(summary, indent=2))
    lines = [f"saved {result.saved_as} model to {result.final_dir}"]
    if "eval_loss" in result.eval_metrics:
        lines.append(f"eval loss {result.eval_metrics['eval_loss']:.4f}")
    for key, value in extra.items():
        if isinstance(value, dict) and "before" in value:
            before = "n/a" if value["before"] is None else f"{value['before']:.3f}"
            lines.append(f"{key}: {before} -> {value['after']:.3f}")
    print("\n".join(lines))
    return summary
