"""Load tokenizer and causal LM (local dir or hub cache), set up LoRA / freeze / full fine-tuning."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfactory.config.schema import FreezeConfig, LoraConfig, ModelConfig, QuantizationConfig, TrainConfig
from rlfactory.errors import UserError, first_line, model_read_errors, read_text

if TYPE_CHECKING:
    from rlfactory.algos.common import HeadKernels

log = logging.getLogger(__name__)


def is_hub_id(path: str) -> bool:
    """``org/name`` or ``name``, not a path (``./x``, ``/x``, ``~/x``, ``a/b/c``)."""
    return not path.startswith((".", "/", "~")) and path.count("/") <= 1


def check_model_exists(path: str, what: str = "model.name_or_path", weights: bool = True) -> None:
    """A path must be a model directory (with a readable config and complete weights, unless ``weights`` is False:
    a tokenizer may come from an adapter folder); a hub id must be cached when offline (HF_HUB_OFFLINE=1)."""
    import os

    if Path(path).expanduser().is_dir():
        if weights:
            check_model_dir(path, what)
        else:
            _check_not_empty(Path(path).expanduser(), what)
        return
    if Path(path).expanduser().exists():
        raise UserError(f"{what}: '{path}' is a file, not a model directory; give the folder holding config.json")
    hub_id = is_hub_id(path)
    if hub_id and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        return  # may be downloaded
    if hub_id:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(path, "config.json"), str):
            return
    raise UserError(
        f"{what}: model path '{path}' does not exist (not a local directory"
        + (" and not in the local Hugging Face cache" if hub_id else "")
        + f"); set {what} to a model directory or a cached hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct)"
    )


def check_model_dir(path: str, what: str = "model.name_or_path") -> None:
    """A local model folder: not empty, a config.json transformers can read, and weights that are all there (an
    interrupted download or copy leaves a truncated safetensors file, which would fail deep inside loading)."""
    folder = Path(path).expanduser()
    _check_not_empty(folder, what)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        check_adapter(str(folder))  # an adapter folder: transformers loads its base model and attaches it
        return
    if not (folder / "config.json").is_file():
        raise UserError(f"{what}: '{path}' has no config.json; it is not a Hugging Face model directory")
    check_config(folder, what)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("pytorch_model*.bin")):
        raise UserError(f"{what}: '{path}' has no weights (no *.safetensors or pytorch_model*.bin files)")
    for file in weights:
        check_safetensors(file)


def check_config(folder: Path, what: str = "model.name_or_path") -> None:
    """A local folder's config.json is one transformers builds its config from (the tokenizer reads it too, so an
    unreadable config is named as such, not as a tokenizer that failed to load)."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(folder))
    except model_read_errors() as exc:
        raise UserError(f"{what}: cannot read {folder / 'config.json'}: {first_line(exc)}") from None


def _check_not_empty(folder: Path, what: str) -> None:
    if not any(folder.iterdir()):
        raise UserError(
            f"{what}: '{folder}' is an empty directory; a model folder holds config.json, the tokenizer files and "
            "the weights (*.safetensors)"
        )


def check_safetensors(file: Path) -> None:
    """The file's header parses and its tensors end exactly at the end of the file (reads the header only)."""
    import json

    size = file.stat().st_size
    problem = None
    with open(file, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            problem = (
                f"its header claims {length} bytes, the file has {size}" if length >= 0 else "shorter than 8 bytes"
            )
        else:
            try:
                header = json.loads(handle.read(length))
                ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                problem = "its header is not valid safetensors JSON"
            else:
                if 8 + length + max(ends, default=0) != size:
                    problem = f"the tensors need {8 + length + max(ends, default=0)} bytes, the file has {size}"
    if problem:
        raise UserError(f"{file}: truncated or corrupt safetensors file ({problem}); download or save the model again")


def load_tokenizer(cfg: ModelConfig, padding_side: str = "right") -> Any:
    """AutoTokenizer with a chat template (its own or the named ``model.template``) and a pad token."""
    from transformers import AutoTokenizer

    path = str(cfg.name_or_path)
    check_model_exists(path, weights=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except model_read_errors() as exc:  # e.g. no tokenizer files: "Couldn't instantiate the backend tokenizer"
        if (Path(path).expanduser() / "config.json").is_file():
            check_config(Path(path).expanduser())  # the config, not the tokenizer files, may be what failed
        raise UserError(
            f"cannot load a tokenizer from '{path}': {first_line(exc)} "
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

    from rlfactory.model.attention import attention_implementation, resolved_attention

    path = str(cfg.name_or_path)
    check_model_paths(cfg)
    options = {
        "dtype": resolve_dtype(cfg.dtype, cfg.finetuning if trainable else "lora"),
        "attn_implementation": attention_implementation(resolved_attention(cfg)),
        "trust_remote_code": cfg.trust_remote_code,
        **quantized_loading(cfg),  # a 4-bit base's dtype is its compute dtype
    }
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **options)
    except model_read_errors() as exc:
        raise UserError(f"cannot load model '{path}': {first_line(exc)}") from None
    for adapter in cfg.adapter_paths:
        model = merge_adapter(model, adapter)
    if trainable:
        maybe_apply_liger(model, liger_setting(cfg), cfg.finetuning, compiled=torch_compile)
    if not trainable:
        model.requires_grad_(False)
        return model
    if cfg.quantization is not None:  # norms and head in float32, inputs that require grad (what TRL does)
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
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


QLORA_NEEDS = "QLoRA needs a CUDA GPU and bitsandbytes: pip install bitsandbytes (or 'rlfactory[qlora]')"


def quantization_problem(cfg: ModelConfig) -> str | None:
    """What this machine lacks for ``model.quantization`` (``config check`` warns, ``train`` refuses)."""
    import importlib.util

    import torch

    if cfg.quantization is None:
        return None
    missing = [
        what
        for what, present in (
            ("no CUDA GPU is visible", torch.cuda.is_available()),
            ("bitsandbytes is not installed", importlib.util.find_spec("bitsandbytes") is not None),
        )
        if not present
    ]
    return f"model.quantization: {QLORA_NEEDS} ({'; '.join(missing)})" if missing else None


def quantized_loading(cfg: ModelConfig) -> dict[str, Any]:
    """from_pretrained's arguments for ``model.quantization`` (none without it); refuses a machine without CUDA or
    bitsandbytes before anything loads."""
    if cfg.quantization is None:
        return {}
    problem = quantization_problem(cfg)
    if problem:
        raise UserError(problem)
    return bnb_loading(cfg.quantization)


def bnb_loading(quant: QuantizationConfig) -> dict[str, Any]:
    """transformers' BitsAndBytesConfig, the whole model on this process's GPU (bitsandbytes weights are placed at
    load; Accelerate does not move them), and for 4 bits the compute dtype as the dtype of the unquantized rest."""
    import os

    import torch
    from transformers import BitsAndBytesConfig

    device_map = {"": int(os.environ.get("LOCAL_RANK", "0"))}
    if quant.bits == 8:
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True), "device_map": device_map}
    compute = getattr(torch, quant.compute_dtype)
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=compute,
    )
    return {"quantization_config": config, "device_map": device_map, "dtype": compute}


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


def check_model_paths(cfg: ModelConfig) -> None:
    """The model folder and every adapter folder, before anything loads (``config check`` and every stage)."""
    check_model_exists(str(cfg.name_or_path))
    for adapter in cfg.adapter_paths:
        check_adapter(adapter)


def check_adapter(adapter: str) -> None:
    if not Path(adapter, "adapter_config.json").is_file():
        where = "does not exist" if not Path(adapter).exists() else "is not a LoRA adapter directory"
        raise UserError(f"model.adapter_paths: '{adapter}' {where} (no adapter_config.json)")
    try:
        config = json.loads(read_text(Path(adapter, "adapter_config.json"), "model.adapter_paths:"))
    except ValueError as exc:
        raise UserError(f"model.adapter_paths: {adapter}/adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UserError(f"model.adapter_paths: {adapter}/adapter_config.json must hold a JSON object")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(BASE_CHANGING_INITS):
        raise UserError(
            f"{adapter}: a {init} adapter saved without conversion: it fits only the residual model its training "
            "started from, not the base it names; save it with peft's path_initial_model_for_weight_conversion "
            "(rlfactory's runs do), or load it on that residual model"
        )
    for file in Path(adapter).glob("*.safetensors"):
        check_safetensors(file)


BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga")  # peft inits that move part of the weight into the adapter


def merge_adapter(model: Any, adapter: str) -> Any:
    from peft import PeftModel

    check_adapter(adapter)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


def peft_lora_config(lora: LoraConfig, task_type: str = "CAUSAL_LM", modules_to_save: list[str] | None = None) -> Any:
    """``lora:`` as peft's LoraConfig (LoRA, DoRA, rsLoRA, the initialisations the schema accepts)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        task_type=task_type,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=(lora.modules_to_save if modules_to_save is None else modules_to_save) or None,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        init_lora_weights=lora.init_lora_weights,
    )


def wrap_lora(model: Any, peft_config: Any, lora: LoraConfig) -> Any:
    """get_peft_model; for an initialisation that changes the base (pissa, olora) the initial adapter is saved
    aside, so ``save_model`` can convert the trained one into a plain LoRA on the original base (peft's
    ``path_initial_model_for_weight_conversion``): without it the saved adapter only fits the residual base."""
    import warnings

    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated name; nothing a user can act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            model = get_peft_model(model, peft_config)
    except (ValueError, NotImplementedError) as exc:
        raise UserError(f"lora: {first_line(exc)}") from None
    if lora.changes_base():
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="rlfactory-lora-init-"))
        atexit.register(shutil.rmtree, folder, True)
        model.save_pretrained(str(folder / "initial"))
        model.lora_initial_adapter = str(folder / "initial")
        log.info(
            "lora.init_lora_weights %s: the base is now the residual; initial adapter kept", lora.init_lora_weights
        )
    return model


def apply_lora(model: Any, lora: LoraConfig, gradient_checkpointing: bool) -> Any:
    if gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return wrap_lora(model, peft_lora_config(lora), lora)


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
    shard (zero3, fsdp2); PEFT picks the adapter's tensors out of it. An adapter initialised with pissa / olora is
    saved converted (rank 2r, on the original base: ``wrap_lora``), so it loads and merges like any LoRA."""
    initial = getattr(model, "lora_initial_adapter", None)
    extra = {"path_initial_model_for_weight_conversion": initial} if initial else {}
    if initial:  # peft converts from the model's own tensors (a given state_dict lacks the initial adapter it
        state_dict = None  # loads); such runs are never sharded (schema), so the model holds the whole adapter
    model.save_pretrained(str(output_dir), safe_serialization=True, state_dict=state_dict, **extra)
    tokenizer.save_pretrained(str(output_dir))
    return "adapter" if hasattr(model, "peft_config") else "full"
