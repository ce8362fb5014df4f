"""Every TRL dataset type loads as it is (standard and conversational) and renders the expected ids and masks;
TRL-style reward functions get every dataset column; rows over cutoff_len are shortened and counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.loader import validate_config
from rlfactory.config.schema import ModelConfig, RewardConfig
from rlfactory.data.loader import load_examples
from rlfactory.errors import UserError
from rlfactory.model.loader import load_tokenizer
from rlfactory.render.chat import IGNORE_INDEX, Segment, render_prompt, render_sft
from rlfactory.render.fit import FitCounts, sft_item
from rlfactory.render.plain import tokenizer_for
from rlfactory.rewards.stack import RewardStack, Sample
from rlfactory.stages import kto, preference_data

SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE = [{"role": "assistant", "content": "It is blue."}]
GREEN = [{"role": "assistant", "content": "It is green."}]
ROWS = {
    "lm": {"text": "The sky is blue."},
    "lm_conv": {"messages": SKY + BLUE},
    "prompt_only": {"prompt": "The sky is", "solution": "blue"},
    "prompt_only_conv": {"prompt": SKY, "solution": "blue"},
    "pc": {"prompt": "The sky is", "completion": " blue."},
    "pc_conv": {"prompt": SKY + BLUE + [{"role": "user", "content": "Sure?"}], "completion": BLUE},
    "pref": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    "pref_conv": {"prompt": SKY, "chosen": BLUE, "rejected": GREEN},
    "pref_implicit": {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    "pref_implicit_conv": {"chosen": SKY + BLUE, "rejected": SKY + GREEN},
    "unpaired": {"prompt": "The sky is", "completion": " blue.", "label": True},
    "unpaired_conv": {"prompt": SKY, "completion": GREEN, "label": False},
    "stepwise": {"prompt": "1 + 1 =", "completions": [" 2", "."], "labels": [True, True]},
}


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """One dataset per TRL type, registered with nothing but its file (the type is detected from the columns)."""
    folder = tmp_path_factory.mktemp("trl")
    entries = {}
    for name, row in ROWS.items():
        (folder / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        entries[name] = {"file_name": f"{name}.jsonl"}
    entries["pc_trl"] = {"file_name": "pc.jsonl", "formatting": "trl"}
    (folder / "dataset_info.yaml").write_text(yaml.safe_dump(entries))
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))


def _one(registry: Path, name: str, kind: str) -> dict:
    [example] = load_examples([name], kind, str(registry))
    return example


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _trained(item: dict) -> list[int]:
    return [t for t, label in zip(item["input_ids"], item["labels"], strict=True) if label != IGNORE_INDEX]


def test_standard_language_modeling_is_text_then_eos_all_trained(registry, tokenizer):
    example = _one(registry, "lm", "sft")
    [item] = render_sft(tokenizer_for(tokenizer, [example]), example["messages"], train_from=0)
    want = _encode(tokenizer, "The sky is blue.") + [tokenizer.eos_token_id]
    assert item == {"input_ids": want, "labels": want}
    assert example["text"] == "The sky is blue." and _one(registry, "lm", "text")["text"] == "The sky is blue."


def test_conversational_language_modeling_is_the_chat_template(registry, tokenizer):
    example = _one(registry, "lm_conv", "sft")
    assert tokenizer_for(tokenizer, [example]) is tokenizer  # conversations keep the model's template
    [item] = render_sft(tokenizer, example["messages"])
    assert [item] == render_sft(tokenizer, SKY + BLUE)
    assert tokenizer.decode(_trained(item)) == "It is blue.<|im_end|>"


def test_prompt_only_standard_and_conversational(registry, tokenizer):
    plain = _one(registry, "prompt_only", "prompt")
    assert render_prompt(tokenizer_for(tokenizer, [plain]), plain["messages"]) == _encode(tokenizer, "The sky is")
    assert plain["columns"] == {"solution": "blue"}
    conv = _one(registry, "prompt_only_conv", "prompt")
    want = tokenizer.apply_chat_template(SKY, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(render_prompt(tokenizer, conv["messages"])) == want
    assert conv["columns"] == {"solution": "blue"}


def test_prompt_completion_trains_the_completion_only(registry, tokenizer):
    plain = _one(registry, "pc", "sft")
    assert plain == {**_one(registry, "pc_trl", "sft"), "source": "pc:1"}  # detected == formatting: trl
    [item] = render_sft(tokenizer_for(tokenizer, [plain]), plain["messages"], train_from=plain["train_from"])
    prompt, completion = _encode(tokenizer, "The sky is"), _encode(tokenizer, " blue.") + [tokenizer.eos_token_id]
    assert item == {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}
    conv = _one(registry, "pc_conv", "sft")
    assert conv["train_from"] == 3
    [item] = render_sft(tokenizer, conv["messages"], train_from=conv["train_from"])
    # the assistant turn inside the prompt is not trained (TRL's completion_only_loss); the completion is
    assert tokenizer.decode(_trained(item)) == "It is blue.<|im_end|>"
    assert render_sft(tokenizer, conv["messages"])[0]["labels"] != item["labels"]  # without train_from: both turns
    # as a prompt (grpo): the prompt messages; the reference completion stays visible to rewards
    as_prompt = _one(registry, "pc_conv", "prompt")
    assert as_prompt["messages"] == ROWS["pc_conv"]["prompt"] and as_prompt["columns"]["completion"] == BLUE


@pytest.mark.parametrize("name", ["pref", "pref_implicit"])
def test_standard_preference_explicit_and_implicit_prompt(registry, tokenizer, name):
    example = _one(registry, name, "pairwise")
    item = preference_data.render_pair(tokenizer_for(tokenizer, [example]), example)
    eos = [tokenizer.eos_token_id]
    assert item["prompt_ids"] == _encode(tokenizer, "The sky is")
    assert item["chosen_ids"] == _encode(tokenizer, " blue.") + eos and all(item["chosen_mask"])
    assert item["rejected_ids"] == _encode(tokenizer, " green.") + eos and all(item["rejected_mask"])


@pytest.mark.parametrize("name", ["pref_conv", "pref_implicit_conv"])
def test_conversational_preference_explicit_and_implicit_prompt(registry, tokenizer, name):
    example = _one(registry, name, "pairwise")
    assert example["messages"] == SKY and example["chosen"] == BLUE and example["rejected"] == GREEN
    item = preference_data.render_pair(tokenizer, example)
    assert tokenizer.decode(item["prompt_ids"]) == tokenizer.apply_chat_template(
        SKY, add_generation_prompt=True, tokenize=False
    )
    trained = [t for t, m in zip(item["chosen_ids"], item["chosen_mask"], strict=True) if m]
    assert tokenizer.decode(trained) == "It is blue.<|im_end|>"


def test_unpaired_preference_standard_and_conversational(registry, tokenizer):
    cfg = validate_config({"stage": "kto", "model": {"name_or_path": str(TINY_MODEL)}, "data": {"dataset": "x"}}, "t")
    plain = _one(registry, "unpaired", "unpaired")
    [item] = kto.render_unpaired(cfg, tokenizer_for(tokenizer, [plain]), [plain])
    assert item["label"] is True and item["prompt_ids"] == _encode(tokenizer, "The sky is")
    assert item["ids"] == _encode(tokenizer, " blue.") + [tokenizer.eos_token_id] and all(item["mask"])
    conv = _one(registry, "unpaired_conv", "unpaired")
    [item] = kto.render_unpaired(cfg, tokenizer, [conv])
    assert item["label"] is False
    trained = [t for t, m in zip(item["ids"], item["mask"], strict=True) if m]
    assert tokenizer.decode(trained) == "It is green.<|im_end|>"


def test_stepwise_supervision_is_refused_clearly(registry):
    with pytest.raises(UserError, match=r"stepwise.jsonl row 1: stepwise supervision .* process reward models"):
        load_examples(["stepwise"], "sft", str(registry))


def test_mixed_plain_and_conversational_rows_are_refused(registry, tokenizer):
    with pytest.raises(UserError, match=r"standard \(plain text\) rows \(lm:1\) and conversations \(lm_conv:1\)"):
        tokenizer_for(tokenizer, [_one(registry, "lm", "sft")], [_one(registry, "lm_conv", "sft")])


TRL_REWARD = """
import json

def correct(completions, solution, **kwargs):  # TRL's convention, unchanged
    seen = dict(kwargs, completions=completions, solution=solution)
    with open(__file__ + ".seen.json", "w") as f:  # user code runs in a worker process: what it saw, for the test
        json.dump(seen, f)
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if s in text else None for text, s in zip(texts, solution)]
"""


def test_every_column_reaches_rewards_and_trl_style_rewards_plug_in(tmp_path):
    (tmp_path / "rewards.py").write_text(TRL_REWARD)
    stack = RewardStack(RewardConfig(functions={f"{tmp_path}/rewards.py:correct": 1.0}), 32)
    rows = [
        {"messages": SKY, "columns": {"solution": "blue", "test_cases": ["It"]}},
        {"messages": SKY, "columns": {"solution": "red", "test_cases": ["No"]}},
    ]
    scores = stack.score([Sample("p", "It is blue.", None, row, 4, [1, 2, 3, 2]) for row in rows])
    assert scores.components["correct"] == [1.0, 0.0] and scores.failures["correct"] == 0  # None: does not apply
    seen = json.loads((tmp_path / "rewards.py.seen.json").read_text())
    assert seen["prompts"] == [SKY, SKY] and seen["completion_ids"] == [[1, 2, 3, 2]] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": "It is blue."}]] * 2
    assert seen["test_cases"] == [["It"], ["No"]] and seen["solution"] == ["blue", "red"]
    plain = [Sample("p", " blue.", None, {"messages": [{"role": "user", "content": "The sky is"}], "plain": True,
                                          "columns": {"solution": "blue"}}, 2, [5, 2])]
    assert stack.score(plain).components["correct"] == [1.0]
    seen = json.loads((tmp_path / "rewards.py.seen.json").read_text())
    assert seen["prompts"] == ["The sky is"] and seen["completions"] == [" blue."]  # standard rows: strings


def _segments(*lengths_and_kinds) -> list[Segment]:
    """Segments of given lengths; ids count up so every token is distinct."""
    out, start = [], 0
    for index, (length, trainable) in enumerate(lengths_and_kinds):
        out.append(Segment(list(range(start, start + length)), trainable, index))
        start += length
    return out


def test_sft_rows_over_cutoff_are_shortened_as_llamafactory_and_counted():
    # glue 30 + turn 90 (+ glue 1): cutoff 100 -> infer_seqlen(30, 90, 100) keeps the source whole (30 * 2 < 100)
    # and gives the response 70; the trailing glue finds no room
    segments = _segments((30, False), (90, True), (1, False))
    item, outcome = sft_item(segments, "assistant", 100, "right")
    assert outcome == "shortened" and item["input_ids"] == list(range(100))
    assert item["labels"] == [IGNORE_INDEX] * 30 + list(range(30, 100))
    # a long prompt and a short answer: the answer stays whole, the prompt keeps its end
    item, _ = sft_item(_segments((300, False), (20, True)), "assistant", 100, "right")
    assert item["input_ids"] == list(range(220, 300)) + list(range(300, 320))
    # two turns: the second gets what the first left (proportional split: 60 prompt + 90 answer -> 40 + 60)
    item, _ = sft_item(_segments((10, False), (10, True), (60, False), (90, True)), "assistant", 120, "right")
    assert item["input_ids"] == list(range(20)) + list(range(40, 80)) + list(range(80, 140))
    assert sft_item(segments, "assistant", 100, "drop") == (None, "longer than the limit (data.truncation: drop)")
    assert sft_item(segments, "assistant", 121, "right")[1] == "kept"
    counts = FitCounts("data.cutoff_len=100", kept=3, shortened=2)
    counts.drop("no trained token left within the limit")
    assert counts.summary() == (
        "after data.cutoff_len=100: 5 of 6 kept (2 shortened), 1 dropped (no trained token left within the limit)"
    )


def test_config_check_reports_what_cutoff_len_does(tmp_path):
    cfg = {
        "stage": "dpo",
        "model": {"name_or_path": str(TINY_MODEL)},
        "data": {"dataset": "arith_pref", "dataset_dir": str(DATA_DIR), "cutoff_len": 64, "max_samples": 40},
    }
    result = run_cli("config", "check", str(write_yaml(tmp_path / "dpo.yaml", cfg)))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "after data.cutoff_len=64" in x)
    assert "of 40 kept" in line and "shortened" in line, result.stdout


CODE_TEST_REWARD = """
import json
from pathlib import Path

def passes(completions, test_cases, **kwargs):
    '''A TRL-style reward that reads a column nothing else maps: `test_cases` (here: the expected answer).'''
    with Path(__file__).with_name("calls.jsonl").open("a") as log:
        log.write(json.dumps({"completions": completions, "test_cases": test_cases, **kwargs}) + "\\n")
    return [float(f"answer is {case['expect']}" in c[0]["content"]) for c, case in zip(completions, test_cases)]
"""


def test_grpo_with_trl_rows_and_a_trl_reward_reading_an_extra_column(tmp_path: Path):
    rows = [json.loads(line) for line in (DATA_DIR / "arith" / "prompts_train.jsonl").read_text().splitlines()[:16]]
    trl_rows = [
        {"prompt": r["messages"], "test_cases": {"expect": r["answer"]}, "level": i} for i, r in enumerate(rows)
    ]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trl_rows))
    (tmp_path / "dataset_info.yaml").write_text("math: {file_name: math.jsonl}\n")
    (tmp_path / "rewards.py").write_text(CODE_TEST_REWARD)
    cfg = {
        "stage": "grpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "math", "dataset_dir": str(tmp_path)},
        "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_response_len": 24},
        "reward": {"functions": {f"{tmp_path}/rewards.py:passes": 1.0}},
        "train": {"max_steps": 2, "per_device_batch_size": 8, "learning_rate": 1e-4},
        "logging": {"progress_bar": False, "plot_loss": False},
    }
    result = run_cli("train", str(write_yaml(tmp_path / "grpo.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # one batched call per step, as TRL makes it
    by_prompt = {json.dumps(r["prompt"]): r for r in trl_rows}
    for call in calls:
        assert len(call["completions"]) == len(call["prompts"]) == len(call["completion_ids"]) == 8
        for prompt, case, level in zip(call["prompts"], call["test_cases"], call["level"], strict=True):
            row = by_prompt[json.dumps(prompt)]  # every column of the row, in the row's own order
            assert case == row["test_cases"] and level == row["level"]
        assert all(c[0]["role"] == "assistant" for c in call["completions"])
    log = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["reward/passes/failures"] for r in log if "reward/passes/failures" in r] == [0.0, 0.0]


def test_a_trl_reward_missing_its_column_is_refused_before_any_model(tmp_path: Path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": SKY}) + "\n")
    (tmp_path / "dataset_info.yaml").write_text("p: {file_name: p.jsonl}\n")
    (tmp_path / "rewards.py").write_text(CODE_TEST_REWARD)
    cfg = {
        "stage": "grpo",
        "model": {"name_or_path": str(TINY_MODEL)},
        "data": {"dataset": "p", "dataset_dir": str(tmp_path)},
        "reward": {"functions": {f"{tmp_path}/rewards.py:passes": 1.0}},
    }
    result = run_cli("config", "check", str(write_yaml(tmp_path / "bad.yaml", cfg)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "reward 'passes' takes the dataset column 'test_cases', which 1 of 1 rows of 'p' lack" in result.stderr


def test_json_string_conversations_are_decoded_and_bracketed_text_stays_text():
    from rlfactory.data.registry import DatasetSpec
    from rlfactory.data.trl import from_trl

    spec = DatasetSpec(file_name="x.csv", formatting="trl")
    conv = from_trl({"prompt": json.dumps(SKY), "completion": json.dumps(BLUE)}, spec)  # as a csv stores them
    assert conv["messages"] == SKY + BLUE and "plain" not in conv
    text = from_trl({"prompt": "[1, 2] has", "completion": " two items."}, spec)
    assert text["plain"] and text["messages"][0]["content"] == "[1, 2] has"


def test_standard_prompt_completion_sft_trains_and_keeps_the_models_chat_template(tmp_path: Path, sft_config: dict):
    rows = [json.loads(line) for line in (DATA_DIR / "arith" / "sft_train.jsonl").read_text().splitlines()[:32]]
    pc = [{"prompt": r["messages"][-2]["content"] + " ", "completion": r["messages"][-1]["content"]} for r in rows]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pc))
    (tmp_path / "dataset_info.yaml").write_text("pc: {file_name: pc.jsonl}\n")
    cfg = {**sft_config, "data": {"dataset": "pc", "dataset_dir": str(tmp_path), "cutoff_len": 128}}
    cfg["train"] = {**cfg["train"], "max_steps": 2}
    result = run_cli("train", str(write_yaml(tmp_path / "sft.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "out")))
    assert saved.chat_template == load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL))).chat_template


def test_kto_unpairs_trl_preference_rows_as_trl_does(registry):
    cfg = validate_config(
        {"stage": "kto", "model": {"name_or_path": str(TINY_MODEL)}, "data": {"dataset": "pref_conv",
                                                                            "dataset_dir": str(registry)}}, "t"
    )
    examples = kto.load_kto_examples(cfg, ["pref_conv", "unpaired_conv"])
    assert [(e["messages"][-1]["content"], e["label"]) for e in examples] == [
        ("It is green.", False),  # the unpaired row
        ("It is blue.", True),  # the pair, one example per side
        ("It is green.", False),
    ]
