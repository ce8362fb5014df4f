"""What an evaluation report states, as a registry of small pure functions over the problems' attempts.

Each entry is ``fn(problems, k, threshold) -> float`` over ``Attempts`` (one problem's n completions, in sampling
order), registered under a name with traits: ``per_k`` entries are reported for each k of :func:`report_ks` as
``<name>@<k>`` (pass@4, maj@4), ``needs_tools`` entries only when tools ran. :func:`summarise` asks the traits;
it never branches on a name. A completion is *correct* at ``score >= threshold`` (1.0 for 0/1 metrics such as
answer_match).

- pass@k: the unbiased estimator of Chen et al. 2021 (Codex, https://arxiv.org/abs/2107.03374, Eq. 1): of n
  samples with c correct, pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems. pass@1 = c / n, the mean
  correctness.
- maj@k: majority vote (self-consistency, Wang et al. 2022, https://arxiv.org/abs/2203.11171) over the final
  answers extracted from the first k completions; the problem counts as solved when a completion carrying the most
  frequent answer is correct (ties: the answer seen first; completions without an answer do not vote).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import comb

from rlfactory.plugins import Registry

EVAL_METRICS = Registry("evaluation report metric")


@dataclass(frozen=True)
class Attempts:
    """One problem's completions, in sampling order."""

    scores: tuple[float, ...]
    answers: tuple[str | None, ...]  # the final answer extracted from each completion (None: none found)
    lengths: tuple[int, ...]  # response tokens (with tools: every turn and the tool results spliced in)
    truncated: tuple[bool, ...]  # the token budget ran out
    tool_calls: tuple[int, ...] = ()  # calls the model made (empty: no tools ran)
    tool_failures: tuple[int, ...] = ()  # executed calls whose tool raised or timed out
    tool_executed: tuple[int, ...] = ()  # well-formed calls of a known tool (the ones that ran)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct) is correct.

    >>> [round(pass_at_k(5, 2, k), 4) for k in range(1, 6)]
    [0.4, 0.7, 0.9, 1.0, 1.0]
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    return 1.0 - comb(n - c, k) / comb(n, k)  # comb(n - c, k) is 0 when k > n - c: a correct one is certain


def majority_index(answers: tuple[str | None, ...]) -> int | None:
    """Index of the first completion carrying the most frequent answer (None when no completion has one).

    >>> majority_index(("3", None, "4", "4", "3"))
    0
    >>> majority_index(("3", "4", "4")), majority_index((None, None))
    (1, None)
    """
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def report_ks(samples: int) -> list[int]:
    """The k of pass@k and maj@k: powers of two up to ``samples``, and ``samples`` itself.

    >>> report_ks(1), report_ks(4), report_ks(6)
    ([1], [1, 2, 4], [1, 2, 4, 6])
    """
    ks = [2**i for i in range(samples.bit_length()) if 2**i <= samples]
    return ks + ([samples] if samples not in ks else [])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@EVAL_METRICS.register("mean_score")
def mean_score(problems: list[Attempts], k: int, threshold: float) -> float:
    """The metric's mean over every completion."""
    return _mean([s for p in problems for s in p.scores])


@EVAL_METRICS.register("pass", per_k=True)
def pass_at(problems: list[Attempts], k: int, threshold: float) -> float:
    """pass@k (unbiased estimator), averaged over problems."""
    return _mean([pass_at_k(len(p.scores), sum(s >= threshold for s in p.scores), k) for p in problems])


@EVAL_METRICS.register("maj", per_k=True)
def maj_at(problems: list[Attempts], k: int, threshold: float) -> float:
    """maj@k: the share of problems whose majority answer among the first k completions is correct."""
    solved = []
    for p in problems:
        top = majority_index(p.answers[:k])
        solved.append(float(top is not None and p.scores[top] >= threshold))
    return _mean(solved)


@EVAL_METRICS.register("mean_length")
def mean_length(problems: list[Attempts], k: int, threshold: float) -> float:
    """Mean completion length in tokens."""
    return _mean([float(n) for p in problems for n in p.lengths])


@EVAL_METRICS.register("truncation_rate")
def truncation_rate(problems: list[Attempts], k: int, threshold: float) -> float:
    """Share of completions that hit the token budget (max_new_tokens) before ending."""
    return _mean([float(t) for p in problems for t in p.truncated])


@EVAL_METRICS.register("tool_calls_per_problem", needs_tools=True)
def tool_calls_per_problem(problems: list[Attempts], k: int, threshold: float) -> float:
    """Tool calls in one attempt at a problem (one completion), on average."""
    return _mean([float(n) for p in problems for n in p.tool_calls])


@EVAL_METRICS.register("tool_error_rate", needs_tools=True)
def tool_error_rate(problems: list[Attempts], k: int, threshold: float) -> float:
    """Share of executed tool calls that failed (the tool raised or timed out)."""
    executed = sum(n for p in problems for n in p.tool_executed)
    return sum(n for p in problems for n in p.tool_failures) / executed if executed else 0.0


def summarise(problems: list[Attempts], samples: int, threshold: float = 1.0, tools: bool = False) -> dict[str, float]:
    """Every registered metric that applies: per-k ones for each k of :func:`report_ks`, tool ones with tools."""
    out: dict[str, float] = {}
    for name in EVAL_METRICS.names():
        traits = EVAL_METRICS.traits(name)
        if traits.get("needs_tools") and not tools:
            continue
        fn = EVAL_METRICS.get(name)
        if traits.get("per_k"):
            out.update({f"{name}@{k}": fn(problems, k, threshold) for k in report_ks(samples)})
        else:
            out[name] = fn(problems, 1, threshold)
    return out
