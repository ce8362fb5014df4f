"""Rendering: token-exact loss masks from the chat template, prompts that prefix training sequences."""

from __future__ import annotations

import pytest
from tests.conftest import TINY_MODEL

from rlfactory.config.schema import ModelConfig
from rlfactory.errors import UserError
from rlfactory.model.loader import load_tokenizer
from rlfactory.render.chat import IGNORE_INDEX, render_continuation, render_prompt, render_segments, render_sft
from rlfactory.render.fit import infer_seqlen

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                          "required": ["expr"]}}}]
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "17*3"}}}
CONVERSATION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 17 times 3?"},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]},
    {"role": "tool", "content": "51"},
    {"role": "assistant", "content": "17 * 3 = 51. The answer is 51."},
    {"role": "user", "content": "And plus 1?"},
    {"role": "assistant", "content": "51 + 1 = 52. The answer is 52."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))


def _trained_spans(input_ids: list[int], labels: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, label in zip(input_ids, labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token  # labels are the input ids where trained
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def test_segments_cover_the_template_text_exactly(tokenizer):
    segments = render_segments(tokenizer, CONVERSATION, TOOLS)
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert tokenizer.decode([t for s in segments for t in s.ids]) == text


def test_three_turn_masks_are_token_exact(tokenizer):
    [item] = render_sft(tokenizer, CONVERSATION, TOOLS)
    spans = _trained_spans(item["input_ids"], item["labels"])
    expected = [
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "17*3"}}\n</tool_call><|im_end|>',
        "17 * 3 = 51. The answer is 51.<|im_end|>",
        "51 + 1 = 52. The answer is 52.<|im_end|>",
    ]
    # exactly the assistant turns (text + tool call + end-of-turn): no system/user/tool/template token
    assert [tokenizer.decode(span) for span in spans] == expected
    assert spans == [tokenizer.encode(text, add_special_tokens=False) for text in expected]


def test_train_on_last_assistant_and_all(tokenizer):
    [last] = render_sft(tokenizer, CONVERSATION, TOOLS, train_on="last_assistant")
    assert [tokenizer.decode(s) for s in _trained_spans(last["input_ids"], last["labels"])] == [
        "51 + 1 = 52. The answer is 52.<|im_end|>"
    ]
    [everything] = render_sft(tokenizer, CONVERSATION, TOOLS, train_on="all")
    assert everything["labels"] == everything["input_ids"]


def test_prompt_is_a_prefix_of_the_training_sequence(tokenizer):
    [full] = render_sft(tokenizer, CONVERSATION, TOOLS)
    full = full["input_ids"]
    for end in (2, 4, 6):  # after the user turn, after the tool result, after the second user turn
        prompt = render_prompt(tokenizer, CONVERSATION[:end], TOOLS)
        assert full[: len(prompt)] == prompt
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")


def test_continuation_masks_tool_results(tokenizer):
    prompt, response, mask = render_continuation(tokenizer, CONVERSATION[:2], CONVERSATION[2:5], TOOLS)
    assert prompt == render_prompt(tokenizer, CONVERSATION[:2], TOOLS)
    untrained = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if not m])
    assert "<tool_response>\n51\n</tool_response>" in untrained and "Let me compute" not in untrained


def test_truncation(tokenizer):
    [item] = render_sft(tokenizer, CONVERSATION, TOOLS)
    n = len(item["input_ids"])
    [cut] = render_sft(tokenizer, CONVERSATION, TOOLS, cutoff_len=n - 5)
    assert len(cut["input_ids"]) == n - 5 and cut["input_ids"][:20] == item["input_ids"][:20]
    assert _trained_spans(cut["input_ids"], cut["labels"])[:2] == _trained_spans(item["input_ids"], item["labels"])[:2]
    assert render_sft(tokenizer, CONVERSATION, TOOLS, cutoff_len=n - 5, truncation="drop") == [None]
    # 10 tokens: the first turn's prompt and answer share them as LLaMA-Factory splits them; the prompt keeps its end,
    # the answer its start, and the turns after it are left out
    first_answer = _trained_spans(item["input_ids"], item["labels"])[0]
    start = next(i for i, label in enumerate(item["labels"]) if label != IGNORE_INDEX)
    keep_prompt, keep_answer = infer_seqlen(start, len(first_answer), 10)
    assert keep_prompt + keep_answer == 10 and keep_answer >= 1
    [tiny] = render_sft(tokenizer, CONVERSATION, TOOLS, cutoff_len=10)
    assert tiny["input_ids"] == item["input_ids"][start - keep_prompt : start] + first_answer[:keep_answer]
    assert tiny["labels"] == [IGNORE_INDEX] * keep_prompt + first_answer[:keep_answer]


def test_tokenizer_without_template_needs_a_named_one(tmp_path):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(UserError, match="has no chat template; set model.template to one of: chatml"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    named = load_tokenizer(ModelConfig(name_or_path=str(tmp_path), template="chatml"))
    [item] = render_sft(named, CONVERSATION, TOOLS)
    spans = [named.decode(s) for s in _trained_spans(item["input_ids"], item["labels"])]
    assert spans[-1] == "51 + 1 = 52. The answer is 52.<|im_end|>" and len(spans) == 3
    with pytest.raises(UserError, match="unknown model.template 'chatm'.*did you mean 'chatml'"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path), template="chatm"))


def test_history_rewriting_template_trains_each_turn_in_its_own_context():
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    # a template that rewrites history (drops earlier assistant turns, like some reasoning templates)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = CONVERSATION[:2] + [CONVERSATION[4]] + CONVERSATION[5:]
    items = render_sft(tokenizer, messages, None)
    # one sequence per turn: the prompt as the template renders it at that turn, then that turn
    expected_prompts = [messages[:2], [*messages[:2], messages[3]]]
    assert len(items) == 2
    for item, prompt, turn in zip(items, expected_prompts, (messages[2], messages[4]), strict=True):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        expected = tokenizer.encode(text + turn["content"] + "<|im_end|>", add_special_tokens=False)
        assert item["input_ids"][: len(expected)] == expected  # then only the template's untrained trailing "\n"
        assert tokenizer.decode(item["input_ids"][len(expected) :]) in ("", "\n")
        [span] = _trained_spans(item["input_ids"], item["labels"])
        assert tokenizer.decode(span) == turn["content"] + "<|im_end|>"
    # the prompt of the last turn is a prefix of the sequence that trains it
    prompt = render_prompt(tokenizer, messages[:4])
    assert items[1]["input_ids"][: len(prompt)] == prompt
