"""Example user reward functions for `reward.functions: {examples/grpo/rewards.py:<name>: weight}`.

Signature (sync or async): fn(prompt, completion, answer, example, **function_args) -> float | dict[str, float]
- prompt: the rendered prompt text; completion: the generated text (special tokens removed)
- answer: the dataset's `answer` column (None if the dataset has none); example: the whole canonical row
A dict is summed into the component and each key is logged as reward/<name>/<key>/mean. A function that
raises or runs past reward.timeout_s scores reward.failure_score and is counted in reward/<name>/failures.
"""

from __future__ import annotations

import asyncio


def shows_work(prompt: str, completion: str, answer: str | None, example: dict, min_equations: int = 1) -> float:
    """1.0 when the completion writes at least `min_equations` equations ("a + b = c") before answering."""
    return float(completion.count("=") >= min_equations)


def answer_and_brevity(prompt: str, completion: str, answer: str | None, example: dict) -> dict[str, float]:
    """Two logged parts: correct final number, and a small bonus for answers under 120 characters."""
    from rlfactory.rewards.builtin import answer_match

    return {"correct": answer_match(prompt, completion, answer, example), "brief": 0.1 * (len(completion) < 120)}


async def remote_judge(prompt: str, completion: str, answer: str | None, example: dict) -> float:
    """Shape of an async reward (e.g. an HTTP call to a judge); all calls of a step run concurrently."""
    await asyncio.sleep(0)  # replace with: async with httpx.AsyncClient() as client: ...
    return float(bool(completion.strip()))
