"""The generation-backend interface of the online stages: token ids in, token ids (and log-probs) out.

A backend never sees text. It continues rendered prompt ids and returns, per sample, the generated
ids exactly as sampled (token-in, token-out: these are the ids the policy is trained on), the
sampler's per-token log-probs when it has them (vLLM does; HF's ``generate`` returns processed
scores, not log-probs, so it gives None), a per-token mask (1 = produced by the policy; a multi-turn
agent loop sets 0 on tool outputs it splices in) and why generation stopped. Backends:
``hf`` (:mod:`rlfactory.rollout.hf`, generates with the policy itself) and ``vllm``
(:mod:`rlfactory.rollout.vllm`, a separate engine that ``sync_weights`` updates after each step), built by
name in :mod:`rlfactory.rollout.backends`. A backend says whether it needs that sync (``syncs_weights``), so
the loop never branches on a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from rlfactory.config.online_schema import RolloutConfig

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy (validation); ignore_eos gives fixed lengths (benchmarks)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    logprobs: bool = True  # a separate sampler (vLLM) returns the sampled tokens' log-probs (rollout.mismatch_every)

    @classmethod
    def from_rollout(cls, ro: RolloutConfig, max_tokens: int | None = None) -> SamplingParams:
        """The ``rollout:`` section's sampling settings, each by name (so none is dropped on the way to the
        sampler); ``max_tokens`` defaults to ``rollout.max_response_len``. Per-turn caps:
        ``dataclasses.replace(params, max_tokens=...)``."""
        return cls(
            max_tokens=ro.max_response_len if max_tokens is None else max_tokens,
            temperature=ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            min_p=ro.min_p,
        )


@dataclass
class Completion:
    """One generated sample: ids (ending with the end-of-turn token when finish_reason is ``stop``)."""

    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None  # the sampler's log-prob of each token, if the backend has them
    mask: list[int] | None = None  # 1 where the policy produced the token; None means all ones

    def policy_mask(self) -> list[int]:
        return self.mask if self.mask is not None else [1] * len(self.token_ids)


class GenerationBackend(Protocol):
    """What the online loop needs from a generator."""

    syncs_weights: bool  # True: the loop must call sync_weights after every update

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt id list, in order (repeat a prompt to get several samples)."""
        ...

    def sync_weights(self, model: Any) -> None:
        """Make the next ``generate`` use the current policy weights (no-op when generating with the policy)."""
        ...

    def close(self) -> None:
        """Free what the backend holds outside the process's memory (temporary files)."""
        ...
