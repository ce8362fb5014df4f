"""LLaMA-Factory run YAMLs: recognise a flat LLaMA-Factory file and translate it into our schema.

A LLaMA-Factory file is flat (``model_name_or_path: ...``, ``lora_rank: 8``, ``per_device_train_batch_size: 1``);
ours has sections. ``KEY_RULES`` is the documented mapping (docs/MIGRATING.md is written from it): every key is
mapped, ignored with a reason (it changes nothing we train), or refused with the alternative. A key that is not in
the table is refused too, so nothing a user wrote is silently dropped. Where LLaMA-Factory's (or transformers')
default differs from ours, the file gets LLaMA-Factory's default, so the run trains what it trained there.

Pure dict -> dict: no file I/O and nothing above the config layer; ``config check``, ``train`` and ``convert``
share it through ``loader.resolve_raw``.
"""

from __future__ import annotations

import re
from typing import Any

from rlfactory.config import lf_rules as rules
from rlfactory.config.lf_rules import MIGRATING, Conversion, Rule
from rlfactory.config.schema import STAGES
from rlfactory.errors import UserError, did_you_mean


def is_llamafactory(raw: dict[str, Any]) -> bool:
    """LLaMA-Factory files name the model in the flat key ``model_name_or_path`` (required there) and never have
    our ``model:`` section."""
    return "model_name_or_path" in raw and "model" not in raw


def mapped_target(key: str) -> str | None:
    """Our key for a LLaMA-Factory key that maps one-to-one (for "did you mean" in our own files)."""
    return getattr(KEY_RULES.get(key), "target", None)


# ---------------------------------------------------------------------------------------------------- the table
_NO_CACHE = "rlfactory reads and renders the rows in-process, no preprocessing cache or workers"
_TEXT_ONLY = "rlfactory trains text-only models"
_EVAL_STRATEGY = rules.strategy_rule(
    "eval_steps", "train.eval_steps", "evaluation at the end only, when there is eval data"
)

KEY_RULES: dict[str, Rule] = {
    # model
    "model_name_or_path": rules.to("model.name_or_path"),
    "adapter_name_or_path": rules.to("model.adapter_paths", rules.split_list),
    "trust_remote_code": rules.to("model.trust_remote_code"),
    "flash_attn": rules.choice(
        "model.attn_implementation",
        {"auto": "auto", "sdpa": "sdpa", "disabled": "eager", "fa2": "flash_attention_2"},
        "auto, sdpa, disabled, fa2",
    ),
    "enable_liger_kernel": rules.choice("model.liger_kernel", {True: "on", False: "off"}, "true or false"),
    "disable_gradient_checkpointing": rules.documented(
        rules.to("model.gradient_checkpointing", lambda v: not v),
        "-> `model.gradient_checkpointing` (negated; on unless set)",
    ),
    "gradient_checkpointing": rules.to("model.gradient_checkpointing"),
    "pure_bf16": rules.choice("model.dtype", {True: "bfloat16", False: "auto"}, "true or false"),
    "template": rules.ignored(
        "rlfactory renders with the tokenizer's own chat template, which LLaMA-Factory's named templates reproduce; "
        "for a tokenizer without one set model.template"
    ),
    "tool_format": rules.ignored("tool calls are rendered by the tokenizer's chat template"),
    "quantization_bit": rules.quantization_bit_rule,
    "quantization_method": rules.quantization_method_rule,
    "quantization_type": rules.four_bit_key("model.quantization.quant_type"),
    "double_quantization": rules.four_bit_key("model.quantization.double_quant"),
    "quantization_device_map": rules.ignored("inference only (LLaMA-Factory's device map for 4-bit inference)"),
    "rope_scaling": rules.refused("not supported; remove it (the model's own rope settings are used)"),
    "use_unsloth": rules.ignored("speed only; rlfactory uses its own kernels (model.liger_kernel)"),
    "use_unsloth_gc": rules.ignored("speed only"),
    "upcast_layernorm": rules.ignored("LoRA adapters are kept in float32; norms follow model.dtype"),
    "low_cpu_mem_usage": rules.ignored("transformers' loading default"),
    "cache_dir": rules.ignored("use the HF_HOME environment variable for the Hugging Face cache"),
    "hf_hub_token": rules.ignored("log in with `hf auth login` instead"),
    "print_param_status": rules.ignored("the trainable parameter count is logged at start"),
    "use_fast_tokenizer": rules.ignored("the fast tokenizer is always used"),
    "resize_vocab": rules.off_only("adding tokens is not supported"),
    "new_special_tokens": rules.refused("adding tokens is not supported"),
    "infer_backend": rules.ignored("inference only"),
    "freeze_vision_tower": rules.ignored(_TEXT_ONLY),
    "freeze_multi_modal_projector": rules.ignored(_TEXT_ONLY),
    # method
    "stage": rules.stage_rule,
    "do_train": rules.off_only("rlfactory train always trains; remove do_train: false", default=True),
    "do_eval": rules.ignored("evaluation runs whenever there is eval data (eval_dataset or val_size)"),
    "do_predict": rules.off_only("prediction is not a training stage; use the `evaluation:` section of our YAML"),
    "predict_with_generate": rules.ignored("prediction is not part of training"),
    "finetuning_type": rules.choice(
        "model.finetuning", {"lora": "lora", "full": "full", "freeze": "freeze"}, "lora, full, freeze; oft is not"
    ),
    "lora_rank": rules.to("lora.r"),
    "lora_alpha": rules.to("lora.alpha"),
    "lora_dropout": rules.to("lora.dropout"),
    "lora_target": rules.documented(
        rules.to("lora.target_modules", lambda v: "all-linear" if v == "all" else rules.split_list(v)),
        "-> `lora.target_modules` (`all` -> all-linear; a comma list -> a list)",
    ),
    "additional_target": rules.to("lora.modules_to_save", rules.split_list),
    "freeze_trainable_layers": rules.freeze_layers_rule,
    "freeze_trainable_modules": rules.off_only(
        "only whole decoder layers are trained; use freeze_extra_modules for other modules", default="all"
    ),
    "freeze_extra_modules": rules.to("freeze.extra_modules", rules.split_list),
    "use_dora": rules.to("lora.use_dora"),
    "use_rslora": rules.to("lora.use_rslora"),
    "pissa_init": rules.pissa_init_rule,
    "pissa_iter": rules.pissa_iter_rule,
    "pissa_convert": rules.pissa_convert_rule,
    "loraplus_lr_ratio": rules.refused("LoRA+ is not supported; remove it"),
    "create_new_adapter": rules.ignored("adapters in adapter_name_or_path are merged and a new one is trained"),
    "use_galore": rules.off_only("GaLore is not supported; use finetuning_type lora or freeze"),
    "use_apollo": rules.off_only("APOLLO is not supported; use finetuning_type lora or freeze"),
    "use_badam": rules.off_only("BAdam is not supported; use finetuning_type lora or freeze"),
    "use_llama_pro": rules.off_only("LLaMA Pro is not supported"),
    "use_adam_mini": rules.off_only("only AdamW is supported"),
    "use_muon": rules.off_only("only AdamW is supported"),
    "use_dft_loss": rules.off_only("the DFT loss is not supported"),
    "optim": rules.optim_rule,
    "pref_loss": rules.pref_loss_rule,
    "pref_beta": rules.per_stage({"dpo": "dpo.beta", "kto": "kto.beta", "orpo": "orpo.beta"}, "the preference beta"),
    "pref_ftx": rules.per_stage({"dpo": "dpo.sft_weight"}, "the SFT loss weight of dpo"),
    "pref_bco_weight": rules.off_only("the BCO term is not supported", default=0.0),
    "dpo_label_smoothing": rules.per_stage({"dpo": "dpo.label_smoothing"}, "cDPO label smoothing"),
    "simpo_gamma": rules.per_stage({"dpo": "dpo.simpo_gamma"}, "the SimPO margin"),
    "kto_chosen_weight": rules.per_stage({"kto": "kto.desirable_weight"}, "KTO's desirable weight"),
    "kto_rejected_weight": rules.per_stage({"kto": "kto.undesirable_weight"}, "KTO's undesirable weight"),
    "ld_alpha": rules.refused("LD-DPO is not supported; remove it"),
    "ref_model": rules.ref_model_rule,
    "ref_model_adapters": rules.refused("merge the adapter into the reference model first"),
    "ref_model_quantization_bit": rules.refused("a quantized reference model is not supported; remove it"),
    "reward_model": rules.per_stage({"ppo": "reward.reward_model"}, "the reward model of ppo"),
    "reward_model_type": rules.reward_model_type_rule,
    "reward_model_adapters": rules.refused("give the folder our rm stage wrote as reward_model"),
    "reward_model_quantization_bit": rules.refused("a quantized reward model is not supported; remove it"),
    "ppo_epochs": rules.per_stage({"ppo": "algorithm.ppo_epochs"}, "PPO epochs"),
    "ppo_buffer_size": rules.ppo_buffer_rule,
    "ppo_target": rules.per_stage({"ppo": "algorithm.kl_target"}, "the adaptive KL target"),
    "ppo_score_norm": rules.off_only("reward score normalisation is not supported"),
    "ppo_whiten_rewards": rules.off_only("reward whitening is not supported"),
    # generation (ppo rollouts)
    "max_new_tokens": rules.generation_rule("rollout.max_response_len"),
    "temperature": rules.generation_rule("rollout.temperature"),
    "top_p": rules.generation_rule("rollout.top_p"),
    "top_k": rules.generation_rule("rollout.top_k"),
    "do_sample": rules.off_only("greedy rollouts are not supported (ppo samples)", default=True),
    "num_beams": rules.off_only("beam search is not supported", default=1),
    "repetition_penalty": rules.off_only("a repetition penalty is not supported", default=1.0),
    "length_penalty": rules.off_only("a length penalty is not supported", default=1.0),
    "max_length": rules.ignored("generation length is max_new_tokens"),
    # dataset
    "dataset": rules.to("data.dataset", rules.split_list),
    "eval_dataset": rules.to("data.eval_dataset", rules.split_list),
    "dataset_dir": rules.to("data.dataset_dir"),
    "cutoff_len": rules.to("data.cutoff_len"),
    "max_samples": rules.to("data.max_samples"),
    "val_size": rules.val_size_rule,
    "packing": rules.when_true("data.packing", True),
    "neat_packing": rules.when_true("data.packing", True),
    "train_on_prompt": rules.when_true("data.train_on", "all"),
    "mask_history": rules.when_true("data.train_on", "last_assistant"),
    "disable_shuffling": rules.documented(rules.to("data.shuffle", lambda v: not v), "-> `data.shuffle` (negated)"),
    "streaming": rules.off_only("streaming is not supported; the rows are read at start"),
    "buffer_size": rules.ignored("streaming only"),
    "mix_strategy": rules.off_only("datasets are concatenated; interleaving is not supported", default="concat"),
    "interleave_probs": rules.refused("interleaving is not supported; datasets are concatenated"),
    "overwrite_cache": rules.ignored(_NO_CACHE),
    "preprocessing_num_workers": rules.ignored(_NO_CACHE),
    "preprocessing_batch_size": rules.ignored(_NO_CACHE),
    "tokenized_path": rules.ignored(_NO_CACHE),
    "ignore_pad_token_for_loss": rules.ignored("padding never carries loss"),
    "media_dir": rules.ignored(_TEXT_ONLY),
    "image_max_pixels": rules.ignored(_TEXT_ONLY),
    "image_min_pixels": rules.ignored(_TEXT_ONLY),
    "video_max_pixels": rules.ignored(_TEXT_ONLY),
    "eval_on_each_dataset": rules.off_only("evaluation datasets are evaluated together"),
    # output
    "output_dir": rules.to("output_dir"),
    "overwrite_output_dir": rules.to("overwrite_output_dir"),
    "run_name": rules.to("name"),
    "logging_steps": rules.to("logging.logging_steps"),
    "plot_loss": rules.to("logging.plot_loss"),
    "report_to": rules.to("logging.report_to"),
    "logging_dir": rules.ignored("trackers write into output_dir"),
    "save_steps": rules.to("train.save_steps"),
    "save_strategy": rules.strategy_rule("save_steps", "train.save_steps", "no checkpoints"),
    "save_total_limit": rules.to("train.save_total_limit"),
    "save_only_model": rules.ignored("checkpoints always hold the trainable weights and the optimizer state"),
    "resume_from_checkpoint": rules.to("resume_from_checkpoint"),
    # train
    "per_device_train_batch_size": rules.to("train.per_device_batch_size"),
    "gradient_accumulation_steps": rules.to("train.grad_accum_steps"),
    "learning_rate": rules.to("train.learning_rate"),
    "num_train_epochs": rules.to("train.num_epochs"),
    "max_steps": rules.max_steps_rule,
    "lr_scheduler_type": rules.choice(
        "train.lr_scheduler",
        {s: s for s in ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr")},
        "cosine, linear, constant, constant_with_warmup, cosine_with_min_lr",
    ),
    "warmup_ratio": rules.to("train.warmup_ratio"),
    "warmup_steps": rules.to("train.warmup_steps"),
    "weight_decay": rules.to("train.weight_decay"),
    "adam_beta1": rules.to("train.adam_beta1"),
    "adam_beta2": rules.to("train.adam_beta2"),
    "adam_epsilon": rules.to("train.adam_epsilon"),
    "max_grad_norm": rules.documented(
        rules.to("train.max_grad_norm", lambda v: v or None), "-> `train.max_grad_norm` (0: null)"
    ),
    "bf16": rules.precision_rule,
    "fp16": rules.precision_rule,
    "seed": rules.to("seed"),
    "deepspeed": rules.to("train.deepspeed"),
    "torch_compile": rules.to("train.torch_compile"),
    "ddp_timeout": rules.ignored("the process group's timeout is Accelerate's"),
    "ddp_find_unused_parameters": rules.ignored("set by the engine"),
    "dataloader_num_workers": rules.ignored("batches are built in the training process"),
    "dataloader_pin_memory": rules.ignored("set by the engine"),
    "remove_unused_columns": rules.ignored("no column reaches the model unless it is trained on"),
    "include_num_input_tokens_seen": rules.ignored("token counts are logged anyway"),
    "include_effective_tokens_per_second": rules.ignored("throughput is logged anyway"),
    "compute_accuracy": rules.ignored("the preference stages log pair accuracy; sft logs loss"),
    # eval
    "eval_strategy": _EVAL_STRATEGY,
    "evaluation_strategy": _EVAL_STRATEGY,
    "eval_steps": rules.eval_steps_rule,
    "per_device_eval_batch_size": rules.ignored("evaluation uses train.per_device_batch_size"),
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
    named = lambda ours: re.search(rf"(?<![\w.]){re.escape(ours)}(?!\w)", message) is not None  # a whole dotted key
    behind = [f"{ours} <- {lf}" for ours, lf in conv.sources.items() if named(ours)]
    return message + (f"\n(converted from LLaMA-Factory keys: {', '.join(behind)})" if behind else "")


def markdown_table() -> str:
    """The key table of docs/MIGRATING.md (a test keeps the two in sync)."""
    rows = ["| LLaMA-Factory key | rlfactory |", "|---|---|"]
    rows += [f"| `{key}` | {text.replace('|', '/')} |" for key, text in rule_docs()]
    return "\n".join(rows) + "\n"
