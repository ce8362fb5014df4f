"""vLLM rollouts on a GPU (a CUDA build of vLLM that matches the machine's torch): bf16 engine colocated with
the trainer, sleep mode, both LoRA sync modes and full weights, and GRPO through the real CLI.

    source .gpu/vllm/setup.sh && export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH HF_HUB_OFFLINE=1
    python3 -m pytest -q tests/gpu/test_gpu_vllm.py

bf16 on both sides: the trainer (HF, sdpa) and vLLM (its own attention kernels) agree to bf16 rounding, not
bit for bit, so the log-prob tolerances here are looser than the CPU fp32 ones of tests/test_vllm_backend.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.schema import RunConfig
from rlfactory.engine.run_dir import read_log
from rlfactory.rollout.base import SamplingParams

pytest.importorskip("vllm", reason="needs a CUDA build of vLLM (pip install vllm)")
pytestmark = pytest.mark.vllm
BF16_MEAN, BF16_MAX = 2e-2, 0.5  # GRPO runs (small LoRA updates)
SYNC_MEAN, SYNC_MAX = 0.1, 1.0  # the sync check's large perturbation (measured: see docs/BENCHMARKS.md)
ROOT = Path(__file__).resolve().parents[2]


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


def _sync_check(mode: str, tmp: Path) -> dict:
    """Sync a perturbed policy into a sleeping engine; sampler vs trainer log-probs of the tokens it samples then,
    and vs the policy as it was before the perturbation (what a stale engine would match)."""
    from rlfactory.engine.online.update import policy_forward
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.render.chat import render_prompt
    from rlfactory.rollout.backends import build_backend
    from rlfactory.rollout.batch import pack_rollouts

    torch.manual_seed(0)
    cfg = RunConfig.model_validate(_cfg(tmp, mode, sleep=True))
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, cfg.lora, cfg.freeze).cuda()
    backend = build_backend(cfg, policy, tokenizer)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": f"What is {i} + {i + 3}?"}]) for i in range(8)]
    greedy = SamplingParams(32, temperature=0)
    before = [c.token_ids for c in backend.generate(prompts, greedy)]  # generate, then the engine sleeps
    deltas = {}
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if param.requires_grad and (mode == "full" or "lora_B" in name):
                deltas[name] = torch.randn_like(param) * (0.02 if mode == "full" else 0.2)
                param.add_(deltas[name])
    backend.sync_weights(policy)  # wakes the weights only
    repeated = [p for p in prompts for _ in range(4)]
    out = backend.generate(repeated, SamplingParams(32, temperature=1.0))
    after = [c.token_ids for c in backend.generate(prompts, greedy)]
    batch = pack_rollouts(repeated, out, tokenizer.pad_token_id)
    batch = batch.to("cuda")
    mask = batch.response_mask > 0
    policy.eval()

    def diff() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            trainer, _ = policy_forward(policy, batch, torch.arange(len(out), device="cuda"))
        return (trainer - batch.sampler_logprobs).abs()[mask]

    synced = diff()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name in deltas:
                param.sub_(deltas[name])
    stale = diff()
    backend.close()
    return {
        "changed": after != before,
        "mean": float(synced.mean()),
        "max": float(synced.max()),
        "stale_mean": float(stale.mean()),
    }


@pytest.mark.parametrize("mode", ["adapter", "merged", "full"])
def test_sync_then_sampler_matches_trainer_in_bf16(tmp_path: Path, mode: str):
    """Each mode in its own process: vLLM's sleep-mode allocator (CuMemAllocator) serves one engine per process.

    The perturbation is large (the tiny model's LoRA B += 0.2 N(0,1)), so bf16 rounding shows more here than in
    the GRPO runs below: the bound is loose in absolute terms, and the sampler must match the synced policy far
    better than the policy before the sync (what a stale engine would match).
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines()[::-1] if line.startswith("RESULT "))[7:])
    print(f"[{mode}] bf16 sampler vs trainer after sync: {result}")
    assert result["changed"]  # the update reached the engine
    assert result["mean"] < SYNC_MEAN and result["max"] < SYNC_MAX
    assert result["mean"] < 0.5 * result["stale_mean"]


@pytest.mark.parametrize("mode, sleep", [("adapter", True), ("merged", False)])
def test_grpo_with_colocated_vllm_on_gpu(tmp_path: Path, mode: str, sleep: bool):
    cfg = _cfg(tmp_path, mode, sleep)
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_log(cfg["output_dir"]) if "score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        print(mode, {k: v for k, v in record.items() if k.startswith(("rollout/", "timing_s/", "actor/rows"))})
        assert record["rollout/logprob_diff_mean"] < BF16_MEAN and record["rollout/prob_pearson"] > 0.99
        assert "timing_s/sync" in record and "actor/is_weight_mean" in record
        assert 0.0 <= record["actor/rows_forward_only"] <= 1.0  # no KL term: zero-advantage rows run forward only


def test_grpo_with_overlap_on_the_vllm_engine_on_gpu(tmp_path: Path):
    """rollout.overlap on a CUDA engine with CUDA graphs: generation in a second thread while the update runs on the
    same GPU; validation between steps waits for it. Step 1 is on-policy (the bf16 bound holds), later steps are
    one step stale, and the run ends cleanly."""
    cfg = _cfg(tmp_path, "adapter", False)
    cfg["rollout"].update(overlap=True, enforce_eager=False)
    cfg["train"].update(max_steps=4, eval_steps=2)
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_log(cfg["output_dir"]) if "score/mean" in r]
    print({k: v for k, v in steps[-1].items() if k.startswith(("rollout/", "timing_s/"))})
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert steps[0]["rollout/logprob_diff_mean"] < BF16_MEAN
    assert all("timing_s/gen_overlapped" in r for r in steps[1:])
    assert [r["step"] for r in read_log(cfg["output_dir"]) if "val/score" in r] == [0, 2, 4]


def _overlap_check(tmp: Path) -> dict:
    """Greedy rounds on the engine (CUDA graphs on) from a thread of its own high-priority stream while the main
    thread keeps the GPU busy, as ``rollout.overlap`` runs them, against the same round on the main thread."""
    from rlfactory.engine.online.overlap import Prefetch, Round
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.render.chat import render_prompt
    from rlfactory.rollout.backends import build_backend

    torch.manual_seed(0)
    raw = _cfg(tmp, "merged", sleep=False)
    raw["rollout"]["enforce_eager"] = False
    cfg = RunConfig.model_validate(raw)
    tokenizer = load_tokenizer(cfg.model)
    policy = load_model(cfg.model, cfg.lora, cfg.freeze).cuda()
    backend = build_backend(cfg, policy, tokenizer)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": f"What is {i} + {i + 3}?"}]) for i in range(16)]
    greedy = SamplingParams(32, temperature=0)

    def tokens() -> list[list[int]]:
        backend.llm.reset_prefix_cache()  # each round computes its prompts afresh, as the first one did
        return [c.token_ids for c in backend.generate(prompts, greedy)]

    reference = tokens()
    streams, rounds = [], []

    def generate(round_: Round) -> Round:
        before = torch.cuda.current_stream()
        round_.completions = tokens()
        streams.append(torch.cuda.current_stream() == before)
        return round_

    prefetch = Prefetch()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        prefetch.launch(Round([], [], 0, {}), generate)
        for _ in range(100):  # the "update": long kernels on the main thread's stream while the round decodes
            busy = torch.tanh(busy @ busy * 1e-3)
        rounds.append(prefetch.take().completions)
    after = tokens()
    return {
        "same_stream": streams,
        "rounds_match": [r == reference for r in rounds],
        "main_after_matches": after == reference,
        "caches_stream": backend.stream_cache is not None,
    }


def test_an_overlapped_round_on_the_engine_stays_on_its_stream_and_samples_the_same_tokens(tmp_path: Path):
    """vLLM's v2 model runner caches the stream it first ran on and makes it current again after each step's
    output copy; ``VLLMBackend.generate`` points that cache at the calling thread's stream. Without it the thread
    leaves its high-priority stream after one step (checked here directly), and the first step's output copy does
    not wait for the thread's sampling kernels (greedy rounds beside busy work would read unfinished tokens)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "overlap", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines()[::-1] if line.startswith("RESULT "))[7:])
    print(result)
    assert result["caches_stream"]  # the vLLM this runs on has the cache the fix is for
    assert result["same_stream"] == [True, True, True]
    assert result["rounds_match"] == [True, True, True] and result["main_after_matches"]


if __name__ == "__main__":  # one mode of test_sync_then_sampler_matches_trainer_in_bf16 (or the overlap check)
    tmp_dir = Path(sys.argv[2])
    check = _overlap_check(tmp_dir) if sys.argv[1] == "overlap" else _sync_check(sys.argv[1], tmp_dir)
    print("RESULT " + json.dumps(check), flush=True)
