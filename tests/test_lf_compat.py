"""LLaMA-Factory compatibility: its dataset_info.json, its data shapes and its flat run YAMLs.

Every file here is written by the test in exactly LLaMA-Factory's shapes (alpaca with `input`, identity-style rows,
glaive tool calls in sharegpt, its dpo and kto layouts, c4-style jsonl); the YAMLs follow its example YAMLs
(examples/train_lora/llama3_lora_{sft,dpo,kto,reward,ppo}.yaml) with only the model path and the step count
overridden on the command line.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import yaml
from tests.conftest import DATA_DIR, TINY_MODEL, expect_train_error, run_cli

from rlfactory.config import llamafactory
from rlfactory.config.loader import load_config
from rlfactory.data.loader import load_examples
from rlfactory.errors import UserError

IDENTITY = [
    {"instruction": "hi", "input": "", "output": "Hello! I am {{name}}, an AI assistant developed by {{author}}."},
    {"instruction": "Who are you?", "input": "", "output": "I am {{name}}, made by {{author}}."},
]
ALPACA = [
    {"instruction": "Add the numbers.", "input": "12 + 30", "output": "12 + 30 = 42. The answer is 42."},
    {"instruction": "What is 7 + 8?", "input": "", "output": "7 + 8 = 15. The answer is 15."},
    {"instruction": "Subtract.", "input": "50 - 8", "output": "50 - 8 = 42. The answer is 42."},
    {"instruction": "Add.", "input": "3 + 4", "output": "3 + 4 = 7. The answer is 7."},
]
CALC_TOOL = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
GLAIVE = [
    {
        "conversations": [
            {"from": "human", "value": "What is 36 + 13?"},
            {"from": "function_call", "value": '{"name": "calculator", "arguments": {"expression": "36 + 13"}}'},
            {"from": "observation", "value": '{"result": 49}'},
            {"from": "gpt", "value": "36 + 13 = 49. The answer is 49."},
        ],
        "tools": json.dumps([CALC_TOOL]),
    },
    {
        "conversations": [
            {"from": "system", "value": "You are a calculator assistant."},
            {"from": "human", "value": "Hi there"},
            {"from": "gpt", "value": "Hello! How can I help?"},
        ],
        "tools": json.dumps([CALC_TOOL]),
    },
]
HISTORY = [
    {
        "instruction": "And times 2?",
        "input": "",
        "output": "42 x 2 = 84. The answer is 84.",
        "system": "Answer with a number.",
        "history": [["What is 40 + 2?", "The answer is 42."]],
    }
]
DPO = [
    {
        "conversations": [{"from": "human", "value": f"What is {a} + {b}?"}],
        "chosen": {"from": "gpt", "value": f"{a} + {b} = {a + b}. The answer is {a + b}."},
        "rejected": {"from": "gpt", "value": f"{a} + {b} = {a + b + 3}. The answer is {a + b + 3}."},
    }
    for a, b in [(3, 4), (10, 5), (21, 9), (7, 7), (12, 30), (8, 1)]
]
KTO = [
    {
        "messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"The answer is {a + b + (0 if good else 2)}."},
        ],
        "label": good,
    }
    for a, b, good in [(3, 4, True), (10, 5, False), (21, 9, True), (7, 7, False), (12, 30, True), (8, 1, False)]
]
C4 = [{"text": "The answer is 42. Numbers add up."}, {"text": "Seven plus eight is fifteen."}]

DATASET_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "alpaca_history": {
        "file_name": "alpaca_history.json",
        "columns": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                    "history": "history"},
    },
    "glaive_toolcall_en_demo": {
        "file_name": "glaive_toolcall_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    },
    "dpo_en_demo": {
        "file_name": "dpo_en_demo.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
    "kto_en_demo": {
        "file_name": "kto_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
    "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
    # entries that cannot be used here: they must not break the others
    "alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en_not_cached", "ms_hub_url": "llamafactory/alpaca_en"},
    "deepctrl": {"ms_hub_url": "deepctrl/deepctrl-sft-data"},
    "mllm_demo": {
        "file_name": "mllm_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
    },
}


@pytest.fixture
def lf_data(tmp_path: Path) -> Path:
    """A LLaMA-Factory data/ folder: dataset_info.json and its files."""
    folder = tmp_path / "data"
    folder.mkdir()
    files = {
        "identity.json": IDENTITY,
        "alpaca_en_demo.json": ALPACA,
        "alpaca_history.json": HISTORY,
        "glaive_toolcall_en_demo.json": GLAIVE,
        "dpo_en_demo.json": DPO,
        "kto_en_demo.json": KTO,
    }
    for name, rows in files.items():
        (folder / name).write_text(json.dumps(rows, indent=2))
    (folder / "c4_demo.jsonl").write_text("".join(json.dumps(row) + "\n" for row in C4))
    (folder / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2))
    return folder


def test_alpaca_defaults_and_input_appended(lf_data: Path):
    """No `formatting` means alpaca; `input` is appended to the instruction on a new line, as LLaMA-Factory does."""
    examples = load_examples(["alpaca_en_demo", "identity"], "sft", str(lf_data))
    assert examples[0]["messages"] == [
        {"role": "user", "content": "Add the numbers.\n12 + 30"},
        {"role": "assistant", "content": "12 + 30 = 42. The answer is 42."},
    ]
    assert examples[1]["messages"][0] == {"role": "user", "content": "What is 7 + 8?"}  # empty input: no newline
    assert examples[4]["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": IDENTITY[0]["output"]},
    ]
    sources = [f"alpaca_en_demo:{i}" for i in (1, 2, 3, 4)] + ["identity:1", "identity:2"]
    assert [e["source"] for e in examples] == sources


def test_glaive_tool_calls_and_tools_column(lf_data: Path):
    """A function_call turn is the assistant's tool call, an observation turn the tool's answer, and the bare
    function schemas of the tools column take the OpenAI form: nothing of the row is lost."""
    first, second = load_examples(["glaive_toolcall_en_demo"], "sft", str(lf_data))
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "36 + 13"}}}
    assert first["messages"] == [
        {"role": "user", "content": "What is 36 + 13?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"result": 49}'},
        {"role": "assistant", "content": "36 + 13 = 49. The answer is 49."},
    ]
    assert first["tools"] == [{"type": "function", "function": CALC_TOOL}]
    assert second["tools"] == first["tools"]
    assert second["messages"][0] == {"role": "system", "content": "You are a calculator assistant."}  # system turn
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant"]


def test_alpaca_system_and_history(lf_data: Path):
    (example,) = load_examples(["alpaca_history"], "sft", str(lf_data))
    assert example["messages"] == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 40 + 2?"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "And times 2?"},
        {"role": "assistant", "content": "42 x 2 = 84. The answer is 84."},
    ]


def test_dpo_kto_and_c4_layouts(lf_data: Path):
    pairs = load_examples(["dpo_en_demo"], "pairwise", str(lf_data))
    assert len(pairs) == 6
    assert pairs[0]["messages"] == [{"role": "user", "content": "What is 3 + 4?"}]
    assert pairs[0]["chosen"] == [{"role": "assistant", "content": "3 + 4 = 7. The answer is 7."}]
    assert pairs[0]["rejected"] == [{"role": "assistant", "content": "3 + 4 = 10. The answer is 10."}]
    unpaired = load_examples(["kto_en_demo"], "unpaired", str(lf_data))
    assert [e["label"] for e in unpaired] == [True, False, True, False, True, False]
    assert unpaired[1]["messages"][-1] == {"role": "assistant", "content": "The answer is 17."}
    prompts = load_examples(["c4_demo"], "prompt", str(lf_data))  # alpaca with the text as the prompt
    assert [e["messages"] for e in prompts] == [[{"role": "user", "content": row["text"]}] for row in C4]


def test_prompt_stage_keeps_the_response_as_answer(lf_data: Path):
    """LLaMA-Factory's ppo reads sft rows as prompts; the response becomes the reference answer, not lost."""
    examples = load_examples(["alpaca_en_demo"], "prompt", str(lf_data))
    assert examples[0]["messages"] == [{"role": "user", "content": "Add the numbers.\n12 + 30"}]
    assert examples[0]["answer"] == "12 + 30 = 42. The answer is 42."


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("alpaca_en", ["dataset 'alpaca_en'", "llamafactory/alpaca_en_not_cached", "local Hugging Face cache"]),
        ("deepctrl", ["dataset 'deepctrl' is on ModelScope only", "ms_hub_url", "file_name"]),
        ("mllm_demo", ["dataset 'mllm_demo' has media columns (images: images)", "text-only"]),
    ],
)
def test_unusable_entries_fail_only_when_used(lf_data: Path, name: str, fragments: list[str]):
    assert len(load_examples(["identity"], "sft", str(lf_data))) == 2  # the rest of the file is usable
    with pytest.raises(UserError) as err:
        load_examples([name], "sft", str(lf_data))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_unmapped_columns_are_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """A column the entry does not read is named with its row count, never dropped silently."""
    rows = [{"instruction": "q", "output": "a", "context": "c1"}, {"instruction": "q2", "output": "b", "context": ""}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    with caplog.at_level(logging.WARNING):
        load_examples(["d"], "sft", str(tmp_path))
    assert "dataset 'd': column(s) 'context' (1 rows) are not mapped" in caplog.text


def test_yaml_and_json_registries_together(lf_data: Path):
    (lf_data / "dataset_info.yaml").write_text(
        yaml.safe_dump({"mine": {"file_name": "kto_en_demo.json", "columns": {"kto_tag": "label"}}, "identity": {}})
    )
    assert len(load_examples(["mine"], "unpaired", str(lf_data))) == 6  # ours: openai by default
    assert len(load_examples(["c4_demo"], "prompt", str(lf_data))) == 2  # LLaMA-Factory's: alpaca by default
    with pytest.raises(UserError, match="'identity' is registered in both dataset_info.yaml and dataset_info.json"):
        load_examples(["identity"], "sft", str(lf_data))


# ------------------------------------------------------------------------------------------------ run YAMLs
def lf_yaml(stage: str, dataset: str, output_dir: Path, **extra: object) -> dict:
    """The shape of LLaMA-Factory's examples/train_lora/llama3_lora_<stage>.yaml (small sizes for a CPU)."""
    return {
        "model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct",
        "trust_remote_code": True,
        "stage": stage,
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_target": "all",
        **extra,
        "dataset": dataset,
        "template": "llama3",
        "cutoff_len": 256,
        "max_samples": 1000,
        "overwrite_cache": True,
        "preprocessing_num_workers": 16,
        "output_dir": str(output_dir),
        "logging_steps": 1,
        "save_steps": 500,
        "plot_loss": True,
        "overwrite_output_dir": True,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1.0e-4,
        "num_train_epochs": 3.0,
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.1,
        "bf16": True,
        "ddp_timeout": 180000000,
    }


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_sft_mapping_and_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = write(tmp_path / "sft.yaml", lf_yaml("sft", "identity,alpaca_en_demo", tmp_path / "out"))
    with caplog.at_level(logging.INFO):
        cfg = load_config(path, [f"model_name_or_path={TINY_MODEL}"])
    assert cfg.stage == "sft" and cfg.model.name_or_path == str(TINY_MODEL)
    assert cfg.data.dataset == ["identity", "alpaca_en_demo"] and cfg.data.cutoff_len == 256
    assert cfg.lora.target_modules == "all-linear" and cfg.lora.r == 8 and cfg.lora.alpha == 16
    assert (cfg.train.per_device_batch_size, cfg.train.grad_accum_steps, cfg.train.num_epochs) == (2, 2, 3.0)
    assert cfg.train.lr_scheduler == "cosine" and cfg.train.mixed_precision == "bf16"
    assert cfg.model.gradient_checkpointing is True  # LLaMA-Factory's default
    assert "a LLaMA-Factory file" in caplog.text and "lora_rank -> lora.r" in caplog.text
    assert "ddp_timeout (the process group's timeout is Accelerate's)" in caplog.text


def test_adamw_settings_reach_the_optimizer(tmp_path: Path):
    """transformers' AdamW keys (adam_beta1/2, adam_epsilon, weight_decay) map to train.* and reach the optimizer
    the engine builds (an epsilon left at AdamW's default would change small updates without a word)."""
    import torch

    from rlfactory.engine.shared import make_optimizer

    extra = {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.1}
    path = write(tmp_path / "sft.yaml", lf_yaml("sft", "identity", tmp_path / "out", **extra))
    train = load_config(path, [f"model_name_or_path={TINY_MODEL}"]).train
    assert (train.adam_beta1, train.adam_beta2, train.adam_epsilon, train.weight_decay) == (0.8, 0.95, 1e-6, 0.1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = make_optimizer(model, 1e-3, train)
    decay, no_decay = optimizer.param_groups
    assert (decay["betas"], decay["eps"], decay["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.1)
    assert (no_decay["eps"], no_decay["weight_decay"]) == (1e-6, 0.0)


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        ({"pref_loss": "sigmoid", "pref_beta": 0.2}, ("dpo", {"loss_type": "sigmoid", "beta": 0.2})),
        ({"pref_loss": "simpo", "simpo_gamma": 0.3}, ("dpo", {"loss_type": "simpo", "simpo_gamma": 0.3})),
        ({"pref_loss": "ipo", "pref_ftx": 0.5}, ("dpo", {"loss_type": "ipo", "sft_weight": 0.5})),
        ({"pref_loss": "orpo", "pref_beta": 0.3}, ("orpo", {"beta": 0.3})),
    ],
)
def test_dpo_pref_loss_mapping(tmp_path: Path, extra: dict, expect: tuple):
    raw = lf_yaml("dpo", "dpo_en_demo", tmp_path / "out", **extra)
    conv = llamafactory.convert(raw)
    stage, section = expect
    assert conv.out["stage"] == stage
    assert conv.out[stage] == section


def test_switches_do_not_undo_each_other(tmp_path: Path):
    out = llamafactory.convert(lf_yaml("sft", "identity", tmp_path, mask_history=True, train_on_prompt=False)).out
    expected = {"dataset": ["identity"], "cutoff_len": 256, "max_samples": 1000, "train_on": "last_assistant"}
    assert out["data"] == expected
    out = llamafactory.convert(lf_yaml("sft", "identity", tmp_path, neat_packing=True, packing=False)).out
    assert out["data"]["packing"] is True


def test_ppo_batches_and_kl(tmp_path: Path):
    raw = lf_yaml("ppo", "identity", tmp_path / "out", reward_model="saves/rm", ppo_buffer_size=2, max_new_tokens=16)
    out = llamafactory.convert(raw).out
    assert out["rollout"]["prompts_per_step"] == 2 * 2 * 2 and out["algorithm"]["num_mini_batches"] == 2
    assert out["rollout"]["num_samples"] == 1 and out["rollout"]["max_response_len"] == 16
    assert out["rollout"]["max_prompt_len"] == 256  # cutoff_len: LLaMA-Factory keeps prompts up to it
    assert "grad_accum_steps" not in out["train"] and out["reward"] == {"reward_model": "saves/rm"}
    assert out["algorithm"]["kl_controller"] == "adaptive" and out["algorithm"]["kl_in_reward_coef"] == 0.2


def test_refused_and_unknown_keys_are_named(tmp_path: Path):
    raw = lf_yaml(
        "dpo", "dpo_en_demo", tmp_path / "out", pref_loss="kto_pair", quantization_bit=4, quantization_method="hqq",
        loraplus_lr_ratio=16.0, lora_rnk=4,
    )  # fmt: skip
    with pytest.raises(UserError) as err:
        llamafactory.convert(raw)
    msg = str(err.value)
    assert "pref_loss: kto_pair (paired KTO) is not supported; use `stage: kto`" in msg
    assert "quantization_method: 'hqq' is not supported; only bitsandbytes (bnb)" in msg
    assert "loraplus_lr_ratio: LoRA+ is not supported" in msg
    assert "lora_rnk: not a key rlfactory can read from a LLaMA-Factory file (did you mean 'lora_rank'?)" in msg
    pt = lf_yaml("pt", "c4_demo", tmp_path / "out")
    if "pt" in llamafactory.STAGES:
        assert llamafactory.convert(pt).out["stage"] == "pt"
    else:
        with pytest.raises(UserError, match="stage: pt .* is not available in this version"):
            llamafactory.convert(pt)


def test_peft_methods_and_qlora_keys_map_and_validate(tmp_path: Path):
    """LLaMA-Factory's DoRA / rsLoRA / PiSSA / bitsandbytes keys (finetuning_args.py, model_args.py) -> our `lora:` and
    `model.quantization`, and the converted file validates; LLaMA-Factory's 4-bit compute dtype follows fp16."""
    qlora = {
        "use_dora": True, "use_rslora": True, "quantization_bit": 4, "quantization_method": "bnb",
        "quantization_type": "fp4", "double_quantization": False,
    }  # fmt: skip
    raw = lf_yaml("sft", "identity", tmp_path / "out", **qlora) | {"bf16": False, "fp16": True}
    cfg = load_config(write(tmp_path / "qlora.yaml", raw))
    assert (cfg.lora.use_dora, cfg.lora.use_rslora, cfg.lora.init_lora_weights) == (True, True, True)
    assert cfg.model.quantization.model_dump() == {
        "bits": 4, "quant_type": "fp4", "double_quant": False, "compute_dtype": "float16"
    }  # fmt: skip
    # 8 bits: LLaMA-Factory ignores the 4-bit keys (its double_quantization default is true), so do we
    eight = lf_yaml("dpo", "dpo_en_demo", tmp_path / "out", quantization_bit=8, double_quantization=True)
    assert load_config(write(tmp_path / "eight.yaml", eight)).model.quantization.model_dump() == {
        "bits": 8, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"
    }  # fmt: skip
    for iters, init in ((None, "pissa_niter_16"), (4, "pissa_niter_4"), (-1, "pissa")):
        keys = {"pissa_init": True, "pissa_convert": True} | ({} if iters is None else {"pissa_iter": iters})
        conv = llamafactory.convert(lf_yaml("sft", "identity", tmp_path / "out", **keys))
        assert conv.out["lora"]["init_lora_weights"] == init
        assert any("always saves the converted adapter" in note for note in conv.ignored)
        path = write(tmp_path / "pissa.yaml", lf_yaml("sft", "identity", tmp_path / "out", **keys))
        assert load_config(path).lora.init_lora_weights == init
    keys = {"pissa_iter": 4, "use_dora": False, "quantization_bit": None}
    off = llamafactory.convert(lf_yaml("sft", "identity", tmp_path / "out", **keys))
    assert "model" not in off.out or "quantization" not in off.out["model"]
    assert off.out["lora"]["use_dora"] is False and "init_lora_weights" not in off.out["lora"]
    assert "pissa_iter (pissa_init is off)" in off.ignored


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"quantization_bit": 3}, "quantization_bit: 3: bitsandbytes quantizes to 4 or 8 bits"),
        ({"pissa_init": True, "pissa_iter": -2}, "pissa_iter: -2: give the fast-SVD steps"),
        ({"quantization_bit": 4, "pissa_init": True}, "model.quantization <- quantization_bit"),  # peft: no PiSSA there
        ({"quantization_bit": 4, "finetuning_type": "full"}, "cannot be trained with finetuning: full"),
    ],
)
def test_peft_and_qlora_keys_that_cannot_work_are_refused(tmp_path: Path, keys: dict, message: str):
    with pytest.raises(UserError) as err:
        load_config(write(tmp_path / "bad.yaml", lf_yaml("sft", "identity", tmp_path / "out", **keys)))
    assert message in str(err.value)


def test_validation_errors_name_the_llamafactory_key(tmp_path: Path):
    path = write(tmp_path / "sft.yaml", lf_yaml("sft", "identity", tmp_path / "out", lora_rank="eight"))
    with pytest.raises(UserError) as err:
        load_config(path)
    assert "lora.r" in str(err.value) and "lora.r <- lora_rank" in str(err.value)


def test_check_accepts_only_what_train_accepts(tmp_path: Path, lf_data: Path):
    """Values that pass `config check` train: comma lists and `all`; a dpo loss train would refuse fails the check."""
    base = {
        "stage": "dpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL)},
        "data": {"dataset": "dpo_en_demo, dpo_en_demo", "dataset_dir": str(lf_data)},
        "lora": {"target_modules": "q_proj,v_proj"},
    }
    ok = run_cli("config", "check", str(write(tmp_path / "ok.yaml", base)))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "12 pairwise examples from dpo_en_demo, dpo_en_demo" in ok.stdout
    bad = run_cli("config", "check", str(write(tmp_path / "bad.yaml", {**base, "dpo": {"loss_type": "kto_pair"}})))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "dpo.loss_type 'kto_pair' (paired KTO) is not supported: use `stage: kto`" in bad.stderr


def test_convert_writes_our_yaml(tmp_path: Path, lf_data: Path):
    src = write(tmp_path / "kto.yaml", lf_yaml("kto", "kto_en_demo", tmp_path / "out", pref_beta=0.2))
    result = run_cli("convert", str(src), "-o", str(tmp_path / "ours.yaml"))
    assert result.returncode == 0, result.stderr[-2000:]
    written = yaml.safe_load((tmp_path / "ours.yaml").read_text())
    assert written["stage"] == "kto" and written["kto"] == {"beta": 0.2}
    assert written["model"]["name_or_path"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert load_config(tmp_path / "ours.yaml") == load_config(src)  # the same run, in our schema
    again = run_cli("convert", str(src), "-o", str(tmp_path / "ours.yaml"))
    assert again.returncode == 2 and "exists" in again.stderr


def _train(tmp_path: Path, name: str, raw: dict, *overrides: str) -> None:
    path = write(tmp_path / f"{name}.yaml", raw)
    result = run_cli("train", str(path), f"model_name_or_path={TINY_MODEL}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a LLaMA-Factory file" in result.stderr
    out = Path(raw["output_dir"])
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    losses = [entry["loss"] for entry in log if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses), log
    assert all(entry["grad_norm"] > 0 for entry in log if "grad_norm" in entry), log  # the adapter got gradients
    assert (out / "adapter_config.json").is_file() or (out / "config.json").is_file()  # the final save


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "dataset", "extra"),
    [
        ("sft", "identity,alpaca_en_demo,glaive_toolcall_en_demo", {}),
        ("dpo", "dpo_en_demo", {"pref_beta": 0.1, "pref_loss": "sigmoid"}),
        ("kto", "kto_en_demo", {"pref_beta": 0.1}),
    ],
)
def test_llamafactory_yaml_trains(tmp_path: Path, lf_data: Path, stage: str, dataset: str, extra: dict):
    raw = lf_yaml(stage, dataset, tmp_path / stage, dataset_dir=str(lf_data), **extra)
    _train(tmp_path, stage, raw, "max_steps=2")


@pytest.mark.slow
def test_llamafactory_reward_then_ppo(tmp_path: Path, lf_data: Path):
    """reward (stage rm) as in llama3_lora_reward.yaml, then ppo on its reward model as in llama3_lora_ppo.yaml."""
    rm = lf_yaml("rm", "dpo_en_demo", tmp_path / "rm", dataset_dir=str(lf_data))
    _train(tmp_path, "rm", rm, "max_steps=2")
    ppo = lf_yaml("ppo", "identity,alpaca_en_demo", tmp_path / "ppo", dataset_dir=str(lf_data),
                  reward_model=str(tmp_path / "rm"))  # fmt: skip
    ppo |= {"max_new_tokens": 8, "top_k": 0, "top_p": 0.9}
    _train(tmp_path, "ppo", ppo, "max_steps=1")


def test_bundled_registry_is_unchanged():
    assert len(load_examples(["arith_sft_alpaca"], "sft", str(DATA_DIR), max_samples=3)) == 3


def test_migrating_doc_has_the_current_key_table():
    from tests.conftest import ROOT

    assert llamafactory.markdown_table() in (ROOT / "docs" / "MIGRATING.md").read_text(), (
        "regenerate the table of docs/MIGRATING.md from rlfactory.config.llamafactory.markdown_table()"
    )


def test_config_check_reads_a_llamafactory_file(tmp_path: Path, lf_data: Path):
    raw = lf_yaml("dpo", "dpo_en_demo", tmp_path / "out", dataset_dir=str(lf_data), pref_loss="sigmoid")
    result = run_cli("config", "check", str(write(tmp_path / "dpo.yaml", raw)), f"model_name_or_path={TINY_MODEL}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "a LLaMA-Factory file" in result.stderr and "pref_loss -> dpo.loss_type" in result.stderr
    assert "6 pairwise examples from dpo_en_demo" in result.stdout


def test_webui_form_loads_a_llamafactory_file(tmp_path: Path):
    """Load YAML in the WebUI converts a LLaMA-Factory file; the form gives back the same run as the CLI reads."""
    from rlfactory.config.loader import validate_config
    from rlfactory.webui import schema_form as sf

    raw = lf_yaml("dpo", "dpo_en_demo", tmp_path / "out", pref_loss="simpo", simpo_gamma=0.3)
    mapping, note = sf.form_mapping(raw)
    assert "a LLaMA-Factory file" in note and "ddp_timeout" in note
    sections = sf.form_sections()
    values, unknown = sf.raw_to_form(sections, mapping)
    assert unknown == []
    path = write(tmp_path / "dpo.yaml", raw)
    assert validate_config(sf.form_to_raw(sections, values), "form") == load_config(path)
    assert sf.form_mapping({"stage": "sft"}) == ({"stage": "sft"}, "")


def test_hub_and_script_entries_load_through_datasets(tmp_path: Path):
    """hf_hub_url (with folder) and script_url go through `datasets.load_dataset`; a local repository stands in
    for the hub here (offline), exercising the same call."""
    repo = tmp_path / "repo"
    (repo / "en").mkdir(parents=True)
    (repo / "en" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ALPACA[:2]))
    (tmp_path / "script_ds").mkdir()
    (tmp_path / "script_ds" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ALPACA[2:]))
    info = {"hub": {"hf_hub_url": str(repo), "folder": "en"}, "script": {"script_url": "script_ds"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    hub = load_examples(["hub"], "sft", str(tmp_path))
    assert [e["messages"][0]["content"] for e in hub] == ["Add the numbers.\n12 + 30", "What is 7 + 8?"]
    script = load_examples(["script"], "sft", str(tmp_path))
    assert [e["messages"][0]["content"] for e in script] == ["Subtract.\n50 - 8", "Add.\n3 + 4"]


def test_train_refuses_with_one_clear_message(tmp_path: Path, lf_data: Path):
    raw = lf_yaml("sft", "identity", tmp_path / "out", dataset_dir=str(lf_data), quantization_bit=3, use_galore=True)
    expect_train_error(
        tmp_path,
        raw | {"model_name_or_path": str(TINY_MODEL)},
        "LLaMA-Factory keys that rlfactory cannot honour",
        "quantization_bit: 3: bitsandbytes quantizes to 4 or 8 bits",
        "use_galore: GaLore is not supported",
    )


def test_alpaca_kto_and_ranking_layouts(tmp_path: Path):
    """ultrafeedback_kto-style (prompt, completion, label) and orca_pairs-style (question, chosen, rejected, system)."""
    kto = [{"prompt": "What is 2 + 2?", "completion": "The answer is 4.", "label": True}]
    pairs = [{"question": "What is 2 + 3?", "chosen": "5", "rejected": "6", "system": "Be brief."}]
    (tmp_path / "kto.json").write_text(json.dumps(kto))
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    info = {
        "kto": {"file_name": "kto.json", "columns": {"prompt": "prompt", "response": "completion", "kto_tag": "label"}},
        "pairs": {
            "file_name": "pairs.json",
            "ranking": True,
            "columns": {"prompt": "question", "chosen": "chosen", "rejected": "rejected", "system": "system"},
        },
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    (example,) = load_examples(["kto"], "unpaired", str(tmp_path))
    assert example["label"] is True and example["messages"][-1] == {"role": "assistant", "content": "The answer is 4."}
    (pair,) = load_examples(["pairs"], "pairwise", str(tmp_path))
    assert pair["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert pair["chosen"] == [{"role": "assistant", "content": "5"}]
    assert pair["rejected"] == [{"role": "assistant", "content": "6"}]
