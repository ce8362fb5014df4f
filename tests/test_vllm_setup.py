"""The vLLM backend without an engine (main venv): the clear error when vLLM is missing, and the pure helpers
that turn a run config and a policy into engine arguments, requests and checkpoint-format weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.schema import RunConfig
from rlfactory.rollout.vllm import base_weights, engine_kwargs, lora_sync, runs_of_prompts, sync_mode


def grpo_vllm(tmp_path: Path, **rollout) -> dict:
    return {
        "stage": "grpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "lora"},
        "lora": {"r": 8, "alpha": 16},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
        "rollout": {"backend": "vllm", "prompts_per_step": 4, "num_samples": 2, "max_response_len": 24, **rollout},
        "reward": {"functions": {"answer_match": 1.0}},
        "train": {"max_steps": 2},
        "logging": {"progress_bar": False, "plot_loss": False},
    }


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_backend_without_vllm_is_one_clear_error(tmp_path: Path):
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", grpo_vllm(tmp_path))))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "rollout.backend: vllm needs the vllm package" in result.stderr
    assert "rollout.backend: hf" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # refused before any model loads or anything is written


def test_the_training_path_imports_vllm_lazily():
    code = (
        "import sys; import rlfactory.cli, rlfactory.engine.online.loop, rlfactory.rollout.base, "
        "rlfactory.rollout.vllm; "
        "print('vllm' in sys.modules)"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_runs_of_equal_prompts_become_n_samples():
    assert runs_of_prompts([[1, 2], [1, 2], [3], [1, 2]]) == [([1, 2], 2), ([3], 1), ([1, 2], 1)]


def test_engine_kwargs_follow_the_config(tmp_path: Path):
    from rlfactory.model.loader import load_model

    cfg = RunConfig.model_validate(
        grpo_vllm(tmp_path, max_prompt_len=100, enable_sleep_mode=True, gpu_memory_utilization=0.5)
        | {"evaluation": {"max_new_tokens": 40}, "lora": {"r": 12, "alpha": 24}}
    )
    policy = load_model(cfg.model, cfg.lora, cfg.freeze)
    assert sync_mode(cfg, policy) == "merged"  # auto: the engine generates without LoRA kernels
    cpu = engine_kwargs(cfg, policy, "adapter", on_cpu=True)
    assert cpu["max_model_len"] == 140 and cpu["dtype"] == "float32" and cpu["enforce_eager"]
    assert cpu["enable_lora"] and cpu["max_lora_rank"] == 16  # rounded up to a rank vLLM's kernels have
    assert not cpu["enable_sleep_mode"]  # no sleep mode on CPU
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["generation_config"] == "vllm"
    gpu = engine_kwargs(cfg, policy, "merged", on_cpu=False)
    assert gpu["enable_sleep_mode"] and gpu["gpu_memory_utilization"] == 0.5 and "enable_lora" not in gpu
    assert gpu["dtype"] == "bfloat16"  # fp32 weights trained under bf16 autocast generate in bf16
    assert "distributed_executor_backend" not in gpu and gpu["seed"] == cfg.seed
    # several processes (torchrun): one engine per process, on the launcher's device, with a seed of its own
    rank1 = engine_kwargs(cfg, policy, "merged", on_cpu=False, rank=1, world=2)
    assert rank1["distributed_executor_backend"] == "external_launcher" and rank1["seed"] == cfg.seed + 1
    assert rank1["tensor_parallel_size"] == 1


def test_base_weights_are_checkpoint_names_without_lora(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from rlfactory.model.loader import load_model

    cfg = RunConfig.model_validate(grpo_vllm(tmp_path))
    policy = load_model(cfg.model, cfg.lora, cfg.freeze)
    plain = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    names = dict(base_weights(policy))
    assert set(names) == {n for n, _ in plain.named_parameters()}
    assert all(torch.equal(names[n], p) for n, p in plain.named_parameters())


def _lora_policy(tmp_path: Path, dtype: torch.dtype, **lora):
    from rlfactory.model.loader import load_model

    cfg = RunConfig.model_validate(grpo_vllm(tmp_path) | ({"lora": {"r": 8, "alpha": 16, **lora}} if lora else {}))
    policy = load_model(cfg.model, cfg.lora, cfg.freeze).to(dtype)
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA B starts at zero: give the adapter something to merge
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return policy


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_merged_weights_are_peft_merge_out_of_place(tmp_path: Path, dtype: torch.dtype):
    """The merged sync's weights equal PEFT's in-place merge bit for bit, and the policy is never written: PEFT's
    merge + unmerge in bf16 moves the frozen base weights (the drift the out-of-place merge avoids)."""
    import copy

    from rlfactory.rollout.vllm import merged_weights

    policy = _lora_policy(tmp_path, dtype)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    in_place = copy.deepcopy(policy)
    in_place.merge_adapter()
    expected = {n: w.clone() for n, w in base_weights(in_place)}
    in_place.unmerge_adapter()

    got = dict(merged_weights(policy))
    assert set(got) == set(expected)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    changed = [n for n in expected if not torch.equal(got[n], dict(base_weights(policy))[n])]
    assert len(changed) == len([n for n, _ in policy.named_parameters() if "lora_A" in n])  # every adapted layer
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())  # the policy is untouched
    if dtype == torch.bfloat16:  # what PEFT's merge + unmerge leaves behind
        drifted = [n for n, p in in_place.named_parameters() if not torch.equal(p, before[n])]
        assert drifted, "bf16 merge + unmerge restored every weight exactly"


def test_merged_weights_leave_dora_to_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlfactory.rollout.vllm import merged_weights

    dora = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY_MODEL), LoraConfig(r=4, use_dora=True))
    assert merged_weights(dora) is None  # DoRA's merge rescales W: PEFT's own merge_adapter does it


def test_an_engine_model_with_mla_attention_is_not_synced_by_a_plain_copy():
    from rlfactory.rollout.vllm import derives_weights_after_loading

    class MLAAttention(torch.nn.Module):  # what vLLM names its multi-head latent attention layer
        pass

    dense = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert not derives_weights_after_loading(dense)
    assert derives_weights_after_loading(torch.nn.Sequential(torch.nn.Linear(2, 2), MLAAttention()))


def test_online_runs_default_to_expandable_segments_unless_the_user_or_sleep_mode_decides(tmp_path: Path):
    from rlfactory.engine.environment import (
        EXPANDABLE_SEGMENTS,
        apply_online_allocator_setting,
        online_allocator_setting,
    )

    awake = RunConfig.model_validate(grpo_vllm(tmp_path))
    assert online_allocator_setting(awake, {}) == EXPANDABLE_SEGMENTS
    hf = RunConfig.model_validate(grpo_vllm(tmp_path, backend="hf"))
    assert online_allocator_setting(hf, {}) == EXPANDABLE_SEGMENTS
    # the user's own PYTORCH_CUDA_ALLOC_CONF wins, whatever it says
    assert online_allocator_setting(awake, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is None
    assert online_allocator_setting(awake, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is None
    # vLLM's sleep mode allocates from a memory pool that refuses expandable segments
    asleep = RunConfig.model_validate(grpo_vllm(tmp_path, enable_sleep_mode=True))
    assert online_allocator_setting(asleep, {}) is None
    sft = RunConfig.model_validate(
        {
            "stage": "sft",
            "output_dir": str(tmp_path / "sft"),
            "model": {"name_or_path": str(TINY_MODEL)},
            "data": {"dataset": "arith_sft", "dataset_dir": str(DATA_DIR)},
        }
    )
    assert online_allocator_setting(sft, {}) is None  # offline stages: not measured there, left as torch has it
    if not torch.cuda.is_available():
        assert apply_online_allocator_setting(awake) is None  # nothing to set without CUDA


def test_lora_sync_auto_merges_unless_the_base_is_quantized(tmp_path: Path):
    def decided(**extra) -> str:
        cfg = grpo_vllm(tmp_path, **extra.pop("rollout", {}))
        cfg["model"].update(extra)
        return lora_sync(RunConfig.model_validate(cfg))

    assert decided() == "merged"
    assert decided(quantization={"bits": 4}) == "adapter"  # a 4-bit base cannot take the merge
    assert decided(rollout={"lora_sync": "adapter"}) == "adapter"  # the user's choice stands
    assert decided(quantization={"bits": 4}, rollout={"lora_sync": "adapter"}) == "adapter"
    cfg = RunConfig.model_validate(grpo_vllm(tmp_path) | {"lora": {"r": 8, "alpha": 16, "use_dora": True}})
    assert lora_sync(cfg) == "merged"  # DoRA, which vLLM cannot serve as an adapter, needs no setting now


def test_an_unknown_lora_sync_is_refused_with_the_choices(tmp_path: Path):
    result = run_cli("config", "check", str(write_yaml(tmp_path / "bad.yaml", grpo_vllm(tmp_path, lora_sync="merge"))))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stdout + result.stderr
    assert "rollout.lora_sync" in message and all(choice in message for choice in ("auto", "adapter", "merged"))


def test_engine_args_pass_through_and_derived_ones_are_refused_with_the_setting(tmp_path: Path):
    from rlfactory.model.loader import load_model

    cfg = RunConfig.model_validate(grpo_vllm(tmp_path, engine_args={"max_num_seqs": 7, "kv_cache_dtype": "fp8"}))
    policy = load_model(cfg.model, cfg.lora, cfg.freeze)
    kwargs = engine_kwargs(cfg, policy, "merged", on_cpu=True)
    assert kwargs["max_num_seqs"] == 7 and kwargs["kv_cache_dtype"] == "fp8"
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # rlfactory's own arguments stay

    derived = grpo_vllm(tmp_path, engine_args={"gpu_memory_utilization": 0.9})
    result = run_cli("config", "check", str(write_yaml(tmp_path / "derived.yaml", derived)))
    message = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in message
    assert "rollout.engine_args: gpu_memory_utilization: rlfactory sets" in message
    assert "from rollout.gpu_memory_utilization" in message

    on_hf = grpo_vllm(tmp_path, backend="hf", engine_args={"max_num_seqs": 7})
    result = run_cli("config", "check", str(write_yaml(tmp_path / "hf.yaml", on_hf)))
    message = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in message
    assert "rollout.engine_args (max_num_seqs)" in message and "rollout.backend: vllm" in message
