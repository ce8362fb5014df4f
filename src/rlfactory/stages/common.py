"""Wiring shared by the stages: checks before anything is written, the output dir, generation eval,
and the closing summary. Each stage module reads top to bottom and calls these."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from rlfactory.config.loader import dump_config
from rlfactory.config.schema import EvaluationConfig, RunConfig
from rlfactory.engine import run_dir

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig) -> Path | None:
    """Checks that need no model: resume target and output dir. Returns the checkpoint to resume."""
    from transformers import set_seed

    resume_from = run_dir.resolve_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    run_dir.check_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resume_from)
    set_seed(cfg.seed)  # before any model is built: LoRA initialisation is random too
    return resume_from


def start_output_dir(cfg: RunConfig, resume_from: Path | None) -> Path:
    """Create the output dir (all checks passed) and save the resolved config in it."""
    out = run_dir.prepare_output_dir(cfg.output_dir, cfg.overwrite_output_dir, resume_from)
    (out / "config.yaml").write_text(dump_config(cfg))
    return out


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
    return load_examples([ev.dataset], "prompt", cfg.data.dataset_dir, ev.max_samples, cfg.data.max_bad_rows)


def evaluate_generation(model: Any, tokenizer: Any, prompts: list[dict[str, Any]], ev: EvaluationConfig) -> dict:
    """Greedy generation on held-out prompts, scored by a reward function (mean score = accuracy)."""
    from rlfactory.render.chat import render_prompt
    from rlfactory.rewards.builtin import metric_score
    from rlfactory.rollout.hf import generate_ids

    prompt_ids = [render_prompt(tokenizer, ex["messages"], ex.get("tools")) for ex in prompts]
    outputs = generate_ids(model, tokenizer, prompt_ids, ev.max_new_tokens, batch_size=ev.batch_size)
    scores, samples = [], []
    for example, ids, out in zip(prompts, prompt_ids, outputs, strict=True):
        completion = tokenizer.decode(out, skip_special_tokens=True)
        scores.append(metric_score(ev.metric, tokenizer.decode(ids), completion, example.get("answer"), example))
        samples.append(
            {
                "prompt": example["messages"][-1]["content"],
                "completion": completion,
                "answer": example.get("answer"),
                "score": scores[-1],
            }
        )
    return {"score": sum(scores) / len(scores), "n": len(scores), "samples": samples}


def generation_before(
    cfg: RunConfig, model: Any, tokenizer: Any, prompts: list, resuming: bool, device: Any = None
) -> float | None:
    """Generation score of the starting model on ``evaluation.dataset`` (None when off or resuming); ``device``:
    where to move the model first (the preference stages score on the device training will use)."""
    if not prompts or resuming or not cfg.evaluation.before_training:
        return None
    if device is not None:
        model.to(device)
    return evaluate_generation(model, tokenizer, prompts, cfg.evaluation)["score"]


def generation_after(cfg: RunConfig, model: Any, tokenizer: Any, prompts: list, before: float | None) -> dict:
    """The same score after training, as ``{name: {before, after, n}}`` for the run summary."""
    from rlfactory.engine.shared import before_after

    if not prompts:
        return {}
    scored = evaluate_generation(model, tokenizer, prompts, cfg.evaluation)
    return {f"{cfg.evaluation.metric} ({cfg.evaluation.dataset})": before_after(before, scored["score"], scored["n"])}


def finish(cfg: RunConfig, result: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Write run_summary.json and print where the model went and what it scored."""
    summary = {
        "stage": cfg.stage,
        "output_dir": str(result.final_dir),
        "saved_as": result.saved_as,
        "global_step": result.global_step,
        "train": result.last_metrics,
        "eval": result.eval_metrics,
        **extra,
    }
    Path(result.final_dir, "run_summary.json").write_text(json.dumps(summary, indent=2))
    lines = [f"saved {result.saved_as} model to {result.final_dir}"]
    if "eval_loss" in result.eval_metrics:
        lines.append(f"eval loss {result.eval_metrics['eval_loss']:.4f}")
    for key, value in extra.items():
        if isinstance(value, dict) and "before" in value:
            before = "n/a" if value["before"] is None else f"{value['before']:.3f}"
            lines.append(f"{key}: {before} -> {value['after']:.3f}")
    print("\n".join(lines))
    return summary
