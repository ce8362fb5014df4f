"""Built-in reward functions, registered by name (``reward.functions`` / ``evaluation.metric``).

Signature of every reward function (built-in or user ``file.py:function``)::

    fn(prompt: str, completion: str, answer: str | None, example: dict) -> float | dict[str, float]

``example`` is the canonical example (all dataset columns mapped by the registry).
"""

from __future__ import annotations

import re
from typing import Any

from rlfactory.algos.registry import Registry

REWARD_FUNCTIONS = Registry("reward function")

_ANSWER_RE = re.compile(r"answer is\s*:?\s*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*\.?\d*")


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
