"""Build the bundled tiny chat model ``data/models/tiny-arith/`` from scratch, offline, on CPU.

    python scripts/make_task_data.py    # first, if data/arith/ is missing
    python scripts/make_tiny_model.py

1. trains a byte-level BPE tokenizer (digits split individually, ChatML special tokens and a
   Qwen2.5-style chat template with tool calling) on the arithmetic task corpus plus a little
   generic text;
2. builds a ~1.8M-parameter ``Qwen2ForCausalLM`` (head_dim 32, tied embeddings);
3. pretrains it with a plain seeded torch loop on chat-rendered task conversations (never on
   the test/eval questions), stopping early enough that later stages still have room to improve;
4. measures greedy accuracy on ``data/arith/prompts_test.jsonl`` and writes a model card.

Deterministic on a given machine (fixed seeds, single process, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

# OpenMP threads that sleep instead of spinning: on a shared, busy CPU spinning threads make training
# several times slower (measured 4x on 2 cores); costs little when the machine is idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.generation import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
try:
    from rlfactory.tasks.arith import SYSTEM_PROMPT, is_correct, make_problem
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
    from rlfactory.tasks.arith import SYSTEM_PROMPT, is_correct, make_problem

SEED = 0
VOCAB_SIZE = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: dropped by skip_special_tokens
EXTRA = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# ChatML in the style of Qwen2.5, without a default system prompt. Prefix-stable: rendering
# messages[:k] with add_generation_prompt=True is a prefix of rendering messages[:k+1] when message k
# is an assistant turn. Assistant turns are wrapped in {% generation %} so that
# apply_chat_template(..., return_assistant_tokens_mask=True) works (e.g. TRL assistant_only_loss).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

GENERIC_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can learn simple patterns from data.
You are a helpful assistant. Please answer the question step by step and keep it short.
The weather in Paris is sunny today, with a temperature of 21 degrees. Tomorrow it may rain.
Call the function with the right arguments and read the result before you answer the user.
Python, JSON and YAML are common formats: {"key": "value", "list": [1, 2, 3], "ok": true}.
Reinforcement learning from human feedback trains a policy with a reward model and a reference model.
What is the capital of France? The capital of France is Paris. What time is it? It is 10:30.
Once upon a time there was a little girl who lived in a village near the forest. Every morning she
walked to the river to fetch water, and every evening she told her grandmother stories about the birds,
the trees and the clouds she had seen. One day a traveller came to the village and asked for directions
to the mountains. "Follow the road to the north," she said, "and turn left at the old bridge."
Science helps us understand the world: plants need light and water, the earth goes around the sun,
and computers follow instructions written by people. Thank you for your help! Sure, here is the answer.
I'm sorry, I don't know. Could you please explain what you mean? Let me think about it for a moment.
"""

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chat(problem: dict[str, str]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem["question"]},
        {"role": "assistant", "content": problem["solution"]},
    ]


def tool_chat(problem: dict[str, str]) -> list[dict]:
    """A conversation that solves a problem with the calculator tool (teaches the tokenizer the format)."""
    expr = problem["solution"].split(" = ")[0]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem["question"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": problem["answer"]},
        {"role": "assistant", "content": problem["solution"]},
    ]


# Exactly the pipeline that transformers 5 rebuilds for Qwen2 tokenizers from vocab + merges (it ignores the
# pre-tokenizer stored in tokenizer.json), so the saved tokenizer loads identically with transformers 4 and 5.
# `\p{N}` is isolated: every digit is its own pre-token, like pre_tokenizers.Digits(individual_digits=True).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(problems: list[dict[str, str]]) -> Tokenizer:
    """Byte-level BPE trained on the task corpus plus a little generic text."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(EXTRA),
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    template_text = CHAT_TEMPLATE.replace("{", " ").replace("}", " ").replace("\\n", "\n")
    texts = [p["question"] + "\n" + p["solution"] for p in problems]
    texts += [SYSTEM_PROMPT, GENERIC_TEXT, template_text, json.dumps(TOOLS)] * 20
    tok.train_from_iterator(texts, trainer=trainer)
    # tool / reasoning tags: added tokens that survive skip_special_tokens (as in Qwen2.5 / Qwen3)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, check_texts: list[str]) -> PreTrainedTokenizerBase:
    """Save ``tok`` as a Qwen2 tokenizer with the chat template, reload it with AutoTokenizer and check
    that the reloaded tokenizer encodes ``check_texts`` exactly like ``tok``."""
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # the template also goes into tokenizer_config.json for readers older than chat_template.jinja
    config.update(tokenizer_class="Qwen2Tokenizer", padding_side="right", add_prefix_space=False,
                  split_special_tokens=False, chat_template=CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    loaded = AutoTokenizer.from_pretrained(out)
    for text in check_texts:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids, text
        assert loaded.decode(tok.encode(text).ids) == text, text
    return loaded


def build_model(tokenizer: PreTrainedTokenizerBase) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config)


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> dict[str, torch.Tensor]:
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


@torch.no_grad()
def evaluate(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, rows: list[dict],
             max_new_tokens: int = 64, batch_size: int = 100) -> dict[str, float]:
    """Greedy accuracy (and answer-format rate) on prompt rows ``{"messages", "answer"}``."""
    model.eval()
    tokenizer.padding_side = "left"
    correct = formatted = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        prompts = [tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
                   for r in chunk]
        enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        for row, ids in zip(chunk, out[:, enc["input_ids"].shape[1]:], strict=True):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            ended = "<|im_end|>" in text
            text = text.split("<|im_end|>")[0]
            formatted += ended and "The answer is " in text
            correct += is_correct(text, row["answer"])
    metrics = {"accuracy": correct / len(rows), "format": formatted / len(rows)}
    # how likely the first answer token calls the calculator when it is offered (what GRPO can raise)
    for name, token, tools in (("p_tool_call", "<tool_call>", TOOLS[:1]),):
        prompts = [tokenizer.apply_chat_template(r["messages"], tools=tools, tokenize=False,
                                                 add_generation_prompt=True) for r in rows]
        enc = tokenizer(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
        probs = model(**enc).logits[:, -1].float().softmax(-1)[:, tokenizer.convert_tokens_to_ids(token)]
        metrics[name] = probs.mean().item()
    tokenizer.padding_side = "right"
    model.train()
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--out", type=Path, default=None, help="default: <data>/models/tiny-arith")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--tool-frac", type=float, default=0.4,
                        help="share of steps on chats that offer the calculator tool")
    parser.add_argument("--tool-call-frac", type=float, default=0.4,
                        help="share of tool-offering chats that call it (the rest answer directly): "
                        "calling pays, and GRPO can learn that")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also evaluate every N steps (0: only at the end)")
    args = parser.parse_args()
    out: Path = args.out or args.data / "models" / "tiny-arith"
    tmp = out.with_name(out.name + ".partial")  # built here, renamed to `out` at the end
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    style_rng = random.Random(SEED + 1)

    test_rows = load_jsonl(args.data / "arith" / "prompts_test.jsonl")
    held_out = {m["content"] for f in ("prompts_test.jsonl", "pref_test.jsonl", "sft_eval.jsonl")
                for r in load_jsonl(args.data / "arith" / f) for m in r["messages"] if m["role"] == "user"}

    def fresh_problem() -> dict[str, str]:
        while True:
            p = make_problem(rng)
            if p["question"] not in held_out:
                return p

    raw = build_tokenizer([fresh_problem() for _ in range(5000)])
    check = [GENERIC_TEXT, "Tom's 1234 apples  cost $5.50!\n\n  ok\t<tool_call>x</tool_call><|im_end|>"]
    tokenizer = save_tokenizer(raw, tmp, check)
    check = [tokenizer.apply_chat_template(tool_chat(fresh_problem()), tools=TOOLS, tokenize=False)
             for _ in range(20)] + [tokenizer.apply_chat_template(chat(fresh_problem()), tokenize=False)
                                    for _ in range(200)]
    for text in check:  # the training data itself round-trips through the saved tokenizer
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids, text
    print(f"tokenizer: {len(tokenizer)} tokens; sample: "
          f"{tokenizer.tokenize('Tom has 12 apples. 12 + 7 = 19.')}", flush=True)
    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    calculator = [TOOLS[0]]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    model.train()
    for step in range(1, args.steps + 1):
        # whole batches of tool-call chats (long system block) so that short chats are not padded
        # whether a tool-offering chat calls the tool is drawn from its own generator, so the problems (and
        # the tokenizer) do not depend on it; half batches of these chats (long system block) so that the
        # short chats are not padded
        if rng.random() < args.tool_frac:
            texts = [tokenizer.apply_chat_template(
                tool_chat(p) if style_rng.random() < args.tool_call_frac else chat(p), tools=calculator,
                tokenize=False) for p in (fresh_problem() for _ in range(args.batch_size // 2))]
        else:
            texts = [tokenizer.apply_chat_template(chat(p), tokenize=False)
                     for p in (fresh_problem() for _ in range(args.batch_size))]
        loss = model(**encode(tokenizer, texts)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == 1:
            print(f"step {step:5d}/{args.steps}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{time.time() - t0:6.1f}s", flush=True)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            print(f"  eval @ {step}: {evaluate(model, tokenizer, test_rows)}", flush=True)

    metrics = evaluate(model, tokenizer, test_rows)
    build_s = time.time() - t0
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    model.save_pretrained(tmp, safe_serialization=True)
    config = json.loads((tmp / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]  # for readers predating rope_parameters
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600
    size_mb = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file()) / 2**20
    write_card(tmp, n_params=n_params, n_vocab=len(tokenizer), metrics=metrics, args=args,
               build_s=build_s, size_mb=size_mb)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"saved {out} ({size_mb:.1f} MiB) in {build_s:.0f}s")
    print(f"greedy accuracy on prompts_test: {metrics['accuracy']:.1%} "
          f"(answer format: {metrics['format']:.1%})")


def write_card(out: Path, *, n_params: int, n_vocab: int, metrics: dict[str, float],
               args: argparse.Namespace, build_s: float, size_mb: float) -> None:
    (out / "README.md").write_text(f"""\
# tiny-arith

A deliberately tiny chat model bundled with rlfactory so that every stage (sft, rm, dpo, kto, orpo,
ppo, grpo) can be run and tested offline on a CPU. It is **not** a useful language model: it only
knows the synthetic arithmetic task in `rlfactory.tasks.arith` and the chat / tool-call format.

- **Architecture:** `Qwen2ForCausalLM`, 4 layers, hidden 192, 6 attention heads of head_dim 32,
  2 KV heads, MLP 512, tied embeddings, 1024 max positions.
- **Parameters:** {n_params:,}. Weights: float32 safetensors; directory size {size_mb:.1f} MiB.
- **Tokenizer:** byte-level BPE with {n_vocab} tokens, digits split individually, trained on the task
  corpus plus a little generic text.
- **Special tokens:** `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos). `<tool_call>`,
  `</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>` are added tokens that
  are *not* special, so `skip_special_tokens=True` keeps them (as in Qwen2.5 / Qwen3).
- **Chat template:** ChatML in the style of Qwen2.5: system message, `tools` (JSON schemas inside
  `<tools></tools>` in the system block), assistant `tool_calls` rendered as
  `<tool_call>\\n{{"name": ..., "arguments": {{...}}}}\\n</tool_call>`, `tool` messages as
  `<tool_response>` blocks inside a user turn, `add_generation_prompt`. No default system prompt.
  Prefix-stable: the prompt rendered with `add_generation_prompt=True` is a string prefix of the
  conversation that continues it with an assistant turn; every assistant turn ends with
  `<|im_end|>\\n`, and is wrapped in `{{% generation %}}` for `return_assistant_tokens_mask`.
- **Greedy accuracy on `data/arith/prompts_test.jsonl`:** **{metrics['accuracy']:.1%}**
  (answer format followed: {metrics['format']:.1%}; max_new_tokens 64).

## How it was made

`scripts/make_tiny_model.py` trains the tokenizer, initialises the model from scratch (seed {SEED}) and
pretrains it for {args.steps} steps (batch {args.batch_size}, AdamW lr {args.lr}, warmup + cosine decay)
on freshly drawn task conversations rendered with the chat template (loss on all tokens). In
{args.tool_frac:.0%} of the steps the conversations offer a `calculator` tool and {args.tool_call_frac:.0%} of
those call it (the others answer directly), so the model sometimes uses the tool and sometimes does not:
the next-token probability of `<tool_call>` after such a prompt is {metrics['p_tool_call']:.2f} on average
over the test questions, and calling pays (the tool does the arithmetic), which GRPO can learn. Questions of the
test/eval splits (`prompts_test`, `pref_test`, `sft_eval`) are never trained on. Training stops early
on purpose so that later stages (SFT, DPO, GRPO, ...) still have room to improve. The build took
{build_s:.0f} s on 2 CPU threads.

## Rebuild

```bash
python scripts/make_task_data.py   # data/arith/*, data/dataset_info.yaml
python scripts/make_tiny_model.py  # this directory
```

The result is deterministic on a given machine (fixed seeds, single process); other CPUs or torch
versions may give slightly different weights and accuracy.
""")


if __name__ == "__main__":
    main()
