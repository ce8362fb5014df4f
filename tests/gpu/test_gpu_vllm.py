"""vLLM rollouts on a GPU (CUDA build of vLLM, e.g. the kit of shared/gpu/README.md): bf16 engine colocated with
the trainer, sleep mode, both LoRA sync modes and full weights, and GRPO through the real CLI.

    source .gpu/vllm/setup.sh && export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH HF_HUB_OFFLINE=1
    python3 -m pytest -q tests/gpu/test_gpu_vllm.py

bf16 on both sides: the trainer (HF, sdpa) and vLLM (its own attention kernels) agree to bf16 rounding, not
bit for bit, so the log-prob tolerances here are looser than the CPU fp32 ones of tests/test_vllm_backend.py.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.schema import RunConfig
from rlfactory.engine.run_dir import read_log
from rlfactory.rollout.base import SamplingParams

pytest.importorskip("vllm", reason="needs vLLM (the GPU kit: shared/gpu/README.md)")
pytestmark = pytest.mark.vllm
BF16_MEAN, BF16_MAX = 2e-2, 0.5


def _cfg(tmp: Path, mode: str, sleep: bool) -> dict:
    return {
        "stage": "grpo",
        "output_dir": str(tmp / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full" if mode == "full" else "lora"},
        "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
        "rollout": {
            "backend": "vllm",
            "lora_sync": "merged" if mode == "full" else mode,
            "enable_sleep_mode": sleep,
            "enforce_eager": True,  # engine start in seconds; CUDA graphs are measured by bench/rollout_bench.py
            "gpu_memory_utilization": 0.2,
            "prompts_per_step": 8,
            "num_samples": 4,
            "max_prompt_len": 128,
            "max_response_len": 32,
            "is_correction": "token_truncate",
        },
        "reward": {"functions": {"answer_match": 1.0}},
        "train": {"max_steps": 3, "per_device_batch_size": 32, "learning_rate": 1e-3 if mode != "full" else 1e-4},
        "evaluation": {"dataset": "arith_prompts_test", "max_samples": 16, "max_new_tokens": 32},
        "logging": {"progress_bar": False, "plot_loss": False},
    }


@pytest.mark.parametrize("mode", ["adapter", "merged", "full"])
def test_sync_then_sampler_matches_trainer_in_bf16(tmp_path: Path, mode: str):
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.render.chat import render_prompt
    from rlfactory.rollout.base import build_backend
    from rlfactory.rollout.batch import pack_rollouts
    from rlfactory.stages.online_update import policy_forward

    cfg = RunConfig.model_validate(_cfg(tmp_path, mode, sleep=True))
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, cfg.lora, cfg.freeze).cuda()
    backend = build_backend(cfg, policy, tokenizer)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": f"What is {i} + {i + 3}?"}]) for i in range(8)]
    greedy = SamplingParams(32, temperature=0)
    before = [c.token_ids for c in backend.generate(prompts, greedy)]  # generate, then the engine sleeps
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad and (mode == "full" or "lora_B" in name):
                param.add_(torch.randn_like(param) * (0.02 if mode == "full" else 0.5))
    backend.sync_weights(policy)  # wakes the weights only
    out = backend.generate([p for p in prompts for _ in range(4)], SamplingParams(32, temperature=1.0))
    after = [c.token_ids for c in backend.generate(prompts, greedy)]
    assert after != before  # the update reached the engine
    batch = pack_rollouts([p for p in prompts for _ in range(4)], out, tokenizer.pad_token_id)
    batch = {k: v.cuda() for k, v in batch.items()}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        trainer, _ = policy_forward(policy.eval(), batch, torch.arange(len(out), device="cuda"))
    diff = (trainer - batch["sampler_logprobs"]).abs()[batch["response_mask"] > 0]
    print(f"[{mode}] bf16 sampler vs trainer: mean {float(diff.mean()):.2e}, max {float(diff.max()):.2e}")
    assert float(diff.mean()) < BF16_MEAN and float(diff.max()) < BF16_MAX
    backend.close()
    del backend
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode, sleep", [("adapter", True), ("merged", False)])
def test_grpo_with_colocated_vllm_on_gpu(tmp_path: Path, mode: str, sleep: bool):
    cfg = _cfg(tmp_path, mode, sleep)
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_log(cfg["output_dir"]) if "score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        print(mode, {k: v for k, v in record.items() if k.startswith(("rollout/", "timing_s/"))})
        assert record["rollout/logprob_diff_mean"] < BF16_MEAN and record["rollout/prob_pearson"] > 0.99
        assert "timing_s/sync" in record and "actor/is_weight_mean" in record
