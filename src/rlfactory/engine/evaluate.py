"""The one evaluation path: completions of held-out prompts, scored by a reward function used as a metric.

Every evaluation goes through :func:`evaluate`: the offline stages' before/after score
(``stages.common.evaluate_generation``), the online loop's validation (``engine.online.loop.validate``) and
``rlfactory eval`` (``use.evaluate``). What differs between them is only what they hand in: the sampler (a
``Rollouts``: an hf or vLLM backend, through the agent loop when tools run), the sampling settings (greedy in runs;
k samples at a temperature in ``rlfactory eval``) and, for the online loop, the reward stack whose parts it logs as
``val/reward/*``.

Several processes: call it on every process with the same prompts. The (prompt, sample) items are split into equal
contiguous shares, the last padded with repeats of the first item, so every process makes the same backend calls
(under zero3 / fsdp2 every forward is collective: transformers' ``synced_gpus`` keeps the processes stepping
together inside a ``generate``); padding is dropped before scoring, and the scored samples are gathered in process
order, so every process returns what one process would have.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlfactory.engine.online.ranks import Ranks
from rlfactory.engine.shared import process_state
from rlfactory.rewards.stack import Sample, Scores

if TYPE_CHECKING:
    from rlfactory.rewards.stack import RewardStack
    from rlfactory.rollout.agent import Rollouts
    from rlfactory.rollout.base import SamplingParams


@dataclass
class Scored:
    """One completion of one prompt, as scored."""

    problem: int  # index of its prompt in the list given to ``evaluate``
    sample: Sample  # what rewards saw: prompt text, completion (the last turn with tools), answer, example, length
    score: float  # the metric
    finish_reason: str  # "length": the token budget ran out
    reward: float = 0.0  # the reward stack's weighted total (when one was given)
    components: dict[str, float] = field(default_factory=dict)  # its components' raw values
    parts: dict[str, float] = field(default_factory=dict)  # "<component>/<key>" of dict-valued rewards

    def row(self) -> dict[str, Any]:
        """Its trace line: the prompt's last message, the completion, the answer, the score and, when tools ran,
        how the episode ended and every turn (calls, results)."""
        from rlfactory.rollout.agent import episode_trace_fields

        return {
            "prompt": self.sample.example["messages"][-1]["content"],
            "completion": self.sample.completion,
            "answer": self.sample.answer,
            "score": self.score,
            **episode_trace_fields(self.sample.example),
        }


@dataclass
class Evaluated:
    """Every scored completion, in prompt order (a prompt's samples together), and reward failures per component."""

    scored: list[Scored]
    failures: dict[str, int] = field(default_factory=dict)

    def mean_score(self) -> float:
        return sum(s.score for s in self.scored) / len(self.scored)

    def reward_scores(self) -> Scores:
        """The reward stack's ``Scores`` over all samples, as one process would have made them (a dict reward's
        part that some samples lack is 0.0 for them, as ``RewardStack.score`` records it)."""
        names = lambda attr: dict.fromkeys(k for s in self.scored for k in getattr(s, attr))
        components = {n: [s.components.get(n, 0.0) for s in self.scored] for n in names("components")}
        parts = {n: [s.parts.get(n, 0.0) for s in self.scored] for n in names("parts")}
        return Scores([s.reward for s in self.scored], components, parts, dict(self.failures))


def render_eval_prompts(tokenizer: Any, prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompts with ``prompt_ids`` (the one rendering path, as rollouts render them); a row's template error
    names the row."""
    from rlfactory.render.chat import for_row, render_prompt

    rendered = []
    for example in prompts:
        with for_row(example):
            rendered.append(
                {**example, "prompt_ids": render_prompt(tokenizer, example["messages"], example.get("tools"))}
            )
    return rendered


def evaluate(
    rollouts: Rollouts,
    tokenizer: Any,
    prompts: list[dict[str, Any]],
    params: SamplingParams,
    metric: str,
    samples: int = 1,
    rewards: RewardStack | None = None,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> Evaluated:
    """``samples`` completions of each prompt (which carries ``prompt_ids``), scored by the reward function
    ``metric`` and, when given, by the reward stack ``rewards``; every process returns the same result.

    ``autocast`` wraps generation only (the online loop's mixed precision); scoring runs outside it."""
    from rlfactory.rewards.builtin import metric_score

    ranks = Ranks(process_state())  # PartialState: the run's Accelerator shares it, and a script without one works
    items = [(i, example) for i, example in enumerate(prompts) for _ in range(samples)]  # a prompt's samples adjoin
    share = math.ceil(len(items) / ranks.world)
    mine = items[ranks.rank * share : (ranks.rank + 1) * share]
    padded = mine + [items[0]] * (share - len(mine))
    with autocast():
        completions, finals, seen = rollouts.generate([example for _, example in padded], params)
    decode = tokenizer.decode
    kept = [
        Sample(
            decode(example["prompt_ids"]),
            decode(c.token_ids, skip_special_tokens=True) if final is None else final,
            example.get("answer"),
            example,
            len(c.token_ids),
            list(c.token_ids),
        )
        for c, final, example in zip(completions[: len(mine)], finals, seen, strict=False)  # padding left out
    ]
    scored = [
        Scored(i, s, metric_score(metric, s.prompt, s.completion, s.answer, s.example), c.finish_reason)
        for (i, _), s, c in zip(mine, kept, completions, strict=False)
    ]
    failures: dict[str, int] = {}
    if rewards is not None and scored:
        scores = rewards.score(kept)
        for row, one in enumerate(scored):
            one.reward = scores.total[row]
            one.components = {name: values[row] for name, values in scores.components.items()}
            one.parts = {name: values[row] for name, values in scores.parts.items()}
        failures = scores.failures
    # in process order, which is the items' order; one process: returned as they are
    return Evaluated(ranks.gather_objects(scored), ranks.sum_counts(failures))
