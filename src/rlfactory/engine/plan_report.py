"""``rlfactory plan``'s answer: the estimate, a rough step time, what to change when it does not fit, and the table.

``plan_config(path, overrides, gpus, gpu_memory_gb)`` -> list of ``Plan`` (one per stage of a pipeline), each with
its step time and suggestions filled; ``render`` prints one; ``plan_command`` is the CLI's handler.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from rlfactory.config.schema import PipelineConfig, RunConfig
from rlfactory.engine import plan_terms as t
from rlfactory.engine.plan import Gpu, Plan, detect_gpu, estimate_run, sequence_len

# dense bf16 FLOP/s and memory bandwidth (bytes/s) by a substring of the card's name (datasheet values, SXM where
# there are two)
CARDS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "H800": (989e12, 3.35e12),
    "GH200": (989e12, 4.0e12),
    "B200": (2250e12, 8.0e12),
    "A100": (312e12, 2.0e12),
    "A800": (312e12, 2.0e12),
    "L40S": (362e12, 0.86e12),
    "L40": (181e12, 0.86e12),
    "A10": (125e12, 0.6e12),
    "4090": (165e12, 1.0e12),
    "3090": (71e12, 0.94e12),
}
MFU = (0.20, 0.45)  # the range of model FLOP utilisation the step time assumes (measured 15-54%: BENCHMARKS)
DECODE_EFFICIENCY = (0.3, 0.7)  # share of the memory bandwidth a decode step reaches (vLLM); hf: the low end / 3
# vLLM's host time per decode step (scheduling, inputs, sampling, outputs), the floor of a step whatever the model's
# size: a 0.5B model's 1,024 decode steps took 2.1-2.8 ms each on H200 machines, where the weights' reads take 0.6
# (docs/BENCHMARKS.md, thirty-first session); a 7B model's 4.9-5.1 ms are its bandwidth's
DECODE_HOST_S = (2.0e-3, 2.9e-3)


def card(gpu: Gpu) -> tuple[float, float] | None:
    return next((v for k, v in CARDS.items() if gpu.name and k in gpu.name), None)


def train_flops_per_token(cfg: RunConfig, params: int, trainable: int) -> float:
    """6 x params per trained token for full fine-tuning (forward 2, backward 4); LoRA and freeze skip most weight
    gradients (4 + 2 x trainable share); checkpointing adds a forward; a reference or old-policy pass adds one."""
    full = cfg.model.finetuning == "full"
    flops = 6.0 * params if full else 4.0 * params + 2.0 * trainable
    if cfg.model.gradient_checkpointing:
        flops += 2.0 * params
    reference = cfg.stage in ("dpo", "kto") and not (cfg.dpo is not None and cfg.dpo.precompute_ref_logps)
    if cfg.algorithm is not None:
        reference = cfg.algorithm.kl_loss_coef > 0 or cfg.algorithm.kl_in_reward_coef > 0
        flops += 2.0 * params if cfg.algorithm.ppo_epochs > 1 else 0.0  # old log-probs
    return flops + (2.0 * params if reference else 0.0)


def step_time(cfg: RunConfig, plan: Plan) -> dict[str, Any]:
    """Rough seconds per optimizer step (offline) or per RL step (update + rollout), per GPU. An estimate from
    FLOPs and bandwidth only: data loading, padding, communication and compilation are not in it."""
    spec = card(plan.gpu)
    if spec is None:
        return {"note": f"no step time: unknown card ({plan.gpu.name or 'no GPU'})"}
    peak, bandwidth = spec
    n = max(plan.processes, 1)
    flops = train_flops_per_token(cfg, plan.shape.params, plan.trainable)
    if cfg.rollout is None:
        tokens = plan.tokens * cfg.train.grad_accum_steps
        seconds = [flops * tokens / (peak * m) for m in reversed(MFU)]
        return {"train_s": seconds, "tokens_per_gpu": tokens, "peak_tflops": peak / 1e12, "mfu": list(MFU)}
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.num_samples / n
    tokens = sequences * sequence_len(cfg) * cfg.algorithm.ppo_epochs if cfg.algorithm else 0
    train = [flops * tokens / (peak * m) for m in reversed(MFU)]
    generate = rollout_seconds(cfg, plan, bandwidth, sequences)
    return {
        "train_s": train,
        "rollout_s": generate,
        "host_floor": cfg.rollout.backend == "vllm",
        "step_s": [train[0] + generate[0], train[1] + generate[1]],
        "tokens_per_gpu": tokens,
        "peak_tflops": peak / 1e12,
        "mfu": list(MFU),
    }


def rollout_seconds(cfg: RunConfig, plan: Plan, bandwidth: float, sequences: float) -> list[float]:
    """Decode is memory-bound: each of max_response_len steps (the longest response's, which the batch waits for)
    reads the weights (bf16) and the batch's KV cache, at 30-70% of the card's bandwidth for vLLM, three times
    slower for hf's generate (per-token Python overhead); and a vLLM step takes at least the engine's host time
    (``DECODE_HOST_S``), which is what bounds a small model's decode."""
    assert cfg.rollout is not None
    shape, rollout = plan.shape, cfg.rollout
    batch = sequences if rollout.backend == "vllm" else min(sequences, rollout.generation_batch_size)
    rounds = max(1.0, sequences / batch)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    mean_len = rollout.max_prompt_len + rollout.max_response_len / 2
    per_step = shape.params * 2 + batch * mean_len * kv_per_token
    slow = 3.0 if rollout.backend == "hf" else 1.0
    host = DECODE_HOST_S if rollout.backend == "vllm" else (0.0, 0.0)
    return [
        rounds * rollout.max_response_len * max(per_step * slow / (bandwidth * e), floor)
        for e, floor in zip(reversed(DECODE_EFFICIENCY), host, strict=True)
    ]


# --------------------------------------------------------------------------- what would make it fit
Suggest = Callable[[RunConfig, Plan], list[tuple[list[str], str]]]


def _sleep(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    if cfg.rollout is not None and cfg.rollout.backend == "vllm" and not cfg.rollout.enable_sleep_mode:
        return [(["rollout.enable_sleep_mode=true"], "vLLM frees its share during the update")]
    return []


def _utilization(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    """The smallest share that holds the engine's bf16 weights, the rollout batch's KV cache and 1 GiB of graphs."""
    if cfg.rollout is None or cfg.rollout.backend != "vllm" or plan.gpu.memory is None:
        return []
    shape, rollout = plan.shape, cfg.rollout
    sequences = rollout.prompts_per_step * rollout.num_samples / max(plan.processes, 1)
    kv = t.kv_cache_bytes(shape, int(sequences), sequence_len(cfg), t.Precision(2, 2))
    need = shape.params * 2 + kv + t.GiB
    share = min(1.0, -(-need / plan.gpu.memory // 0.05) * 0.05)
    if share < rollout.gpu_memory_utilization:
        return [([f"rollout.gpu_memory_utilization={share:.2f}"], "enough for the weights and one step's KV cache")]
    return []


def _checkpointing(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    if not cfg.model.gradient_checkpointing:
        return [(["model.gradient_checkpointing=true"], "recompute each layer in backward (~30% slower)")]
    return []


def _micro_batch(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    """Halve the micro-batch down to 1; offline stages keep the global batch with more accumulation."""
    out, size, accum = [], cfg.train.per_device_batch_size, cfg.train.grad_accum_steps
    while size > 1:
        size, accum = size // 2, accum * 2
        keys = [f"train.per_device_batch_size={size}"]
        if cfg.rollout is None:
            keys.append(f"train.grad_accum_steps={accum}")
        out.append((keys, "same global batch" if cfg.rollout is None else "the rollout batch is unchanged"))
    return out


def _lora(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    if cfg.model.finetuning != "lora":
        return [(["model.finetuning=lora"], "train adapters only: no full gradients or moments")]
    return []


def _zero3(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    if cfg.sharded() or cfg.train.deepspeed or cfg.rollout is not None:
        return []
    gpus = max(plan.gpu.count, plan.processes)
    if gpus < 2:
        return []
    return [([f"distributed.num_processes={gpus}", "distributed.strategy=zero3"], f"shard over {gpus} GPUs")]


def _precompute(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    if (
        cfg.dpo is not None
        and not cfg.dpo.precompute_ref_logps
        and any(x.name == "reference model" and x.bytes for x in plan.terms)
    ):
        return [(["dpo.precompute_ref_logps=true"], "reference log-probs once before training, no copy held")]
    return []


def _compile(cfg: RunConfig, plan: Plan) -> list[tuple[list[str], str]]:
    if not cfg.train.torch_compile and plan.gpu.cuda:
        return [(["train.torch_compile=true"], "compiled layers save fewer activations (and run faster)")]
    return []


# least disruptive first: this order breaks ties between suggestions that fit
SUGGESTIONS: dict[str, Suggest] = {
    "sleep_mode": _sleep,
    "gpu_memory_utilization": _utilization,
    "precompute_ref_logps": _precompute,
    "torch_compile": _compile,
    "gradient_checkpointing": _checkpointing,
    "micro_batch": _micro_batch,
    "lora": _lora,
    "zero3": _zero3,
}


def with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig | None:
    """The config with ``key=value`` overrides applied and validated again (None if the schema refuses it)."""
    from rlfactory.config.loader import apply_overrides, validate_config
    from rlfactory.errors import UserError

    raw = apply_overrides(cfg.model_dump(exclude_none=True), overrides)
    try:
        changed = validate_config(raw, "plan")
    except UserError:
        return None
    return changed if isinstance(changed, RunConfig) else None


def suggest(cfg: RunConfig, plan: Plan) -> list[dict[str, Any]]:
    """Each rule's change re-estimated (a rule with several candidates, the micro-batch, gives its first that fits,
    else its largest saving): those that fit first, least disruptive first, then the rest by savings. When none
    fits alone, the rules' first changes are tried together in order, up to the first set that fits."""
    if plan.fits is not False:
        return []
    found = []
    for name, rule in SUGGESTIONS.items():
        tried = []
        for overrides, why in rule(cfg, plan):
            changed = with_overrides(cfg, overrides)
            if changed is not None:
                tried.append(_suggestion(name, overrides, why, plan, estimate_run(changed, plan.gpu).peak))
                if tried[-1]["fits"]:
                    break
        if tried:
            found.append(tried[-1] if tried[-1]["fits"] else max(tried, key=lambda s: s["saves_gb"]))
    found.sort(key=lambda s: (not s["fits"], -s["saves_gb"] if not s["fits"] else 0))
    if not any(s["fits"] for s in found):
        together = _together(cfg, plan)
        found = ([together] if together else []) + found
    return [s for s in found if s["saves_gb"] > 0.005]


def _together(cfg: RunConfig, plan: Plan) -> dict[str, Any] | None:
    """The rules' first changes applied one after another, stopping at the first set that fits (or None)."""
    combined: list[str] = []
    current = cfg
    for rule in SUGGESTIONS.values():
        for overrides, _why in rule(current, plan)[:1]:
            trial = with_overrides(current, overrides)
            if trial is None:
                continue
            combined, current = combined + overrides, trial
            peak = estimate_run(current, plan.gpu).peak
            if plan.gpu.memory is not None and peak <= plan.gpu.memory:
                return _suggestion("together", combined, "these changes together", plan, peak)
    return None


def _suggestion(name: str, overrides: list[str], why: str, plan: Plan, peak: float) -> dict[str, Any]:
    assert plan.gpu.memory is not None
    return {
        "name": name,
        "overrides": overrides,
        "why": why,
        "peak_gb": round(peak / t.GiB, 2),
        "saves_gb": round((plan.peak - peak) / t.GiB, 2),
        "fits": peak <= plan.gpu.memory,
    }


# --------------------------------------------------------------------------- entry points
def plan_runs(config: RunConfig | PipelineConfig, gpu: Gpu) -> list[Plan]:
    """One plan per run (a pipeline's ``from_stage`` runs take the model of the stage they start from)."""
    runs = config.stages if isinstance(config, PipelineConfig) else [config]
    models: dict[str, str] = {}
    plans = []
    for run in runs:
        if run.model.from_stage is not None:
            model = run.model.model_copy(update={"name_or_path": models[run.model.from_stage]})
            run = run.model_copy(update={"model": model})
        models[run.name or run.stage] = str(run.model.name_or_path)
        plan = estimate_run(run, gpu)
        plan.step_time = step_time(run, plan)
        plan.suggestions = suggest(run, plan)
        plans.append(plan)
    return plans


def plan_config(
    path: str,
    overrides: list[str],
    gpus: int | None = None,
    gpu_memory_gb: float | None = None,
    gpu_name: str | None = None,
) -> list[Plan]:
    """The CLI's entry: a YAML path and overrides -> the plans (UserError on bad input). The WebUI's estimate next to
    Start calls ``plan_runs`` on the form's validated config (webui/plan_panel.py)."""
    from rlfactory.config.loader import load_config

    config = load_config(path, overrides)
    return plan_runs(config, detect_gpu(gpus, gpu_memory_gb, gpu_name))


def _range(values: list[float], unit: str = "s") -> str:
    return f"{values[0]:.2g}-{values[1]:.2g} {unit}"


def render(plan: Plan) -> str:
    """The table, the verdict and the suggestions, as ``rlfactory plan`` prints them."""
    s = plan.shape
    lines = [
        f"model {plan.model}: {s.params / 1e6:,.1f}M parameters (embeddings {s.params_embed / 1e6:,.1f}M, "
        f"{s.layers} layers {s.params_layers / 1e6:,.1f}M, head {'tied' if s.tied else f'{s.params_head / 1e6:,.1f}M'}"
        f"), hidden {s.hidden}, {s.heads} heads ({s.kv_heads} kv), vocab {s.vocab}",
        f"run: stage {plan.stage}, {plan.trainable / 1e6:,.2f}M trainable, micro-batch {plan.tokens} tokens, "
        f"{plan.processes} process(es), {plan.strategy}, {plan.layer_path} layers",
        "",
        f"  {'per GPU':<38} {'GiB':>8}  phase",
    ]
    for term in plan.terms:
        note = f"  ({term.note})" if term.note else ""
        lines.append(f"  {term.name:<38} {term.gb:8.2f}  {term.phase}{note}")
    lines.append(f"  {'peak (' + plan.peak_phase + ')':<38} {plan.peak / t.GiB:8.2f}")
    lines.append("")
    lines.append(verdict(plan))
    lines += _time_lines(plan)
    for i, sug in enumerate(plan.suggestions, 1):
        mark = "fits" if sug["fits"] else "still too large"
        lines.append(
            f"  {i}. {' '.join(sug['overrides'])}: -{sug['saves_gb']:.1f} GiB -> {sug['peak_gb']:.1f} GiB, {mark} "
            f"({sug['why']})"
        )
    return "\n".join(lines + plan.notes)


def verdict(plan: Plan) -> str:
    if plan.gpu.memory is None:
        return f"GPU memory unknown (no CUDA device here): give --gpu-memory GB; peak {plan.peak / t.GiB:.1f} GiB"
    gpu = f"{plan.gpu.name or 'GPU'} with {plan.gpu.memory / t.GiB:.1f} GiB"
    if plan.processes > plan.gpu.count:
        return f"DOES NOT FIT: {plan.processes} processes need as many GPUs, {plan.gpu.count} visible ({gpu})"
    share = plan.peak / plan.gpu.memory
    if plan.fits:
        return f"FITS: {plan.peak / t.GiB:.1f} of {gpu} ({share:.0%})"
    return f"DOES NOT FIT: {plan.peak / t.GiB:.1f} GiB on {gpu} ({share:.0%}); changes that help, re-estimated:"


def _time_lines(plan: Plan) -> list[str]:
    time = plan.step_time
    if "train_s" not in time:
        return [time.get("note", "")] if time.get("note") else []
    head = f"step time, a rough estimate (FLOPs / ({time['peak_tflops']:.0f} TFLOP/s x {MFU[0]:.0%}-{MFU[1]:.0%} MFU)"
    if "rollout_s" not in time:
        return [f"{head}): {_range(time['train_s'])} per optimizer step"]
    low, high = (seconds * 1e3 for seconds in DECODE_HOST_S)
    floor = f", at least {low:.1f}-{high:.1f} ms a step" if time["host_floor"] else ""
    return [
        f"{head}; decode at {DECODE_EFFICIENCY[0]:.0%}-{DECODE_EFFICIENCY[1]:.0%} of the memory bandwidth{floor}): "
        f"update {_range(time['train_s'])}, rollout {_range(time['rollout_s'])}, {_range(time['step_s'])} per RL step"
    ]


def plan_command(args: argparse.Namespace) -> int:
    """``rlfactory plan run.yaml [overrides] [--gpus N] [--gpu-memory GB] [--json]``."""
    plans = plan_config(args.config, args.overrides, args.gpus, args.gpu_memory, args.gpu_name)
    if args.json:
        print(json.dumps([p.to_dict() for p in plans] if len(plans) > 1 else plans[0].to_dict(), indent=2))
        return 0
    for index, plan in enumerate(plans):
        if len(plans) > 1:
            print(f"{'' if index == 0 else chr(10)}== stage {index}: {plan.stage}")
        print(render(plan))
    return 0
