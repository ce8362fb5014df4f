"""LLaMA-Factory run YAMLs: recognise a flat LLaMA-Factory file and translate it into our schema.

A LLaMA-Factory file is flat (``model_name_or_path: ...``, ``lora_rank: 8``, ``per_device_train_batch_size: 1``);
ours has sections. ``KEY_RULES`` is the documented mapping (docs/MIGRATING.md is written from it): every key is
mapped, ignored with a reason (it changes nothing we train), or refused with the alternative. A key that is not in
the table is refused too, so nothing a user wrote is silently dropped. Where LLaMA-Factory's (or transformers')
default differs from ours, the file gets LLaMA-Factory's default, so the run trains what it trained there.

Pure dict -> dict: no file I/O and nothing above the config layer, so ``config check``, ``train``, ``convert`` and
the WebUI share it through ``loader.load_config``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfactory.config.schema import STAGES
from rlfactory.errors import UserError, did_you_mean

MIGRATING = "docs/MIGRATING.md"


def is_llamafactory(raw: dict[str, Any]) -> bool:
    """LLaMA-Factory files name the model in the flat key ``model_name_or_path`` (required there) and never have
    our ``model:`` section."""
    return "model_name_or_path" in raw and "model" not in raw


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


def _split(value: Any) -> Any:
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


def _documented(rule: Rule, text: str) -> Rule:
    """The same rule with its own line in docs/MIGRATING.md (for mappings that transform the value)."""
    rule.__doc__ = text
    return rule


def mapped_target(key: str) -> str | None:
    """Our key for a LLaMA-Factory key that maps one-to-one (for "did you mean" in our own files)."""
    return getattr(KEY_RULES.get(key), "target", None)


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
def _stage(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    """sft rm dpo kto ppo as they are; dpo with pref_loss orpo is our orpo stage; pt where this version has it."""
    conv.mapped.append(f"stage -> stage ({conv.stage})")


def _pref_loss(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
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


_pref_loss.__doc__ = "dpo: sigmoid/hinge/ipo/simpo -> `dpo.loss_type`, orpo -> `stage: orpo`, kto_pair refused"


def _max_steps(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value is None or (isinstance(value, int) and value < 0):  # transformers' -1: train by epochs
        conv.ignored.append(f"max_steps ({value}: train by num_train_epochs)")
        return
    conv.set("train.max_steps", value, key)
    conv.mapped.append("max_steps -> train.max_steps")


_max_steps.__doc__ = "-> `train.max_steps` (-1: by epochs)"


def _precision(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value:
        conv.set("train.mixed_precision", "bf16" if key == "bf16" else "fp16", key)
        conv.mapped.append(f"{key} -> train.mixed_precision")
    else:
        conv.ignored.append(f"{key} (false)")


_precision.__doc__ = "true -> `train.mixed_precision` bf16 / fp16 (neither: no mixed precision, as in transformers)"


def _eval_strategy(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value == "steps":
        conv.mapped.append(f"{key} steps -> evaluation every train.eval_steps")
    elif value == "no":
        conv.ignored.append(f"{key} (no: evaluation at the end only, when there is eval data)")
    else:
        conv.refused.append(f"{key}: {value!r} is not supported; use `eval_strategy: steps` with eval_steps")


_eval_strategy.__doc__ = "steps: evaluate every `eval_steps`; no: only at the end; epoch refused"


def _save_strategy(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value == "steps":
        conv.mapped.append("save_strategy steps -> checkpoints every train.save_steps")
    elif value == "no":
        conv.set("train.save_steps", None, key)
        conv.mapped.append("save_strategy no -> train.save_steps: null")
    else:
        conv.refused.append(f"save_strategy: {value!r} is not supported; use `save_strategy: steps` with save_steps")


_save_strategy.__doc__ = "steps: every `save_steps`; no: no checkpoints; epoch refused"


def _val_size(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if isinstance(value, float) and 0 <= value < 1:
        conv.set("data.eval_split", value, key)
        conv.mapped.append("val_size -> data.eval_split")
    else:
        conv.refused.append(f"val_size: {value!r}: give a fraction in [0, 1) (a row count is not supported)")


_val_size.__doc__ = "a fraction -> `data.eval_split` (a row count refused)"


def _freeze_layers(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if isinstance(value, int) and value > 0:
        conv.set("freeze.trainable_layers", value, key)
        conv.mapped.append("freeze_trainable_layers -> freeze.trainable_layers")
    else:
        conv.refused.append(f"freeze_trainable_layers: {value!r}: only the last n layers (n > 0) can be trained")


_freeze_layers.__doc__ = "n > 0 -> `freeze.trainable_layers` (the first layers: refused)"


def _ref_model(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if conv.stage == "dpo":
        conv.set("dpo.ref_model", value, key)
        conv.mapped.append("ref_model -> dpo.ref_model")
    else:
        conv.refused.append(
            f"ref_model: stage {conv.stage} uses the policy with its adapter disabled (or a frozen copy) as the "
            "reference; a separate reference model is supported for dpo only"
        )


_ref_model.__doc__ = "dpo: `dpo.ref_model`; other stages refused"


def _reward_model_type(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value == "api":
        conv.refused.append("reward_model_type: api is not supported; use reward.functions (Python functions)")
    else:
        conv.ignored.append(f"{key} ({value}: reward_model is the folder our rm stage wrote, adapter or full)")


_reward_model_type.__doc__ = "lora/full: ignored (reward_model is the folder our rm stage wrote); api refused"


def _generation(dotted: str) -> Rule:
    """Sampling keys: the rollouts of ppo; LLaMA-Factory uses them elsewhere for predict only."""
    inner = to(dotted)

    def rule(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
        if conv.stage == "ppo":
            inner(conv, key, value, raw)
        else:
            conv.ignored.append(f"{key} (sampling: used by stage ppo only)")

    rule.__doc__ = f"ppo: `{dotted}`; else ignored"
    return rule


def _optim(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if value in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
        conv.ignored.append(f"optim ({value}: AdamW is the optimizer)")
    else:
        conv.refused.append(f"optim: {value!r} is not supported; only AdamW (adamw_torch)")


_optim.__doc__ = "adamw_torch(_fused): ignored (AdamW is the optimizer); others refused"


def _ppo_buffer(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    if conv.stage != "ppo":
        conv.ignored.append(f"{key} (used by stage ppo only)")  # ppo: used by _ppo_batches


_ppo_buffer.__doc__ = "ppo: `algorithm.num_mini_batches`, and a factor of `rollout.prompts_per_step` (below)"


def _eval_steps(conv: Conversion, key: str, value: Any, raw: dict[str, Any]) -> None:
    """transformers evaluates every eval_steps only under eval_strategy steps (its default is no)."""
    if raw.get("eval_strategy", raw.get("evaluation_strategy", "no")) == "steps":
        conv.set("train.eval_steps", value, key)
        conv.mapped.append("eval_steps -> train.eval_steps")
    else:
        conv.ignored.append(f"{key} (eval_strategy is not steps)")


_eval_steps.__doc__ = "with `eval_strategy: steps` -> `train.eval_steps`; else ignored, as in transformers"


# ---------------------------------------------------------------------------------------------------- the table
_NO_CACHE = "rlfactory reads and renders the rows in-process, no preprocessing cache or workers"
_TEXT_ONLY = "rlfactory trains text-only models"

KEY_RULES: dict[str, Rule] = {
    # model
    "model_name_or_path": to("model.name_or_path"),
    "adapter_name_or_path": to("model.adapter_paths", _split),
    "trust_remote_code": to("model.trust_remote_code"),
    "flash_attn": choice(
        "model.attn_implementation",
        {"auto": "sdpa", "sdpa": "sdpa", "disabled": "eager", "fa2": "flash_attention_2"},
        "auto, sdpa, disabled, fa2",
    ),
    "enable_liger_kernel": choice("model.liger_kernel", {True: "on", False: "off"}, "true or false"),
    "disable_gradient_checkpointing": _documented(
        to("model.gradient_checkpointing", lambda v: not v),
        "-> `model.gradient_checkpointing` (negated; on unless set)",
    ),
    "gradient_checkpointing": to("model.gradient_checkpointing"),
    "pure_bf16": choice("model.dtype", {True: "bfloat16", False: "auto"}, "true or false"),
    "template": ignored(
        "rlfactory renders with the tokenizer's own chat template, which LLaMA-Factory's named templates reproduce; "
        "for a tokenizer without one set model.template"
    ),
    "tool_format": ignored("tool calls are rendered by the tokenizer's chat template"),
    "quantization_bit": refused("QLoRA is not supported yet; remove it (LoRA on the unquantized model)"),
    "quantization_method": refused("QLoRA is not supported yet; remove it"),
    "double_quantization": off_only("QLoRA is not supported yet; remove it", default=True),
    "rope_scaling": refused("not supported; remove it (the model's own rope settings are used)"),
    "use_unsloth": ignored("speed only; rlfactory uses its own kernels (model.liger_kernel)"),
    "use_unsloth_gc": ignored("speed only"),
    "upcast_layernorm": ignored("LoRA adapters are kept in float32; norms follow model.dtype"),
    "low_cpu_mem_usage": ignored("transformers' loading default"),
    "cache_dir": ignored("use the HF_HOME environment variable for the Hugging Face cache"),
    "hf_hub_token": ignored("log in with `hf auth login` instead"),
    "print_param_status": ignored("the trainable parameter count is logged at start"),
    "use_fast_tokenizer": ignored("the fast tokenizer is always used"),
    "resize_vocab": off_only("adding tokens is not supported"),
    "new_special_tokens": refused("adding tokens is not supported"),
    "infer_backend": ignored("inference only"),
    "freeze_vision_tower": ignored(_TEXT_ONLY),
    "freeze_multi_modal_projector": ignored(_TEXT_ONLY),
    # method
    "stage": _stage,
    "do_train": off_only("rlfactory train always trains; remove do_train: false", default=True),
    "do_eval": ignored("evaluation runs whenever there is eval data (eval_dataset or val_size)"),
    "do_predict": off_only("prediction is not a training stage; use the `evaluation:` section of our YAML"),
    "predict_with_generate": ignored("prediction is not part of training"),
    "finetuning_type": choice(
        "model.finetuning", {"lora": "lora", "full": "full", "freeze": "freeze"}, "lora, full, freeze; oft is not"
    ),
    "lora_rank": to("lora.r"),
    "lora_alpha": to("lora.alpha"),
    "lora_dropout": to("lora.dropout"),
    "lora_target": _documented(
        to("lora.target_modules", lambda v: "all-linear" if v == "all" else _split(v)),
        "-> `lora.target_modules` (`all` -> all-linear; a comma list -> a list)",
    ),
    "additional_target": to("lora.modules_to_save", _split),
    "freeze_trainable_layers": _freeze_layers,
    "freeze_trainable_modules": off_only(
        "only whole decoder layers are trained; use freeze_extra_modules for other modules", default="all"
    ),
    "freeze_extra_modules": to("freeze.extra_modules", _split),
    "use_dora": off_only("DoRA is not supported; remove it"),
    "use_rslora": off_only("rsLoRA is not supported; remove it"),
    "pissa_init": off_only("PiSSA is not supported; remove it"),
    "pissa_convert": off_only("PiSSA is not supported; remove it"),
    "loraplus_lr_ratio": refused("LoRA+ is not supported; remove it"),
    "create_new_adapter": ignored("adapters in adapter_name_or_path are merged and a new one is trained"),
    "use_galore": off_only("GaLore is not supported; use finetuning_type lora or freeze"),
    "use_apollo": off_only("APOLLO is not supported; use finetuning_type lora or freeze"),
    "use_badam": off_only("BAdam is not supported; use finetuning_type lora or freeze"),
    "use_llama_pro": off_only("LLaMA Pro is not supported"),
    "use_adam_mini": off_only("only AdamW is supported"),
    "use_muon": off_only("only AdamW is supported"),
    "use_dft_loss": off_only("the DFT loss is not supported"),
    "optim": _optim,
    "pref_loss": _pref_loss,
    "pref_beta": per_stage({"dpo": "dpo.beta", "kto": "kto.beta", "orpo": "orpo.beta"}, "the preference beta"),
    "pref_ftx": per_stage({"dpo": "dpo.sft_weight"}, "the SFT loss weight of dpo"),
    "pref_bco_weight": off_only("the BCO term is not supported", default=0.0),
    "dpo_label_smoothing": per_stage({"dpo": "dpo.label_smoothing"}, "cDPO label smoothing"),
    "simpo_gamma": per_stage({"dpo": "dpo.simpo_gamma"}, "the SimPO margin"),
    "kto_chosen_weight": per_stage({"kto": "kto.desirable_weight"}, "KTO's desirable weight"),
    "kto_rejected_weight": per_stage({"kto": "kto.undesirable_weight"}, "KTO's undesirable weight"),
    "ld_alpha": refused("LD-DPO is not supported; remove it"),
    "ref_model": _ref_model,
    "ref_model_adapters": refused("merge the adapter into the reference model first"),
    "ref_model_quantization_bit": refused("QLoRA is not supported yet"),
    "reward_model": per_stage({"ppo": "reward.reward_model"}, "the reward model of ppo"),
    "reward_model_type": _reward_model_type,
    "reward_model_adapters": refused("give the folder our rm stage wrote as reward_model"),
    "reward_model_quantization_bit": refused("QLoRA is not supported yet"),
    "ppo_epochs": per_stage({"ppo": "algorithm.ppo_epochs"}, "PPO epochs"),
    "ppo_buffer_size": _ppo_buffer,
    "ppo_target": per_stage({"ppo": "algorithm.kl_target"}, "the adaptive KL target"),
    "ppo_score_norm": off_only("reward score normalisation is not supported"),
    "ppo_whiten_rewards": off_only("reward whitening is not supported"),
    # generation (ppo rollouts)
    "max_new_tokens": _generation("rollout.max_response_len"),
    "temperature": _generation("rollout.temperature"),
    "top_p": _generation("rollout.top_p"),
    "top_k": _generation("rollout.top_k"),
    "do_sample": off_only("greedy rollouts are not supported (ppo samples)", default=True),
    "num_beams": off_only("beam search is not supported", default=1),
    "repetition_penalty": off_only("a repetition penalty is not supported", default=1.0),
    "length_penalty": off_only("a length penalty is not supported", default=1.0),
    "max_length": ignored("generation length is max_new_tokens"),
    # dataset
    "dataset": to("data.dataset", _split),
    "eval_dataset": to("data.eval_dataset", _split),
    "dataset_dir": to("data.dataset_dir"),
    "cutoff_len": to("data.cutoff_len"),
    "max_samples": to("data.max_samples"),
    "val_size": _val_size,
    "packing": to("data.packing"),
    "neat_packing": to("data.packing"),
    "train_on_prompt": choice("data.train_on", {True: "all", False: "assistant"}, "true or false"),
    "mask_history": choice("data.train_on", {True: "last_assistant", False: "assistant"}, "true or false"),
    "disable_shuffling": _documented(to("data.shuffle", lambda v: not v), "-> `data.shuffle` (negated)"),
    "streaming": off_only("streaming is not supported; the rows are read at start"),
    "buffer_size": ignored("streaming only"),
    "mix_strategy": off_only("datasets are concatenated; interleaving is not supported", default="concat"),
    "interleave_probs": refused("interleaving is not supported; datasets are concatenated"),
    "overwrite_cache": ignored(_NO_CACHE),
    "preprocessing_num_workers": ignored(_NO_CACHE),
    "preprocessing_batch_size": ignored(_NO_CACHE),
    "tokenized_path": ignored(_NO_CACHE),
    "ignore_pad_token_for_loss": ignored("padding never carries loss"),
    "media_dir": ignored(_TEXT_ONLY),
    "image_max_pixels": ignored(_TEXT_ONLY),
    "image_min_pixels": ignored(_TEXT_ONLY),
    "video_max_pixels": ignored(_TEXT_ONLY),
    "eval_on_each_dataset": off_only("evaluation datasets are evaluated together"),
    # output
    "output_dir": to("output_dir"),
    "overwrite_output_dir": to("overwrite_output_dir"),
    "run_name": to("name"),
    "logging_steps": to("logging.logging_steps"),
    "plot_loss": to("logging.plot_loss"),
    "report_to": to("logging.report_to"),
    "logging_dir": ignored("trackers write into output_dir"),
    "save_steps": to("train.save_steps"),
    "save_strategy": _save_strategy,
    "save_total_limit": to("train.save_total_limit"),
    "save_only_model": ignored("checkpoints always hold the trainable weights and the optimizer state"),
    "resume_from_checkpoint": to("resume_from_checkpoint"),
    # train
    "per_device_train_batch_size": to("train.per_device_batch_size"),
    "gradient_accumulation_steps": to("train.grad_accum_steps"),
    "learning_rate": to("train.learning_rate"),
    "num_train_epochs": to("train.num_epochs"),
    "max_steps": _max_steps,
    "lr_scheduler_type": choice(
        "train.lr_scheduler",
        {s: s for s in ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr")},
        "cosine, linear, constant, constant_with_warmup, cosine_with_min_lr",
    ),
    "warmup_ratio": to("train.warmup_ratio"),
    "warmup_steps": to("train.warmup_steps"),
    "weight_decay": to("train.weight_decay"),
    "adam_beta1": to("train.adam_beta1"),
    "adam_beta2": to("train.adam_beta2"),
    "max_grad_norm": _documented(to("train.max_grad_norm", lambda v: v or None), "-> `train.max_grad_norm` (0: null)"),
    "bf16": _precision,
    "fp16": _precision,
    "seed": to("seed"),
    "deepspeed": to("train.deepspeed"),
    "torch_compile": to("train.torch_compile"),
    "ddp_timeout": ignored("the process group's timeout is Accelerate's"),
    "ddp_find_unused_parameters": ignored("set by the engine"),
    "dataloader_num_workers": ignored("batches are built in the training process"),
    "dataloader_pin_memory": ignored("set by the engine"),
    "remove_unused_columns": ignored("no column reaches the model unless it is trained on"),
    "include_num_input_tokens_seen": ignored("token counts are logged anyway"),
    "include_effective_tokens_per_second": ignored("throughput is logged anyway"),
    "compute_accuracy": ignored("the preference stages log pair accuracy; sft logs loss"),
    # eval
    "eval_strategy": _eval_strategy,
    "evaluation_strategy": _eval_strategy,
    "eval_steps": _eval_steps,
    "per_device_eval_batch_size": ignored("evaluation uses train.per_device_batch_size"),
}


def _lf_defaults(stage: str) -> dict[str, Any]:
    """LLaMA-Factory's (and transformers' TrainingArguments') defaults where they differ from ours."""
    defaults: dict[str, Any] = {
        "train.learning_rate": 5e-5,
        "train.num_epochs": 3.0,
        "train.per_device_batch_size": 8,
        "train.lr_scheduler": "linear",
        "train.mixed_precision": "no",
        "train.save_steps": 500,
        "train.save_total_limit": None,
        "logging.logging_steps": 500,
        "logging.plot_loss": False,
        "data.cutoff_len": 2048,
        "model.gradient_checkpointing": True,
        "lora.target_modules": "all-linear",
    }
    if stage == "ppo":  # LLaMA-Factory's sampling defaults and TRL's classic PPOConfig (adaptive KL from 0.2)
        defaults |= {
            "rollout.temperature": 0.95,
            "rollout.top_p": 0.7,
            "rollout.top_k": 50,
            "rollout.max_response_len": 1024,
            "rollout.num_samples": 1,
            "algorithm.adv_estimator": "gae",
            "algorithm.ppo_epochs": 4,
            "algorithm.kl_in_reward_coef": 0.2,
            "algorithm.kl_controller": "adaptive",
            "algorithm.value_clip": 0.2,
        }
    return defaults


def _our_stage(raw: dict[str, Any]) -> str:
    stage = raw.get("stage", "sft")  # LLaMA-Factory's default stage
    if stage == "dpo" and raw.get("pref_loss") == "orpo":
        return "orpo"
    if stage in ("sft", "rm", "dpo", "kto", "ppo") or (stage == "pt" and "pt" in STAGES):
        return stage
    if stage == "pt":
        raise UserError(
            "stage: pt (continued pre-training on raw text) is not available in this version of rlfactory; "
            "train the text as sft data, or update rlfactory"
        )
    raise UserError(f"stage: {stage!r} is not a LLaMA-Factory stage (pt, sft, rm, dpo, kto, ppo)")


def _has(node: dict[str, Any], dotted: str) -> bool:
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and last in node


def _ppo_batches(conv: Conversion, raw: dict[str, Any]) -> None:
    """LLaMA-Factory's ppo: a rollout batch of batch x accumulation x ppo_buffer_size prompts (one sample each),
    updated in ppo_buffer_size optimizer steps of batch x accumulation. Ours: prompts_per_step, num_mini_batches,
    and no train.grad_accum_steps (the mini-batch is split into micro-batches instead)."""
    batch = raw.get("per_device_train_batch_size", 8)
    accum = raw.get("gradient_accumulation_steps", 1)
    buffer = raw.get("ppo_buffer_size", 1)
    conv.set("rollout.prompts_per_step", batch * accum * buffer, "per_device_train_batch_size")
    conv.set("algorithm.num_mini_batches", buffer, "ppo_buffer_size")
    conv.set("rollout.max_prompt_len", raw.get("cutoff_len", 2048), "cutoff_len")  # LLaMA-Factory keeps long prompts
    conv.out.setdefault("train", {}).pop("grad_accum_steps", None)
    conv.mapped.append(
        "per_device_train_batch_size x gradient_accumulation_steps x ppo_buffer_size -> rollout.prompts_per_step"
        f" ({batch * accum * buffer}), ppo_buffer_size -> algorithm.num_mini_batches, cutoff_len -> "
        "rollout.max_prompt_len"
    )


def convert(raw: dict[str, Any]) -> Conversion:
    """Translate a flat LLaMA-Factory mapping; a UserError lists every refused or unknown key at once."""
    conv = Conversion(stage=_our_stage(raw))
    conv.set("stage", conv.stage, "stage")
    for key, value in raw.items():
        rule = KEY_RULES.get(key)
        if rule is None:
            hint = did_you_mean(key, KEY_RULES)
            conv.refused.append(f"{key}: not a key rlfactory can read from a LLaMA-Factory file{hint}")
        else:
            rule(conv, key, value, raw)
    if conv.refused:
        raise UserError(
            "LLaMA-Factory keys that rlfactory cannot honour (see "
            + MIGRATING
            + "):\n  - "
            + "\n  - ".join(conv.refused)
        )
    if conv.stage == "ppo":
        _ppo_batches(conv, raw)
    if "lora_alpha" not in raw:  # LLaMA-Factory: alpha = 2 x rank
        conv.set("lora.alpha", 2 * raw.get("lora_rank", 8), "lora_rank")
    for dotted, value in _lf_defaults(conv.stage).items():
        if not _has(conv.out, dotted):
            conv.set(dotted, value, "(LLaMA-Factory default)")
    return conv


def rule_docs() -> list[tuple[str, str]]:
    """(LLaMA-Factory key, what happens to it) for every key of the table, for docs/MIGRATING.md."""
    return [(key, (rule.__doc__ or "").strip().splitlines()[0]) for key, rule in KEY_RULES.items()]


def explain_error(message: str, conv: Conversion) -> str:
    """Name the LLaMA-Factory key behind each of our keys that a validation error mentions."""
    behind = [f"{ours} <- {lf}" for ours, lf in conv.sources.items() if f"'{ours}'" in message or f"{ours}:" in message]
    return message + (f"\n(converted from LLaMA-Factory keys: {', '.join(behind)})" if behind else "")


def markdown_table() -> str:
    """The key table of docs/MIGRATING.md (a test keeps the two in sync)."""
    rows = ["| LLaMA-Factory key | rlfactory |", "|---|---|"]
    rows += [f"| `{key}` | {text.replace('|', '/')} |" for key, text in rule_docs()]
    return "\n".join(rows) + "\n"
