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
from rlfactory.engine.health import HealthMonitor, stopped
from rlfactory.engine.host_reads import HostCopy, device_scalar
from rlfactory.engine.shared import (
    NonFiniteGuard,
    StopSignals,
    allocator_flushes,
    autocast_forward,
    backward,
    build_accelerator,
    check_finite_weights,
    clip_grad_norm,
    end_run,
    init_trackers,
    keep_trainable_weights,
    load_checkpoint,
    log_lines_above,
    log_record,
    make_optimizer,
    make_scheduler,
    peak_memory_gb,
    prepare_model,
    save_checkpoint,
)
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
    # run on the prepared (unwrapped) model before the first step of a fresh run, on every process: the model is
    # on its device then (under zero3/fsdp2 sharded: every process must take part). Its result is TrainResult.before
    before_training: Callable[[Any], Any] | None = None


@dataclass
class TrainResult:
    global_step: int
    model: Any  # the trained model, unwrapped (for evaluation after training)
    final_dir: Path
    saved_as: str
    last_metrics: dict[str, float]
    eval_metrics: dict[str, float]
    before: Any = None  # what StageParts.before_training returned (None when resuming or not set)


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

    def take(self, accelerator: Any = None) -> tuple[list[str], torch.Tensor]:
        """The metric names and one float64 tensor on the accelerator's device, ``[sums..., weights...]`` since the
        last take, summed over the processes (one collective; every process must call it at the same point). Does
        not wait for the GPU: read the values with ``means`` (through a ``HostCopy`` to read them later)."""
        keys, device = sorted(self.sums), accelerator.device if accelerator is not None else "cpu"
        values = [device_scalar(self.sums[k], device, torch.float64) for k in keys]
        values += [device_scalar(self.counts[k], device, torch.float64) for k in keys]
        stacked = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=device)
        if accelerator is not None and accelerator.num_processes > 1 and keys:
            stacked = accelerator.reduce(stacked, "sum")
        self.sums.clear()
        self.counts.clear()
        return keys, stacked

    @staticmethod
    def means(keys: list[str], values: list[float]) -> dict[str, float]:
        """Each metric's mean from ``take``'s values (those past ``2 * len(keys)`` are ignored)."""
        sums, counts = values[: len(keys)], values[len(keys) : 2 * len(keys)]
        # a NaN stays in the log (a diverged value must show), only a metric without any weight is left out
        return {k: total / count for k, total, count in zip(keys, sums, counts, strict=True) if count}

    def pop(self, accelerator: Any = None) -> dict[str, float]:
        """Means since the last pop, over all processes (waits for the GPU: for evaluation's end)."""
        keys, stacked = self.take(accelerator)
        return self.means(keys, stacked.tolist())


def eval_shard(examples: list[Any], batch_size: int, rank: int, world: int) -> list[tuple[list[Any], float]]:
    """This process's eval batches with their weights: batches ``rank, rank + world, ...`` of the eval set, padded
    with weight-0 repeats of the first batch so that every process runs the same number of forwards.

    By hand rather than an Accelerate-prepared loader: Accelerate evens the shards by repeating examples, which
    a summed loss would count twice (``gather_for_metrics`` drops them, but needs per-example values), and
    uneven shards would leave ranks waiting in a sharded (zero3/fsdp2) forward. One process: every batch, weight 1.
    """
    batches = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    mine = [(batch, 1.0) for batch in batches[rank::world]]
    return mine + [(batches[0], 0.0)] * (math.ceil(len(batches) / world) - len(mine))


def evaluate(accelerator: Any, model: Any, shard: list[tuple[list[Any], float]], parts: StageParts) -> dict[str, float]:
    """Eval loss = summed loss / summed units over the whole eval set (all processes); stage metrics weighted by
    units too."""
    from accelerate.utils import send_to_device

    model.eval()
    total_loss = torch.zeros((), device=accelerator.device)
    total_count = torch.zeros((), device=accelerator.device)
    meter = _Meter()
    with torch.no_grad():
        for items, weight in shard:
            batch = send_to_device(parts.collate(items), accelerator.device)
            with autocast_forward(accelerator, model):
                loss_sum, metrics = parts.loss_fn(model, batch)
            count = torch.as_tensor(parts.count_fn(batch), dtype=torch.float32, device=accelerator.device) * weight
            total_loss += loss_sum.detach().float() * weight
            total_count += count
            meter.add(metrics, weight=count)  # a smaller last batch weighs less: means over the whole eval set
    total_loss = accelerator.reduce(total_loss, "sum")
    total_count = accelerator.reduce(total_count, "sum")
    model.train()
    out = {f"eval_{k}": v for k, v in meter.pop(accelerator).items()}
    out["eval_loss"] = float(total_loss / total_count.clamp(min=1))
    return out


def _steps_per_epoch(num_batches: int, accum: int, n_examples: int, cfg: RunConfig, world: int = 1) -> int:
    """Optimizer steps per epoch over ``num_batches`` micro-batches of the whole loader, shared by ``world``
    processes; a trailing partial accumulation window is dropped. ceil(ceil(N / B) / W) = ceil(N / (B W)): the
    same count for every process count with the same global batch (Accelerate completes the last round of
    batches with the epoch's first examples, as the Hugging Face Trainer does)."""
    steps = math.ceil(num_batches / world) // accum
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
    eval_shard: list[tuple[list[Any], float]] | None
    steps_per_epoch: int
    total_steps: int
    health: HealthMonitor  # the health rules that apply offline (non_finite, memory_pressure), fed every logged record


def _log(s: _Setup, out: Path, record: dict[str, Any]) -> None:
    log_record(s.accelerator, out, record)
    s.health.observe(record)


def _setup(cfg: RunConfig, model: Any, parts: StageParts) -> _Setup:
    """Accelerator, data loaders, optimizer and LR schedule, all passed through ``accelerator.prepare``."""
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    accelerator = build_accelerator(cfg)
    set_seed(cfg.seed)
    batch_size = cfg.train.per_device_batch_size
    loader = DataLoader(
        parts.train_examples,
        batch_size=batch_size,
        shuffle=cfg.data.shuffle,
        collate_fn=parts.collate,
        pin_memory=accelerator.device.type == "cuda",  # with the Accelerator's non_blocking copies (build_accelerator)
    )
    shard = None
    if parts.eval_examples:
        shard = eval_shard(parts.eval_examples, batch_size, accelerator.process_index, accelerator.num_processes)
    steps_per_epoch = _steps_per_epoch(
        len(loader), cfg.train.grad_accum_steps, len(parts.train_examples), cfg, accelerator.num_processes
    )
    total_steps = cfg.train.max_steps or max(1, math.ceil(steps_per_epoch * cfg.train.num_epochs))
    optimizer = make_optimizer(model, cfg.train.learning_rate, cfg.train)
    scheduler = make_scheduler(optimizer, cfg.train, total_steps)
    model, optimizer, loader, scheduler = prepare_model(
        accelerator,
        model,
        optimizer,
        loader,
        scheduler,
        torch_compile=cfg.train.torch_compile,
        cuda_graphs=cfg.train.cuda_graphs,
    )
    accelerator.register_save_state_pre_hook(keep_trainable_weights)
    init_trackers(accelerator, cfg)
    health = HealthMonitor(cfg.health, Path(cfg.output_dir), accelerator.is_main_process)
    return _Setup(accelerator, model, optimizer, scheduler, loader, shard, steps_per_epoch, total_steps, health)


def _train_window(
    s: _Setup, cfg: RunConfig, parts: StageParts, window: list[Batch], meter: _Meter, guard: NonFiniteGuard, step: int
) -> Any:
    """One optimizer step over an accumulation window (skipped or stopped when its loss or gradient is not
    finite: ``guard``); returns the tokens it processed."""
    acc = s.accelerator
    # summed as returned (numbers on the host, tensors on the device) and made a tensor without a host sync
    units = device_scalar(sum(parts.count_fn(b) for b in window), acc.device)
    units = acc.reduce(units, "sum").clamp(min=1.0)
    window_loss, tokens, grad_norm, total_loss = torch.zeros((), device=acc.device), 0, None, None
    if cfg.train.cuda_graphs:
        # A new generation of CUDA graph trees per optimizer step, not per micro-batch: the first micro-batch's
        # backward leaves the accumulated gradients in the graphs' memory pool, and a new generation started before
        # the next micro-batch lets its replay overwrite them ("accessing tensor output of CUDAGraphs that has been
        # overwritten"; on an H200 marking per micro-batch or not at all failed with accumulation, per window
        # matched the compiled run's losses exactly: bench/cudagraph_probe.py, docs/BENCHMARKS.md).
        torch.compiler.cudagraph_mark_step_begin()
    for batch in window:
        with acc.accumulate(s.model):
            with autocast_forward(acc, s.model):
                loss_sum, metrics = parts.loss_fn(s.model, batch)
            loss = loss_sum / units
            # Accelerate/DeepSpeed divide by accum and DDP averages over processes; undo both so the
            # gradient is exactly d(sum of window losses / window units).
            backward(acc, s.model, loss * cfg.train.grad_accum_steps * acc.num_processes)
            window_loss += loss.detach().float()
            meter.add(metrics)
            tokens += _batch_tokens(batch)
            if acc.sync_gradients:
                grad_norm = clip_grad_norm(acc, s.model, cfg.train.max_grad_norm)
                total_loss = acc.reduce(window_loss, "sum")
                if guard.on_device(s.optimizer):  # the fused optimizer skips a non-finite update itself
                    guard.step_on_device(step, s.optimizer, total_loss, grad_norm)
                elif guard.ok(step, total_loss, grad_norm):
                    s.optimizer.step()
                s.scheduler.step()
                s.optimizer.zero_grad()
    meter.add({"loss": total_loss, "grad_norm": grad_norm})
    return tokens


def train(cfg: RunConfig, model: Any, tokenizer: Any, parts: StageParts, resume_from: Path | None) -> TrainResult:
    """Run the loop; returns where the final model was saved. The output dir must already exist."""
    from tqdm.auto import tqdm

    s = _setup(cfg, model, parts)
    acc, out, accum = s.accelerator, Path(cfg.output_dir), cfg.train.grad_accum_steps
    global_batch = cfg.train.per_device_batch_size * accum * acc.num_processes
    step, epoch, skip_batches, before = 0, 0, 0, None
    if resume_from is not None:
        state = load_checkpoint(acc, resume_from, out)
        step, epoch = state["global_step"], state["epoch"]
        _check_global_batch(state, global_batch, resume_from)
        s.health.replay(run_dir.read_log(out))
        # per-process micro-batches already consumed this epoch: step i used examples [i*G, (i+1)*G) of the epoch's
        # order whatever the process count, so the position is exact for any count with the same global batch G
        skip_batches = (step - epoch * s.steps_per_epoch) * accum
        acc.print(f"resumed from {resume_from} at step {step}")
    elif parts.before_training is not None:
        before = parts.before_training(acc.unwrap_model(s.model))
    acc.print(
        f"stage {cfg.stage}: {len(parts.train_examples)} examples, {s.steps_per_epoch} steps/epoch, "
        f"{s.total_steps} steps, batch {cfg.train.per_device_batch_size} x accum {accum} x {acc.num_processes} "
        f"process(es), mixed precision {acc.mixed_precision}"
    )
    show = cfg.logging.progress_bar and acc.is_main_process
    bar = tqdm(total=s.total_steps, initial=step, disable=not show, desc=cfg.stage)
    clock, guard = _Clock(step), NonFiniteGuard(cfg.train, acc, out)
    if s.eval_shard is not None and resume_from is None:  # step-0 eval: the baseline the curve starts from
        _log(s, out, {"step": 0, **evaluate(acc, s.model, s.eval_shard, parts)})
    s.model.train()
    with StopSignals() as stop, log_lines_above(bar):
        step, last_metrics, eval_metrics = _loop(s, cfg, parts, step, epoch, skip_batches, stop, guard, bar, clock)
    bar.close()
    if s.eval_shard is not None and not (cfg.train.eval_steps and step % cfg.train.eval_steps == 0):
        eval_metrics = evaluate(acc, s.model, s.eval_shard, parts)
        _log(s, out, {"step": step, **eval_metrics})
    result = _finish(acc, cfg, s.model, tokenizer, out, step, last_metrics, eval_metrics)
    result.before = before
    return result


def _loop(
    s: _Setup,
    cfg: RunConfig,
    parts: StageParts,
    step: int,
    epoch: int,
    skip_batches: int,
    stop: StopSignals,
    guard: NonFiniteGuard,
    bar: Any,
    clock: _Clock,
) -> tuple[int, dict[str, float], dict[str, float]]:
    """The steps from ``step`` to the end; returns the last step, its logged metrics and the last eval's."""
    acc, out, accum = s.accelerator, Path(cfg.output_dir), cfg.train.grad_accum_steps
    global_batch = cfg.train.per_device_batch_size * accum * acc.num_processes
    meter, eval_metrics, last_metrics, saved = _Meter(), {}, {}, -1
    pending: _PendingLog | None = None  # the last logged step's line, written once the next step is queued
    # only where the optimizer skips a non-finite update itself: elsewhere the guard reads each step's values on the
    # host anyway (and its stop must follow the last step's line in the log)
    lagging = guard.on_device(s.optimizer)

    def write_pending() -> None:
        nonlocal pending, last_metrics
        if pending is not None:
            last_metrics, pending = _write_log(s, out, pending, guard, bar), None

    while step < s.total_steps:
        s.loader.set_epoch(epoch)
        iterator = iter(acc.skip_first_batches(s.loader, skip_batches) if skip_batches else s.loader)
        skip_batches = 0
        while step < s.total_steps and step - epoch * s.steps_per_epoch < s.steps_per_epoch:
            window = [next(iterator) for _ in range(accum)]
            try:
                clock.tokens += _train_window(s, cfg, parts, window, meter, guard, step + 1)
            except BaseException:
                with contextlib.suppress(Exception):  # the last logged step's line is kept, whatever stops this one
                    write_pending()
                raise
            step += 1
            bar.update(1)
            # One step behind, the host reads what the GPU made: the earlier steps' non-finite checks and the last
            # logged step's line. Reading right after a step would leave the GPU idle while the host launches the
            # next one; now this step's work is queued behind those values.
            guard.settle(before=step)
            write_pending()
            if step % cfg.logging.logging_steps == 0 or step == s.total_steps:
                pending = _queue_log(s, meter, clock, step)
            eval_due = s.eval_shard is not None and cfg.train.eval_steps and step % cfg.train.eval_steps == 0
            save_due = cfg.train.save_steps and step % cfg.train.save_steps == 0 and step < s.total_steps
            signum = stop.requested(acc, a_step_late=lagging)
            if not lagging or step == s.total_steps or eval_due or save_due or signum or s.health.stop is not None:
                guard.settle()  # what follows acts on this step's values: read them now
                write_pending()
            if eval_due:
                eval_metrics = evaluate(acc, s.model, s.eval_shard, parts)
                _log(s, out, {"step": step, **eval_metrics})
            state = {"epoch": epoch, "global_batch": global_batch, "num_processes": acc.num_processes}
            if save_due:
                save_checkpoint(acc, out, step, state, cfg.train.save_total_limit)
                saved = step
            if (signum or s.health.stop is not None) and step < s.total_steps:
                path = out / f"{run_dir.CHECKPOINT_PREFIX}{step}"
                if saved != step:
                    path = save_checkpoint(acc, out, step, state, cfg.train.save_total_limit)
                if s.health.stop is not None:  # a health rule with action stop fired
                    raise stopped(s.health.stop, path)
                raise StopSignals.stopped(signum, step, path)
        if step - epoch * s.steps_per_epoch >= s.steps_per_epoch:
            epoch += 1
    return step, last_metrics, eval_metrics


def _check_global_batch(state: dict[str, Any], global_batch: int, path: Path) -> None:
    """A checkpoint resumes with another process count only with the same global batch: then every step holds the
    same examples, and the step count and LR schedule stay those of the run that wrote it."""
    saved = state.get("global_batch")  # absent in checkpoints written before several processes were supported
    if saved is not None and saved != global_batch:
        raise UserError(
            f"resume_from_checkpoint: {path} was written with a global batch of {saved} examples per step "
            f"({state.get('num_processes', '?')} process(es)); this run has {global_batch} "
            "(train.per_device_batch_size x train.grad_accum_steps x processes): keep it the same, e.g. double "
            "per_device_batch_size or grad_accum_steps when halving the processes"
        )


@dataclass
class _PendingLog:
    """A logged step's line whose values are still on their way from the GPU."""

    record: dict[str, Any]  # what the host knew when the step was queued: step, epoch, lr
    seconds: float  # since the last line
    times: dict[str, float]  # elapsed, ETA
    keys: list[str]  # the metrics in ``values``
    values: HostCopy  # [metric sums..., weights..., this process's tokens, the most peak memory, the most flushes]


def _queue_log(s: _Setup, meter: _Meter, clock: _Clock, step: int) -> _PendingLog:
    """The step's log line, its values copied to the host behind the work that makes them (``HostCopy``)."""
    acc = s.accelerator
    keys, stacked = meter.take(acc)
    # on GPUs, the fullest process's peak of torch's allocated memory so far (GiB): what ``rlfactory plan``
    # estimates, read where the run happens (the allocator's cache and the CUDA context come on top); and the most
    # allocator cache flushes any process had since the last line (``allocator_flushes``)
    flushes = clock.flushes_since_lap()
    peak = peak_memory_gb() if torch.cuda.is_available() else 0.0
    fullest = torch.stack([device_scalar(x, acc.device, torch.float64) for x in (peak, flushes)])
    if acc.num_processes > 1 and torch.cuda.is_available():
        fullest = acc.reduce(fullest, "max")
    tokens = device_scalar(clock.tokens, acc.device, torch.float64)
    record = {"step": step, "epoch": round(step / s.steps_per_epoch, 4), "lr": s.scheduler.get_last_lr()[0]}
    seconds, times = clock.lap(step, s.total_steps)
    values = HostCopy(torch.cat([stacked, tokens.reshape(1), fullest]))
    return _PendingLog(record, seconds, times, keys, values)


def _write_log(s: _Setup, out: Path, pending: _PendingLog, guard: NonFiniteGuard, bar: Any) -> dict[str, float]:
    """Writes a queued line (waiting for its values only); returns its metrics."""
    values = pending.values.values()
    metrics = _Meter.means(pending.keys, values)
    tokens, peak, flushes = values[-3], values[-2], int(values[-1])
    record = {
        "step": pending.record["step"],
        "epoch": pending.record["epoch"],
        **metrics,
        **guard.pop_skipped(upto=pending.record["step"]),
        "lr": pending.record["lr"],
        "tokens_per_s": tokens * s.accelerator.num_processes / max(pending.seconds, 1e-9),
        **pending.times,
        **({"max_memory_gb": round(peak, 3), "alloc_flushes": flushes} if torch.cuda.is_available() else {}),
    }
    _log(s, out, record)
    bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}")
    return metrics


class _Clock:
    """Tokens and time since the last log line, elapsed time and ETA."""

    def __init__(self, start_step: int) -> None:
        self.start, self.last, self.start_step = time.time(), time.time(), start_step
        self.tokens: Any = 0  # this process's, since the last lap: a number or a device tensor
        self.flushes = allocator_flushes()  # the allocator's count at the last lap

    def flushes_since_lap(self) -> int:
        """This process's allocator cache flushes since the last call (``allocator_flushes``)."""
        now = allocator_flushes()
        since, self.flushes = now - self.flushes, now
        return since

    def lap(self, step: int, total_steps: int) -> tuple[float, dict[str, float]]:
        """The seconds since the last lap, and the elapsed time and ETA to log; restarts the token count."""
        now = time.time()
        elapsed = now - self.start
        seconds, self.last, self.tokens = now - self.last, now, 0
        eta = elapsed / max(step - self.start_step, 1) * (total_steps - step)
        return seconds, {"elapsed_s": round(elapsed, 4), "eta_s": round(eta, 2)}


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
    from rlfactory.model.reference import is_peft

    accelerator.wait_for_everyone()
    check_finite_weights(accelerator, [model], "final model")
    unwrapped = accelerator.unwrap_model(model)
    # every process takes part: under zero3 / fsdp2 this gathers the full weights (to the main process, on the host);
    # otherwise it is the unwrapped model's own state dict
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        # a run killed after renaming a checkpoint into place but before rotating, then resumed from it with no save
        # left to make, would otherwise end with one checkpoint more than save_total_limit
        run_dir.rotate_checkpoints(out, cfg.train.save_total_limit)
        save_model(unwrapped, tokenizer, out, state_dict=state_dict)
        if cfg.logging.plot_loss:
            run_dir.plot_log(out)
    del state_dict
    accelerator.wait_for_everyone()
    end_run(accelerator)
    saved_as = "adapter" if is_peft(unwrapped) else "full"  # every process returns the same summary
    return TrainResult(step, unwrapped, out, saved_as, last_metrics, eval_metrics)
