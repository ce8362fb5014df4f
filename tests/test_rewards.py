"""Reward functions and the reward stack: built-ins on hand-computed values, user files (sync and async),
failures (raising, slow, bad return values) scored and logged instead of crashing, weights and dict parts."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from rlfactory.config.schema import RewardConfig
from rlfactory.errors import UserError
from rlfactory.rewards.builtin import (
    REWARD_FUNCTIONS,
    answer_match,
    json_format,
    last_boxed,
    length_penalty,
    math_match,
    think_format,
)
from rlfactory.rewards.builtin import format_regex as format_fn
from rlfactory.rewards.stack import RewardStack, Sample, score_metrics


def sample(completion: str, answer: str | None = "12", length: int = 10) -> Sample:
    return Sample("prompt", completion, answer, {"messages": [], "answer": answer}, length)


def test_math_match_boxed_fractions_and_last_number():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert math_match("", r"so \boxed{\dfrac{1}{4}}.", "0.25", {}) == 1.0
    assert math_match("", r"\boxed{1,024}", "1024", {}) == 1.0
    assert math_match("", r"\boxed{50\%}", "50", {}) == 1.0
    assert math_match("", "3 apples, then 9 pears; total 12", "12", {}) == 1.0  # no box: the last number
    assert math_match("", r"\boxed{12} but later 13", "12", {}) == 1.0  # the box wins over later numbers
    assert math_match("", r"\boxed{x^2}", "x^2", {}) == 1.0 and math_match("", r"\boxed{x^3}", "x^2", {}) == 0.0
    assert math_match("", "no number at all", "3", {}) == 0.0 and math_match("", "3", None, {}) == 0.0


def test_format_rewards():
    assert format_fn("", "4 + 8 = 12. The answer is 12.", None, {}) == 1.0
    assert format_fn("", "The answer is twelve.", None, {}) == 0.0
    assert format_fn("", "ABC", None, {}, pattern="^[A-Z]+$") == 1.0
    assert think_format("", "<think>\n4 + 8 = 12\n</think>\nThe answer is 12.", None, {}) == 1.0
    assert think_format("", "<think> </think> 12", None, {}) == 0.0  # empty reasoning
    assert think_format("", "<think>a</think><think>b</think> 12", None, {}) == 0.0  # one block only
    assert think_format("", "<think>unclosed 12", None, {}) == 0.0
    assert json_format("", '{"answer": 12}', None, {}, required_keys=["answer"]) == 1.0
    assert json_format("", '{"result": 12}', None, {}, required_keys=["answer"]) == 0.0
    assert json_format("", "```json\n[1, 2]\n```", None, {}) == 1.0
    assert json_format("", "{'answer': 12}", None, {}) == 0.0  # not JSON


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (75, 0.0), (80, -0.2), (90, -0.6), (99, -0.96), (100, -1.0), (130, -1.0)],
)
def test_dapo_soft_overlong_punishment(length: int, expected: float):
    # L_max = 100, L_cache = 25: free up to 75 tokens, then (75 - L) / 25 down to -1 at 100
    value = length_penalty("", "", None, {}, response_length=length, max_response_len=100, overlong_buffer=25)
    assert value == pytest.approx(expected)


def test_registry_traits_and_unknown_name():
    assert REWARD_FUNCTIONS.traits("answer_match")["needs_answer"] and REWARD_FUNCTIONS.traits("math_match")
    assert REWARD_FUNCTIONS.traits("length_penalty")["needs_lengths"]
    with pytest.raises(UserError, match="unknown reward function 'answer_mach'.*did you mean 'answer_match'"):
        RewardStack(RewardConfig(functions={"answer_mach": 1.0}), 64)


def test_weights_combine_components_and_length_is_passed():
    cfg = RewardConfig(
        functions={"answer_match": 1.0, "format_regex": 0.5, "length_penalty": 2.0},
        function_args={"length_penalty": {"overlong_buffer": 8}},
    )
    stack = RewardStack(cfg, max_response_len=16)
    scores = stack.score([sample("The answer is 12.", length=4), sample("so 13", length=12)])
    assert scores.components == {
        "answer_match": [1.0, 0.0],
        "format_regex": [1.0, 0.0],
        "length_penalty": [0.0, -0.5],  # 12 tokens: (8 - 12) / 8
    }
    assert scores.total == pytest.approx([1.0 + 0.5, -1.0])
    metrics = score_metrics(scores)
    assert metrics["reward/answer_match/mean"] == 0.5 and metrics["reward/length_penalty/mean"] == -0.25
    assert metrics["reward/format_regex/failures"] == 0.0


USER_REWARDS = """
import asyncio, time

def exact(prompt, completion, answer, example, bonus=0.0):
    return float(completion.strip() == answer) + bonus

def parts(prompt, completion, answer, example):
    return {"short": float(len(completion) < 5), "has_digit": float(any(c.isdigit() for c in completion))}

async def remote(prompt, completion, answer, example):
    await asyncio.sleep(0.01)
    return 0.5

def boom(prompt, completion, answer, example):
    if completion == "bad":
        raise RuntimeError("kaput")
    return 1.0

def slow(prompt, completion, answer, example):
    time.sleep(5 if completion == "slow" else 0)
    return 1.0

async def slow_async(prompt, completion, answer, example):
    await asyncio.sleep(5 if completion == "slow" else 0)
    return 1.0

def not_a_number(prompt, completion, answer, example):
    return "yes"
"""


@pytest.fixture
def user_file(tmp_path: Path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_user_file_functions_sync_async_and_dict_parts(user_file: str):
    cfg = RewardConfig(
        functions={f"{user_file}:exact": 1.0, f"{user_file}:parts": 1.0, f"{user_file}:remote": 2.0},
        function_args={f"{user_file}:exact": {"bonus": 0.25}},
    )
    scores = RewardStack(cfg, 64).score([sample("12"), sample("twelve")])
    assert scores.components["exact"] == [1.25, 0.25]
    assert scores.components["parts"] == [2.0, 0.0]  # a dict is summed ...
    assert scores.parts == {"parts/short": [1.0, 0.0], "parts/has_digit": [1.0, 0.0]}  # ... and kept per key
    assert scores.components["remote"] == [0.5, 0.5]
    assert scores.total == [1.25 + 2.0 + 1.0, 0.25 + 0.0 + 1.0]
    assert "reward/parts/short/mean" in score_metrics(scores)


def test_raising_slow_and_malformed_rewards_fail_softly(user_file: str, caplog):
    cfg = RewardConfig(
        functions={f"{user_file}:{name}": 1.0 for name in ("boom", "slow", "slow_async", "not_a_number")},
        timeout_s=0.5,
        failure_score=-1.0,
    )
    stack = RewardStack(cfg, 64)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlfactory.rewards.stack"):
        scores = stack.score([sample("bad"), sample("slow"), sample("fine")])
    # the two 5 s calls (one per component, in turn) were cut at 0.5 s: well under 10 s, worker starts included
    assert time.monotonic() - start < 8.0
    assert scores.components["boom"] == [-1.0, 1.0, 1.0]
    assert scores.components["slow"] == [1.0, -1.0, 1.0]
    assert scores.components["slow_async"] == [1.0, -1.0, 1.0]
    assert scores.components["not_a_number"] == [-1.0, -1.0, -1.0]
    assert scores.failures == {"boom": 1, "slow": 1, "slow_async": 1, "not_a_number": 3}
    text = caplog.text
    assert "RuntimeError: kaput" in text and "timed out after 0.5s" in text and "returned 'yes'" in text


def test_user_function_errors_are_clear_before_any_model(user_file: str, tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        RewardStack(RewardConfig(functions={str(tmp_path / "nope.py:f"): 1.0}), 64)
    with pytest.raises(UserError, match="has no function 'missing'; functions there: exact"):
        RewardStack(RewardConfig(functions={f"{user_file}:missing": 1.0}), 64)
    with pytest.raises(UserError, match="cannot be called as fn"):
        RewardStack(RewardConfig(functions={"answer_match": 1.0}, function_args={"answer_match": {"tol": 1}}), 64)
    with pytest.raises(UserError, match="not in reward.functions"):
        RewardStack(RewardConfig(functions={"answer_match": 1.0}, function_args={"format_regex": {}}), 64)


def test_answer_match_is_what_evaluation_uses():
    assert answer_match("", "The answer is 12.", "12", {}) == 1.0


def test_reward_model_component(tmp_path: Path):
    """A sequence classifier directory (as stage rm saves it) is a weighted component named reward_model."""
    import torch
    from tests.conftest import TINY_MODEL
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlfactory.rewards.model import RewardModelScorer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(TINY_MODEL, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    scorer = RewardModelScorer(str(tmp_path / "rm"), "cpu")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    samples = [Sample("p", text, "5", {"messages": messages}, 3) for text in ("The answer is 5.", "no idea")]
    stack = RewardStack(
        RewardConfig(functions={"answer_match": 1.0}, reward_model=str(tmp_path / "rm"), reward_model_weight=0.5),
        64,
        reward_model=scorer,
    )
    scores = stack.score(samples)
    rm = scores.components["reward_model"]
    assert rm[0] != rm[1]
    assert scores.total == pytest.approx([1.0 + 0.5 * rm[0], 0.5 * rm[1]])
    # the same number as scoring the rendered conversation directly
    from rlfactory.model.heads import score_conversations

    direct = score_conversations(
        scorer.model, scorer.tokenizer, [messages + [{"role": "assistant", "content": "no idea"}]]
    )
    assert rm[1] == pytest.approx(direct[0], abs=1e-5)
