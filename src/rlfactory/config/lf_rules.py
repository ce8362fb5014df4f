"""The rule kinds of the LLaMA-Factory key table (``llamafactory.KEY_RULES``) and the rules with logic of their own.

A rule is ``rule(conversion, key, value, raw)``: it sets our keys on the ``Conversion`` and records the key as mapped,
ignored (with the reason) or refused (with the alternative). Its docstring is its line in docs/MIGRATING.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MIGRATING = "docs/MIGRATING.md"


@dataclass
class Conversion:
    """The translated mapping and what happened to every key of the source file."""

    stage: str
    out: dict[str, Any] = field(default_factory=dict)
    mapped: list[str] = field(default_factory=list)  # "lora_rank -> lora.r"
    ignored: list[str] = field(default_factory=list)  # "ddp_timeout (reason)"
    refused: list[str] = field(default_factory=list)  # "quantization_bit: reason; alternative"
    sources: dict[str, str] = field(default_factory=dict)  # our dotted key -> LLaMA-Factory key

    def set(self, dotted: str, value: Any, source: str) -> None:
        node = self.out
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
        self.sources[dotted] = source

    def notes(self, path: str) -> list[str]:
        import textwrap

        lines = [f"{path}: a LLaMA-Factory file, read through the key mapping of {MIGRATING}"]
        for title, items, sep in (("mapped:  ", self.mapped, ", "), ("ignored: ", self.ignored, "; ")):
            if items:
                lines += textwrap.wrap(sep.join(items), 116, initial_indent="  " + title, subsequent_indent=" " * 11)
        return lines


def split_list(value: Any) -> Any:
    """LLaMA-Factory's comma lists (``dataset: a,b``, ``lora_target: q_proj,v_proj``)."""
    return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value


# ----------------------------------------------------------------------------------------------------- rule kinds
Rule = Callable[[Conversion, str, Any, dict[str, Any]], None]


def to(dotted: str, transform: Callable[[Any], Any] = lambda v: v) -> Rule:
    """Mapped one-to-one (after ``transform``)."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        conv.set(dotted, transform(value), key)
        conv.mapped.append(f"{key} -> {dotted}")

    rule.__doc__ = f"-> `{dotted}`"
    rule.target = dotted  # type: ignore[attr-defined]
    return rule


def documented(rule: Rule, text: str) -> Rule:
    """The same rule with its own line in docs/MIGRATING.md (for mappings that transform the value)."""
    rule.__doc__ = text
    return rule


def ignored(reason: str) -> Rule:
    """Accepted and not used: it changes nothing about what is trained here."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        conv.ignored.append(f"{key} ({reason})")

    rule.__doc__ = f"ignored: {reason}"
    return rule


def refused(alternative: str) -> Rule:
    """Not supported: the run would train something else than the file asks for."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        conv.refused.append(f"{key}: {alternative}")

    rule.__doc__ = f"refused: {alternative}"
    return rule


def off_only(alternative: str, default: Any = False) -> Rule:
    """A feature we do not have: its LLaMA-Factory default (off) is ignored, anything else refused."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if value == default or value is None:
            conv.ignored.append(f"{key} ({json.dumps(value)} is LLaMA-Factory's default: no effect)")
        else:
            conv.refused.append(f"{key}: {alternative}")

    rule.__doc__ = f"only its default ({json.dumps(default)}); otherwise refused: {alternative}"
    return rule


def when_true(dotted: str, value_if_true: Any) -> Rule:
    """A switch that is off by default in both tools: true sets ``dotted``; false changes nothing (so that two switches
    of one key, such as ``packing`` and ``neat_packing``, never undo each other by their order in the file)."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if value:
            conv.set(dotted, value_if_true, key)
            conv.mapped.append(f"{key} -> {dotted}: {json.dumps(value_if_true)}")
        else:
            conv.ignored.append(f"{key} (false is the default)")

    rule.__doc__ = f"true -> `{dotted}: {json.dumps(value_if_true)}`; false: the default"
    return rule


def choice(dotted: str, values: dict[Any, Any], alternative: str) -> Rule:
    """Mapped value by value; other values refused."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if value not in values:
            conv.refused.append(f"{key}: {value!r} is not supported ({alternative})")
            return
        conv.set(dotted, values[value], key)
        conv.mapped.append(f"{key} -> {dotted}")

    shown = ", ".join(f"{k if isinstance(k, str) else json.dumps(k)} -> {v}" for k, v in values.items())
    rule.__doc__ = f"-> `{dotted}` ({shown}); other values refused"
    return rule


def per_stage(targets: dict[str, str], note: str) -> Rule:
    """A key whose target depends on the stage (``pref_beta`` is dpo.beta, kto.beta or orpo.beta)."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if conv.stage in targets:
            conv.set(targets[conv.stage], value, key)
            conv.mapped.append(f"{key} -> {targets[conv.stage]}")
        else:
            conv.ignored.append(f"{key} ({note}; not used by stage {conv.stage})")

    rule.__doc__ = ", ".join(f"{stage}: `{target}`" for stage, target in targets.items()) + f"; else ignored ({note})"
    return rule


# ------------------------------------------------------------------------------------------- keys with own logic
def stage_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    """sft rm dpo kto ppo as they are; dpo with pref_loss orpo is our orpo stage; pt where this version has it."""
    conv.mapped.append(f"stage -> stage ({conv.stage})")


def pref_loss_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if conv.stage == "orpo":
        conv.mapped.append("pref_loss orpo -> stage orpo")
    elif conv.stage != "dpo":
        conv.ignored.append(f"pref_loss (used by stage dpo only, not {conv.stage})")
    elif value == "kto_pair":
        conv.refused.append(
            "pref_loss: kto_pair (paired KTO) is not supported; use `stage: kto`, which also takes ranking data "
            "(each pair gives one desirable and one undesirable example)"
        )
    elif value in ("sigmoid", "hinge", "ipo", "simpo"):
        conv.set("dpo.loss_type", value, key)
        conv.mapped.append("pref_loss -> dpo.loss_type")
    else:
        conv.refused.append(f"pref_loss: {value!r} is not supported (sigmoid, hinge, ipo, simpo, orpo)")


pref_loss_rule.__doc__ = "dpo: sigmoid/hinge/ipo/simpo -> `dpo.loss_type`, orpo -> `stage: orpo`, kto_pair refused"


def max_steps_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value is None or (isinstance(value, int) and value < 0):  # transformers' -1: train by epochs
        conv.ignored.append(f"max_steps ({value}: train by num_train_epochs)")
        return
    conv.set("train.max_steps", value, key)
    conv.mapped.append("max_steps -> train.max_steps")


max_steps_rule.__doc__ = "-> `train.max_steps` (-1: by epochs)"


def precision_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value:
        conv.set("train.mixed_precision", "bf16" if key == "bf16" else "fp16", key)
        conv.mapped.append(f"{key} -> train.mixed_precision")
    else:
        conv.ignored.append(f"{key} (false)")


precision_rule.__doc__ = "true -> `train.mixed_precision` bf16 / fp16 (neither: no mixed precision, as in transformers)"


def strategy_rule(steps_key: str, our_key: str, when_no: str) -> Rule:
    """transformers' eval_strategy / save_strategy: steps (every ``steps_key``) or no; epoch is refused."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if value == "steps":
            conv.mapped.append(f"{key} steps -> every {our_key}")
        elif value == "no" and our_key == "train.save_steps":
            conv.set(our_key, None, key)
            conv.mapped.append(f"{key} no -> {our_key}: null")
        elif value == "no":
            conv.ignored.append(f"{key} (no: {when_no})")
        else:
            conv.refused.append(f"{key}: {value!r} is not supported; use `{key}: steps` with {steps_key}")

    rule.__doc__ = f"steps: every `{steps_key}`; no: {when_no}; epoch refused"
    return rule


def val_size_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if isinstance(value, float) and 0 <= value < 1:
        conv.set("data.eval_split", value, key)
        conv.mapped.append("val_size -> data.eval_split")
    else:
        conv.refused.append(f"val_size: {value!r}: give a fraction in [0, 1) (a row count is not supported)")


val_size_rule.__doc__ = "a fraction -> `data.eval_split` (a row count refused)"


def freeze_layers_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if isinstance(value, int) and value > 0:
        conv.set("freeze.trainable_layers", value, key)
        conv.mapped.append("freeze_trainable_layers -> freeze.trainable_layers")
    else:
        conv.refused.append(f"freeze_trainable_layers: {value!r}: only the last n layers (n > 0) can be trained")


freeze_layers_rule.__doc__ = "n > 0 -> `freeze.trainable_layers` (the first layers: refused)"


def ref_model_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if conv.stage == "dpo":
        conv.set("dpo.ref_model", value, key)
        conv.mapped.append("ref_model -> dpo.ref_model")
    else:
        conv.refused.append(
            f"ref_model: stage {conv.stage} uses the policy with its adapter disabled (or a frozen copy) as the "
            "reference; a separate reference model is supported for dpo only"
        )


ref_model_rule.__doc__ = "dpo: `dpo.ref_model`; other stages refused"


def reward_model_type_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value == "api":
        conv.refused.append("reward_model_type: api is not supported; use reward.functions (Python functions)")
    else:
        conv.ignored.append(f"{key} ({value}: reward_model is the folder our rm stage wrote, adapter or full)")


reward_model_type_rule.__doc__ = "lora/full: ignored (reward_model is the folder our rm stage wrote); api refused"


def generation_rule(dotted: str) -> Rule:
    """Sampling keys: the rollouts of ppo; LLaMA-Factory uses them elsewhere for predict only."""
    inner = to(dotted)

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if conv.stage == "ppo":
            inner(conv, key, value, raw)
        else:
            conv.ignored.append(f"{key} (sampling: used by stage ppo only)")

    rule.__doc__ = f"ppo: `{dotted}`; else ignored"
    return rule


def optim_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
        conv.ignored.append(f"optim ({value}: AdamW is the optimizer)")
    else:
        conv.refused.append(f"optim: {value!r} is not supported; only AdamW (adamw_torch)")


optim_rule.__doc__ = "adamw_torch(_fused): ignored (AdamW is the optimizer); others refused"


def ppo_buffer_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if conv.stage != "ppo":
        conv.ignored.append(f"{key} (used by stage ppo only)")  # ppo: used by _ppo_batches


ppo_buffer_rule.__doc__ = "ppo: `algorithm.num_mini_batches`, and a factor of `rollout.prompts_per_step` (below)"


def eval_steps_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    """transformers evaluates every eval_steps only under eval_strategy steps (its default is no)."""
    if raw.get("eval_strategy", raw.get("evaluation_strategy", "no")) == "steps":
        conv.set("train.eval_steps", value, key)
        conv.mapped.append("eval_steps -> train.eval_steps")
    else:
        conv.ignored.append(f"{key} (eval_strategy is not steps)")


eval_steps_rule.__doc__ = "with `eval_strategy: steps` -> `train.eval_steps`; else ignored, as in transformers"


# ------------------------------------------------------------------------------------ PEFT methods and QLoRA
def pissa_init_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    # LLaMA-Factory's pissa_iter fast-SVD steps (default 16; -1: the full SVD) become peft's own name
    if not value:
        conv.ignored.append(f"{key} (false is the default)")
        return
    steps = raw.get("pissa_iter", 16)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < -1:
        conv.refused.append(f"pissa_iter: {steps!r}: give the fast-SVD steps (N >= 0) or -1 for the full SVD")
        return
    init = "pissa" if steps == -1 else f"pissa_niter_{steps}"
    conv.set("lora.init_lora_weights", init, key)
    conv.mapped.append(f"{key} -> lora.init_lora_weights: {init}")


pissa_init_rule.__doc__ = (
    "true -> `lora.init_lora_weights: pissa_niter_N` (N = pissa_iter, default 16; pissa_iter -1: `pissa`)"
)


def pissa_iter_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if raw.get("pissa_init"):
        conv.mapped.append(f"{key} -> lora.init_lora_weights (with pissa_init)")  # set by pissa_init_rule
    else:
        conv.ignored.append(f"{key} (pissa_init is off)")


pissa_iter_rule.__doc__ = "with `pissa_init`: the N of `pissa_niter_N` (-1: `pissa`); else ignored"


def pissa_convert_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value:
        conv.ignored.append(
            f"{key} (rlfactory always saves the converted adapter: a plain LoRA of rank 2r on the original base, "
            "what LLaMA-Factory writes to pissa_converted/)"
        )
    elif raw.get("pissa_init"):
        conv.ignored.append(
            f"{key} (false: the saved adapter is converted all the same, a plain LoRA of rank 2r on the original "
            "base; the unconverted PiSSA adapter works only on the residual base, which neither tool saves)"
        )
    else:
        conv.ignored.append(f"{key} (false is the default)")


pissa_convert_rule.__doc__ = (
    "ignored: the saved PiSSA adapter is always converted to a plain LoRA of the original base (rank 2r)"
)


def _bits(raw: dict[str, Any]) -> Any:
    return raw.get("quantization_bit")


def quantization_bit_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    # LLaMA-Factory's 4-bit compute dtype follows bf16 / fp16 (fp16: float16; otherwise our bfloat16)
    if value is None:
        conv.ignored.append(f"{key} (null is the default: no quantization)")
        return
    if value not in (4, 8):
        conv.refused.append(f"{key}: {value!r}: bitsandbytes quantizes to 4 or 8 bits")
        return
    conv.set("model.quantization.bits", value, key)
    conv.sources["model.quantization"] = key  # validation errors name the section
    conv.mapped.append(f"{key} -> model.quantization.bits")
    if value == 4 and raw.get("fp16") and not (raw.get("bf16") or raw.get("pure_bf16")):
        conv.set("model.quantization.compute_dtype", "float16", "fp16")
        conv.mapped.append("fp16 -> model.quantization.compute_dtype: float16")


quantization_bit_rule.__doc__ = (
    "4 or 8 -> `model.quantization.bits` (QLoRA; with fp16: `compute_dtype: float16`); other bit widths refused"
)


def quantization_method_rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if _bits(raw) is None:
        conv.ignored.append(f"{key} (no quantization_bit: no effect)")
    elif value == "bnb":
        conv.mapped.append(f"{key} bnb -> model.quantization (bitsandbytes)")
    else:
        conv.refused.append(
            f"{key}: {value!r} is not supported; only bitsandbytes (bnb) quantizes on the fly here (a model already "
            "quantized with GPTQ/AWQ cannot be trained with LoRA here either)"
        )


quantization_method_rule.__doc__ = "bnb: the method of `model.quantization`; others refused (with quantization_bit)"


def four_bit_key(dotted: str) -> Rule:
    """A 4-bit setting of bitsandbytes: mapped with ``quantization_bit: 4``; LLaMA-Factory ignores it otherwise."""

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if _bits(raw) == 4:
            conv.set(dotted, value, key)
            conv.mapped.append(f"{key} -> {dotted}")
        else:
            conv.ignored.append(f"{key} (used with quantization_bit: 4 only)")

    rule.__doc__ = f"with `quantization_bit: 4` -> `{dotted}`; else ignored"
    return rule
