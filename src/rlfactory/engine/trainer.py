"""The one training loop (Accelerate) shared by every offline stage.

A stage hands over :class:`StageParts` — examples, a collate function and a loss — and this
loop owns the rest: optimizer, LR schedule, mixed precision, gradient accumulation, clipping,
DeepSpeed (through Accelerate), evaluation, checkpoint/resume, trainer_log.jsonl and trackers.

Loss normalisation: ``loss_fn`` returns a *sum* (e.g. summed token NLL) and ``count_fn`` the
number of units in a batch (e.g. trained tokens). Each optimizer step divides by the units of
the whole accumulation window across all processes, so batch 1 x accumulation 8 gives the same
gradient as batch 8 x accumulation 1.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlfactory.config.schema import RunConfig
from rlfactory.engine import run_dir
from rlfactory.errors import UserError

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


@dataclass
class StageParts:
    """What a stage supplies to the loop."""

    train_examples: list[dict[str, Any]]
    collate: Callable[[list[dict[str, Any]]], Batch]
    loss_fn: Callable[[Any, Batch], tuple[torch.Tensor, dict[str, float]]]  # (loss sum, metrics)
    count_fn: Callable[[Batch], Any]  # loss units in a batch (tokens, pairs, ...): a number or a 0-d tensor
    eval_examples: list[dict[str, Any]] | None = None
    extra_state: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainResult:
    global_step: int
    model: Any  # the trained model, unwrapped (for evaluation after training)
    final_dir: Path
    saved_as: str
    last_metrics: dict[str, float]
    eval_metrics: dict[str, float]


def _mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def build_accelerator(cfg: RunConfig) -> Any:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin

    trackers = [t for t in cfg.logging.report_to if t != "none"]
    for tracker in trackers:
        if importlib.util.find_spec("tensorboard" if tracker == "tensorboard" else tracker) is None:
            raise UserError(f"logging.report_to: {tracker} is not installed; `pip install {tracker}` or remove it")
    plugin = None
    if cfg.train.deepspeed:
        if not Path(cfg.train.deepspeed).is_file():
            raise UserError(f"train.deepspeed: file '{cfg.train.deepspeed}' does not exist")
        plugin = DeepSpeedPlugin(
            hf_ds_config=cfg.train.deepspeed, gradient_accumulation_steps=cfg.train.grad_accum_steps
        )
    return Accelerator(
        mixed_precision=_mixed_precision(cfg.train.mixed_precision),
        # windows never span epochs (see _steps_per_epoch), so Accelerate's counter stays aligned
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.train.grad_accum_steps, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        deepspeed_plugin=plugin,
        log_with=trackers or None,
        project_dir=cfg.output_dir,
        cpu=not torch.cuda.is_available(),
    )


def _optimizer(model: Any, cfg: RunConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    if not decay and not no_decay:
        raise UserError("no trainable parameters: check model.finetuning and the lora/freeze sections")
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.train.adam_beta1, cfg.train.adam_beta2)
    # fused AdamW (one kernel for all tensors) on CUDA, as transformers' Trainer defaults to
    fused = torch.cuda.is_available() and all(p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.train.learning_rate, betas=betas, fused=fused or None)


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


def autocast_forward(accelerator: Any, model: Any) -> contextlib.ExitStack:
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


def _keep_trainable_weights(models: list[Any], weights: list[dict], _output_dir: str) -> None:
    """Checkpoint only trainable tensors (a LoRA checkpoint then holds the adapter, not the base model)."""
    for model, state in zip(models, weights, strict=False):
        names = {name for name, param in model.named_parameters() if param.requires_grad}
        for key in [k for k in state if k not in names]:
            del state[key]


def _batch_tokens(batch: Batch) -> Any:
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else batch["input_ids"].numel()


class _Meter:
    """Averages metrics between two log lines. Tensor values stay on the device until `pop`, so the
    step loop never waits for the GPU (a `.item()` between forward and backward stalls the launch queue)."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = defaultdict(float)
        self.counts: dict[str, Any] = defaultdict(float)

    def add(self, metrics: dict[str, Any], weight: Any = 1.0) -> None:
        """``weight``: how many units (pairs, tokens) the batch's metric values are means over."""
        for key, value in metrics.items():
            if value is None:
                continue
            value = value.detach().float() if torch.is_tensor(value) else float(value)
            self.sums[key] = self.sums[key] + value * weight
            self.counts[key] = self.counts[key] + weight

    def pop(self) -> dict[str, float]:
        out = {k: float(self.sums[k]) / float(self.counts[k]) for k in self.sums}
        self.sums.clear()
        self.counts.clear()
        return {k: v for k, v in out.items() if not math.isnan(v)}


def evaluate(accelerator: Any, model: Any, loader: Any, parts: StageParts) -> dict[str, float]:
    """Eval loss = summed loss / summed units over the whole eval set; stage metrics weighted by units too."""
    model.eval()
    total_loss = torch.zeros((), device=accelerator.device)
    total_count = torch.zeros((), device=accelerator.device)
    meter = _Meter()
    with torch.no_grad():
        for batch in loader:
            with autocast_forward(accelerator, model):
                loss_sum, metrics = parts.loss_fn(model, batch)
            count = parts.count_fn(batch)
            total_loss += loss_sum.detach().float()
            total_count += count
            meter.add(metrics, weight=count)  # a smaller last batch weighs less: means over the whole eval set
    total_loss = accelerator.reduce(total_loss, "sum")
    total_count = accelerator.reduce(total_count, "sum")
    model.train()
    out = {f"eval_{k}": v for k, v in meter.pop().items()}
    out["eval_loss"] = float(total_loss / total_count.clamp(min=1))
    return out


def _steps_per_epoch(num_batches: int, accum: int, n_examples: int, cfg: RunConfig) -> int:
    """Optimizer steps per epoch; a trailing partial accumulation window is dropped."""
    steps = num_batches // accum
    if steps == 0:
        raise UserError(
            f"the training set has {n_examples} examples: fewer than one optimizer step of "
            f"train.per_device_batch_size ({cfg.train.per_device_batch_size}) x train.grad_accum_steps ({accum}); "
            "lower them or add data"
        )
    return steps


@dataclass
class _Setup:
    """Everything prepared by Accelerate for one run."""

    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    eval_loader: Any
    steps_per_epoch: int
    total_steps: int


def _setup(cfg: RunConfig, model: Any, parts: StageParts) -> _Setup:
    """Accelerator, data loaders, optimizer and LR schedule, all passed through ``accelerator.prepare``."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    accelerator = build_accelerator(cfg)
    set_seed(cfg.seed)
    batch_size = cfg.train.per_device_batch_size
    loader = DataLoader(parts.train_examples, batch_size=batch_size, shuffle=cfg.data.shuffle, collate_fn=parts.collate)
    eval_loader = None
    if parts.eval_examples:
        eval_loader = DataLoader(parts.eval_examples, batch_size=batch_size, collate_fn=parts.collate)
    per_process_batches = math.ceil(len(loader) / accelerator.num_processes)
    steps_per_epoch = _steps_per_epoch(per_process_batches, cfg.train.grad_accum_steps, len(parts.train_examples), cfg)
    total_steps = cfg.train.max_steps or max(1, math.ceil(steps_per_epoch * cfg.train.num_epochs))
    if cfg.train.torch_compile:
        log.info("torch.compile: %d decoder layers", compile_layers(model))
    optimizer = _optimizer(model, cfg)
    scheduler = get_scheduler(
        cfg.train.lr_scheduler,
        optimizer,
        num_warmup_steps=cfg.train.warmup_steps or math.ceil(cfg.train.warmup_ratio * total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs={"min_lr_rate": 0.1} if "min_lr" in cfg.train.lr_scheduler else None,
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if eval_loader is not None:
        eval_loader = accelerator.prepare(eval_loader)
    # Accelerate's bf16 wrapper copies every output to fp32 -- with a 150k vocabulary that is a 5 GB logits
    # tensor per micro-batch. Remove it and autocast the loss ourselves (`accelerator.autocast()` below).
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    accelerator.register_save_state_pre_hook(_keep_trainable_weights)
    if accelerator.log_with:
        accelerator.init_trackers(cfg.name or cfg.stage, config=json.loads(cfg.model_dump_json()))
    return _Setup(accelerator, model, optimizer, scheduler, loader, eval_loader, steps_per_epoch, total_steps)


def _train_window(s: _Setup, cfg: RunConfig, parts: StageParts, window: list[Batch], meter: _Meter) -> Any:
    """One optimizer step over an accumulation window; returns the tokens it processed."""
    acc = s.accelerator
    units = sum(torch.as_tensor(parts.count_fn(b), dtype=torch.float32, device=acc.device) for b in window)
    units = acc.reduce(units, "sum").clamp(min=1.0)
    window_loss, tokens, grad_norm = torch.zeros((), device=acc.device), 0, None
    for batch in window:
        with acc.accumulate(s.model):
            with autocast_forward(acc, s.model):
                loss_sum, metrics = parts.loss_fn(s.model, batch)
            loss = loss_sum / units
            # Accelerate/DeepSpeed divide by accum and DDP averages over processes; undo both so the
            # gradient is exactly d(sum of window losses / window units).
            acc.backward(loss * cfg.train.grad_accum_steps * acc.num_processes)
            window_loss += loss.detach().float()
            meter.add(metrics)
            tokens += _batch_tokens(batch)
            if acc.sync_gradients:
                grad_norm = _clip(acc, s.model, cfg.train.max_grad_norm)
                s.optimizer.step()
                s.scheduler.step()
                s.optimizer.zero_grad()
    meter.add({"loss": acc.reduce(window_loss, "sum"), "grad_norm": grad_norm})
    return tokens


def train(cfg: RunConfig, model: Any, tokenizer: Any, parts: StageParts, resume_from: Path | None) -> TrainResult:
    """Run the loop; returns where the final model was saved. The output dir must already exist."""
    from tqdm.auto import tqdm

    s = _setup(cfg, model, parts)
    acc, out, accum = s.accelerator, Path(cfg.output_dir), cfg.train.grad_accum_steps
    step, epoch, skip_batches = 0, 0, 0
    if resume_from is not None:
        state = json.loads((resume_from / "trainer_state.json").read_text())
        acc.load_state(str(resume_from), strict=False)
        step, epoch = state["global_step"], state["epoch"]
        skip_batches = (step - epoch * s.steps_per_epoch) * accum
        run_dir.truncate_log(out, step)
        acc.print(f"resumed from {resume_from} at step {step}")
    acc.print(
        f"stage {cfg.stage}: {len(parts.train_examples)} examples, {s.steps_per_epoch} steps/epoch, "
        f"{s.total_steps} steps, batch {cfg.train.per_device_batch_size} x accum {accum} x {acc.num_processes} "
        f"process(es), mixed precision {acc.mixed_precision}"
    )
    show = cfg.logging.progress_bar and acc.is_main_process
    bar = tqdm(total=s.total_steps, initial=step, disable=not show, desc=cfg.stage)
    meter, eval_metrics, last_metrics = _Meter(), {}, {}
    clock = _Clock(step)
    if s.eval_loader is not None and resume_from is None:  # step-0 eval: the baseline the curve starts from
        _log_record(acc, out, {"step": 0, **evaluate(acc, s.model, s.eval_loader, parts)})
    s.model.train()
    while step < s.total_steps:
        s.loader.set_epoch(epoch)
        iterator = iter(acc.skip_first_batches(s.loader, skip_batches) if skip_batches else s.loader)
        skip_batches = 0
        while step < s.total_steps and step - epoch * s.steps_per_epoch < s.steps_per_epoch:
            clock.tokens += _train_window(s, cfg, parts, [next(iterator) for _ in range(accum)], meter)
            step += 1
            bar.update(1)
            if step % cfg.logging.logging_steps == 0 or step == s.total_steps:
                last_metrics = meter.pop()
                record = {
                    "step": step,
                    "epoch": round(step / s.steps_per_epoch, 4),
                    **last_metrics,
                    "lr": s.scheduler.get_last_lr()[0],
                    **clock.lap(step, s.total_steps, acc.num_processes),
                }
                _log_record(acc, out, record)
                bar.set_postfix(loss=f"{last_metrics.get('loss', float('nan')):.4f}")
            if s.eval_loader is not None and cfg.train.eval_steps and step % cfg.train.eval_steps == 0:
                eval_metrics = evaluate(acc, s.model, s.eval_loader, parts)
                _log_record(acc, out, {"step": step, **eval_metrics})
            if cfg.train.save_steps and step % cfg.train.save_steps == 0 and step < s.total_steps:
                _save_checkpoint(acc, cfg, out, step, epoch)
        if step - epoch * s.steps_per_epoch >= s.steps_per_epoch:
            epoch += 1
    bar.close()
    if s.eval_loader is not None and not (cfg.train.eval_steps and step % cfg.train.eval_steps == 0):
        eval_metrics = evaluate(acc, s.model, s.eval_loader, parts)
        _log_record(acc, out, {"step": step, **eval_metrics})
    return _finish(acc, cfg, s.model, tokenizer, out, step, last_metrics, eval_metrics)


class _Clock:
    """Throughput since the last log line, elapsed time and ETA."""

    def __init__(self, start_step: int) -> None:
        self.start, self.last, self.start_step, self.tokens = time.time(), time.time(), start_step, 0

    def lap(self, step: int, total_steps: int, num_processes: int) -> dict[str, float]:
        now = time.time()
        elapsed = now - self.start
        out = {
            "tokens_per_s": float(self.tokens) * num_processes / max(now - self.last, 1e-9),
            "elapsed_s": round(elapsed, 4),
            "eta_s": round(elapsed / max(step - self.start_step, 1) * (total_steps - step), 2),
        }
        self.last, self.tokens = now, 0
        return out


def _clip(accelerator: Any, model: Any, max_norm: float | None) -> Any:
    if max_norm is not None:
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    else:
        grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
        norm = torch.stack(grads).norm() if grads else None
    return norm  # a tensor: read at log time, not here


def _log_record(accelerator: Any, out: Path, record: dict[str, Any]) -> None:
    if accelerator.is_main_process:
        run_dir.append_log(out, record)
    if accelerator.log_with:
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def _save_checkpoint(accelerator: Any, cfg: RunConfig, out: Path, step: int, epoch: int) -> None:
    path = out / f"{run_dir.CHECKPOINT_PREFIX}{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        # written last: a checkpoint without trainer_state.json is incomplete and never resumed from
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": epoch}))
        run_dir.rotate_checkpoints(out, cfg.train.save_total_limit)
    accelerator.wait_for_everyone()


def _finish(
    accelerator: Any,
    cfg: RunConfig,
    model: Any,
    tokenizer: Any,
    out: Path,
    step: int,
    last_metrics: dict[str, float],
    eval_metrics: dict[str, float],
) -> TrainResult:
    from rlfactory.model.loader import save_model

    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    saved_as = "full"
    if accelerator.is_main_process:
        saved_as = save_model(unwrapped, tokenizer, out)
        if cfg.logging.plot_loss:
            run_dir.plot_log(out)
    accelerator.end_training()
    return TrainResult(step, unwrapped, out, saved_as, last_metrics, eval_metrics)
