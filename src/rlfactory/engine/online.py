"""Mechanics of the online (rollout) loop shared by ppo and grpo: optimizers, phase timers,
checkpoint/resume, log lines and rollout traces. The step itself lives in ``stages/online.py``.

Kept apart from :mod:`rlfactory.engine.trainer` (the offline loop) because an online step is not
"one micro-batch -> one loss": it generates, scores and then runs several optimizer steps on
mini-batches of its own rollouts, for one or two models. What both loops share comes from the
same places: :func:`rlfactory.engine.trainer.build_accelerator` and :mod:`rlfactory.engine.run_dir`.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlfactory.config.schema import TrainConfig
from rlfactory.engine import run_dir
from rlfactory.errors import UserError

STATE_FILE = "online_state.json"


def make_optimizer(model: Any, lr: float, train: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; no weight decay on biases and norms (as the offline engine)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    if not decay and not no_decay:
        raise UserError("no trainable parameters: check model.finetuning and the lora/freeze sections")
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused AdamW on CUDA (one kernel for all of LoRA's hundreds of small tensors), as the offline engine
    fused = torch.cuda.is_available() and all(p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=(train.adam_beta1, train.adam_beta2), fused=fused or None)


def make_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig, total_updates: int) -> Any:
    from transformers import get_scheduler

    warmup = train.warmup_steps or int(train.warmup_ratio * total_updates + 0.999)
    return get_scheduler(
        train.lr_scheduler,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_updates,
        scheduler_specific_kwargs={"min_lr_rate": 0.1} if "min_lr" in train.lr_scheduler else None,
    )


class PhaseTimer:
    """``with timer("gen"):`` adds the seconds to ``timing_s/gen`` (phases may repeat within a step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # attribute GPU work to the phase that queued it
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"timing_s/{k}": round(v, 4) for k, v in self.seconds.items()}
        self.seconds.clear()
        return out


def peak_memory_gb() -> float:
    """Peak GPU memory allocated by torch; on CPU the process's peak resident set size."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def grad_norm(accelerator: Any, model: Any, max_norm: float | None) -> torch.Tensor | float:
    """Clip (when ``max_norm``) and return the total gradient norm before clipping, as a device tensor (reading
    it would make the CPU wait for the GPU; the caller reads it once per RL step)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm is not None:
        return accelerator.clip_grad_norm_(params, max_norm).detach().float()
    return torch.stack([p.grad.detach().float().norm() for p in params]).norm()


def keep_trainable_weights(models: list[Any], weights: list[dict], _output_dir: str) -> None:
    """save_state pre-hook: a checkpoint holds trainable tensors only (a LoRA run saves adapters, not bases)."""
    for model, state in zip(models, weights, strict=False):
        names = {name for name, param in model.named_parameters() if param.requires_grad}
        for key in [k for k in state if k not in names]:
            del state[key]


def save_checkpoint(accelerator: Any, out: Path, step: int, state: dict[str, Any], keep: int | None) -> Path:
    """Models, optimizers, schedulers and RNG (Accelerate) + the loop's own state; trainer_state.json last."""
    path = out / f"{run_dir.CHECKPOINT_PREFIX}{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps(state))
        # written last: a checkpoint without trainer_state.json is incomplete and never resumed from
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": state.get("epoch", 0)}))
        run_dir.rotate_checkpoints(out, keep)
    accelerator.wait_for_everyone()
    return path


def load_checkpoint(accelerator: Any, path: Path, out: Path) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; drops log lines written after it."""
    accelerator.load_state(str(path), strict=False)
    state = json.loads((path / STATE_FILE).read_text())
    run_dir.truncate_log(out, state["step"])
    return state


def log_record(accelerator: Any, out: Path, record: dict[str, Any]) -> None:
    """One trainer_log.jsonl line (numbers only, besides ``step``) and the trackers."""
    record = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()}
    if accelerator.is_main_process:
        run_dir.append_log(out, record)
    if accelerator.log_with:
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def write_trace(out: Path, name: str, rows: list[dict[str, Any]]) -> Path:
    """``rollouts/<name>.jsonl``: one replayable line per sample."""
    folder = out / "rollouts"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
