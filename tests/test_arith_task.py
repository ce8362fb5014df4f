"""The bundled arithmetic task (rlfactory.tasks.arith) and its generated datasets under data/."""

from __future__ import annotations

import doctest
import json
import random
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
try:
    from rlfactory.tasks import arith
except ImportError:  # checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
    from rlfactory.tasks import arith


def test_doctests() -> None:
    result = doctest.testmod(arith)
    assert result.attempted > 5 and result.failed == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12 + 7 = 19. The answer is 19.", "19"),
        ("The answer is 3. No wait, the answer is 4.", "4"),  # last "The answer is" wins
        ("the ANSWER IS: 42", "42"),  # case-insensitive, optional colon
        ("The answer is 1,024.", "1024"),  # thousands separators
        ("The answer is -5.", "-5"),
        ("The answer is 7.0", "7"),  # integral decimals normalised
        ("The answer is 2.5", "2.5"),  # non-integral decimals kept as written
        ("The answer is 007.", "7"),
        ("3 + 4 = 7", "7"),  # no marker: last number
        ("The answer is 5. Then 6 more apples arrive.", "5"),  # marker beats a later number
        ("The answer is unknown, maybe 8", "8"),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert arith.extract_answer(text) == expected


def test_is_correct() -> None:
    assert arith.is_correct("5 + 5 = 10. The answer is 10.", "10")
    assert arith.is_correct("The answer is 10", " 10 ")
    assert arith.is_correct("The answer is 10.", "010")
    assert not arith.is_correct("5 + 5 = 11. The answer is 11.", "10")
    assert not arith.is_correct("The answer is 100.", "10")
    assert not arith.is_correct("The answer is 2.5", "2")
    assert not arith.is_correct("I don't know", "10")
    assert not arith.is_correct("", "0")


def test_problems_and_wrong_solutions() -> None:
    rng = random.Random(0)
    for _ in range(500):
        p = arith.make_problem(rng)
        assert set(p) == {"question", "answer", "solution"}
        assert int(p["answer"]) >= 0
        assert arith.is_correct(p["solution"], p["answer"])
        assert p["solution"].endswith(f"The answer is {p['answer']}.")
        lhs, rhs = p["solution"].split(". ")[0].split(" = ")
        assert eval(lhs) == int(rhs) == int(p["answer"])  # noqa: S307 - "a op b" from our own generator
        wrong = arith.wrong_solution(p, rng)
        assert wrong.startswith(lhs + " = ") and not arith.is_correct(wrong, p["answer"])
        assert int(arith.extract_answer(wrong) or -1) >= 0
    a, b = random.Random(7), random.Random(7)
    assert [arith.make_problem(a) for _ in range(20)] == [arith.make_problem(b) for _ in range(20)]


def _arithmetic_ok(solution: str) -> bool:
    """A correct "a op b = r. The answer is r." (False for anything else, e.g. a malformed tool call)."""
    try:
        lhs, rhs = solution.split(". ")[0].split(" = ")
        return eval(lhs) == int(rhs) == int(arith.extract_answer(solution) or -1)  # noqa: S307
    except (ValueError, SyntaxError, NameError):
        return False


def _load(path: Path) -> list[dict]:
    if path.suffix == ".txt":  # the pt corpus: one document per line
        return [{"text": line} for line in path.read_text().splitlines()]
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines()]


def _questions(path: Path) -> set[str]:
    qs = set()
    for row in _load(path):
        if "messages" in row:
            qs.update(m["content"] for m in row["messages"] if m["role"] == "user")
        elif "text" in row:
            qs.add(row["text"])
        elif "conversations" in row:
            qs.update(t["value"] for t in row["conversations"] if t["from"] == "human")
        else:
            qs.add(row["instruction"])
    return qs


def test_dataset_info_and_files() -> None:
    info = yaml.safe_load((DATA / "dataset_info.yaml").read_text())
    assert {"arith_sft", "arith_sft_eval", "arith_prompts", "arith_prompts_test", "arith_pref",
            "arith_pref_test", "arith_kto", "arith_sft_alpaca", "arith_pref_sharegpt"} <= set(info)
    total = 0
    for name, spec in info.items():
        path = DATA / spec["file_name"]
        assert path.is_file(), name
        total += path.stat().st_size
        rows = _load(path)
        if path.suffix == ".txt":  # the pt corpus: plain text, no columns
            assert len(rows) >= 50 and all(row["text"].strip() for row in rows), name
            continue
        assert len(rows) >= 200, name
        assert spec["formatting"] in ("openai", "alpaca", "sharegpt")
        for row in rows[:50]:
            for column in spec["columns"].values():
                assert column in row, (name, column)
            if spec["formatting"] == "openai":
                roles = [m["role"] for m in row["messages"]]
                assert roles[:2] == ["system", "user"]
                assert row["messages"][0]["content"] == arith.SYSTEM_PROMPT
            if spec.get("ranking") and spec["formatting"] == "openai":
                # a side is one assistant message, or (tool pairs) the turns up to the final answer
                chosen, rejected = ([side] if isinstance(side, dict) else side for side in (row["chosen"],
                                                                                           row["rejected"]))
                assert _arithmetic_ok(chosen[-1]["content"])
                assert not _arithmetic_ok(rejected[-1]["content"])
        if "answer" in spec["columns"].values():
            for row in rows:
                if row["messages"][-1]["role"] == "assistant":
                    assert arith.is_correct(row["messages"][-1]["content"], row["answer"])
    assert total < 5 * 2**20  # small enough to ship in the repository
    labels = [row["label"] for row in _load(DATA / "arith" / "kto_train.jsonl")]
    assert 0.4 < sum(labels) / len(labels) < 0.6


def test_test_splits_disjoint_from_train() -> None:
    arith_dir = DATA / "arith"
    test = {"sft_eval.jsonl", "prompts_test.jsonl", "pref_test.jsonl"}
    test_q = set().union(*(_questions(arith_dir / f) for f in test))
    train_q = set().union(*(_questions(p) for p in arith_dir.iterdir() if p.name not in test))
    assert len(test_q) == 600 and len(train_q) >= 5000
    assert not test_q & train_q
