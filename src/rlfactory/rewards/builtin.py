"""Built-in reward functions, registered by name (``reward.functions`` / ``evaluation.metric``).

Signature of every reward function (built-in or user ``file.py:function``)::

    fn(prompt: str, completion: str, answer: str | None, example: dict) -> float | dict[str, float]

``example`` is the canonical example (the columns mapped by the registry), with every other column of the row
under ``example["columns"]``. Functions in TRL's convention (a ``completions`` parameter) are called batched, as
TRL calls them: see ``rewards/stack.py``.
"""

from __future__ import annotations

import re
from typing import Any

from rlfactory.rewards import agent as _agent_rewards  # noqa: F401 - registers the tool-calling rewards
from rlfactory.rewards.registry import REWARD_FUNCTIONS

_ANSWER_RE = re.compile(r"answer is\s*:?\s*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*\.?\d*")


def metric_score(name: str, prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> float:
    """A generation's score under the reward function ``name`` used as an evaluation metric (a dict result is
    summed): the one scorer of every stage's before/after generation line."""
    value = REWARD_FUNCTIONS.get(name)(prompt, completion, answer, example)
    return float(sum(value.values()) if isinstance(value, dict) else value)


def extract_final_answer(text: str) -> str | None:
    """The number after the last "answer is", else the last number in the text.

    >>> extract_final_answer("12 + 7 = 19. The answer is 19.")
    '19'
    >>> extract_final_answer("so we get 3, then 4") is None
    False
    """
    found = _ANSWER_RE.findall(text)
    if found:
        return found[-1].replace(",", "")
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a.strip().lower() == b.strip().lower()


@REWARD_FUNCTIONS.register("answer_match", needs_answer=True)
def answer_match(prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> float:
    """1.0 when the completion's final answer equals the ground truth (numbers compared as numbers).

    >>> answer_match("", "7 + 5 = 12. The answer is 12.", "12", {})
    1.0
    >>> answer_match("", "The answer is 13.", "12", {})
    0.0
    """
    predicted = extract_final_answer(completion)
    return float(predicted is not None and answer is not None and _same_number(predicted, str(answer)))


# --------------------------------------------------------------------------- math answers
def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (nested braces allowed), or None.

    >>> last_boxed(r"so \boxed{\frac{1}{2}} and not \boxed{3")
    '\\frac{1}{2}'
    """
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def _to_number(text: str) -> float | None:
    r"""A LaTeX-ish answer as a number: '1,000', '$5$', '\frac{3}{4}', '3/4', '50\%' (-> 50)."""
    cleaned = text.strip().strip("$").replace("\\left", "").replace("\\right", "").replace("\\!", "")
    cleaned = _FRAC_RE.sub(r"(\1)/(\2)", cleaned).replace(",", "").replace("\\%", "").rstrip("%. ")
    cleaned = cleaned.replace(" ", "").replace("(", "").replace(")", "")
    try:
        if cleaned.count("/") == 1:
            num, den = cleaned.split("/")
            return float(num) / float(den)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


@REWARD_FUNCTIONS.register("math_match", needs_answer=True)
def math_match(prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> float:
    r"""1.0 when the last ``\boxed{}`` answer (else the final number) equals the ground truth.

    Numbers, fractions and thousands separators are compared as numbers; anything else as
    whitespace-free strings.

    >>> math_match("", r"... so the result is \boxed{\frac{3}{4}}", "0.75", {})
    1.0
    >>> math_match("", "we get 1,200 apples", "1200", {})
    1.0
    >>> math_match("", r"\boxed{x+1}", "x + 1", {})
    1.0
    >>> math_match("", r"\boxed{5}", "6", {})
    0.0
    """
    if answer is None:
        return 0.0
    predicted = last_boxed(completion)
    if predicted is None:
        predicted = extract_final_answer(completion)
    if predicted is None:
        return 0.0
    a, b = _to_number(predicted), _to_number(str(answer))
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))
    return float(predicted.replace(" ", "").strip("$") == str(answer).replace(" ", "").strip("$"))


# --------------------------------------------------------------------------- format
DEFAULT_FORMAT = r"The answer is -?\d[\d,]*(\.\d+)?\.?\s*$"


@REWARD_FUNCTIONS.register("format_regex")
def format_regex(
    prompt: str, completion: str, answer: str | None, example: dict[str, Any], pattern: str = DEFAULT_FORMAT
) -> float:
    """1.0 when ``re.search(pattern, completion)`` matches (DOTALL). Default: ends with "The answer is N."

    >>> format_regex("", "3 + 4 = 7. The answer is 7.", None, {})
    1.0
    >>> format_regex("", "The answer is 7. Bye", None, {})
    0.0
    >>> format_regex("", "<a>x</a>", None, {}, pattern=r"^<a>.*</a>$")
    1.0
    """
    return float(re.search(pattern, completion, flags=re.DOTALL) is not None)


_THINK_RE = re.compile(r"^\s*<think>(.+?)</think>\s*\S", re.DOTALL)


@REWARD_FUNCTIONS.register("think_format")
def think_format(prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> float:
    """1.0 for ``<think>reasoning</think>`` followed by a non-empty answer (R1-style), with one think block.

    >>> think_format("", "<think>7 + 5 = 12</think> The answer is 12.", None, {})
    1.0
    >>> think_format("", "<think></think>12", None, {}), think_format("", "12 <think>x</think>", None, {})
    (0.0, 0.0)
    """
    match = _THINK_RE.match(completion)
    ok = match is not None and match.group(1).strip() and completion.count("<think>") == 1
    return float(bool(ok))


@REWARD_FUNCTIONS.register("json_format")
def json_format(
    prompt: str, completion: str, answer: str | None, example: dict[str, Any], required_keys: list[str] | None = None
) -> float:
    """1.0 when the completion (optionally in a ```json fence) parses as JSON with all ``required_keys``.

    >>> json_format("", '```json\\n{"answer": 3}\\n```', None, {}, required_keys=["answer"])
    1.0
    >>> json_format("", '{"answer": 3', None, {})
    0.0
    """
    import json

    text = completion.strip().removesuffix("<|im_end|>").strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, flags=re.DOTALL)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError:
        return 0.0
    if required_keys:
        return float(isinstance(value, dict) and all(key in value for key in required_keys))
    return 1.0


# --------------------------------------------------------------------------- length
@REWARD_FUNCTIONS.register("length_penalty", needs_lengths=True)
def length_penalty(
    prompt: str,
    completion: str,
    answer: str | None,
    example: dict[str, Any],
    *,
    response_length: int,
    max_response_len: int,
    overlong_buffer: int | None = None,
    penalty: float = 1.0,
) -> float:
    """DAPO soft overlong punishment: 0 up to L_max - L_cache, then a linear ramp down to -penalty at L_max.

    Paper: DAPO (Yu et al. 2025, https://arxiv.org/abs/2503.14476), Eq. 13, with L_max =
    ``max_response_len`` (token budget) and L_cache = ``overlong_buffer`` (default L_max // 4).
    Lengths are in tokens (the stack passes them). Beyond L_max the value stays -penalty.

    >>> length_penalty("", "", None, {}, response_length=60, max_response_len=100, overlong_buffer=20)
    0.0
    >>> length_penalty("", "", None, {}, response_length=90, max_response_len=100, overlong_buffer=20)
    -0.5
    >>> length_penalty("", "", None, {}, response_length=100, max_response_len=100, overlong_buffer=20)
    -1.0
    """
    buffer = max_response_len // 4 if overlong_buffer is None else overlong_buffer
    expected = max_response_len - buffer
    if response_length <= expected:
        return 0.0
    if buffer <= 0 or response_length >= max_response_len:
        return -penalty
    return (expected - response_length) / buffer * penalty
