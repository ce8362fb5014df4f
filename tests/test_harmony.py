"""The harmony format (GPT-OSS): a turn ends with <|return|> (answer) or <|call|> (tool call), so rollouts stop
on either; tool results are spliced as GPT-OSS's own chat template renders them; the rollout equals the training
render token for token; a GRPO run with `agent.parser: harmony` trains through the CLI.

No GPT-OSS tokenizer is available offline: the bundled tiny tokenizer gets harmony's special tokens and the
GPT-OSS chat template that TRL ships (trl/chat_templates/gptoss.jinja, the model's template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml
from tests.test_agent import ScriptedBackend, assert_rollout_equals_training_render

from rlfactory.config.schema import ModelConfig, ToolSpec
from rlfactory.envs.factory import build_env_factory
from rlfactory.model.loader import load_tokenizer
from rlfactory.render.chat import render_prompt, render_segments, stop_ids, stop_strings
from rlfactory.rollout.agent import AgentLoop, AgentSettings
from rlfactory.rollout.base import SamplingParams
from rlfactory.rollout.hf import HFBackend
from rlfactory.tasks.arith_tools import CALCULATOR_SCHEMA
from rlfactory.tools.execute import ExecLimits
from rlfactory.tools.spec import load_tools

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]


def _gptoss_template() -> str:
    import trl

    path = Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja"
    if not path.is_file():
        pytest.skip("this trl has no GPT-OSS chat template")
    return path.read_text()


def harmony_tokenizer():
    tok = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = _gptoss_template()
    return tok


@pytest.fixture(scope="module")
def harmony():
    return harmony_tokenizer()


@pytest.fixture(scope="module")
def calc():
    return load_tools([ToolSpec(function="calculator")])


def _call(expr: str) -> str:
    return f' to=functions.calculator<|channel|>commentary json<|message|>{{"expression": "{expr}"}}<|call|>'


class HarmonyScript(ScriptedBackend):
    """Scripted turns that carry their own stop token (<|call|> or <|return|>)."""

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer, scripts, stop="")
        self.turn_of = lambda text: text.count("<|start|>assistant") - 1


def test_stop_strings_are_both_harmony_ends_and_one_elsewhere(harmony):
    assert stop_strings(harmony) == ["<|return|>", "<|call|>"]
    assert stop_ids(harmony) == [harmony.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    assert stop_strings(load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))) == ["<|im_end|>"]


def test_training_render_ends_a_call_turn_at_call_and_the_answer_at_return(harmony):
    messages = [
        {"role": "user", "content": "What is 12 + 7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 7"}}}
            ],
        },
        {"role": "tool", "name": "calculator", "content": "19"},
        {"role": "assistant", "content": "The answer is 19."},
    ]
    trained = [harmony.decode(s.ids) for s in render_segments(harmony, messages, [CALCULATOR_SCHEMA]) if s.trainable]
    assert trained == [_call("12 + 7"), "<|channel|>final<|message|>The answer is 19.<|return|>"]


def test_agent_loop_stops_on_call_runs_the_tool_and_equals_the_training_render(harmony, calc):
    """Turn 1 ends with <|call|> (the tool runs, its result is spliced as the template's `functions.calculator`
    message, JSON-quoted as GPT-OSS renders it), turn 2 ends with <|return|> (the answer)."""
    script = [_call("12 + 7"), "<|channel|>final<|message|>The answer is 19.<|return|>"]
    messages = [{"role": "user", "content": "Q1: what is 12 + 7?"}]
    example = {
        "messages": messages,
        "tools": [CALCULATOR_SCHEMA],
        "answer": "19",
        "prompt_ids": render_prompt(harmony, messages, [CALCULATOR_SCHEMA]),
    }
    factory = build_env_factory("tools", calc, ExecLimits(), {})
    loop = AgentLoop(HarmonyScript(harmony, {"Q1": script}), harmony, calc, AgentSettings(4, "harmony"), factory)
    [res] = loop.run([example], SamplingParams(400))
    assert res.finish == "answer" and len(res.turns) == 2
    assert [(c["name"], c["arguments"], c["result"]) for c in res.turns[0]["calls"]] == [
        ("calculator", {"expression": "12 + 7"}, "19")
    ]
    assert res.final_text == "The answer is 19."
    spliced = [t for t, m in zip(res.completion.token_ids, res.completion.mask, strict=True) if not m]
    assert harmony.decode(spliced) == (
        '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>"19"<|end|><|start|>assistant'
    )
    assert_rollout_equals_training_render(harmony, res, example)


def test_glue_json_escapes_contents_the_template_writes_as_json(harmony):
    from rlfactory.render.chat import _apply
    from rlfactory.render.glue import ObservationGlue

    observation = [{"role": "tool", "name": "calculator", "content": 'say "hi"\nthen 5'}]
    glue = ObservationGlue(harmony).text(observation)
    assert '"say \\"hi\\"\\nthen 5"' in glue
    call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
    before = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    full = _apply(harmony, [*before, *observation], None, generation_prompt=True)
    assert full.endswith(glue)


def test_hf_backend_cuts_at_the_first_of_several_stop_tokens():
    """A real generate: two tokens of the model's own greedy output are made stop tokens; the completion ends at
    the earlier one, and a run without them goes to max_tokens."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    prompt = render_prompt(tok, [{"role": "user", "content": "What is 37 + 45?"}])
    backend = HFBackend(model, tok)
    backend.stop_ids = [-1]  # nothing stops: the greedy reference
    [free] = backend.generate([prompt], SamplingParams(12, temperature=0.0))
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    later, earlier = free.token_ids[6], free.token_ids[3]
    if later in free.token_ids[:4]:
        pytest.skip("the greedy output repeats a token; pick another prompt")
    backend.stop_ids = [later, earlier]
    [cut] = backend.generate([prompt], SamplingParams(12, temperature=0.0))
    first = free.token_ids.index(earlier)
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: first + 1]


@pytest.mark.slow
def test_grpo_with_the_harmony_parser_trains_through_the_cli(tmp_path, harmony):
    """The harmony tool path end to end (was refused before the backends stopped on several tokens): the tiny
    model with harmony's tokens added and GPT-OSS's template, 2 GRPO steps with the calculator."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "tiny-harmony"
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    model.resize_token_embeddings(len(harmony))
    with torch.no_grad():  # make <|call|> likely once a call is written, so some turns end with a real call
        head = model.get_output_embeddings().weight
        head[harmony.convert_tokens_to_ids("<|call|>")] = head[harmony.convert_tokens_to_ids("<|im_end|>")]
    model.save_pretrained(model_dir)
    harmony.save_pretrained(model_dir)
    cfg = {
        "stage": "grpo",
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
        "model": {"name_or_path": str(model_dir), "finetuning": "lora"},
        "lora": {"r": 8, "alpha": 16},
        "data": {"dataset": "arith_tool_prompts", "dataset_dir": str(DATA_DIR), "max_samples": 16},
        "tools": ["calculator"],
        "agent": {"max_turns": 2, "parser": "harmony"},
        "rollout": {"prompts_per_step": 2, "num_samples": 2, "max_prompt_len": 512, "max_response_len": 48},
        "reward": {"functions": {"answer_match": 1.0, "tool_call_validity": 0.2}},
        "algorithm": {"adv_estimator": "grpo"},
        "train": {"max_steps": 2, "per_device_batch_size": 4, "learning_rate": 1e-4},
        "evaluation": {"dataset": None},
        "logging": {"logging_steps": 1, "rollout_trace_steps": 1, "plot_loss": False},
    }
    proc = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "score/mean" in r]
    assert len(steps) == 2 and all("num_turns/mean" in r for r in steps)
    traces = [
        json.loads(line)
        for p in sorted((tmp_path / "out" / "rollouts").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert traces and all("turns" in json.dumps(t) for t in traces)
