"""Sampled tool-call evaluation of a model: success, calls per conversation and invalid calls, by category.

Runs the held-out tool prompts of a run config (``evaluation.dataset``, its tools and ``agent`` settings)
through the real agent loop on the hf backend, sampled (temperature 1 by default: the distribution GRPO
trains on), several conversations per prompt, seeded. Prints one table row and a few examples of each kind
of invalid call; ``--json`` writes the numbers.

    python scripts/tool_call_eval.py data/models/tiny-arith
    python scripts/tool_call_eval.py outputs/quickstart-grpo --samples 4 --temperature 1.0

Categories of invalid calls (each call counts once):
  truncated      the turn was cut by the response budget (rollout.max_response_len) inside the call
  unclosed       the turn ended (end-of-turn token) before </tool_call>
  bad_json       the call's text is not JSON
  bad_shape      JSON, but not {"name": ..., "arguments": {...}}
  unknown_tool   a tool that is not declared
  bad_arguments  arguments that do not fit the tool's schema
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
try:
    import rlfactory  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

CATEGORIES = ("truncated", "unclosed", "bad_json", "bad_shape", "unknown_tool", "bad_arguments")


def category(call: dict[str, Any], turn: dict[str, Any]) -> str | None:
    """The kind of an invalid call (None for a valid one); see the module docstring."""
    kind = call["error_kind"]
    if kind is None:
        return None
    if kind != "malformed":
        return kind
    if turn.get("finish_reason") == "length":
        return "truncated"
    error = call["error"] or ""
    if "not closed" in error:
        return "unclosed"
    return "bad_json" if "invalid JSON" in error else "bad_shape"


def summarize(episodes: list[dict[str, Any]], scores: list[float], examples_per_kind: int = 3) -> dict[str, Any]:
    """Success, calls/conv, invalid per call and per conversation, counts by category, a few examples."""
    counts: Counter[str] = Counter()
    shown: dict[str, list[str]] = {k: [] for k in CATEGORIES}
    calls = invalid_convs = 0
    for episode in episodes:
        bad_here = 0
        for turn in episode["turns"]:
            for call in turn["calls"]:
                calls += 1
                kind = category(call, turn)
                if kind is None:
                    continue
                bad_here += 1
                counts[kind] += 1
                if len(shown[kind]) < examples_per_kind:
                    shown[kind].append(turn["assistant"][-160:])
        invalid_convs += bad_here > 0
    n = len(episodes)
    invalid = sum(counts.values())
    return {
        "conversations": n,
        "success": sum(scores) / n,
        "calls_per_conv": calls / n,
        "invalid_per_call": invalid / max(calls, 1),
        "invalid_per_conv": invalid / n,
        "convs_with_invalid": invalid_convs / n,
        "invalid": {k: counts[k] for k in CATEGORIES},
        "finish": dict(Counter(ep["finish"] for ep in episodes)),
        "examples": {k: v for k, v in shown.items() if v},
    }


def evaluate(
    model_dir: str, config: str, samples: int, temperature: float, seed: int, overrides: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary and every conversation of a sampled run of the config's evaluation set."""
    import torch

    from rlfactory.config.loader import load_config
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.rewards.builtin import metric_score
    from rlfactory.rollout.agent import Rollouts, build_rollouts
    from rlfactory.rollout.base import SamplingParams
    from rlfactory.stages.rl import load_prompt_sets, render_prompts

    cfg = load_config(config, [f"model.name_or_path={model_dir}", *overrides])
    _, evals, _ = load_prompt_sets(cfg)  # checked, tools attached
    tokenizer = load_tokenizer(cfg.model)
    evals = render_prompts(cfg, tokenizer, evals)
    model = load_model(cfg.model, cfg.lora, cfg.freeze, trainable=False).eval()
    if cfg.rollout.backend != "hf":
        raise SystemExit("tool_call_eval samples with the hf backend: run it on a config with rollout.backend: hf")
    rollouts: Rollouts = build_rollouts(cfg, model, tokenizer)
    assert rollouts.agent is not None, "the config declares no tools"
    torch.manual_seed(seed)
    examples = [ex for ex in evals for _ in range(samples)]
    params = SamplingParams(cfg.evaluation.max_new_tokens, temperature)
    _, finals, seen = rollouts.generate(examples, params)
    scores = [
        metric_score(cfg.evaluation.metric, "", final, ex.get("answer"), ex)
        for ex, final in zip(seen, finals, strict=True)
    ]
    rows = [{"source": ex["source"], "score": sc, **ex["agent"]} for ex, sc in zip(seen, scores, strict=True)]
    return summarize([ex["agent"] for ex in seen], scores), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a model directory (the bundled model, or a run's output_dir)")
    parser.add_argument("--config", default=str(ROOT / "examples/quickstart/grpo.yaml"))
    parser.add_argument("--samples", type=int, default=4, help="sampled conversations per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--trace", help="also write every conversation (source, score, turns) to this .jsonl")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. evaluation.max_samples=50")
    args = parser.parse_args()
    start = time.time()
    out, rows = evaluate(args.model, args.config, args.samples, args.temperature, args.seed, args.overrides)
    out["model"], out["temperature"], out["seconds"] = args.model, args.temperature, round(time.time() - start, 1)
    print(
        f"{args.model}: T={args.temperature} n={out['conversations']} success {out['success']:.3f}  "
        f"calls/conv {out['calls_per_conv']:.2f}  invalid/call {out['invalid_per_call']:.3f}  "
        f"invalid/conv {out['invalid_per_conv']:.3f}  convs with invalid {out['convs_with_invalid']:.3f}"
    )
    print("  invalid by kind:", ", ".join(f"{k} {v}" for k, v in out["invalid"].items()))
    print("  finish:", out["finish"])
    for kind, texts in out["examples"].items():
        for text in texts:
            print(f"  [{kind}] ...{text!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.trace:
        Path(args.trace).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
