"""The one schema: YAML + overrides -> validated config, with errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import write_yaml

from rlfactory.config.loader import apply_overrides, load_config, validate_config
from rlfactory.config.schema import PipelineConfig, RunConfig
from rlfactory.errors import UserError

BASE = {"stage": "sft", "model": {"name_or_path": "m"}, "data": {"dataset": "d"}}


def test_minimal_config_fills_defaults():
    cfg = validate_config(BASE, "run.yaml")
    assert isinstance(cfg, RunConfig)
    assert cfg.data.dataset == ["d"]  # a single name is accepted for a list
    assert cfg.lora.target_modules == "all-linear" and cfg.model.finetuning == "lora"
    assert cfg.dpo is None and cfg.rollout is None  # other stages' sections stay off


def test_stage_sections_default_for_their_stage():
    cfg = validate_config({**BASE, "stage": "dpo"}, "run.yaml")
    assert cfg.dpo is not None and cfg.dpo.beta == 0.1


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(UserError) as err:
        validate_config({**BASE, "train": {"learnig_rate": 1e-4}}, "run.yaml")
    msg = str(err.value)
    assert "run.yaml" in msg and "unknown key 'train.learnig_rate'" in msg
    assert "did you mean 'train.learning_rate'" in msg  # the full key, not the leaf


@pytest.mark.parametrize(
    ("raw", "hint"),
    [
        ({"dataset": "a"}, "unknown key 'dataset' (did you mean 'data.dataset'?)"),  # not the section `data`
        ({"model": {"name_or_path": "m", "learning_rate": 1e-4}}, "did you mean 'train.learning_rate'?"),
        ({"train": {"per_device_train_batch_size": 2}}, "did you mean 'train.per_device_batch_size'?"),
        ({"data": {"datset": "a"}}, "did you mean 'data.dataset'?"),
        ({"cutof_len": 64}, "did you mean 'data.cutoff_len'?"),
    ],
)
def test_hints_name_the_full_key(raw: dict, hint: str):
    with pytest.raises(UserError) as err:
        validate_config({**BASE, **raw}, "run.yaml")
    assert hint in str(err.value)


def test_unknown_top_level_key():
    with pytest.raises(UserError, match=r"unknown key 'modle'.*did you mean 'model'"):
        validate_config({**BASE, "modle": {}}, "run.yaml")


def test_wrong_type_names_the_path():
    with pytest.raises(UserError, match=r"train\.per_device_batch_size: .*integer.*got 'four'"):
        validate_config({**BASE, "train": {"per_device_batch_size": "four"}}, "run.yaml")


def test_out_of_range_names_the_path():
    with pytest.raises(UserError, match=r"lora\.dropout: .*less than 1"):
        validate_config({**BASE, "lora": {"dropout": 1.5}}, "run.yaml")


def test_section_of_another_stage_is_refused():
    with pytest.raises(UserError, match="section 'dpo' applies to stage dpo, not to stage 'sft'"):
        validate_config({**BASE, "dpo": {"beta": 0.2}}, "run.yaml")


def test_cross_field_rules():
    with pytest.raises(UserError, match="stage ppo needs a reward source"):
        validate_config({**BASE, "stage": "ppo"}, "run.yaml")
    with pytest.raises(UserError, match="reference-free: remove dpo.ref_model"):
        validate_config({**BASE, "stage": "dpo", "dpo": {"loss_type": "simpo", "ref_model": "x"}}, "run.yaml")
    with pytest.raises(UserError, match="model.name_or_path is required"):
        validate_config({"stage": "sft", "data": {"dataset": "d"}}, "run.yaml")


@pytest.mark.parametrize(
    ("raw", "refusal"),
    [
        ({"train": {"torch_compile": False}}, "set train.torch_compile: true as well"),
        (
            {"stage": "grpo", "reward": {"functions": ["answer_match"]}},
            "offline stages .* stage grpo's update sees batches of new widths",
        ),
        ({"model": {"name_or_path": "m", "gradient_checkpointing": True}}, "with model.gradient_checkpointing"),
        ({"distributed": {"strategy": "fsdp2"}}, "ddp only, not distributed.strategy fsdp2"),
        ({"train": {"deepspeed": "ds.json"}}, "ddp only, not train.deepspeed"),
    ],
)
def test_cuda_graphs_are_refused_where_they_cannot_replay(raw: dict, refusal: str):
    """train.cuda_graphs needs the compiled layers, an offline stage's repeating shapes, no recomputation in the
    backward and whole weights on every process; each miss is one message naming the key."""
    train = {"torch_compile": True, "cuda_graphs": True, **raw.get("train", {})}
    with pytest.raises(UserError, match=refusal):
        validate_config({**BASE, **raw, "train": train}, "run.yaml")
    assert validate_config({**BASE, "train": {"torch_compile": True, "cuda_graphs": True}}, "x").train.cuda_graphs


def test_overrides_parse_yaml_values():
    raw = apply_overrides(BASE, ["train.learning_rate=3e-4", "lora.target_modules=[q_proj, v_proj]", "seed=7"])
    cfg = validate_config(raw, "x")
    assert cfg.train.learning_rate == 3e-4 and cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.seed == 7
    assert BASE["model"] == {"name_or_path": "m"}  # the input is not modified


def test_bad_override_shapes():
    with pytest.raises(UserError, match="must look like key.sub=value"):
        apply_overrides(BASE, ["train.learning_rate"])
    with pytest.raises(UserError, match="'stage' is a value, not a section"):
        apply_overrides(BASE, ["stage.x=1"])


def test_missing_and_malformed_yaml(tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage: sft\nmodel: [unclosed\n")
    with pytest.raises(UserError, match=r"bad.yaml: YAML syntax error at line \d+"):
        load_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(UserError, match="empty"):
        load_config(empty)


def test_pipeline_defaults_outputs_and_stage_overrides(tmp_path: Path):
    path = write_yaml(
        tmp_path / "p.yaml",
        {
            "output_dir": str(tmp_path / "pipe"),
            "defaults": {"model": {"name_or_path": "m"}, "seed": 3},
            "stages": [
                {"stage": "sft", "data": {"dataset": "a"}},
                {"stage": "grpo", "name": "rl", "model": {"from_stage": "sft"}, "data": {"dataset": "b"},
                 "reward": {"functions": {"answer_match": 1.0}}},
            ],
        },
    )
    cfg = load_config(path, ["rl.train.learning_rate=5e-6", "seed=9"])
    assert isinstance(cfg, PipelineConfig)
    sft, rl = cfg.stages
    assert sft.output_dir == str(tmp_path / "pipe" / "sft") and rl.output_dir == str(tmp_path / "pipe" / "rl")
    assert rl.train.learning_rate == 5e-6 and sft.train.learning_rate == 1e-4
    assert sft.seed == 9 and rl.seed == 9  # a plain key in a pipeline override goes to `defaults`
    assert rl.model.from_stage == "sft" and rl.model.name_or_path == "m"


def test_pipeline_from_stage_must_be_earlier():
    with pytest.raises(UserError, match="'later' is not an earlier stage"):
        validate_config(
            {"stages": [{**BASE, "model": {"from_stage": "later"}}, {**BASE, "name": "later"}]}, "p.yaml"
        )


def test_json_schema_covers_every_section():
    schema = RunConfig.model_json_schema()
    for section in ("model", "lora", "data", "train", "logging", "dpo", "rollout", "reward", "algorithm"):
        assert section in schema["properties"]
    assert "description" in schema["$defs"]["TrainConfig"]["properties"]["learning_rate"]


def test_reward_functions_by_name_weigh_one():
    """`reward.functions: answer_match` (or a list, or `a, b`) is what users type first: each name weighs 1.0."""
    from rlfactory.config.online_schema import RewardConfig

    assert RewardConfig(functions="answer_match").functions == {"answer_match": 1.0}
    assert RewardConfig(functions="answer_match, format_regex").functions == {"answer_match": 1.0, "format_regex": 1.0}
    assert RewardConfig(functions=["rewards.py:score"]).functions == {"rewards.py:score": 1.0}
    assert RewardConfig(functions={"answer_match": 0.5}).functions == {"answer_match": 0.5}
