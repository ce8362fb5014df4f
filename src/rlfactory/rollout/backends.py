"""The rollout backends by name (``rollout.backend``), with the traits the stages ask instead of the name.

Each entry is a builder ``(cfg, model, tokenizer) -> GenerationBackend`` that imports its module when
called, so vLLM is imported only when a run uses it. Traits: ``syncs_weights`` (the backend generates
from its own copy of the weights, which the loop updates after every step) and ``package`` (the optional
package it needs, checked before any model loads; None: nothing beyond the base install).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlfactory.plugins import Registry

if TYPE_CHECKING:
    from rlfactory.config.schema import RunConfig
    from rlfactory.rollout.base import GenerationBackend

BACKENDS = Registry("rollout backend")


@BACKENDS.register("hf", syncs_weights=False, package=None)
def hf_backend(cfg: RunConfig, model: Any, tokenizer: Any) -> GenerationBackend:
    """transformers' ``generate`` on the policy itself."""
    from rlfactory.rollout.hf import HFBackend

    assert cfg.rollout is not None
    return HFBackend(model, tokenizer, cfg.rollout.generation_batch_size)


@BACKENDS.register("vllm", syncs_weights=True, package="vllm")
def vllm_backend(cfg: RunConfig, model: Any, tokenizer: Any) -> GenerationBackend:
    """A vLLM engine in this process, synced after every update."""
    from rlfactory.rollout.vllm import VLLMBackend

    return VLLMBackend(cfg, model, tokenizer)


def build_backend(cfg: RunConfig, model: Any, tokenizer: Any) -> GenerationBackend:
    """The backend named by ``rollout.backend`` (an unknown name: a UserError listing the valid ones)."""
    assert cfg.rollout is not None
    return BACKENDS.get(cfg.rollout.backend)(cfg, model, tokenizer)


def build_overlap_sampler(cfg: RunConfig, model: Any, tokenizer: Any, seed: int) -> GenerationBackend:
    """The sampler of ``rollout.overlap``: generates the next step's rollouts in a second thread while ``model``
    trains, so it cannot be the policy itself: hf's ``generate`` on a copy of its weights (the schema refuses overlap
    with other backends), sampling from its own generator seeded with ``seed``."""
    from rlfactory.rollout.hf import CopyBackend

    assert cfg.rollout is not None and cfg.rollout.backend == "hf"
    return CopyBackend(model, tokenizer, cfg.rollout.generation_batch_size, seed)
