"""The bundled tiny chat model data/models/tiny-arith (built by scripts/make_tiny_model.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "data" / "models" / "tiny-arith"
SYSTEM = "Solve the problem. End with 'The answer is N.'"

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]},
}}]
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Tom has 12 apples and buys 7 more. How many apples does Tom have now?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 7"}}}]},
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "Let me double-check.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "7 + 12"}'}}]},
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "12 + 7 = 19. The answer is 19."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def test_files_and_config() -> None:
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in MODEL_DIR.iterdir()) < 10 * 2**20
    config = transformers.AutoConfig.from_pretrained(MODEL_DIR)
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads == 32
    assert getattr(config, "head_dim", 32) == 32
    assert config.tie_word_embeddings


def test_model_loads(model, tokenizer) -> None:
    assert type(model).__name__ == "Qwen2ForCausalLM"
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 3_000_000
    assert model.get_input_embeddings().weight.shape[0] >= len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    for tag in ("<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<think>", "</think>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    # digits are split individually; tool tags survive skip_special_tokens, ChatML markers do not
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]
    ids = tokenizer("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"
    assert tokenizer.decode(tokenizer("Tom has 12 apples.")["input_ids"]) == "Tom has 12 apples."


def test_chat_template_renders_everything(tokenizer) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\n" + SYSTEM + "\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", '
            '"arguments": {"expression": "12 + 7"}}\n</tool_call><|im_end|>\n') in text
    assert ('<|im_start|>assistant\nLet me double-check.\n<tool_call>\n{"name": "calculator", '
            '"arguments": {"expression": "7 + 12"}}\n</tool_call><|im_end|>\n') in text  # JSON-string args
    assert "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\nYou are welcome.<|im_end|>\n")
    assert text.count("<|im_start|>") == 9  # system + 8 turns (both tool results go in one user turn each)

    plain = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert plain == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{CONVERSATION[1]['content']}"
                     "<|im_end|>\n<|im_start|>assistant\n")
    no_system = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert no_system.startswith("<|im_start|>user\n")  # no default system prompt
    with_tools = tokenizer.apply_chat_template(CONVERSATION[1:2], tools=TOOLS, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")

    # consecutive tool results share one user turn
    two_results = [*CONVERSATION[:3], {"role": "tool", "content": "19"}, {"role": "tool", "content": "20"}]
    rendered = tokenizer.apply_chat_template(two_results, tools=TOOLS, tokenize=False)
    assert rendered.endswith("<|im_start|>user\n<tool_response>\n19\n</tool_response>\n"
                             "<tool_response>\n20\n</tool_response><|im_end|>\n")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_prefix_stable(tokenizer, tools) -> None:
    full = tokenizer.apply_chat_template(CONVERSATION, tools=tools, tokenize=False)
    checked = 0
    for k, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(CONVERSATION[:k], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(CONVERSATION[:k + 1], tools=tools, tokenize=False)
        assert upto.startswith(prompt), k
        assert full.startswith(upto), k
        assert upto.endswith("<|im_end|>\n"), k
        # token-level too: the prompt tokens are a prefix of the conversation tokens
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        u_ids = tokenizer(upto, add_special_tokens=False)["input_ids"]
        assert u_ids[:len(p_ids)] == p_ids, k
        checked += 1
    assert checked == 4


def test_assistant_tokens_mask(tokenizer) -> None:
    out = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant_text = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert assistant_text.endswith("The answer is 19.<|im_end|>You are welcome.<|im_end|>")
    assert assistant_text.count("<|im_end|>") == 4 and "Thanks" not in assistant_text


def test_greedy_generation_ends_with_im_end(model, tokenizer) -> None:
    row = json.loads((ROOT / "data" / "arith" / "prompts_test.jsonl").read_text().splitlines()[0])
    prompt = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "The answer is " in tokenizer.decode(new, skip_special_tokens=True)
