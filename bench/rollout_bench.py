"""Rollout benchmarks on the GPU machine, one command: vLLM vs HF generation, GRPO steps with vLLM in both LoRA
sync modes, and peak GPU memory with and without sleep mode.

    source .gpu/vllm/setup.sh && export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH HF_HUB_OFFLINE=1
    python3 bench/rollout_bench.py                                  # all cases, Qwen2.5-0.5B shape
    python3 bench/rollout_bench.py --cases gen --shape tiny --prompts 8 --samples 2 --tokens 32   # smoke

Model: a Qwen2.5-0.5B-shaped Qwen2 with random bf16 weights (written once to a temp dir with the bundled
tiny model's tokenizer, so the arithmetic prompts render with its chat template). Random weights almost never
emit the end-of-turn token (1 in 151,936 per token), so GRPO completions run to the fixed length as well.

- gen:    64 prompts x 8 samples x 256 new tokens (ignore_eos): HFBackend vs VLLMBackend (CUDA graphs), tokens/s.
- grpo:   GRPO, LoRA r=16 all-linear, 8 prompts x 8 samples x 256 tokens, beta 0, for lora_sync adapter and
          merged: median step time, timing_s/* breakdown, rollout/logprob_diff_{mean,max}, rollout/prob_pearson.
- memory: the same GRPO run (adapter) with enable_sleep_mode false/true: peak device memory used by the process.
Each case runs in its own subprocess (a fresh CUDA context, so peak memory is its own); one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "models" / "tiny-arith"
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
}


def make_model_dir(shape: str, out: Path) -> Path:
    """A random-weight model of ``shape`` with the tiny model's tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (TINY / name).exists():
            shutil.copy(TINY / name, out / name)
    return out


class PeakMemory:
    """Peak device memory used (all allocators: torch's and vLLM's), polled every 20 ms in a thread."""

    def __init__(self):
        import torch

        self.peak, self.stop = 0, False
        self.thread = threading.Thread(target=self._poll, args=(torch,), daemon=True)

    def _poll(self, torch) -> None:
        while not self.stop and torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def case_gen(args, model_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfactory.config.schema import RunConfig
    from rlfactory.rollout.base import SamplingParams, build_backend

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda" if cuda else "cpu").eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 1000, (args.prompts, 32), generator=gen).tolist()
    repeated = [p for p in prompts for _ in range(args.samples)]
    cfg = _grpo_cfg(args, model_dir, Path(tempfile.mkdtemp()), args.impl, "adapter", False)
    cfg["model"]["finetuning"] = "full"
    cfg["rollout"]["generation_batch_size"] = len(repeated)
    backend = build_backend(RunConfig.model_validate(cfg), model, tokenizer)
    params = SamplingParams(args.tokens, temperature=1.0, ignore_eos=True)
    backend.generate(repeated[: args.samples], SamplingParams(8, 1.0, ignore_eos=True))  # warmup
    times = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        out = backend.generate(repeated, params)
        sync()
        times.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for c in out)
    return {
        "case": "gen",
        "impl": args.impl,
        "tokens": tokens,
        "seconds": statistics.median(times),
        "tokens_per_s": tokens / statistics.median(times),
    }


def _grpo_cfg(args, model_dir: Path, out: Path, backend: str, sync: str, sleep: bool) -> dict:
    return {
        "stage": "grpo",
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "model": {"name_or_path": str(model_dir), "finetuning": "lora", "gradient_checkpointing": False},
        "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear", "dropout": 0.0},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(ROOT / "data")},
        "rollout": {
            "backend": backend,
            "lora_sync": sync,
            "prompts_per_step": args.prompts // 8 or 1,
            "num_samples": args.samples,
            "max_response_len": args.tokens,
            "enable_sleep_mode": sleep,
            "gpu_memory_utilization": 0.3,
            "enforce_eager": args.eager,
            "generation_batch_size": 512,
        },
        "reward": {"functions": {"answer_match": 1.0}},
        "algorithm": {"adv_estimator": "grpo", "kl_loss_coef": 0.0, "loss_agg": "token-mean"},
        "train": {
            "max_steps": args.steps,
            "per_device_batch_size": 16,
            "learning_rate": 1e-5,
            "lr_scheduler": "constant",
        },
        "evaluation": {"dataset": None},
        "logging": {"progress_bar": False, "plot_loss": False, "rollout_trace_steps": None},
    }


def case_grpo(args, model_dir: Path) -> dict:
    """GRPO through the real CLI entry point, in this process (the engine is colocated)."""
    import yaml

    from rlfactory.cli import main
    from rlfactory.engine.run_dir import read_log

    out = Path(tempfile.mkdtemp())
    cfg = _grpo_cfg(args, model_dir, out / "run", args.impl, args.sync, args.sleep)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    with PeakMemory() as memory:
        code = main(["train", str(out / "run.yaml")])
    steps = [r for r in read_log(out / "run") if "score/mean" in r][args.warmup :]
    median = lambda key: statistics.median(r[key] for r in steps) if steps and key in steps[0] else None
    keys = sorted({k for r in steps for k in r if k.startswith(("timing_s/", "rollout/logprob", "rollout/prob"))})
    return {
        "case": args.case,
        "impl": args.impl,
        "sync": args.sync,
        "sleep": args.sleep,
        "exit": code,
        "steps": len(steps),
        "peak_device_gb": round(memory.peak / 2**30, 2),
        **{k: median(k) for k in keys},
    }


def run_one(args) -> None:
    model_dir = Path(args.model_dir)
    result = case_gen(args, model_dir) if args.case == "gen" else case_grpo(args, model_dir)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="gen,grpo,memory")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=64, help="gen: prompts; grpo: prompts x 8 per step / 8")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="grpo steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    # internal: one case in a subprocess
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="vllm", help=argparse.SUPPRESS)
    parser.add_argument("--sync", default="adapter", help=argparse.SUPPRESS)
    parser.add_argument("--sleep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_one(args)
    model_dir = make_model_dir(args.shape, Path(tempfile.mkdtemp()) / "model")
    runs = []
    cases = args.cases.split(",")
    if "gen" in cases:
        runs += [["--case", "gen", "--impl", impl] for impl in ("hf", "vllm")]
    if "grpo" in cases:
        runs += [["--case", "grpo", "--sync", sync] for sync in ("adapter", "merged")]
    if "memory" in cases:
        runs += [["--case", "memory", "--sync", "adapter"] + sleep for sleep in ([], ["--sleep"])]
    passthrough = [f"--{k}={getattr(args, k)}" for k in ("prompts", "samples", "tokens", "steps", "warmup", "repeats")]
    passthrough += ["--eager"] if args.eager else []
    for extra in runs:
        cmd = [sys.executable, __file__, "--one", "--model-dir", str(model_dir), *passthrough, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(json.dumps({"run": extra, "error": proc.stderr[-2000:]}), flush=True)
        else:
            print(lines[-1].removeprefix("RESULT "), flush=True)


if __name__ == "__main__":
    main()
