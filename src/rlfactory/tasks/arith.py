"""Bundled synthetic task: arithmetic word problems with checkable integer answers.

The task is small enough for a ~2M-parameter model to learn partially, so every
post-training stage (SFT, DPO, KTO, PPO, GRPO, ...) has room to show a gain, and
the answer can be verified exactly, so it doubles as an RL reward.

>>> import random
>>> p = make_problem(random.Random(0))
>>> sorted(p)
['answer', 'question', 'solution']
>>> is_correct(p["solution"], p["answer"])
True
>>> is_correct(wrong_solution(p, random.Random(1)), p["answer"])
False
"""

from __future__ import annotations

import random
import re

__all__ = ["SYSTEM_PROMPT", "extract_answer", "is_correct", "make_problem", "wrong_solution"]

SYSTEM_PROMPT = "Solve the problem. End with 'The answer is N.'"

NAMES = (
    "Tom",
    "Anna",
    "Ben",
    "Mia",
    "Sam",
    "Lily",
    "Max",
    "Emma",
    "Leo",
    "Zoe",
    "Jack",
    "Ella",
    "Noah",
    "Ava",
    "Omar",
    "Nina",
    "Ravi",
    "Yuki",
    "Carl",
    "Ines",
)
OBJECTS = (
    "apples",
    "pencils",
    "books",
    "stickers",
    "marbles",
    "cookies",
    "coins",
    "cards",
    "shells",
    "stamps",
    "balloons",
    "candies",
    "toys",
    "eggs",
    "flowers",
    "rocks",
)

# (operator, template). Placeholders: {n} name, {m} second name, {o} object, {a} {b} operands.
_ADD = (
    "{n} has {a} {o} and buys {b} more. How many {o} does {n} have now?",
    "{n} had {a} {o}. {m} gave {n} {b} more {o}. How many {o} does {n} have now?",
    "There are {a} {o} in a box and {b} {o} on the table. How many {o} are there in total?",
    "{n} collected {a} {o} on Monday and {b} {o} on Tuesday. How many {o} did {n} collect?",
)
_SUB = (
    "{n} has {a} {o} and gives {b} to {m}. How many {o} does {n} have left?",
    "There were {a} {o} in a bag. {n} took out {b} of them. How many {o} are still in the bag?",
    "{n} had {a} {o} and lost {b} of them. How many {o} does {n} have now?",
)
_MUL = (
    "{n} buys {a} boxes of {o}. Each box holds {b} {o}. How many {o} does {n} buy?",
    "{n} has {a} bags with {b} {o} in each bag. How many {o} does {n} have in total?",
)

_ANSWER_RE = re.compile(r"answer is\s*:?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def make_problem(rng: random.Random) -> dict[str, str]:
    """Draw one problem: ``{"question", "answer", "solution"}`` (``answer`` is a str of an int).

    Operands are 1..50 for addition and subtraction (the result of a subtraction is never
    negative) and 2..9 for multiplication.

    >>> p = make_problem(random.Random(3))
    >>> p["solution"].endswith(f"The answer is {p['answer']}.")
    True
    """
    kind = rng.choices(("add", "sub", "mul"), weights=(0.45, 0.35, 0.2))[0]
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        template, sym, result = rng.choice(_MUL), "*", a * b
    else:
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        if kind == "add":
            template, sym, result = rng.choice(_ADD), "+", a + b
        else:
            a, b = max(a, b), min(a, b)
            template, sym, result = rng.choice(_SUB), "-", a - b
    name, other = rng.sample(NAMES, 2)
    question = template.format(n=name, m=other, o=rng.choice(OBJECTS), a=a, b=b)
    solution = f"{a} {sym} {b} = {result}. The answer is {result}."
    return {"question": question, "answer": str(result), "solution": solution}


def wrong_solution(problem: dict[str, str], rng: random.Random) -> str:
    """A plausible but wrong solution in the same format (the final result is off).

    >>> p = {"question": "...", "answer": "19", "solution": "12 + 7 = 19. The answer is 19."}
    >>> s = wrong_solution(p, random.Random(0))
    >>> s.startswith("12 + 7 = ") and extract_answer(s) != "19"
    True
    """
    correct = int(problem["answer"])
    lhs = problem["solution"].split(" = ")[0]
    wrong = correct
    while wrong == correct or wrong < 0:
        wrong = correct + rng.choice((-1, 1)) * rng.choice((1, 1, 2, 3, 5, 10))
    return f"{lhs} = {wrong}. The answer is {wrong}."


def _normalize(num: str) -> str:
    num = num.replace(",", "")
    if "." in num:
        whole, frac = num.split(".", 1)
        if frac.strip("0"):
            return num
        num = whole
    try:
        return str(int(num))
    except ValueError:
        return num


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the number after the last "The answer is",
    falling back to the last number anywhere; ``None`` if there is no number.

    >>> extract_answer("12 + 7 = 19. The answer is 19.")
    '19'
    >>> extract_answer("The answer is 3. Wait, the answer is 1,024.")
    '1024'
    >>> extract_answer("I think it is 42")
    '42'
    >>> extract_answer("The answer is 7.0") , extract_answer("no idea") is None
    ('7', True)
    """
    matches = _ANSWER_RE.findall(text)
    if matches:
        return _normalize(matches[-1])
    numbers = _NUMBER_RE.findall(text)
    return _normalize(numbers[-1]) if numbers else None


def is_correct(completion: str, answer: str) -> bool:
    """Whether the answer extracted from ``completion`` equals ``answer``.

    >>> is_correct("5 + 5 = 10. The answer is 10.", "10")
    True
    >>> is_correct("5 + 5 = 11. The answer is 11.", "10")
    False
    >>> is_correct("", "10")
    False
    """
    got = extract_answer(completion)
    return got is not None and got == _normalize(str(answer).strip())
