"""The reward stack of the online stages: named functions + a reward model, weighted and summed.

Each component is a reward function (a registry name or ``path/to/file.py:function``, sync or
``async def``) called as ``fn(prompt, completion, answer, example, **function_args)``, or the
reward model. A function with a ``completions`` parameter is a TRL-style reward and is called as TRL's
GRPOTrainer calls one, once per batch: ``fn(prompts=[...], completions=[...], completion_ids=[...],
<column>=[...] for every other dataset column, **function_args) -> list[float | None]`` (conversational rows:
prompts as message lists, completions as ``[{"role": "assistant", "content": text}]``; ``None`` = does not apply,
scored 0 as TRL's nansum does). A call that raises, returns something that is not a number (or a dict of numbers), or
runs past ``reward.timeout_s`` is a *failure*: it scores ``reward.failure_score``, is counted in
``reward/<name>/failures`` and logged once per step — a bad reward never crashes a run. Calls run
on daemon threads, ``reward.num_workers`` at a time, so a hung function cannot block the run (its
thread is abandoned). A dict result is summed into the component; its keys are logged separately.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfactory.config.schema import RewardConfig
from rlfactory.errors import UserError
from rlfactory.plugins import load_user_function
from rlfactory.rewards.builtin import REWARD_FUNCTIONS

log = logging.getLogger(__name__)

RM_NAME = "reward_model"


@dataclass
class Sample:
    """What a reward sees of one rollout."""

    prompt: str  # the rendered prompt text
    completion: str  # the generated text (special tokens removed)
    answer: str | None
    example: dict[str, Any]
    response_length: int  # generated tokens
    completion_ids: list[int] | None = None  # the generated ids (TRL-style rewards get them)


@dataclass
class Component:
    name: str
    weight: float
    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    needs_answer: bool = False
    needs_lengths: bool = False
    trl_style: bool = False  # batched fn(prompts, completions, completion_ids, **columns) -> list


TRL_ARGS = ("prompts", "completions", "completion_ids")


def is_trl_style(fn: Callable[..., Any]) -> bool:
    """TRL's reward convention is recognised by its ``completions`` parameter (ours takes ``completion``)."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def trl_required_columns(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[str]:
    """Dataset columns a TRL-style reward cannot run without: its parameters without a default, beyond TRL's own
    arguments and ``reward.function_args``."""
    return [
        name
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and name not in TRL_ARGS
        and name not in kwargs
    ]


@dataclass
class Scores:
    """Per-sample total and per-component raw scores, plus failures per component."""

    total: list[float]
    components: dict[str, list[float]]
    parts: dict[str, list[float]]  # "<component>/<key>" for dict results
    failures: dict[str, int]


def is_user_function(spec: str) -> bool:
    return ":" in spec and spec.rpartition(":")[0].endswith(".py")


def build_components(cfg: RewardConfig) -> list[Component]:
    """Resolve ``reward.functions`` (and check ``function_args``) without loading any model."""
    unknown = set(cfg.function_args) - set(cfg.functions)
    if unknown:
        raise UserError(f"reward.function_args: {sorted(unknown)} not in reward.functions ({', '.join(cfg.functions)})")
    components, short_names = [], [s.rpartition(":")[2] if is_user_function(s) else s for s in cfg.functions]
    for (spec, weight), short in zip(cfg.functions.items(), short_names, strict=True):
        name = short if short_names.count(short) == 1 else spec
        if is_user_function(spec):
            fn, traits = load_user_function(spec), {}
        else:
            fn, traits = REWARD_FUNCTIONS.get(spec), REWARD_FUNCTIONS.traits(spec)
        kwargs = dict(cfg.function_args.get(spec, {}))
        trl_style = is_trl_style(fn)
        if not trl_style:
            _check_signature(spec, fn, kwargs, traits.get("needs_lengths", False))
        needs = traits.get("needs_answer", False), traits.get("needs_lengths", False)
        components.append(Component(name, weight, fn, kwargs, *needs, trl_style=trl_style))
    return components


def _check_signature(spec: str, fn: Callable[..., Any], kwargs: dict[str, Any], lengths: bool) -> None:
    extra = {"response_length": 0, "max_response_len": 0} if lengths else {}
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer", {}, **kwargs, **extra)
    except TypeError as exc:
        raise UserError(
            f"reward function '{spec}' cannot be called as fn(prompt, completion, answer, example"
            f"{''.join(', ' + k + '=...' for k in kwargs)}): {exc}; check reward.function_args"
        ) from None


def _as_score(value: Any) -> tuple[float, dict[str, float]]:
    """A float (or dict of floats, summed) from a reward function's return value; raises on anything else."""
    if isinstance(value, dict):
        parts = {str(k): _as_score(v)[0] for k, v in value.items()}
        return sum(parts.values()), parts
    if isinstance(value, bool | int | float) and not math.isnan(float(value)):
        return float(value), {}
    raise TypeError(f"returned {value!r}; expected a number or a dict of numbers")


def _run_threads(calls: list[Callable[[], Any]], timeout: float, workers: int) -> list[tuple[Any, str | None]]:
    """Run zero-argument calls on daemon threads, ``workers`` at a time; (result, error) per call."""
    results: list[tuple[Any, str | None]] = [(None, f"timed out after {timeout:g}s")] * len(calls)

    def target(i: int, call: Callable[[], Any]) -> None:
        try:
            results[i] = (call(), None)
        except Exception as exc:  # a user reward failed: recorded, never raised
            results[i] = (None, f"{type(exc).__name__}: {exc}")

    for start in range(0, len(calls), workers):
        threads = [
            threading.Thread(target=target, args=(i, calls[i]), daemon=True)
            for i in range(start, min(start + workers, len(calls)))
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    return results


def _run_async(fn: Callable[..., Any], arg_sets: list[tuple], kwargs: list[dict], timeout: float) -> list:
    """All calls of an ``async def`` reward in one event loop (on a daemon thread), each with its own timeout."""

    async def one(args: tuple, kw: dict) -> Any:
        return await asyncio.wait_for(fn(*args, **kw), timeout)

    async def gather() -> list:
        calls = (one(a, k) for a, k in zip(arg_sets, kwargs, strict=True))
        return await asyncio.gather(*calls, return_exceptions=True)

    [(outcome, error)] = _run_threads([lambda: asyncio.run(gather())], timeout + 1.0, 1)
    if error is not None:
        return [(None, error)] * len(arg_sets)
    return [
        (None, f"timed out after {timeout:g}s")
        if isinstance(r, asyncio.TimeoutError | TimeoutError)
        else (None, f"{type(r).__name__}: {r}")
        if isinstance(r, BaseException)
        else (r, None)
        for r in outcome
    ]


class RewardStack:
    """Scores a batch of samples with every component and combines them with their weights."""

    def __init__(self, cfg: RewardConfig, max_response_len: int, reward_model: Any = None):
        self.cfg = cfg
        self.components = build_components(cfg)
        self.max_response_len = max_response_len
        self.reward_model = reward_model  # callable list[Sample] -> list[float], or None

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components] + ([RM_NAME] if self.reward_model is not None else [])

    def _call_component(self, comp: Component, samples: list[Sample]) -> list[tuple[Any, str | None]]:
        if comp.trl_style:
            return self._call_trl(comp, samples)
        arg_sets = [(s.prompt, s.completion, s.answer, s.example) for s in samples]
        kwargs = [
            {
                **comp.kwargs,
                **(
                    {"response_length": s.response_length, "max_response_len": self.max_response_len}
                    if comp.needs_lengths
                    else {}
                ),
            }
            for s in samples
        ]
        if inspect.iscoroutinefunction(comp.fn):
            return _run_async(comp.fn, arg_sets, kwargs, self.cfg.timeout_s)
        calls = [lambda a=a, k=k: comp.fn(*a, **k) for a, k in zip(arg_sets, kwargs, strict=True)]
        return _run_threads(calls, self.cfg.timeout_s, self.cfg.num_workers)

    def _call_trl(self, comp: Component, samples: list[Sample]) -> list[tuple[Any, str | None]]:
        """One batched call, as TRL's GRPOTrainer makes it; a failed call fails every sample of the batch."""
        kwargs = {**trl_inputs(samples), **comp.kwargs}
        if inspect.iscoroutinefunction(comp.fn):
            [(values, error)] = _run_async(comp.fn, [()], [kwargs], self.cfg.timeout_s)
        else:
            [(values, error)] = _run_threads([lambda: comp.fn(**kwargs)], self.cfg.timeout_s, 1)
        if error is None and (not isinstance(values, list | tuple) or len(values) != len(samples)):
            error = f"returned {type(values).__name__} of length {len(values) if hasattr(values, '__len__') else '?'}"
            error += f"; a TRL-style reward returns one value per completion ({len(samples)})"
        if error is not None:
            return [(None, error)] * len(samples)
        return [(0.0 if value is None else value, None) for value in values]

    def score(self, samples: list[Sample]) -> Scores:
        total = [0.0] * len(samples)
        components: dict[str, list[float]] = {}
        parts: dict[str, list[float]] = {}
        failures: dict[str, int] = {}
        for comp in self.components:
            values, errors = [], []
            for row, (raw, error) in enumerate(self._call_component(comp, samples)):
                if error is None:
                    try:
                        value, sub = _as_score(raw)
                        for key, part in sub.items():
                            parts.setdefault(f"{comp.name}/{key}", [0.0] * len(samples))[row] = part
                    except TypeError as exc:
                        error = str(exc)
                if error is not None:
                    value = self.cfg.failure_score
                    errors.append(error)
                values.append(value)
            if errors:
                log.warning(
                    "reward '%s' failed on %d/%d samples (first: %s)", comp.name, len(errors), len(samples), errors[0]
                )
            components[comp.name], failures[comp.name] = values, len(errors)
            total = [t + comp.weight * v for t, v in zip(total, values, strict=True)]
        if self.reward_model is not None:
            values = [float(v) for v in self.reward_model(samples)]
            components[RM_NAME], failures[RM_NAME] = values, 0
            total = [t + self.cfg.reward_model_weight * v for t, v in zip(total, values, strict=True)]
        return Scores(total, components, parts, failures)


def trl_inputs(samples: list[Sample]) -> dict[str, list[Any]]:
    """TRL's reward arguments for a batch: prompts and completions (strings for standard rows, messages for
    conversations), completion ids, and every other dataset column as a list (``example["columns"]``)."""
    plain = [bool(s.example.get("plain")) for s in samples]
    inputs: dict[str, list[Any]] = {
        "prompts": [
            _trl_prompt(s.example) if p else s.example["messages"] for s, p in zip(samples, plain, strict=True)
        ],
        "completions": [
            s.completion if p else [{"role": "assistant", "content": s.completion}]
            for s, p in zip(samples, plain, strict=True)
        ],
        "completion_ids": [s.completion_ids for s in samples],
    }
    names = {key for s in samples for key in s.example.get("columns", {})} - set(TRL_ARGS)
    for name in sorted(names):
        inputs[name] = [s.example.get("columns", {}).get(name) for s in samples]
    return inputs


def _trl_prompt(example: dict[str, Any]) -> str:
    """A standard row's prompt text, as the dataset gave it."""
    return "".join(m["content"] for m in example["messages"])


def score_metrics(scores: Scores, prefix: str = "reward") -> dict[str, float]:
    """``reward/<name>/mean`` per component (and dict part), ``reward/<name>/failures``."""
    mean = lambda values: sum(values) / max(len(values), 1)
    metrics = {f"{prefix}/{name}/mean": mean(values) for name, values in {**scores.components, **scores.parts}.items()}
    metrics.update({f"{prefix}/{name}/failures": float(n) for name, n in scores.failures.items()})
    return metrics
