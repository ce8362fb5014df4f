"""The reward stack of the online stages: named functions + a reward model, weighted and summed.

Each component is a reward function (a registry name or ``path/to/file.py:function``, sync or
``async def``) called as ``fn(prompt, completion, answer, example, **function_args)``, or the
reward model. A function with a ``completions`` parameter is a TRL-style reward and is called as TRL's
GRPOTrainer calls one, once per batch: ``fn(prompts=[...], completions=[...], completion_ids=[...],
<column>=[...] for every other dataset column, **function_args) -> list[float | None]`` (conversational rows:
prompts as message lists, completions as ``[{"role": "assistant", "content": text}]``; ``None`` = does not apply,
scored 0 as TRL's nansum does).
A call that raises (``SystemExit`` too), returns something that is not a finite number (or a dict
of them: NaN and inf are failures), or runs past ``reward.timeout_s`` is a *failure*: it scores
``reward.failure_score``, is counted in ``reward/<name>/failures`` and logged once per step with its reason — a
bad reward never crashes a run. User functions run in worker processes (``rlfactory.usercode``,
``reward.num_workers`` of them, kept for the run), so a hung call, even a CPU-bound loop, is killed at its
timeout, and what they print stays out of the run's output; bundled functions are called directly. A dict
result is summed into the component; its keys are logged separately. ``reward.max_failures_in_a_row`` failed
calls of one function in a row stop the run (:class:`FailureStreaks`, checked by the online loop).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfactory.config.schema import RewardConfig
from rlfactory.errors import UserError
from rlfactory.plugins import load_user_function
from rlfactory.rewards.builtin import REWARD_FUNCTIONS
from rlfactory.usercode import Outcome, UserCodePool

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
    ref: str | None = None  # ``path/to/file.py:function`` of a user function (run in a worker process)
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
        ref = spec if is_user_function(spec) else None
        components.append(Component(name, weight, fn, kwargs, *needs, ref, trl_style=trl_style))
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
    """A finite float (or dict of them, summed) from a reward function's return value; raises on anything else."""
    if isinstance(value, dict):
        parts = {str(k): _as_score(v)[0] for k, v in value.items()}
        return sum(parts.values()), parts
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        return float(value), {}
    raise TypeError(f"returned {value!r}; expected a finite number or a dict of finite numbers")


def _call_in_process(fn: Callable[..., Any], calls: list[tuple[tuple, dict[str, Any]]]) -> list[Outcome]:
    """Bundled reward functions: ours, fast and bounded, so called directly (no worker round trip)."""
    outcomes = []
    for args, kwargs in calls:
        try:
            outcomes.append(Outcome(fn(*args, **kwargs)))
        except Exception as exc:  # e.g. a bad function_args pattern: scored as a failure like any other
            outcomes.append(Outcome(error=f"{type(exc).__name__}: {exc}"))
    return outcomes


class FailureStreaks:
    """Calls in a row that failed, per reward function, over steps: a step in which any call of a function
    succeeded resets its count. Fed the step's failure counts of every process, so every process decides alike."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.counts: dict[str, int] = {}

    def update(self, failures: dict[str, int], calls: int) -> str | None:
        """The name of a function whose streak reached the limit, else None."""
        for name, failed in failures.items():
            self.counts[name] = self.counts.get(name, 0) + failed if failed >= calls else 0
            if self.limit is not None and self.counts[name] >= self.limit:
                return name
        return None


class RewardStack:
    """Scores a batch of samples with every component and combines them with their weights."""

    def __init__(self, cfg: RewardConfig, max_response_len: int, reward_model: Any = None):
        self.cfg = cfg
        self.components = build_components(cfg)
        self.max_response_len = max_response_len
        self.reward_model = reward_model  # callable list[Sample] -> list[float], or None
        self.pool = UserCodePool(cfg.num_workers)  # user functions' worker processes, started at their first call
        self.last_errors: dict[str, str] = {}  # the latest failure of each function, for the stop message

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components] + ([RM_NAME] if self.reward_model is not None else [])

    def _call_component(self, comp: Component, samples: list[Sample]) -> list[Outcome]:
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
        return self.execute(comp, list(zip(arg_sets, kwargs, strict=True)))

    def execute(self, comp: Component, calls: list[tuple[tuple, dict[str, Any]]]) -> list[Outcome]:
        """Run ``comp`` once per ``(args, kwargs)``: how, not with what (argument building is the caller's). A user
        function runs in the worker pool, with the timeout; a bundled one in this process."""
        if comp.ref is None:
            return _call_in_process(comp.fn, calls)
        return self.pool.map(comp.ref, calls, self.cfg.timeout_s)

    def execute_batched(self, comp: Component, kwargs: dict[str, Any], n: int) -> list[Outcome]:
        """One call that scores ``n`` samples at once (it returns a list of ``n`` values), as a per-sample outcome
        list: a failed call, or a result that is not a list of ``n``, fails every sample with the reason."""
        [outcome] = self.execute(comp, [((), kwargs)])
        values = outcome.value
        if outcome.error is None and (not isinstance(values, list | tuple) or len(values) != n):
            size = f"of length {len(values)}" if hasattr(values, "__len__") else repr(values)[:80]
            outcome.error = f"returned {type(values).__name__} {size}; expected a list of {n} values, one per sample"
        if outcome.error is not None:
            return [Outcome(error=outcome.error, seconds=outcome.seconds, timed_out=outcome.timed_out)] * n
        return [Outcome(value, seconds=outcome.seconds) for value in values]

    def close(self) -> None:
        self.pool.close()

    def _call_trl(self, comp: Component, samples: list[Sample]) -> list[Outcome]:
        """One batched call, as TRL's GRPOTrainer makes it; a failed call fails every sample of the batch, and a
        ``None`` (does not apply) scores 0, as TRL's nansum does."""
        outcomes = self.execute_batched(comp, {**trl_inputs(samples), **comp.kwargs}, len(samples))
        for outcome in outcomes:
            if outcome.error is None and outcome.value is None:
                outcome.value = 0.0
        return outcomes

    def score(self, samples: list[Sample]) -> Scores:
        total = [0.0] * len(samples)
        components: dict[str, list[float]] = {}
        parts: dict[str, list[float]] = {}
        failures: dict[str, int] = {}
        for comp in self.components:
            values, errors = [], []
            for row, outcome in enumerate(self._call_component(comp, samples)):
                raw, error = outcome.value, outcome.error
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
                self.last_errors[comp.name] = errors[-1]
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
