"""The agent loop: token-exact masks across a three-turn conversation, identity with the training render,
tool failures that do not stop the run, budgets, environments, metrics, and the loss ignoring masked tokens."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import TINY_MODEL

from rlfactory.config.online_schema import RolloutConfig
from rlfactory.config.schema import ModelConfig, ToolSpec
from rlfactory.envs.factory import build_env_factory
from rlfactory.model.loader import load_tokenizer
from rlfactory.render.chat import render_prompt, render_segments
from rlfactory.render.glue import ObservationGlue
from rlfactory.rollout.agent import AgentLoop, AgentSettings, episode_metrics
from rlfactory.rollout.base import Completion, SamplingParams
from rlfactory.tasks.arith_tools import CALCULATOR_SCHEMA
from rlfactory.tools.execute import ExecLimits
from rlfactory.tools.spec import Tool, load_tools

SYSTEM = {"role": "system", "content": "Solve the problem. End with 'The answer is N.'"}


def _call(expr: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


class ScriptedBackend:
    """Replays assistant turns per conversation (keyed by its prompt), tokenized as the template renders them,
    with made-up sampler log-probs; records every batched call."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], stop: str = "<|im_end|>"):
        self.tok, self.scripts, self.stop = tokenizer, scripts, stop
        self.calls: list[int] = []
        self.params: list[SamplingParams] = []
        self.turn_of = lambda text: text.count("<|im_start|>assistant") - 1

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        self.params.append(params)
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            key = next(k for k in self.scripts if k in text)
            turn = self.turn_of(text)
            ids = self.tok.encode(self.scripts[key][turn] + self.stop, add_special_tokens=False)
            if len(ids) > params.max_tokens:
                out.append(Completion(ids[: params.max_tokens], "length", [-0.5] * params.max_tokens))
            else:
                out.append(Completion(ids, "stop", [-0.5] * len(ids)))
        return out

    def sync_weights(self, model):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))


def _example(tokenizer, question: str, tools=None) -> dict:
    tools = tools or [CALCULATOR_SCHEMA]
    messages = [SYSTEM, {"role": "user", "content": question}]
    return {
        "messages": messages,
        "tools": tools,
        "answer": "40",
        "prompt_ids": render_prompt(tokenizer, messages, tools),
    }


def _loop(tokenizer, backend, tools: dict[str, Tool], env="tools", max_turns=4, limits=None, **env_args):
    factory = build_env_factory(env, tools, limits or ExecLimits(), env_args)
    return AgentLoop(backend, tokenizer, tools, AgentSettings(max_turns), factory)


@pytest.fixture(scope="module")
def calc():
    return load_tools([ToolSpec(function="calculator")])


def training_render(tokenizer, res, example) -> tuple[list[int], list[int]]:
    """(ids, mask) of the conversation the loop built, rendered for training (render/chat.py); prompt included."""
    segments = [s for s in render_segments(tokenizer, res.messages, example["tools"]) if s.message_index >= 0]
    return [t for s in segments for t in s.ids], [int(s.trainable) for s in segments for _ in s.ids]


def assert_rollout_equals_training_render(tokenizer, res, example) -> None:
    """The rollout's prompt + response ids and mask equal the training render of the same conversation."""
    ids, mask = training_render(tokenizer, res, example)
    n_prompt = len(example["prompt_ids"])
    assert ids[:n_prompt] == example["prompt_ids"]
    assert ids[n_prompt:] == res.completion.token_ids
    assert mask[n_prompt:] == res.completion.mask


THREE_TURNS = [
    "Let me add first.\n" + _call("12 + 7"),
    _call("19 * 2") + "\n" + _call("38 + 2"),  # two calls in one turn
    "19 * 2 + 2 = 40. The answer is 40.",
]


def test_three_turn_masks_are_token_exact_and_equal_the_training_render(tokenizer, calc):
    backend = ScriptedBackend(tokenizer, {"Q1": THREE_TURNS})
    example = _example(tokenizer, "Q1")
    [res] = _loop(tokenizer, backend, calc).run([example], SamplingParams(400))
    assert res.finish == "answer" and len(res.turns) == 3
    assert [c["result"] for t in res.turns for c in t["calls"]] == ["19", "38", "40"]
    # the conversation the loop built, rendered for training (render/chat.py), gives the same tokens and masks
    assert_rollout_equals_training_render(tokenizer, res, example)
    # mask 1 is exactly the three sampled turns, each ending with the end-of-turn token
    spans, current = [], []
    for token, m in zip(res.completion.token_ids, res.completion.mask, strict=True):
        if m:
            current.append(token)
        elif current:
            spans, current = [*spans, current], []
    spans.append(current)
    assert [tokenizer.decode(s) for s in spans] == [t + "<|im_end|>" for t in THREE_TURNS]
    # sampler log-probs on sampled tokens, a 0.0 placeholder on spliced ones
    assert [lp for lp, m in zip(res.completion.logprobs, res.completion.mask, strict=True) if m] == [-0.5] * sum(
        res.completion.mask
    )
    assert all(lp == 0.0 for lp, m in zip(res.completion.logprobs, res.completion.mask, strict=True) if not m)
    assert res.final_text == THREE_TURNS[-1]


def test_every_turn_samples_with_the_rollout_settings(tokenizer, calc):
    """A turn's cap (what is left of the budget) changes max_tokens only: min_p, top_k, top_p and temperature of
    ``rollout:`` reach every turn's backend call."""
    backend = ScriptedBackend(tokenizer, {"Q1": THREE_TURNS})
    settings = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05}
    params = SamplingParams.from_rollout(RolloutConfig(max_response_len=400, **settings))
    [res] = _loop(tokenizer, backend, calc).run([_example(tokenizer, "Q1")], params)
    caps = [p.max_tokens for p in backend.params]
    assert len(res.turns) == 3 and caps[0] == 400 and caps[0] > caps[1] > caps[2]  # capped by what is left
    assert backend.params == [SamplingParams(max_tokens=cap, **settings) for cap in caps]


def test_glue_from_prefix_differences_equals_a_full_render(tokenizer):
    glue = ObservationGlue(tokenizer)
    for observation in (
        [{"role": "tool", "name": "calculator", "content": "19"}],
        [{"role": "tool", "name": "a", "content": "1"}, {"role": "tool", "name": "b", "content": "x\ny"}],
        [{"role": "user", "content": "Try again."}],
    ):
        calls = [{"type": "function", "function": {"name": m.get("name", ""), "arguments": {}}} for m in observation]
        assistant = {
            "role": "assistant",
            "content": "ok",
            **({"tool_calls": calls} if calls[0]["function"]["name"] else {}),
        }
        messages = [SYSTEM, {"role": "user", "content": "hi"}, assistant]
        before = tokenizer.apply_chat_template(messages, tokenize=False)
        full = tokenizer.apply_chat_template(messages + observation, tokenize=False, add_generation_prompt=True)
        cut = before.rfind("<|im_end|>") + len("<|im_end|>")
        assert glue.text(observation) == full[cut:]


def test_one_batched_backend_call_per_round(tokenizer, calc):
    scripts = {"Q1": THREE_TURNS, "Q2": ["The answer is 5."], "Q3": [_call("2 + 3"), "The answer is 5."]}
    backend = ScriptedBackend(tokenizer, scripts)
    examples = [_example(tokenizer, q) for q in scripts]
    results = _loop(tokenizer, backend, calc).run(examples, SamplingParams(400))
    assert backend.calls == [3, 2, 1]  # live conversations per round
    assert [len(r.turns) for r in results] == [3, 1, 2]


def test_failing_tools_return_errors_and_the_conversation_continues(tokenizer, tmp_path):
    path = tmp_path / "t.py"
    path.write_text(
        "import time\n\n"
        "def slow(x: str) -> str:\n    '''Slow.\n\n    Args:\n        x: x.\n    '''\n    time.sleep(30)\n\n\n"
        "def boom(x: str) -> str:\n    '''Boom.\n\n    Args:\n        x: x.\n    '''\n    raise KeyError(x)\n"
    )
    tools = load_tools([ToolSpec(function=f"{path}:slow", timeout_s=0.3), ToolSpec(function=f"{path}:boom")])
    turn1 = '<tool_call>\n{"name": "slow", "arguments": {"x": "a"}}\n</tool_call>\n<tool_call>\n{"name": "boom", "arguments": {"x": "b"}}\n</tool_call>'  # noqa: E501
    turn2 = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "slow", "arguments": {"y": 1}}\n</tool_call>'  # noqa: E501
    backend = ScriptedBackend(tokenizer, {"Q": [turn1, turn2, "The answer is 40."]})
    [res] = _loop(tokenizer, backend, tools).run([_example(tokenizer, "Q")], SamplingParams(400))
    assert res.finish == "answer" and len(res.turns) == 3
    first, second = res.turns[0]["calls"], res.turns[1]["calls"]
    assert first[0]["tool_error"] == "tool 'slow' timed out after 0.3s"
    assert first[1]["result"] == "Error: KeyError: 'b'"
    assert [c["error_kind"] for c in second] == ["unknown_tool", "bad_arguments"]
    assert "Error: unknown tool 'nope'" in tokenizer.decode(res.completion.token_ids)
    metrics = episode_metrics([{"agent": res.summary()}])
    assert metrics["num_turns/mean"] == 3 and metrics["tool_calls/mean"] == 4
    assert metrics["tool_errors/rate"] == 1.0 and metrics["invalid_calls/rate"] == 0.5
    assert metrics["tool_calls/slow"] == 1 and metrics["tool_calls/boom"] == 1 and metrics["finish/answer"] == 1.0


def test_max_turns_and_token_budget_end_on_a_sampled_token(tokenizer, calc):
    backend = ScriptedBackend(tokenizer, {"Q": [_call("1 + 1")] * 5})
    [res] = _loop(tokenizer, backend, calc, max_turns=2).run([_example(tokenizer, "Q")], SamplingParams(400))
    assert res.finish == "max_turns" and len(res.turns) == 2 and res.completion.mask[-1] == 1
    assert res.completion.finish_reason == "stop"
    one_turn = len(tokenizer.encode(_call("1 + 1") + "<|im_end|>", add_special_tokens=False))
    [res] = _loop(tokenizer, backend, calc).run([_example(tokenizer, "Q")], SamplingParams(one_turn + 5))
    # the tool result does not fit with room for another sampled token: stop before splicing it
    assert res.finish == "length" and len(res.completion.token_ids) == one_turn and res.completion.mask[-1] == 1
    [res] = _loop(tokenizer, backend, calc).run([_example(tokenizer, "Q")], SamplingParams(10))
    assert res.finish == "length" and len(res.completion.token_ids) == 10 and res.turns[0]["calls"][0]["error_kind"]


def test_environment_user_turns_are_masked_and_reward_parts_summed(tokenizer, calc):
    backend = ScriptedBackend(tokenizer, {"Q": ["The answer is 41.", _call("38 + 2"), "The answer is 40."]})
    loop = _loop(tokenizer, backend, calc, env="arith_feedback", max_attempts=3)
    [res] = loop.run([_example(tokenizer, "Q")], SamplingParams(400))
    assert res.finish == "answer" and res.reward_parts == {"solved": 1.0, "attempts": 1.0}
    assert [m["role"] for m in res.messages[2:]] == ["assistant", "user", "assistant", "tool", "assistant"]
    text = tokenizer.decode([t for t, m in zip(res.completion.token_ids, res.completion.mask, strict=True) if not m])
    assert "That is not right" in text and "<tool_response>\n40\n</tool_response>" in text
    assert "That is not right" not in tokenizer.decode(
        [t for t, m in zip(res.completion.token_ids, res.completion.mask, strict=True) if m]
    )


def test_an_environment_that_raises_or_exits_ends_its_episode_not_the_run(tokenizer, calc, tmp_path, caplog):
    import logging

    env_file = tmp_path / "envs.py"
    env_file.write_text(
        "import sys\nfrom rlfactory.envs.base import ToolEnv\n"
        "class Broken(ToolEnv):\n    async def step(self, message, calls):\n        raise KeyError('state')\n"
        "class Leaves(ToolEnv):\n    def step(self, message, calls):\n        sys.exit(3)\n"
    )
    for name, error in (("Broken", "KeyError: 'state'"), ("Leaves", "SystemExit: 3")):
        backend = ScriptedBackend(tokenizer, {"Q": THREE_TURNS})
        with caplog.at_level(logging.WARNING, logger="rlfactory.rollout.agent"):
            [res] = _loop(tokenizer, backend, calc, env=f"{env_file}:{name}").run(
                [_example(tokenizer, "Q")], SamplingParams(400)
            )
        assert res.finish == "env_error" and res.turns[-1]["env_error"] == error and len(res.turns) == 1
        assert res.completion.mask[-1] == 1  # the response ends on the sampled turn
        assert f"environment steps raised in 1/1 episodes (first: {error})" in caplog.text
    assert episode_metrics([{"agent": res.summary()}])["finish/env_error"] == 1.0


def test_on_several_processes_the_failure_lines_say_they_count_one_process(monkeypatch, caplog):
    """Each process logs its own rollouts' failures; the logged rates count every process's, so the line says whose
    counts it gives."""
    import logging
    from types import SimpleNamespace

    from rlfactory.rollout.agent import _log_failures

    calls = [{"error_kind": None, "tool_error": "ValueError: bad"}, {"error_kind": None}]
    convs = [SimpleNamespace(turns=[{"calls": calls, "env_error": "KeyError: 'state'"}])]
    for world, where in (("1", ""), ("2", " (this process)")):
        monkeypatch.setenv("WORLD_SIZE", world)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rlfactory.rollout.agent"):
            _log_failures(convs)
        assert f"tool calls failed{where}: 1/2 (first: ValueError: bad)" in caplog.text
        assert f"environment steps raised{where} in 1/1 episodes (first: KeyError: 'state')" in caplog.text


def test_an_environment_step_that_hangs_times_out_and_a_plain_one_is_flagged(tokenizer, calc, tmp_path):
    """agent.env_step_timeout_s: an async step awaiting forever is cancelled; a plain step spinning in a CPU loop
    cannot be, so its episode is flagged ``env_hung`` (the online loop then stops the run). Both end their episode
    with the timeout as env_error, and the loop returns promptly (the spinning thread is a daemon: it never keeps
    the process from exiting)."""
    import time

    env_file = tmp_path / "hangs.py"
    env_file.write_text(
        "import asyncio\nfrom rlfactory.envs.base import ToolEnv\n"
        "class Waits(ToolEnv):\n    async def step(self, message, calls):\n        await asyncio.sleep(3600)\n"
        # spins 3 s, far past the 0.5 s timeout, then ends: a thread left spinning would hold the GIL for the rest of
        # the test process
        "import time\nclass Spins(ToolEnv):\n    def step(self, message, calls):\n"
        "        end = time.monotonic() + 3\n        while time.monotonic() < end:\n            pass\n"
    )
    for name, hung in (("Waits", False), ("Spins", True)):
        backend = ScriptedBackend(tokenizer, {"Q": THREE_TURNS})
        factory = build_env_factory(f"{env_file}:{name}", calc, ExecLimits(), {})
        loop = AgentLoop(backend, tokenizer, calc, AgentSettings(4, env_step_timeout_s=0.5), factory)
        start = time.monotonic()
        [res] = loop.run([_example(tokenizer, "Q")], SamplingParams(400))
        assert time.monotonic() - start < 30
        assert res.finish == "env_error" and "agent.env_step_timeout_s (0.5 s)" in res.turns[-1]["env_error"]
        assert res.turns[-1]["env_hung"] is hung
        assert episode_metrics([{"agent": res.summary()}])["env/hung_steps"] == float(hung)


def test_agent_rewards_read_the_episode(tokenizer, calc):
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    backend = ScriptedBackend(tokenizer, {"Q": ['<tool_call>\n{"name": "calculator"\n</tool_call>', *THREE_TURNS]})
    [res] = _loop(tokenizer, backend, calc, max_turns=5).run([_example(tokenizer, "Q")], SamplingParams(500))
    example = {"agent": res.summary()}
    score = {n: REWARD_FUNCTIONS.get(n)("", res.final_text, "40", example) for n in
             ("answer_match", "tool_call_validity", "tool_errors", "tool_format", "turn_penalty")}  # fmt: skip
    assert score == {"answer_match": 1.0, "tool_call_validity": 0.75, "tool_errors": -0.25, "tool_format": 0.0,
                     "turn_penalty": -0.2}  # fmt: skip
    assert REWARD_FUNCTIONS.get("tool_safety")("", "", None, example, forbidden_tools=["calculator"]) == -3.0


def test_an_answer_inside_a_broken_call_is_not_the_final_answer(tokenizer, calc):
    """Outcome rewards read the last turn's text outside its calls: an episode that ends inside an unclosed (or
    budget-cut) call has given no answer, even when "The answer is 40" is written in the call."""
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    match = REWARD_FUNCTIONS.get("answer_match")
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "38 + 2 = 40. The answer is 40.'
    backend = ScriptedBackend(tokenizer, {"Q": [broken]})
    [res] = _loop(tokenizer, backend, calc, max_turns=1).run([_example(tokenizer, "Q")], SamplingParams(400))
    assert res.finish == "max_turns" and res.turns[0]["calls"][0]["error_kind"] == "malformed"
    assert res.final_text == "" and match("", res.final_text, "40", {}) == 0.0
    cut = len(tokenizer.encode(broken, add_special_tokens=False))  # the budget ends right after the answer
    [res] = _loop(tokenizer, backend, calc).run([_example(tokenizer, "Q")], SamplingParams(cut))
    assert res.finish == "length" and res.turns[0]["finish_reason"] == "length" and res.final_text == ""
    # text before the call is the message content, and is read
    backend = ScriptedBackend(tokenizer, {"Q": ["The answer is 40.\n" + broken]})
    [res] = _loop(tokenizer, backend, calc, max_turns=1).run([_example(tokenizer, "Q")], SamplingParams(400))
    assert res.final_text == "The answer is 40." and match("", res.final_text, "40", {}) == 1.0


def test_real_model_rollouts_are_token_in_token_out(tokenizer, calc):
    """The tiny model through the HF backend: sampled turns and spliced tool results; every conversation whose
    calls were all valid renders back to exactly the rollout's tokens."""
    from transformers import AutoModelForCausalLM

    from rlfactory.rollout.hf import HFBackend

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    questions = (
        "Tom has 12 apples and buys 7 more. How many apples does Tom have now?",
        "Anna has 6 bags with 7 cards in each bag. How many cards in total?",
    )
    examples = [_example(tokenizer, q) for q in questions]
    results = _loop(tokenizer, HFBackend(model, tokenizer), calc).run(examples * 4, SamplingParams(120, 1.0))
    checked = 0
    for example, res in zip(examples * 4, results, strict=True):
        completion = res.completion
        assert len(completion.token_ids) == len(completion.mask) <= 120 and completion.mask[-1] == 1
        assert completion.logprobs is None  # HF generate gives no sampler log-probs
        if res.finish == "answer" and all(c["error_kind"] is None for t in res.turns for c in t["calls"]):
            checked += training_render(tokenizer, res, example)[0] == example["prompt_ids"] + completion.token_ids
    assert any(len(r.turns) > 1 for r in results)  # the model does call the calculator
    assert checked >= 1  # seeded: at least one clean multi-turn conversation to compare


# --------------------------------------------------------------------------- the loss ignores spliced tokens
def test_policy_loss_ignores_tokens_the_policy_did_not_sample(tokenizer, calc):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from rlfactory.config.schema import AlgorithmConfig
    from rlfactory.engine.online.update import MiniBatch, actor_loss_fn, policy_forward
    from rlfactory.rollout.batch import pack_rollouts

    backend = ScriptedBackend(tokenizer, {"Q1": THREE_TURNS, "Q2": ["The answer is 5."]})
    examples = [_example(tokenizer, "Q1"), _example(tokenizer, "Q2")]
    results = _loop(tokenizer, backend, calc).run(examples, SamplingParams(400))
    batch = pack_rollouts([e["prompt_ids"] for e in examples], [r.completion for r in results], tokenizer.pad_token_id)
    assert batch.loss_mask.sum() == sum(sum(r.completion.mask) for r in results)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    with torch.no_grad():
        current, _ = policy_forward(model, batch, torch.arange(2))
    batch.advantages = torch.randn(batch.responses.shape) * batch.response_mask
    batch.old_logprobs = current
    alg = AlgorithmConfig(adv_estimator="grpo")

    def loss_and_grads(b):
        model.zero_grad()
        rows = torch.arange(2)
        loss = actor_loss_fn(model, b, alg, 1.0, 400)(rows, rows, MiniBatch.local(rows, b.loss_mask)).loss
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(batch)
    junk = replace(batch)
    spliced = (batch.loss_mask == 0) & (
        torch.arange(batch.responses.shape[1]) < batch.response_length[:, None]
    )
    assert spliced.sum() > 0
    junk.advantages = torch.where(spliced, torch.full_like(batch.advantages, 1e4), batch.advantages)
    junk.old_logprobs = torch.where(spliced, torch.full_like(current, -50.0), current)
    junk_loss, junk_grads = loss_and_grads(junk)
    assert junk_loss == loss and all(torch.equal(a, b) for a, b in zip(grads, junk_grads, strict=True))


@pytest.mark.parametrize("name", ["chatml", "llama3", "gemma_tools"])
def test_glue_and_agent_tokens_match_the_training_render_for_named_templates(tokenizer, calc, name):
    """The same identity for the named templates (chatml renders each tool result as its own turn, llama3 as
    ipython turns, gemma_tools inside Gemma's user turns): splicing == rendering the whole conversation."""
    import copy

    from rlfactory.render.templates import get_template

    tok = copy.deepcopy(tokenizer)
    tok.chat_template, tok.end_of_turn = get_template(name).jinja, get_template(name).end_of_turn
    call = _call("12 + 7") if name != "llama3" else None
    turns = (
        [call, "The answer is 40."]
        if call
        else ['{"name": "calculator", "parameters": {"expression": "12 + 7"}}', "The answer is 40."]
    )
    backend = ScriptedBackend(tok, {"Q1": turns}, stop=tok.end_of_turn)
    backend_turn = lambda text: text.count({"chatml": "<|im_start|>assistant", "llama3": "assistant<|end_header_id|>",
                                            "gemma_tools": "<start_of_turn>model"}[name]) - 1  # fmt: skip
    backend.turn_of = backend_turn
    example = _example(tok, "Q1")
    factory = build_env_factory("tools", calc, ExecLimits(), {})
    settings = AgentSettings(4, "json" if name == "llama3" else "hermes")
    [res] = AgentLoop(backend, tok, calc, settings, factory).run([example], SamplingParams(400))
    assert res.finish == "answer" and len(res.turns) == 2 and res.turns[0]["calls"][0]["result"] == "19"
    assert_rollout_equals_training_render(tok, res, example)


def test_tool_call_eval_counts_invalid_calls_by_kind(tokenizer, calc):
    """scripts/tool_call_eval.py on scripted episodes: per call, per conversation and by kind, hand-counted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "tool_call_eval.py"
    spec = importlib.util.spec_from_file_location("tool_call_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cut = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "38 + 2 and on and on and on'
    scripts = {
        "Q1": [_call("38 + 2"), "The answer is 40."],  # valid
        "Q2": ['<tool_call>\n{"name": "calculator"\n</tool_call>', _call("1 + 1 = 2"), "The answer is 2."],
        "Q3": [_call("2") + '<tool_call>\n{"name": "calc"}', "The answer is 2."],  # valid + unclosed
        "Q4": [cut, "The answer is 40."],  # run again below with a budget that cuts it inside the call
    }
    loop = _loop(tokenizer, ScriptedBackend(tokenizer, scripts), calc)
    budget = len(tokenizer.encode(cut, add_special_tokens=False)) - 3
    results = loop.run([_example(tokenizer, q) for q in scripts], SamplingParams(400))
    results[3:] = loop.run([_example(tokenizer, "Q4")], SamplingParams(budget))
    out = module.summarize([r.summary() for r in results], [1.0, 1.0, 0.0, 0.0])
    # 6 calls in 4 conversations: Q1 valid; Q2 bad JSON then a valid call whose tool raised (not invalid);
    # Q3 valid + unclosed; Q4 truncated
    assert out["invalid"] == {"truncated": 1, "unclosed": 1, "bad_json": 1, "bad_shape": 0, "unknown_tool": 0,
                              "bad_arguments": 0}  # fmt: skip
    assert (out["calls_per_conv"], out["invalid_per_call"], out["invalid_per_conv"]) == (1.5, 0.5, 0.75)
    assert out["convs_with_invalid"] == 0.75 and out["success"] == 0.5
