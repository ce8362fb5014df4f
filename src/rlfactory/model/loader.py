"""Load tokenizer and causal LM (local dir or hub cache), set up LoRA / freeze / full fine-tuning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfactory.config.schema import FreezeConfig, LoraConfig, ModelConfig, TrainConfig
from rlfactory.errors import UserError

if TYPE_CHECKING:
    from rlfactory.algos.common import HeadKernels

log = logging.getLogger(__name__)


def _check_exists(path: str) -> None:
    """A path must be a model directory; a hub id must be cached when offline (HF_HUB_OFFLINE=1)."""
    import os

    if Path(path).expanduser().is_dir():
        return
    is_hub_id = not path.startswith((".", "/", "~")) and path.count("/") <= 1
    if is_hub_id and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        return  # may be downloaded
    if is_hub_id:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(path, "config.json"), str):
            return
    raise UserError(
        f"model path '{path}' does not exist (not a local directory"
        + (" and not in the local Hugging Face cache" if is_hub_id else "")
        + "); set model.name_or_path to a model directory or a cached hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct)"
    )


def load_tokenizer(cfg: ModelConfig, padding_side: str = "right") -> Any:
    """AutoTokenizer with a chat template (its own or the named ``model.template``) and a pad token."""
    from transformers import AutoTokenizer

    path = str(cfg.name_or_path)
    _check_exists(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise UserError(
            f"cannot load a tokenizer from '{path}': {str(exc).splitlines()[0]} "
            "(offline: the model must be a local directory or already in the Hugging Face cache)"
        ) from None
    if cfg.template is not None:
        from rlfactory.render.templates import get_template

        named = get_template(cfg.template)
        tokenizer.chat_template = named.jinja
        tokenizer.end_of_turn = named.end_of_turn
        tokenizer.template_name = f"model.template '{cfg.template}'"
        if named.end_of_turn and tokenizer.convert_tokens_to_ids(named.end_of_turn) in (None, tokenizer.unk_token_id):
            raise UserError(
                f"model.template '{cfg.template}' ends turns with '{named.end_of_turn}', which is not a token of "
                f"'{path}'; pick a template that matches the tokenizer's special tokens"
            )
    elif not getattr(tokenizer, "chat_template", None):
        from rlfactory.render.templates import TEMPLATES

        raise UserError(
            f"the tokenizer of '{path}' has no chat template; set model.template to one of: {', '.join(TEMPLATES)}"
        )
    else:
        tokenizer.template_name = f"the chat template of '{path}'"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def resolve_dtype(name: str, finetuning: str = "lora") -> Any:
    """``auto``: bf16 weights for LoRA on a bf16 GPU (the frozen base needs no fp32 copy); fp32 master
    weights otherwise, trained under bf16 autocast on GPU (pure-bf16 AdamW updates lose small steps)."""
    import torch

    if name == "auto":
        use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported() and finetuning == "lora"
        return torch.bfloat16 if use_bf16 else torch.float32
    return getattr(torch, name)


def load_model(
    cfg: ModelConfig, lora: LoraConfig, freeze: FreezeConfig, trainable: bool = True, torch_compile: bool = False
) -> Any:
    """The causal LM with adapters merged and the fine-tuning method applied.

    ``torch_compile`` (``train.torch_compile``): the layers will be compiled, so ``liger_kernel: auto`` leaves
    Liger's layer kernels out; compiled, they were slower than the compiler's own fusions (docs/BENCHMARKS.md).
    """
    from transformers import AutoModelForCausalLM

    path = str(cfg.name_or_path)
    _check_exists(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=resolve_dtype(cfg.dtype, cfg.finetuning if trainable else "lora"),
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load model '{path}': {str(exc).splitlines()[0]}") from None
    for adapter in cfg.adapter_paths:
        model = merge_adapter(model, adapter)
    if trainable:
        maybe_apply_liger(model, liger_setting(cfg), cfg.finetuning, compiled=torch_compile)
    if not trainable:
        model.requires_grad_(False)
        return model
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.finetuning == "lora":
        model = apply_lora(model, lora, cfg.gradient_checkpointing)
    elif cfg.finetuning == "freeze":
        apply_freeze(model, freeze)
    trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "trainable params: %s / %s (%.2f%%)", f"{trainable_params:,}", f"{total:,}", 100 * trainable_params / total
    )
    return model


def liger_setting(cfg: ModelConfig) -> bool | None:
    """``model.liger_kernel`` as on (True), off (False) or auto (None)."""
    return None if cfg.liger_kernel == "auto" else cfg.liger_kernel == "on"


def _liger_installed(enabled: bool | None) -> bool:
    """Whether liger-kernel is importable; ``liger_kernel: on`` without it is a config error."""
    import importlib.util

    installed = importlib.util.find_spec("liger_kernel") is not None
    if enabled and not installed:
        raise UserError("model.liger_kernel: on needs the liger-kernel package (`pip install liger-kernel`)")
    return installed


def head_kernels(model: ModelConfig, train: TrainConfig) -> HeadKernels:
    """The run's LM-head kernels (``algos.common.HeadKernels``), decided once from its config.

    ``compiled`` under ``train.torch_compile`` (sft's chunk becomes one fused kernel on CUDA). The log-prob
    kernel of dpo/kto/orpo is Liger's fused linear cross-entropy on CUDA unless liger_kernel is off (measured
    +9% on DPO LoRA over the chunked torch loop), also for LoRA and compiled runs, where the layer kernels stay out.
    """
    import torch

    from rlfactory.algos.common import HeadKernels

    enabled = liger_setting(model)
    use_liger = enabled is not False and _liger_installed(enabled) and torch.cuda.is_available()
    return HeadKernels(compiled=train.torch_compile, logprobs="liger" if use_liger else "torch")


def maybe_apply_liger(model: Any, enabled: bool | None, finetuning: str = "full", compiled: bool = False) -> bool:
    """Liger's layer kernels: patch the model instance (TRL's `use_liger_kernel` does the same). The LM-head
    log-prob kernel is chosen apart from this, by ``head_kernels``.

    Auto (None): the instance is patched for full/freeze fine-tuning on CUDA when installed. Not for LoRA:
    measured on an H200 (docs/BENCHMARKS.md) Liger made LoRA SFT of a 0.5B model slower, in TRL as well. Nor
    when the layers will be ``compiled``: torch.compile fuses RMSNorm/SwiGLU/RoPE itself, and with Liger's
    kernels inside, compiled full SFT was 33% slower (H200). Returns whether the instance was patched.
    """
    import torch

    installed = _liger_installed(enabled)
    if enabled is None:
        enabled = installed and torch.cuda.is_available() and finetuning != "lora" and not compiled
    if not enabled:
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    log.info("Liger kernels applied (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE)")
    return True


def merge_adapter(model: Any, adapter: str) -> Any:
    from peft import PeftModel

    if not Path(adapter, "adapter_config.json").is_file():
        raise UserError(f"model.adapter_paths: '{adapter}' is not a LoRA adapter directory (no adapter_config.json)")
    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


def apply_lora(model: Any, lora: LoraConfig, gradient_checkpointing: bool) -> Any:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    peft_config = PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save or None,
    )
    try:
        return get_peft_model(model, peft_config)
    except ValueError as exc:
        raise UserError(f"lora.target_modules: {exc}") from None


def apply_freeze(model: Any, freeze: FreezeConfig) -> None:
    """Train only the last ``trainable_layers`` decoder layers (plus ``extra_modules``)."""
    num_layers = model.config.num_hidden_layers
    if freeze.trainable_layers > num_layers:
        raise UserError(f"freeze.trainable_layers is {freeze.trainable_layers} but the model has {num_layers} layers")
    keep = {f".layers.{i}." for i in range(num_layers - freeze.trainable_layers, num_layers)}
    for name, param in model.named_parameters():
        param.requires_grad = any(k in name for k in keep) or any(m in name for m in freeze.extra_modules)


def save_model(model: Any, tokenizer: Any, output_dir: str | Path, state_dict: dict | None = None) -> str:
    """Save a normal HF directory: the adapter for LoRA, the full weights otherwise; returns its kind.

    ``state_dict``: the full weights gathered by ``accelerator.get_state_dict`` when the model itself holds only a
    shard (zero3, fsdp2); PEFT picks the adapter's tensors out of it."""
    model.save_pretrained(str(output_dir), safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(str(output_dir))
    return "adapter" if hasattr(model, "peft_config") else "full"
