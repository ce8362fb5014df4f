"""The reference policy of dpo and kto: a function rows -> (summed, averaged) response log-probs, no grad.

Which one (DESIGN principle 5, LoRA first):
- LoRA: the policy itself with its adapter disabled (``disable_adapter()`` on the unwrapped PEFT model;
  no second copy in memory; adapters from ``model.adapter_paths`` are merged into the base, so they
  are part of the reference).
- full / freeze fine-tuning: a frozen copy of the starting model, or of ``dpo.ref_model``.
- ``dpo.precompute_ref_logps``: one pass before training stores the reference log-probs in the
  examples, then the copy is freed. The starting weights ARE the reference, so without ``ref_model``
  the pass uses the policy itself and no copy is ever loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from rlfactory.config.schema import RunConfig
from rlfactory.engine.offline import Batch
from rlfactory.stages.preference_data import forward_logps, run_device

log = logging.getLogger(__name__)

RefFn = Callable[[Batch, str], tuple[torch.Tensor, torch.Tensor]]  # (batch, row prefix) -> (sums, means)


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_disabled(model: Any) -> RefFn:
    """The base model under the LoRA adapter. ``model`` must be the unwrapped PEFT model (not DDP)."""

    @torch.no_grad()
    def reference(batch: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        with model.disable_adapter():
            return forward_logps(model, batch, prefix)

    return reference


def frozen(model: Any) -> RefFn:
    """A separate frozen model, moved on first use to the device of the batch (the engine places the policy)."""
    model.eval()

    @torch.no_grad()
    def reference(batch: Batch, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        device = batch[f"{prefix}input_ids"].device
        if next(model.parameters()).device != device:
            model.to(device)
        return forward_logps(model, batch, prefix)

    return reference


def load_frozen_copy(cfg: RunConfig, path: str | None) -> Any:
    """The starting model (or ``path``) with gradients off, for full/freeze fine-tuning."""
    from rlfactory.model.loader import load_model

    model_cfg = cfg.model if path is None else cfg.model.model_copy(update={"name_or_path": path, "adapter_paths": []})
    log.info("reference model: frozen copy of %s", model_cfg.name_or_path)
    return load_model(model_cfg, cfg.lora, cfg.freeze, trainable=False)


def build_reference(cfg: RunConfig, policy: Any, ref_path: str | None = None) -> RefFn:
    """Adapter-disabled policy for LoRA (unless ``ref_path``), otherwise a frozen copy."""
    if is_peft(policy) and ref_path is None:
        log.info("reference model: the policy with its LoRA adapter disabled (no copy)")
        return adapter_disabled(policy)
    return frozen(load_frozen_copy(cfg, ref_path))


def precompute_pairs(ref_path: str | None, cfg: RunConfig, policy: Any, item_sets: list[list[dict]], **kw: Any) -> None:
    """Store ``ref_chosen_logps`` / ``ref_rejected_logps`` in every pair item (summed or averaged per ``kw``).

    kw: ``collate``, ``batch_size``, ``length_normalised``. The policy at step 0 is the reference, so it is
    used directly unless ``ref_path`` names another model, which is loaded, used once and freed.
    """
    device = run_device()
    copy = load_frozen_copy(cfg, ref_path) if ref_path else None
    model = (copy or policy).to(device)
    context = model.disable_adapter() if copy is None and is_peft(model) else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    with torch.no_grad(), context:
        for items in item_sets:
            for start in range(0, len(items), kw["batch_size"]):
                chunk = items[start : start + kw["batch_size"]]
                batch = {k: v.to(device) for k, v in kw["collate"](chunk).items()}
                sums, means = forward_logps(model, batch)
                chosen, rejected = (means if kw["length_normalised"] else sums).float().cpu().chunk(2)
                for item, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True):
                    item.update(ref_chosen_logps=c, ref_rejected_logps=r)
    model.train(was_training)
    if copy is not None:
        del copy, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    log.info("reference log-probs precomputed for %d pair(s)", sum(len(items) for items in item_sets))
