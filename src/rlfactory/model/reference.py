"""The reference policy, one implementation for dpo/kto and the RL stages (ppo, grpo).

Which weights (DESIGN principle 5, LoRA first):
- LoRA: the policy itself with its adapter disabled (``model.adapters.adapters_off``, PEFT's
  ``disable_adapter()`` without its walk over every module, on the unwrapped PEFT model):
  no second copy in memory. Adapters from ``model.adapter_paths`` are merged into the base, so they are
  part of the reference.
- full / freeze fine-tuning, another model named (``dpo.ref_model``), or LoRA initialised with pissa / olora
  (the adapter-disabled policy is then the residual of the weights, not the model): a frozen copy, loaded on the
  host and moved to the device on first use (the engine places the policy, not the copy).

API::

    ref = build_reference(cfg, policy, ref_path=None)  # -> ReferencePolicy; loads a copy only when needed
    ref.is_copy                                        # True: a frozen copy; False: the adapter-disabled policy
    with ref.weights(device) as model:                 # under torch.no_grad()
        logps = forward(model, batch)                  # any forward that takes the policy takes ``model``

``weights`` yields a module to run in place of the policy: call it with the same forward (and the same
``HeadKernels``) as the policy. ``policy`` must be the unwrapped model (PEFT, not DDP or Accelerate's
wrapper): the adapter switch is on the PEFT model. The RL stages' former ``online_setup.Reference.logprobs``
is ``with ref.weights(batch["input_ids"].device) as model: forward(model, batch, rows)``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from rlfactory.config.schema import RunConfig
from rlfactory.model.adapters import adapters_off

log = logging.getLogger(__name__)


def is_peft(model: Any) -> bool:
    """A PEFT model whose adapter can be switched off (the LoRA reference needs no copy)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class ReferencePolicy:
    """The reference: the LoRA policy with its adapter disabled (no copy), or a frozen copy of a model."""

    def __init__(self, policy: Any, copy: Any | None = None) -> None:
        if copy is None and not is_peft(policy):
            raise ValueError("a reference without a copy needs a PEFT policy (its adapter is disabled)")
        self.policy = policy
        self.copy = copy

    @property
    def is_copy(self) -> bool:
        return self.copy is not None

    @contextlib.contextmanager
    def weights(self, device: torch.device | str | None = None) -> Iterator[Any]:
        """The model to run in place of the policy, under no_grad; moved to ``device`` when it is elsewhere
        (a copy on its first use; the policy only before the engine has placed it, as in a pass at step 0)."""
        model = self.copy if self.copy is not None else self.policy
        if device is not None and next(model.parameters()).device != torch.device(device):
            model.to(device)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if self.copy is None:  # PEFT's disable_adapter() without its walk over every module (model.adapters)
                stack.enter_context(adapters_off(model))
            yield model


def load_frozen_copy(cfg: RunConfig, path: str | None = None) -> Any:
    """The starting model (or the model at ``path``, without ``model.adapter_paths``), gradients off, eval mode."""
    from rlfactory.model.loader import load_model

    model_cfg = cfg.model if path is None else cfg.model.model_copy(update={"name_or_path": path, "adapter_paths": []})
    log.info("reference model: frozen copy of %s", model_cfg.name_or_path)
    return load_model(model_cfg, cfg.lora, cfg.freeze, trainable=False).eval()


def build_reference(cfg: RunConfig, policy: Any, ref_path: str | None = None) -> ReferencePolicy:
    """Adapter-disabled policy for LoRA (unless ``ref_path`` names another model, or ``lora.init_lora_weights``
    pissa / olora made the frozen base a residual), otherwise a frozen copy."""
    if is_peft(policy) and cfg.lora.changes_base() and ref_path is None:
        log.info(
            "lora.init_lora_weights %s changed the base weights: the reference is a copy", cfg.lora.init_lora_weights
        )
    elif is_peft(policy) and ref_path is None:
        log.info("reference model: the policy with its LoRA adapter disabled (no copy)")
        return ReferencePolicy(policy)
    return ReferencePolicy(policy, load_frozen_copy(cfg, ref_path))
