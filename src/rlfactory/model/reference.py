"""The reference policy of the KL terms (RL) and of dpo/kto: the LoRA policy with its adapter disabled (no second
copy in memory), or a frozen copy of a model. ``with reference.weights(device) as model:`` runs ``model`` in place
of the policy, without gradients."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from rlfactory.config.schema import RunConfig

log = logging.getLogger(__name__)


class ReferencePolicy:
    def __init__(self, policy: Any, copy: Any = None):
        self.policy, self.copy = policy, copy

    @property
    def is_copy(self) -> bool:
        return self.copy is not None

    @contextlib.contextmanager
    def weights(self, device: Any) -> Iterator[Any]:
        with torch.no_grad():
            if self.copy is not None:
                self.copy.to(device)
                yield self.copy
            else:
                with self.policy.disable_adapter():
                    yield self.policy


def build_reference(cfg: RunConfig, policy: Any, ref_path: str | None = None) -> ReferencePolicy:
    if hasattr(policy, "peft_config") and hasattr(policy, "disable_adapter") and ref_path is None:
        log.info("reference model: the policy with its LoRA adapter disabled (no copy)")
        return ReferencePolicy(policy)
    log.info("reference model: frozen copy of %s", cfg.model.name_or_path)
    from rlfactory.model.loader import load_model

    return ReferencePolicy(policy, load_model(cfg.model, cfg.lora, cfg.freeze, trainable=False).eval())
