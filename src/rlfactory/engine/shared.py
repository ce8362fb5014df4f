"""Loop mechanics shared by the offline loop (``engine.offline``) and the online loop (``engine.online``).

One place for what both loops do the same way: the Accelerator, the optimizer and LR schedule, mixed-precision
forwards, gradient clipping, checkpoints (save, resume) and log lines. The loops differ only in what a step is:
one micro-batch -> one loss offline; generate, score, then several optimizer steps on mini-batches online.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlfactory.config.schema import RunConfig, TrainConfig
from rlfactory.engine import run_dir
from rlfactory.engine.host_reads import HostCopy, device_scalar
from rlfactory.errors import RunStopped, UserError, read_text

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

    if not torch.cuda.is_available():
        # DeepSpeed, when installed, is imported by Accelerate (unwrap_model) even when no strategy uses it, and then
        # warns from every process that it "was unable to detect" a GPU; on a CPU machine there is none to detect
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
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
        # on a GPU the loaders pin their batches and copy them without waiting: a copy from pageable memory waits
        # for all queued GPU work, once per batch tensor (3.5 waits per sft step: bench/sync_probe.py)
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=torch.cuda.is_available()),
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
    betas = (train.adam_beta1, train.adam_beta2)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=train.adam_epsilon, fused=fused or None)


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


def prepare_model(
    accelerator: Accelerator, model: Any, *others: Any, torch_compile: bool = False, cuda_graphs: bool = False
) -> tuple:
    """``accelerator.prepare`` the model (and optimizer, scheduler, loaders), then undo what we do ourselves.

    Accelerate's bf16 wrapper copies every output to fp32 -- with a 150k vocabulary that is a 5 GB logits tensor
    per micro-batch -- so it is removed and the loops autocast the forwards (``autocast_forward``). With
    ``torch_compile`` the layers are compiled first, in place (``nn.Module.compile``): parameter names, PEFT's
    adapter switch and the weight sync are unchanged. ``cuda_graphs`` (``train.cuda_graphs``) compiles them in
    torch.compile's reduce-overhead mode: each layer's forward and backward replay as CUDA graphs (a no-op on CPU).
    """
    import logging

    if torch_compile:
        compiled = compile_layers(model, mode="reduce-overhead" if cuda_graphs else None)
        logging.getLogger(__name__).info("torch.compile: %d layers%s", compiled, " (CUDA graphs)" * cuda_graphs)
        if compiled > 1:
            keep_layer_graphs_whole()
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


def compile_layers(model: Any, mode: str | None = None) -> int:
    """``torch.compile`` every block of the model's repeated layer stacks (a ``ModuleList`` named ``layers``).

    Per layer rather than the whole model, as torchtune does: one graph serves all layers, compile time stays
    short, and the parts around the stack (mask building, the chunked LM head, PEFT's adapter switch) stay
    eager. Models without such a stack are compiled whole. ``mode``: torch.compile's (``reduce-overhead``: CUDA
    graphs; the layers share one compiled function, and CUDA graph trees record each layer's call once per batch
    shape, as its weights sit at other addresses). Returns how many modules were compiled.
    """
    stacks = [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and name.endswith("layers")]
    blocks = [block for stack in stacks for block in stack]
    for block in blocks or [model]:
        block.compile(mode=mode)
    return len(blocks) or 1


def keep_layer_graphs_whole() -> None:
    """Compile each layer as one graph under DDP too.

    Dynamo's DDP optimizer splits any graph compiled inside DDP's forward at the gradient buckets' boundaries (25 MB)
    so that the all-reduce of one bucket can start while the rest of the graph's backward runs. Our graphs are
    single layers, whose backward ends -- and fires DDP's per-parameter hooks -- layer by layer anyway, so the split
    buys no overlap; it only cuts each layer into pieces that fuse and schedule worse. Process-wide (it is dynamo's
    global switch), and only for per-layer graphs: a model compiled whole keeps the split, its only overlap. A no-op
    on one process, where nothing runs inside DDP.
    """
    import torch._dynamo

    torch._dynamo.config.optimize_ddp = False


def autocast_forward(accelerator: Accelerator, model: Any) -> contextlib.ExitStack:
    """``accelerator.autocast()`` for a forward, and with it PEFT adapters take their input as it comes.

    PEFT keeps LoRA weights in float32 on a bf16 model and casts each adapter's input to float32; under autocast
    the adapter's matmul casts it straight back to bf16, and that copy is what autograd saves, one per adapted
    linear: 1.3 GB of a 0.5B model's activations at 8k tokens, uncompiled (H100, docs/BENCHMARKS.md). Without the
    cast the values are the same and the adapter saves the input the base layer already holds. The backward of
    such a forward goes through ``backward`` below.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(accelerator.autocast())
    stack.enter_context(_adapter_input_casting_off(accelerator, model))
    return stack


def _adapter_input_casting_off(accelerator: Accelerator, model: Any) -> contextlib.AbstractContextManager:
    # entered up to twice per micro-batch: no walk over the model's modules here (PEFT's helper walks them all on
    # entry and exit, Accelerate's unwrap_model once, looking for compiled regions); the adapter layers are found
    # once per model, none for a model without adapters
    if accelerator.mixed_precision in ("bf16", "fp16"):
        from rlfactory.model.adapters import input_casting_off

        return input_casting_off(model)
    return contextlib.nullcontext()


def backward(accelerator: Accelerator, model: Any, loss: torch.Tensor) -> None:
    """``accelerator.backward`` for a forward run under ``autocast_forward``. Gradient checkpointing runs each
    layer's forward again inside the backward; it must cast the adapters' inputs as the first forward did, or
    DoRA's norms come out in another dtype and torch refuses the recomputed tensors (a 7B DoRA run on an H200)."""
    with _adapter_input_casting_off(accelerator, model):
        accelerator.backward(loss)


def clip_grad_norm(accelerator: Accelerator, model: Any, max_norm: float | None) -> torch.Tensor | float | None:
    """Clip (when ``max_norm``) and return the total gradient norm before clipping, as a device tensor: reading
    it here would make the CPU wait for the GPU, so the loops read it once per log line."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return None
    if max_norm is not None:
        norm = accelerator.clip_grad_norm_(params, max_norm)  # DeepSpeed clips inside its step: a float or None
        return _whole(norm).detach().float() if torch.is_tensor(norm) else norm
    return torch.stack([_whole(p.grad.detach().float().norm()) for p in params]).norm()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """FSDP2 gives sharded DTensors (a norm too): the plain, globally reduced tensor, which ``.tolist()`` reads."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


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
    """Models, optimizers, schedulers and RNG (Accelerate), then the loop's ``state``; rotates old checkpoints.

    Written into ``checkpoint-N.partial`` and renamed to ``checkpoint-N`` once complete, so a kill mid-write leaves
    no folder that looks like a checkpoint; ``trainer_state.json`` lists every file with its size (a checkpoint
    damaged later is seen as incomplete). Weights that are not finite are refused, never saved."""
    check_finite_weights(accelerator, accelerator._models, f"checkpoint at step {step}")
    path = out / f"{run_dir.CHECKPOINT_PREFIX}{step}"
    partial = path.with_name(path.name + run_dir.PARTIAL_SUFFIX)
    if accelerator.is_main_process:
        run_dir.remove_partial_checkpoints(out)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = {str(f.relative_to(partial)): f.stat().st_size for f in sorted(partial.rglob("*")) if f.is_file()}
        run_dir.write_atomic(partial / STATE_FILE, json.dumps({"global_step": step, **state, "files": files}))
        run_dir.replace_dir(partial, path)
        run_dir.rotate_checkpoints(out, keep)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Accelerator, path: Path, out: Path) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote and return the loop's state; drops log lines written after it."""
    state = run_dir.read_checkpoint_state(path)  # a clear error for a checkpoint that is not complete
    accelerator.load_state(str(path), strict=False)
    state.pop("files", None)
    legacy = path / "online_state.json"  # online checkpoints written before the shared engine kept the loop state apart
    if legacy.is_file():
        state.update(json.loads(legacy.read_text()))
    if accelerator.is_main_process:
        run_dir.truncate_log(out, state["global_step"])
    accelerator.wait_for_everyone()
    return state


def nonfinite_weights(accelerator: Accelerator, models: list[Any]) -> int:
    """How many trainable weight tensors of ``models`` hold NaN or inf, over every process (each checks its own,
    possibly sharded, parameters)."""
    params = [p for m in models for p in m.parameters() if p.requires_grad and p.numel()]
    bad = torch.zeros((), device=accelerator.device)
    if params:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # an FSDP2 shard
        bad = torch.stack([(~torch.isfinite(t.detach())).any() for t in local]).sum().float().to(accelerator.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, "sum")
    return int(bad)


def check_finite_weights(accelerator: Accelerator, models: list[Any], what: str, step: int | None = None) -> None:
    """Raise :class:`RunStopped` when a trainable weight is NaN or infinite: such weights are never saved (``what``:
    the checkpoint or model about to be written) nor trained on (``step``: the update that made them)."""
    bad = nonfinite_weights(accelerator, models)
    if bad:
        where = f"training diverged at step {step}" if step is not None else f"the {what} was not saved"
        raise RunStopped(
            f"{where}: {bad} trained weight tensor(s) hold NaN or inf (a learning rate too high?); nothing was "
            "saved from them. Lower train.learning_rate or keep train.max_grad_norm set, and start again (or "
            "resume from an earlier checkpoint)"
        )


class NonFiniteGuard:
    """A non-finite loss or gradient norm: stop with a message, or (``train.skip_nonfinite_steps`` > 0) skip that
    update, stopping after that many skipped in a row. Decided on values that every process shares (the reduced
    loss, the global gradient norm), so every process decides alike.

    Two ways: ``ok`` reads the values on the host (one host sync per optimizer step) and says whether to step;
    ``step_on_device`` (torch's fused Adam/AdamW: ``on_device``) lets the optimizer skip the update itself, as it
    does under a grad scaler (its ``found_inf``), and ``settle`` counts and reports those steps later, from copies
    that no longer make the host wait (``HostCopy``). The outcome is the same: a skipped update is never applied, and
    a run past the allowed skips stops without saving, naming the step; it stops one step later on the host."""

    def __init__(self, train: TrainConfig, accelerator: Accelerator, out: Path):
        self.allowed, self.lr, self.out = train.skip_nonfinite_steps, train.learning_rate, out
        self.main = accelerator.is_main_process
        # under fp16 the grad scaler skips overflowing steps itself (an inf gradient norm is expected there)
        self.scaled = getattr(accelerator, "scaler", None) is not None
        self.in_a_row = 0
        self.skipped: list[int] = []  # the steps skipped since the last log line
        self.pending: list[tuple[int, HostCopy]] = []  # steps checked on the device, not yet counted

    def _values(self, loss: Any, grad_norm: Any) -> torch.Tensor:
        values = [torch.as_tensor(loss, dtype=torch.float32).reshape(())]
        if grad_norm is not None and not self.scaled:
            values.append(torch.as_tensor(grad_norm, dtype=torch.float32, device=values[0].device).reshape(()))
        return torch.stack(values)

    def on_device(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` (Accelerate's wrapper or torch's) can skip an update on the device."""
        inner = getattr(optimizer, "optimizer", optimizer)
        return not self.scaled and isinstance(inner, torch.optim.Adam) and bool(inner.defaults.get("fused"))

    def step_on_device(self, step: int, optimizer: Any, loss: Any, grad_norm: Any) -> None:
        """``optimizer.step()``, which leaves parameters and state as they were when a value is not finite."""
        values = self._values(loss, grad_norm)
        inner = getattr(optimizer, "optimizer", optimizer)
        inner.found_inf = (~torch.isfinite(values).all()).float()
        try:
            optimizer.step()
        finally:
            del inner.found_inf
        self.pending.append((step, HostCopy(values)))

    def settle(self, before: int | None = None) -> None:
        """Count and report the steps checked on the device (those before step ``before``; None: all), in order;
        raises RunStopped as ``ok`` does."""
        while self.pending and (before is None or self.pending[0][0] < before):
            step, copy = self.pending.pop(0)
            self._decide(step, copy.values())

    def ok(self, step: int, loss: Any, grad_norm: Any) -> bool:
        """True: apply this update. False: skip it. Raises RunStopped past the allowed skips."""
        if loss is None:
            return True
        return self._decide(step, self._values(loss, grad_norm).tolist())

    def _decide(self, step: int, values_host: list[float]) -> bool:
        if all(math.isfinite(v) for v in values_host):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped.append(step)
        found = f"loss {values_host[0]}" + (f", gradient norm {values_host[1]}" if len(values_host) > 1 else "")
        if self.in_a_row > self.allowed:
            from rlfactory.engine import health

            kept = run_dir.list_checkpoints(self.out)
            message = f"training diverged at step {step}: {found} (not finite); stopped without saving the model"
            bad = 0 if not math.isfinite(values_host[0]) else 1  # the loss, else the gradient norm
            alert = health.divergence_alert(step, ("loss", "grad_norm")[bad], values_host[bad], message)
            health.report(alert, self.out, self.main)  # the stop is an alert too (trainer_log.jsonl, the WebUI)
            raise RunStopped(
                f"{message}. Lower train.learning_rate (now {self.lr:g}), keep train.max_grad_norm set, or set "
                "train.skip_nonfinite_steps to skip such updates"
                + (f"; the last checkpoint is {kept[-1]}" if kept else "")
            )
        logging.getLogger(__name__).warning(
            "step %d: %s (not finite): update skipped (%d in a row, train.skip_nonfinite_steps %d)",
            step, found, self.in_a_row, self.allowed,
        )  # fmt: skip
        return False

    def pop_skipped(self, upto: int | None = None) -> dict[str, float]:
        """``skipped_steps`` since the last log line, up to step ``upto`` (None: all; only when some were skipped):
        a line written a step late does not count the later step's skip."""
        counted = [step for step in self.skipped if upto is None or step <= upto]
        self.skipped = [step for step in self.skipped if step not in counted]
        return {"skipped_steps": float(len(counted))} if counted else {}


@contextlib.contextmanager
def log_lines_above(bar: Any) -> Any:
    """While the progress ``bar`` shows, log lines print above it (``tqdm.write``) instead of after its text on its
    own line, which left a mid-run warning glued to the bar ("grpo:  40%|...| 4/10 [...]INFO ...") and the bar
    redrawn after it. tqdm's own logging bridge; the handlers keep their stream and format."""
    if bar.disable:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(tqdm_class=type(bar)):
        yield


class StopSignals:
    """SIGTERM and SIGINT during training: finish the current step, save a checkpoint, stop with a message.

    ``with StopSignals() as stop:`` installs the handlers (main thread only) and restores them after. A second
    signal (after ``REPEAT_S``) stops at once (SIGINT: KeyboardInterrupt; SIGTERM: the default action).
    ``requested()`` is asked at each step's end; on several processes the flag is reduced (max) so every process
    stops at the same step, whichever got the signal first (torchrun passes SIGTERM on to each process)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    REPEAT_S = 2.0  # a second signal sooner than this is the first one again, forwarded by a launcher

    def __init__(self) -> None:
        self.signum, self.when = 0, 0.0
        self._reduced: HostCopy | None = None  # the last reduction of the flag, for ``requested(a_step_late=True)``
        self._previous: dict[int, Any] = {}
        self._previous_mask: set[signal.Signals] | None = None

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum and time.monotonic() - self.when < self.REPEAT_S:
            return  # the same Ctrl+C passed on by a launcher (torchrun forwards what its process group got)
        if self.signum:
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.signum, self.when = signum, time.monotonic()
        print(
            f"{signal.Signals(signum).name}: stopping after this step with a checkpoint (send it again to stop now)",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            # a launcher may hand them down blocked (CI's runner seems to): they would wait, pending, until the run ends
            if hasattr(signal, "pthread_sigmask"):  # not on Windows
                self._previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous_mask)
            self._previous_mask = None

    def requested(self, accelerator: Accelerator, a_step_late: bool = False) -> int:
        """The signal to stop for (0: none), the same on every process. On several processes the flag is reduced
        on the device; ``a_step_late``: the answer is the previous call's reduction, read without waiting for the
        GPU's newer work (``HostCopy``), so a signal stops the run one step later."""
        if accelerator.num_processes == 1:
            return self.signum
        flag = accelerator.reduce(device_scalar(float(self.signum), accelerator.device), "max")
        if not a_step_late:
            return int(flag)
        earlier, self._reduced = self._reduced, HostCopy(flag)
        return int(earlier.values()[0]) if earlier is not None else 0

    @staticmethod
    def stopped(signum: int, step: int, checkpoint: Path) -> RunStopped:
        name = signal.Signals(signum).name
        return RunStopped(
            f"{name} at step {step}: saved {checkpoint}; continue with resume_from_checkpoint=auto",
            exit_code=128 + signum,
        )


def log_record(accelerator: Accelerator, out: Path, record: dict[str, Any]) -> None:
    """One trainer_log.jsonl line (the main process writes it) and the trackers."""
    if accelerator.is_main_process:
        run_dir.append_log(out, record)
    if accelerator.log_with:
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def before_after(before: float | None, after: float, n: int) -> dict[str, Any]:
    """A run summary's score entry: the same metric before and after training, on ``n`` held-out examples."""
    return {"before": before, "after": after, "n": n}


def allocator_flushes() -> int:
    """How many times torch's CUDA caching allocator has freed its cache to retry an allocation that did not fit,
    since the process started (0 on CPU). A flush waits for the device and hands memory back to the driver, so a step
    with flushes is slower than its neighbours: the sign that a run is at its GPU memory limit (DeepSpeed warns on
    the same counter; the ``memory_pressure`` health rule reads it)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch; on CPU the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
