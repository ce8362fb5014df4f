"""The model's sections of the schema: which weights to load and how, and what of them trains (LoRA, freeze,
QLoRA's quantized base). ``schema.py`` gathers them into a run."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfactory.config.base import Section, _as_list, _comma_list

QUANT_STAGES = ("pt", "sft", "dpo", "kto", "orpo", "grpo")  # the stages QLoRA is wired and tested for


class QuantizationConfig(Section):
    """QLoRA: the frozen base loaded in 4 or 8 bits (bitsandbytes, a CUDA GPU), LoRA adapters trained on top."""

    bits: Literal[4, 8] = Field(4, description="4 (QLoRA's NF4/FP4) or 8 (LLM.int8) bits per base weight.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4 bits: the data type (nf4 as in QLoRA, or fp4).")
    double_quant: bool = Field(True, description="4 bits: also quantize the quantization constants (~0.4 bit/weight).")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="4 bits: the dtype the dequantized weights are multiplied in (and the dtype of the rest).",
    )

    @model_validator(mode="after")
    def _four_bit_keys(self) -> QuantizationConfig:
        """8 bits has no data type, double quantization or compute dtype: setting them would change nothing."""
        given = sorted(self.model_fields_set & {"quant_type", "double_quant", "compute_dtype"})
        if self.bits == 8 and given:
            raise ValueError(f"{', '.join(given)}: for bits: 4 only; remove for 8-bit loading")
        return self


class ModelConfig(Section):
    """Which model to start from and how it is loaded and trained."""

    name_or_path: str | None = Field(
        None,
        description="Base model: a local directory or a Hugging Face hub id (must be in the local cache "
        "when offline). Required unless `from_stage` is set.",
    )
    from_stage: str | None = Field(
        None,
        description="Pipelines only: start from the output of the earlier stage with this name "
        "(its merged adapter or full weights).",
    )
    adapter_paths: list[str] = Field(
        default_factory=list,
        description="LoRA adapters to load and merge into the base model before training.",
    )
    template: str | None = Field(
        None,
        description="Chat template to use instead of the tokenizer's own (needed when the tokenizer has none): "
        "a bundled name (chatml, llama3, gemma_tools), a Jinja file (`.jinja`, path relative to the working "
        "directory), or the name of a template TRL ships in trl/chat_templates (e.g. qwen3, llama3_1, gemma3, "
        "gptoss, qwen3_training). Every render is read back: a template that drops a message, tool call or "
        "tool schema is refused; one that rewrites earlier turns trains each turn in its own context.",
    )
    finetuning: Literal["lora", "full", "freeze"] = Field(
        "lora", description="What is trained: LoRA adapters, all weights, or only the last layers (freeze)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight dtype. auto: bfloat16 for LoRA on a GPU that supports it, else float32 "
        "(full/freeze keep fp32 master weights and train under bf16 autocast on GPU).",
    )
    attn_implementation: Literal["auto", "sdpa", "sdpa_varlen", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto",
        description="Attention kernel passed to transformers. auto: sdpa_varlen on a CUDA GPU whose torch has the "
        "varlen kernel (a model with transformers' own code and no sliding-window layers, softcapping or attention "
        "dropout), else sdpa. sdpa_varlen: sdpa, except packed micro-batches (sft's data.packing, ppo/grpo's "
        "rollout.packing), which run as one row through torch's flash-attention varlen kernel "
        "(torch >= 2.10, CUDA, bf16/fp16; each document's causal attention only, where sdpa computes a packed row's "
        "whole attention under a mask); like flash_attention_2 without the flash-attn package. Elsewhere it is sdpa.",
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory (recompute activations).")
    liger_kernel: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Liger's fused kernels (RMSNorm, SwiGLU, RoPE; fused linear cross-entropy). auto: its layer "
        "kernels for full/freeze fine-tuning on CUDA when liger-kernel is installed and train.torch_compile is off, "
        "and its fused cross-entropy as the kernel of the preference stages' chunked log-probs on CUDA (off: a "
        "torch loop there).",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code shipped with the checkpoint.")
    quantization: QuantizationConfig | None = Field(
        None,
        description="QLoRA: load the base quantized (keys bits, quant_type, double_quant, compute_dtype; see "
        "`model.quantization` below). Needs finetuning: lora, a CUDA GPU and bitsandbytes (`pip install "
        "'rlfactory[qlora]'`); with rollout.backend vllm the adapter alone is synced (lora_sync: adapter).",
    )

    _as_list_adapters = field_validator("adapter_paths", mode="before")(_as_list)

    @model_validator(mode="after")
    def _quantized(self) -> ModelConfig:
        if self.quantization is None:
            return self
        if self.finetuning != "lora":
            raise ValueError(
                f"model.quantization: a quantized base cannot be trained with finetuning: {self.finetuning} (its "
                "weights are frozen 4/8-bit tensors); use finetuning: lora, or remove model.quantization"
            )
        if self.adapter_paths:
            raise ValueError(
                "model.quantization with model.adapter_paths: merging an adapter into a quantized base rounds it "
                "again; merge first (`rlfactory export ADAPTER --to DIR`) and set model.name_or_path: DIR"
            )
        return self


LORA_INITS = ("gaussian", "orthogonal", "pissa", "olora")
LORA_INITS_REFUSED = {
    "eva": "EVA initialises from activations of training data (peft's initialize_lora_eva_weights); use pissa",
    "corda": "CorDA needs a covariance pass over data first; use pissa",
    "loftq": "LoftQ needs its own quantization config; use model.quantization with true or pissa",
    "lora_ga": "LoRA-GA needs gradient estimates from data first; use pissa",
    "mica": "MiCA freezes B, which the checkpoints do not expect; use pissa",
}


class LoraConfig(Section):
    """LoRA adapters (peft), used when model.finetuning is lora: LoRA, DoRA, rsLoRA, PiSSA/OLoRA initialisation."""

    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: `all-linear` (or `all`) or a list such as [q_proj, v_proj] "
        "(a comma-separated string works too).",
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Extra modules trained in full and saved with the adapter."
    )
    use_dora: bool = Field(
        False,
        description="DoRA: a trained magnitude per output and the LoRA update on the direction (peft use_dora); "
        "slower steps. vLLM cannot serve DoRA adapters: with rollout.backend vllm set rollout.lora_sync: merged.",
    )
    use_rslora: bool = Field(False, description="rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r.")
    init_lora_weights: bool | str = Field(
        True,
        description="How adapters start (peft init_lora_weights): true (B = 0, the model starts unchanged), false "
        "(random A and B, for tests), gaussian, orthogonal (r even), pissa / pissa_niter_N (the top singular "
        "directions of each weight, N fast-SVD iterations; the residual becomes the frozen base), olora (QR of each "
        "weight, likewise). pissa and olora change the base weights: the saved adapter is converted to a plain LoRA "
        "of rank 2r on the original base, a reference policy is a frozen copy, and vllm syncs merged weights.",
    )

    _names_modules = field_validator("modules_to_save", mode="before")(_comma_list)

    @field_validator("init_lora_weights", mode="before")
    @classmethod
    def _init(cls, value: Any) -> Any:
        """The initialisations that need nothing but the weights; peft's data-driven ones are refused by name."""
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "false"):
            return text == "true"
        if text in LORA_INITS or re.fullmatch(r"pissa_niter_\d+", text):
            return text
        if text in LORA_INITS_REFUSED:
            raise ValueError(f"'{value}' is not supported: {LORA_INITS_REFUSED[text]}")
        raise ValueError(
            f"'{value}' is not an initialisation; use true, false, {', '.join(LORA_INITS)} or pissa_niter_N (N >= 0)"
        )

    @model_validator(mode="after")
    def _combinations(self) -> LoraConfig:
        if self.init_lora_weights == "orthogonal" and self.r % 2:
            raise ValueError(f"init_lora_weights: orthogonal needs an even r (r is {self.r})")
        if self.use_dora and self.changes_base():
            raise ValueError(
                f"use_dora with init_lora_weights: {self.init_lora_weights}: the trained adapter could not be "
                "converted back to the original base (DoRA's magnitudes are not a low-rank difference; measured "
                "wrong); use one of the two"
            )
        return self

    def changes_base(self) -> bool:
        """pissa / olora move part of each weight into the adapter: the frozen base is a residual, not the model."""
        return isinstance(self.init_lora_weights, str) and self.init_lora_weights.startswith(("pissa", "olora"))

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear(cls, value: Any) -> Any:
        """`all` (LLaMA-Factory's name) is PEFT's `all-linear`; `q_proj,v_proj` is a list. One name without a comma
        stays a string (PEFT reads a string as a regular expression)."""
        names = _comma_list(value) if isinstance(value, str) and "," in value else value
        if names in ("all", ["all"], ["all-linear"]):
            return "all-linear"
        if isinstance(names, list) and ("all" in names or "all-linear" in names):
            raise ValueError("`all` / `all-linear` stands alone; give either it or a list of module names")
        return names


class FreezeConfig(Section):
    """Freeze fine-tuning: only the last layers are trained."""

    trainable_layers: int = Field(
        2, ge=1, description="Freeze fine-tuning: how many of the last decoder layers are trained."
    )
    extra_modules: list[str] = Field(
        default_factory=list, description="Name substrings of other modules to train too (e.g. [lm_head])."
    )
