"""Stage ppo through the real CLI on the bundled model: critic (value model) + GAE + KL in reward, the saved
critic, a frozen reference for full fine-tuning, learning on a rule reward, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.engine.run_dir import read_log


@pytest.fixture(autouse=True)
def _passive_openmp(monkeypatch):
    """CLI subprocesses: OpenMP threads sleep instead of spinning; on a busy 2-core machine spinning threads
    make the tiny model's many small ops up to 10x slower."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")


def ppo_config(tmp_path: Path, **sections) -> dict:
    cfg = {
        "stage": "ppo",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "lora"},
        "lora": {"r": 8, "alpha": 16},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
        "rollout": {"prompts_per_step": 8, "num_samples": 1, "max_response_len": 24},
        "reward": {"functions": {"answer_match": 1.0, "format_regex": 0.5}},
        "algorithm": {
            "kl_in_reward_coef": 0.05,
            "kl_controller": "adaptive",
            "kl_target": 0.1,
            "kl_horizon": 100,
            "ppo_epochs": 2,
            "num_mini_batches": 2,
        },
        "critic": {"learning_rate": 1e-3, "warmup_steps": 1},
        "train": {"max_steps": 3, "per_device_batch_size": 4, "learning_rate": 1e-3},
        "logging": {"progress_bar": False, "plot_loss": False, "rollout_trace_steps": None},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    return cfg


def _train(tmp_path: Path, cfg: dict):
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    return result, [r for r in read_log(cfg["output_dir"]) if "score/mean" in r]


@pytest.mark.slow
def test_ppo_lora_critic_gae_and_adaptive_kl(tmp_path: Path):
    cfg = ppo_config(tmp_path)
    result, steps = _train(tmp_path, cfg)
    assert "LoRA adapter disabled (no copy)" in result.stderr
    assert [r["step"] for r in steps] == [1, 2, 3]
    critic_keys = {
        "critic/vf_loss",
        "critic/vf_explained_var",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "timing_s/values",
        "timing_s/update_critic",
        "timing_s/ref",
        "actor/reward_kl",
        "actor/kl_coef",
    }
    assert all(critic_keys <= set(r) for r in steps)
    assert "actor/pg_loss" not in steps[0] and "actor/pg_loss" in steps[1]  # critic warmup: step 1 trains no actor
    assert steps[1]["actor/reward_kl"] == 0.0 != steps[2]["actor/reward_kl"]  # k1: the actor left the reference
    assert steps[0]["actor/kl_coef"] == 0.05 and steps[2]["actor/kl_coef"] != 0.05  # adaptive controller acted
    out = Path(cfg["output_dir"])
    assert (out / "adapter_config.json").is_file()
    assert (out / "critic" / "adapter_config.json").is_file() and (out / "critic" / "value_head.safetensors").is_file()
    assert json.loads((out / "run_summary.json").read_text())["saved_as"] == "adapter"


@pytest.mark.slow
def test_ppo_full_finetuning_uses_a_frozen_reference(tmp_path: Path):
    cfg = ppo_config(
        tmp_path,
        model={"finetuning": "full"},
        train={"max_steps": 1},
        algorithm={"kl_loss_coef": 0.01, "kl_in_reward_coef": 0.0},
        critic={"warmup_steps": 0},
    )
    result, steps = _train(tmp_path, cfg)
    assert "reference model: frozen copy" in result.stderr
    assert "actor/kl_loss" in steps[0] and (Path(cfg["output_dir"]) / "critic" / "model.safetensors").is_file()


@pytest.mark.slow
def test_ppo_raises_mean_reward(tmp_path: Path):
    """Learning, not just running: with the rule reward (answer_match) on a fixed set of 16 training problems the
    mean reward of the rollouts goes up (full fine-tuning of policy and critic, GAE, one update per batch)."""
    cfg = ppo_config(
        tmp_path,
        model={"finetuning": "full"},
        data={"max_samples": 16},
        rollout={"prompts_per_step": 16, "num_samples": 4, "max_response_len": 32},
        reward={"functions": {"answer_match": 1.0}},
        algorithm={"kl_in_reward_coef": 0.0, "ppo_epochs": 1, "num_mini_batches": 1},
        critic={"learning_rate": 1e-3, "warmup_steps": 2},
        train={"max_steps": 20, "per_device_batch_size": 64, "learning_rate": 1e-4, "lr_scheduler": "constant"},
    )
    _, steps = _train(tmp_path, cfg)
    scores = [r["score/mean"] for r in steps]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    print(
        f"ppo: rollout reward {first:.3f} -> {last:.3f}, explained variance {steps[-1]['critic/vf_explained_var']:.2f}"
    )
    assert last >= first + 0.08, scores


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"reward": {"functions": {}}}, "stage ppo needs a reward source: set reward.functions or reward.reward_model"),
        ({"algorithm": {"adv_estimator": "grpo"}}, "'grpo' compares samples of the same prompt: rollout.num_samples"),
        ({"critic": {"model_path": "no/such/critic"}}, "critic.model_path: 'no/such/critic' is not a directory"),
    ],
)
def test_bad_ppo_config_is_a_clear_error(tmp_path: Path, change: dict, fragment: str):
    cfg = ppo_config(tmp_path, **change)
    if "reward" in change:
        cfg["reward"] = change["reward"]
    result = run_cli("train", str(write_yaml(tmp_path / "bad.yaml", cfg)))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert fragment in result.stderr, result.stderr
    assert not Path(cfg["output_dir"]).exists()
