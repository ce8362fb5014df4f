"""`evaluation.tools`: an offline stage (sft here) scores held-out prompts through the agent loop, so a model
trained on tool-call demonstrations is measured by what its calls return, as ppo/grpo validate."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from tests.conftest import DATA_DIR, TINY_MODEL

from rlfactory.config.schema import EvaluationConfig, RunConfig
from rlfactory.errors import UserError


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL), AutoTokenizer.from_pretrained(TINY_MODEL)


def _prompts(ev: EvaluationConfig) -> list[dict]:
    cfg = RunConfig(
        stage="sft",
        model={"name_or_path": str(TINY_MODEL)},
        data={"dataset": "arith_tool_sft", "dataset_dir": str(DATA_DIR)},
        evaluation=ev.model_dump(),
    )
    from rlfactory.stages.common import load_eval_prompts

    return load_eval_prompts(cfg)


@pytest.mark.slow
def test_tools_run_in_the_evaluation_and_the_final_answer_is_scored(tiny):
    """The bundled model calls the calculator on about half of the tool prompts: scored on its first turn (no
    tools) those calls are wrong answers; with evaluation.tools the calls run, their results come back and the
    answer after them is scored."""
    from rlfactory.stages.common import evaluate_generation

    model, tokenizer = tiny
    plain = EvaluationConfig(dataset="arith_tool_prompts_test", max_samples=24, max_new_tokens=32)
    with_tools = EvaluationConfig(**{**plain.model_dump(), "tools": ["calculator"], "max_new_tokens": 80})
    without = evaluate_generation(model, tokenizer, _prompts(plain), plain)
    scored = evaluate_generation(model, tokenizer, _prompts(with_tools), with_tools)
    calls = [s for s in without["samples"] if "<tool_call>" in s["completion"]]
    assert calls and all(s["score"] == 0.0 for s in calls)  # a call is not an answer
    assert not any("<tool_call>" in s["completion"] for s in scored["samples"])  # the last turn, after the calls
    assert scored["n"] == without["n"] == 24
    print(f"answer_match of the bundled model: {without['score']:.3f} without tools, {scored['score']:.3f} with")
    assert scored["score"] >= without["score"] + 0.2, (without["score"], scored["score"])


def test_evaluation_tools_are_checked_before_any_model_loads():
    ev = {"dataset": "arith_tool_prompts_test", "tools": ["python"]}  # the rows offer `calculator`
    with pytest.raises(UserError, match="offers tool 'calculator'"):
        _prompts(EvaluationConfig(**ev))
    with pytest.raises(UserError, match="unknown tool-call parser 'qwen'"):
        _prompts(EvaluationConfig(**{**ev, "tools": ["calculator"], "parser": "qwen"}))


def test_online_stages_evaluate_with_their_own_tools():
    cfg = {
        "stage": "grpo",
        "model": {"name_or_path": str(TINY_MODEL)},
        "data": {"dataset": "arith_tool_prompts"},
        "tools": ["calculator"],
        "reward": {"functions": {"answer_match": 1.0}},
        "evaluation": {"dataset": "arith_tool_prompts_test", "tools": ["calculator"]},
    }
    with pytest.raises(ValidationError, match="evaluation.tools: stage grpo evaluates through its own agent loop"):
        RunConfig(**cfg)
    sft = {"stage": "sft", "model": cfg["model"], "data": {"dataset": "arith_tool_sft"}, "tools": ["calculator"]}
    with pytest.raises(ValidationError, match="evaluation.tools runs this stage's evaluation with tools"):
        RunConfig(**sft)
