"""Real chat templates on copies of the bundled tokenizer: masks token-exact, content kept or refused, history-
rewriting templates (Qwen3, Mistral, GPT-OSS) trained turn by turn in their own context.

No real tokenizer is available offline: each copy of the tiny tokenizer gets the model's special tokens and the
model's own template as shipped: TRL's trl/chat_templates/ copies (qwen2_5, qwen3, llama3 = Llama 3 Instruct,
llama3_1, gemma3, gptoss) and, for Mistral, tests/fixtures/templates/mistral_v0_3.jinja (its README says where it
comes from). Each copy is saved and loaded through the real loader, so the template name and the end of turn are
found as for a user's model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.schema import ModelConfig
from rlfactory.errors import UserError
from rlfactory.model.loader import load_tokenizer
from rlfactory.render.chat import (
    IGNORE_INDEX,
    render_contexts,
    render_continuation,
    render_prompt,
    render_sft,
    stop_strings,
)
from rlfactory.render.glue import ObservationGlue
from rlfactory.render.templates import trl_templates

FIXTURES = Path(__file__).parent / "fixtures" / "templates"
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"]
# name -> (template file, special tokens to add, bos, eos): each model's own tokens
MODELS = {
    "qwen2_5": ("qwen2_5", [], None, "<|im_end|>"),
    "qwen3": ("qwen3", [], None, "<|im_end|>"),
    "llama3": ("llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "llama3_1": ("llama3_1", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": ("gemma3", ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], "<bos>", "<eos>"),
    "mistral": (str(FIXTURES / "mistral_v0_3.jinja"), ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>"),
    "gptoss": ("gptoss", HARMONY, None, "<|return|>"),
}

SYSTEM = {"role": "system", "content": "You are a careful calculator."}
CHAT = [
    SYSTEM,
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4. The answer is 4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "4 * 3 = 12. The answer is 12."},
]
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The sum."}},
                   "required": ["expression"]}}}]


def _call(expr: str, with_id: bool = False) -> dict:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
    return {**call, "id": "call00001"} if with_id else call


def tool_chat(text: str = "", with_id: bool = False) -> list[dict]:
    """system, user, assistant (a call, with or without text), the tool result, the answer."""
    result = {"role": "tool", "content": "51", **({"tool_call_id": "call00001"} if with_id else {})}
    return [
        SYSTEM,
        {"role": "user", "content": "What is 17 times 3?"},
        {"role": "assistant", "content": text, "tool_calls": [_call("17*3", with_id)]},
        result,
        {"role": "assistant", "content": "17 * 3 = 51. The answer is 51."},
    ]


def template_text(name: str) -> str:
    source = MODELS[name][0]
    if source.endswith(".jinja"):
        return Path(source).read_text()
    shipped = trl_templates()
    if source not in shipped:
        pytest.skip(f"this trl ships no {source} template")
    return shipped[source].read_text()


def save_model_tokenizer(name: str, folder: Path) -> Path:
    """A copy of the tiny tokenizer as model `name` ships it: its special tokens, bos/eos and chat template."""
    from transformers import AutoTokenizer

    _, tokens, bos, eos = MODELS[name]
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    if tokens:
        tok.add_special_tokens({"additional_special_tokens": tokens})
    if bos:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = template_text(name)
    tok.save_pretrained(folder)
    for name in ("config.json", "model.safetensors"):  # a whole model folder: `config check` loads one
        shutil.copy(TINY_MODEL / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        name: load_tokenizer(ModelConfig(name_or_path=str(save_model_tokenizer(name, root / name))))
        for name in MODELS
    }


def trained_spans(tok, item: dict) -> list[str]:
    spans, current = [], []
    for token, label in zip(item["input_ids"], item["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    return spans + ([tok.decode(current)] if current else [])


def assert_token_exact(tok, messages: list[dict], tools, expected_turns: list[str], sequences: int) -> None:
    """Every assistant turn is trained exactly (its tokens as the template writes them, end token included), once,
    right after the prompt exactly as the template renders it at that turn; nothing else is trained."""
    items = render_sft(tok, messages, tools)
    assert len(items) == sequences
    assert [span for item in items for span in trained_spans(tok, item)] == expected_turns
    turns = iter(zip([i for i, m in enumerate(messages) if m["role"] == "assistant"], expected_turns, strict=True))
    for item in items:
        labels = item["labels"]
        for start in [k for k, label in enumerate(labels) if label != IGNORE_INDEX and labels[k - 1] == IGNORE_INDEX]:
            turn, text = next(turns)
            prompt = render_prompt(tok, messages[:turn], tools)
            assert item["input_ids"][:start] == prompt
            assert tok.decode(prompt) == tok.apply_chat_template(
                messages[:turn], tools=tools, tokenize=False, add_generation_prompt=True
            )
            ids = tok.encode(text, add_special_tokens=False)
            assert item["input_ids"][start : start + len(ids)] == ids


EXPECTED_CHAT = {  # the trained text of CHAT's two turns, and in how many sequences
    "qwen2_5": (["{a}<|im_end|>"], 1),
    "qwen3": (["<think>\n\n</think>\n\n{a}<|im_end|>"], 2),  # past turns lose their (empty) think block
    "llama3": (["{a}<|eot_id|>"], 1),
    "llama3_1": (["{a}<|eot_id|>"], 1),
    "gemma3": (["{a}<end_of_turn>"], 1),  # ends with <end_of_turn>, not with its eos <eos>
    "mistral": ([" {a}</s>"], 2),  # the system prompt moves to the last user message
    "gptoss": (["<|channel|>final<|message|>{a}<|return|>"], 2),  # past answers end with <|end|>
}


@pytest.mark.parametrize("name", list(MODELS))
def test_multi_turn_chat_masks_are_token_exact(toks, name):
    (form,), sequences = EXPECTED_CHAT[name]
    expected = [form.format(a=m["content"]) for m in CHAT if m["role"] == "assistant"]
    assert_token_exact(toks[name], CHAT, None, expected, sequences)


EXPECTED_TOOLS = {  # the trained text of tool_chat()'s turns (a call only, then the answer), or the refusal
    "qwen2_5": ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*3"}}\n</tool_call><|im_end|>',
                "{a}<|im_end|>"],
    "qwen3": ['<think>\n\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*3"}}\n'
              "</tool_call><|im_end|>", "<think>\n\n</think>\n\n{a}<|im_end|>"],
    "llama3": "drops part of the tool schema ('Evaluate an arithmetic expression.') of the tool 'calculator'",
    "llama3_1": ['{"name": "calculator", "parameters": {"expression": "17*3"}}<|eot_id|>', "{a}<|eot_id|>"],
    "gemma3": "drops part of the tool schema ('Evaluate an arithmetic expression.') of the tool 'calculator'",
    "mistral": "needs every tool call to carry an `id` of 9 letters or digits",
    "gptoss": [' to=functions.calculator<|channel|>commentary json<|message|>{"expression": "17*3"}<|call|>',
               "<|channel|>final<|message|>{a}<|return|>"],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_tool_conversation_is_kept_token_exact_or_refused_clearly(toks, name):
    tok, expected = toks[name], EXPECTED_TOOLS[name]
    messages = tool_chat()
    if isinstance(expected, str):
        with pytest.raises(UserError, match="the chat template of '.*" + name) as refusal:
            render_sft(tok, messages, TOOLS)
        assert expected in str(refusal.value)
        return
    answer = messages[-1]["content"]
    turns = [t.replace("{a}", answer) for t in expected]
    sequences = len(render_contexts(tok, messages, TOOLS))
    assert_token_exact(tok, messages, TOOLS, turns, sequences)


def test_mistral_trains_calls_that_carry_ids(toks):
    """With the ids its template requires, Mistral keeps a call-only turn (trained as its [TOOL_CALLS] block)."""
    tok, messages = toks["mistral"], tool_chat(with_id=True)
    spans = [s for item in render_sft(tok, messages, TOOLS) for s in trained_spans(tok, item)]
    assert spans == [
        '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "17*3"}, "id": "call00001"}]</s>',
        " 17 * 3 = 51. The answer is 51.</s>",
    ]


@pytest.mark.parametrize("name", ["llama3_1", "mistral"])
def test_a_turn_whose_text_the_template_drops_is_refused(toks, name):
    """Llama 3.1 and Mistral write only the call of a turn that has text and a call: refused, naming what."""
    with pytest.raises(UserError, match=r"drops the text \('Let me compute.'\) of message 2 \(assistant\)"):
        render_sft(toks[name], tool_chat("Let me compute.", with_id=True), TOOLS)


def test_gemma3_template_errors_are_clear_errors(toks):
    """Gemma 3 raises on a tool message (roles must alternate): one UserError naming the template and the fix."""
    messages = [{"role": "user", "content": "What is 17 times 3?"}, {"role": "tool", "content": "51"},
                {"role": "assistant", "content": "The answer is 51."}]
    with pytest.raises(UserError, match=r"gemma3' cannot render this conversation: Conversation roles must alternate"
                                        r".*takes only alternating user/assistant turns"):
        render_sft(toks["gemma3"], messages)


def test_llama3_without_tools_drops_the_call_of_a_turn(toks):
    """Llama 3 (no tool support) writes a call-only turn as an empty turn: refused, never trained empty."""
    with pytest.raises(UserError, match=r"drops the tool call \('calculator'\) of message 2 \(assistant\)"):
        render_sft(toks["llama3"], tool_chat(), None)


def test_qwen3_keeps_reasoning_of_the_turn_it_trains(toks):
    tok = toks["qwen3"]
    messages = [*CHAT[:2], {"role": "assistant", "content": "<think>\n2 and 2 make 4.\n</think>\n\nThe answer is 4."},
                *CHAT[3:]]
    items = render_sft(tok, messages)
    assert [trained_spans(tok, item) for item in items] == [
        ["<think>\n2 and 2 make 4.\n</think>\n\nThe answer is 4.<|im_end|>"],
        ["<think>\n\n</think>\n\n4 * 3 = 12. The answer is 12.<|im_end|>"],
    ]
    # the second turn's context is the history as Qwen3 renders it then: the past reasoning stripped
    assert "2 and 2 make 4" not in tok.decode(items[1]["input_ids"])


def test_qwen3_preference_on_a_multi_turn_prompt_and_multi_turn_responses(toks):
    tok = toks["qwen3"]
    chosen = [{"role": "assistant", "content": "The answer is 12."}]
    prompt, response, mask = render_continuation(tok, CHAT[:4], chosen)
    assert prompt == render_prompt(tok, CHAT[:4])
    assert tok.decode(response) == "<think>\n\n</think>\n\nThe answer is 12.<|im_end|>\n" and mask[-1] is False
    assert tok.decode([t for t, m in zip(response, mask, strict=True) if m]) == (
        "<think>\n\n</think>\n\nThe answer is 12.<|im_end|>"
    )
    # a response of several turns is rewritten by Qwen3 once the tool result follows: refused, not mis-masked
    with pytest.raises(UserError, match="rewrites the earlier turns of this response"):
        render_continuation(tok, tool_chat()[:2], tool_chat()[2:], TOOLS)


def test_qwen3_rollout_glue_after_a_call(toks):
    """Multi-turn RL keeps each turn as sampled (token-in, token-out); the tool result is spliced as Qwen3 writes
    it after a turn, although Qwen3 rewrites the turn itself once a result follows."""
    glue = ObservationGlue(toks["qwen3"])
    assert glue.text([{"role": "tool", "content": "51"}]) == (
        "\n<|im_start|>user\n<tool_response>\n51\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert stop_strings(toks["qwen3"]) == ["<|im_end|>"] and stop_strings(toks["gemma3"]) == ["<end_of_turn>"]


def test_model_template_takes_trl_names_and_jinja_files(tmp_path):
    named = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL), template="qwen3"))
    assert named.chat_template == template_text("qwen3")
    path = tmp_path / "mine.jinja"
    path.write_text(template_text("qwen2_5"))
    from_file = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL), template=str(path)))
    assert from_file.chat_template == template_text("qwen2_5") and stop_strings(from_file) == ["<|im_end|>"]
    with pytest.raises(UserError, match="unknown model.template 'qwen3_tranining'.*did you mean 'qwen3_training'"):
        load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL), template="qwen3_tranining"))
    with pytest.raises(UserError, match="no such template file"):
        load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL), template=str(tmp_path / "none.jinja")))


def _check(tmp_path: Path, name: str, dataset: str) -> object:
    model = save_model_tokenizer(name, tmp_path / name)
    cfg = {"stage": "sft", "output_dir": str(tmp_path / "out"), "model": {"name_or_path": str(model)},
           "data": {"dataset": dataset, "dataset_dir": str(DATA_DIR), "max_samples": 8}}
    return run_cli("config", "check", str(write_yaml(tmp_path / f"{name}.yaml", cfg)))


@pytest.mark.parametrize(("name", "fragments"), [
    ("llama3", ["arith_tool_sft_glaive:1: the chat template of '", "drops part of the tool schema"]),
    ("mistral", ["arith_tool_sft_glaive:1: the chat template of '", "Tool call IDs should be alphanumeric"]),
])
def test_config_check_refuses_a_template_that_loses_or_rejects_rows(tmp_path, name, fragments):
    result = _check(tmp_path, name, "arith_tool_sft_glaive")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "template OK" not in result.stdout
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_config_check_reads_a_sample_back_and_says_when_turns_train_apart(tmp_path):
    result = _check(tmp_path, "qwen3", "arith_tool_sft")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "8 of 8 rows rendered and read back, every message, tool call and tool schema kept" in result.stdout
    assert "it rewrites earlier turns, so 8 of them train one sequence per rewritten turn" in result.stdout


@pytest.mark.slow
def test_qwen3_multi_turn_and_tool_conversations_train(tmp_path):
    """A short sft run through the CLI with Qwen3's own template on multi-turn chats and tool conversations: every
    turn trained in its own context, the loss goes down."""
    import shutil

    model = tmp_path / "tiny-qwen3"
    shutil.copytree(TINY_MODEL, model)
    save_model_tokenizer("qwen3", model)
    rows = [{"messages": CHAT}, {"messages": tool_chat(), "tools": TOOLS}] * 4
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data" / "dataset_info.yaml").write_text(
        "mixed:\n  file_name: rows.jsonl\n  formatting: openai\n  columns: {messages: messages, tools: tools}\n"
    )
    cfg = {"stage": "sft", "output_dir": str(tmp_path / "out"), "seed": 0,
           "model": {"name_or_path": str(model), "finetuning": "lora"}, "lora": {"r": 8, "alpha": 16},
           "data": {"dataset": "mixed", "dataset_dir": str(tmp_path / "data"), "cutoff_len": 256},
           "train": {"max_steps": 6, "per_device_batch_size": 16, "learning_rate": 3e-3},
           "evaluation": {"dataset": None}, "logging": {"logging_steps": 1, "progress_bar": False, "plot_loss": False}}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 conversation(s) trained as one sequence per rewritten turn (16 sequences in all)" in result.stderr
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_qwen3_multi_turn_rollout_runs_a_tool_and_keeps_each_turn_as_sampled(toks):
    """Multi-turn RL with Qwen3's own template (was refused: it rewrites a call turn once the result follows): the
    agent loop runs the call, splices the result as Qwen3 writes it, and trains each turn exactly as sampled."""
    from tests.test_agent import ScriptedBackend

    from rlfactory.config.schema import ToolSpec
    from rlfactory.envs.factory import build_env_factory
    from rlfactory.rollout.agent import AgentLoop, AgentSettings
    from rlfactory.rollout.base import SamplingParams
    from rlfactory.tasks.arith_tools import CALCULATOR_SCHEMA
    from rlfactory.tools.execute import ExecLimits
    from rlfactory.tools.spec import load_tools

    tok = toks["qwen3"]
    think = "<think>\n\n</think>\n\n"
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>'
    script = [think + call, think + "The answer is 19."]
    messages = [{"role": "user", "content": "Q1: what is 12 + 7?"}]
    example = {"messages": messages, "tools": [CALCULATOR_SCHEMA], "answer": "19",
               "prompt_ids": render_prompt(tok, messages, [CALCULATOR_SCHEMA])}
    calc = load_tools([ToolSpec(function="calculator")])
    factory = build_env_factory("tools", calc, ExecLimits(), {})
    loop = AgentLoop(ScriptedBackend(tok, {"Q1": script}), tok, calc, AgentSettings(4), factory)
    [res] = loop.run([example], SamplingParams(200))
    assert res.finish == "answer" and len(res.turns) == 2 and res.turns[0]["calls"][0]["result"] == "19"
    ids, mask = res.completion.token_ids, res.completion.mask
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "".join(turn + "<|im_end|>" for turn in script)
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if not m]) == (
        "\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_bundled_llama3_template_keeps_schemas_without_a_system_message():
    """The read-back found the bundled llama3 template writing tool schemas only into a system message."""
    from tests.test_render import CONVERSATION
    from tests.test_render import TOOLS as CALC

    from rlfactory.render.templates import get_template

    tok = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    tok.add_special_tokens({"additional_special_tokens": MODELS["llama3"][1]})
    tok.chat_template, tok.end_of_turn = get_template("llama3").jinja, "<|eot_id|>"
    [item] = render_sft(tok, CONVERSATION[1:], CALC)  # no system message: the schemas get a system turn
    assert '"description": "Evaluate arithmetic."' in tok.decode(item["input_ids"])


def test_train_refuses_rows_the_template_rejects_before_writing_anything(tmp_path):
    """Mistral with LLaMA-Factory-style glaive rows (calls without ids) was a raw TemplateError traceback (exit 1)."""
    from tests.conftest import expect_train_error

    model = save_model_tokenizer("mistral", tmp_path / "mistral")
    cfg = {"stage": "sft", "output_dir": str(tmp_path / "out"), "model": {"name_or_path": str(model)},
           "data": {"dataset": "arith_tool_sft_glaive", "dataset_dir": str(DATA_DIR), "max_samples": 4}}
    expect_train_error(tmp_path, cfg, "arith_tool_sft_glaive:1: the chat template of '", "Tool call IDs should be",
                       "needs every tool call to carry an `id` of 9 letters or digits")


@pytest.mark.slow
def test_qwen3_dpo_on_multi_turn_prompts_trains(tmp_path):
    """DPO with Qwen3's own template on prompts that carry earlier turns (Qwen3 rewrites them): each pair is one
    prompt as Qwen3 renders it at the response, then the chosen or rejected turn."""
    import shutil

    model = tmp_path / "tiny-qwen3"
    shutil.copytree(TINY_MODEL, model)
    save_model_tokenizer("qwen3", model)
    rows = [{"messages": CHAT[:4], "chosen": [{"role": "assistant", "content": f"4 * 3 = 12. The answer is 12.{i}"}],
             "rejected": [{"role": "assistant", "content": f"The answer is 7.{i}"}]} for i in range(8)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data" / "dataset_info.yaml").write_text(
        "pairs:\n  file_name: pairs.jsonl\n  formatting: openai\n  ranking: true\n"
        "  columns: {messages: messages, chosen: chosen, rejected: rejected}\n"
    )
    cfg = {"stage": "dpo", "output_dir": str(tmp_path / "out"), "seed": 0,
           "model": {"name_or_path": str(model), "finetuning": "lora"}, "lora": {"r": 8, "alpha": 16},
           "data": {"dataset": "pairs", "dataset_dir": str(tmp_path / "data"), "cutoff_len": 256},
           "train": {"max_steps": 4, "per_device_batch_size": 8, "learning_rate": 3e-3},
           "evaluation": {"dataset": None}, "logging": {"logging_steps": 1, "progress_bar": False, "plot_loss": False}}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0]
