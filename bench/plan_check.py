"""`rlfactory plan` against measured peaks on a GPU: each case runs a few real training steps in its own process.

    python bench/plan_check.py                       # the default cases below, on the visible GPU
    python bench/plan_check.py --cases sft_lora_05b,grpo_vllm_sleep_05b --steps 3

Models are Qwen2.5-shaped with random bf16 weights (no download: the device has no network), written once to
--work with the bundled tiny tokenizer (its ids are a subset of the vocabulary). Data is synthetic and long, so
every sequence reaches its cap (cutoff_len, or the response cap: random weights rarely stop early), which is the
worst case the planner estimates. Per case: the plan's peak (and its phase), torch's peak allocated memory of
the run (the fullest rank's ``max_memory_gb`` from the log when the run has several processes; + the plan's
CUDA-context constant, for comparison), and the peak of memory.used above its start on any visible GPU, polled by
nvidia-smi every 50 ms. The error is against the latter, what the device itself counts (the allocator's cache, the
CUDA context and NCCL included; under vLLM's sleep mode torch's counter keeps the sleeping engine's pool, whose
memory went back to the driver). A line of JSON per case, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "05b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
SFT, DPO, GRPO = "examples/quickstart/sft.yaml", "examples/quickstart/dpo.yaml", "examples/grpo/tiny_arith_vllm.yaml"
COMMON = [
    "logging.plot_loss=false",
    "logging.progress_bar=false",
    "train.save_steps=null",
    "train.eval_steps=null",
    "logging.logging_steps=1",
]
OFFLINE = ["data.dataset=long_sft", "data.eval_dataset=[]", "evaluation.dataset=null", "data.cutoff_len=2048"]
ONLINE = ["rollout.max_prompt_len=128", "rollout.max_response_len=512", "rollout.prompts_per_step=8",
          "rollout.num_samples=8", "evaluation.dataset=null", "model.dtype=auto"]  # fmt: skip
# name -> (yaml, shape, overrides): 0.5B and 7B; full and LoRA; sft, dpo, grpo with vLLM with and without sleep mode
CASES: dict[str, tuple[str, str, list[str]]] = {
    "sft_lora_05b": (SFT, "05b", [*OFFLINE, "model.finetuning=lora", "train.per_device_batch_size=8"]),
    "sft_full_05b": (SFT, "05b", [*OFFLINE, "model.finetuning=full", "train.per_device_batch_size=4"]),
    "dpo_lora_05b": (DPO, "05b", ["data.dataset=long_dpo", "data.eval_dataset=[]", "evaluation.dataset=null",
                                  "data.cutoff_len=1024", "model.finetuning=lora", "train.per_device_batch_size=4"]),
    "sft_lora_7b_ckpt": (SFT, "7b", [*OFFLINE, "model.finetuning=lora", "model.gradient_checkpointing=true",
                                     "train.per_device_batch_size=4"]),
    # QLoRA against LoRA on the 7B shape (the after-training issue's measurement): peak memory and seconds per step
    "sft_qlora4_7b_ckpt": (SFT, "7b", [*OFFLINE, "model.finetuning=lora", "model.gradient_checkpointing=true",
                                       "train.per_device_batch_size=4", "model.quantization.bits=4"]),
    "sft_qlora8_7b_ckpt": (SFT, "7b", [*OFFLINE, "model.finetuning=lora", "model.gradient_checkpointing=true",
                                       "train.per_device_batch_size=4", "model.quantization.bits=8"]),
    "sft_dora_7b_ckpt": (SFT, "7b", [*OFFLINE, "model.finetuning=lora", "model.gradient_checkpointing=true",
                                     "train.per_device_batch_size=4", "lora.use_dora=true"]),
    "grpo_vllm_05b": (GRPO, "05b", [*ONLINE, "model.finetuning=lora", "train.per_device_batch_size=16"]),
    "grpo_vllm_sleep_05b": (GRPO, "05b", [*ONLINE, "model.finetuning=lora", "train.per_device_batch_size=16",
                                          "rollout.enable_sleep_mode=true"]),
    # several GPUs: the fullest GPU of a ZeRO-3 run (needs 2 visible GPUs; measured by nvidia-smi on each)
    "sft_full_05b_zero3x2": (SFT, "05b", [*OFFLINE, "model.finetuning=full", "train.per_device_batch_size=4",
                                          "distributed.num_processes=2", "distributed.strategy=zero3"]),
}  # fmt: skip


def make_model(shape: str, work: Path, weights: bool = True) -> Path:
    """A Qwen2.5-shaped model with random bf16 weights and the bundled tokenizer, written once (``weights``
    False: config.json only, all the planner reads)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    folder = work / f"qwen2.5-{shape}-random"
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, pad_token_id=0, eos_token_id=2)
    if not weights:
        config.save_pretrained(folder)
        return folder
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(ROOT / "data/models/tiny-arith").save_pretrained(folder)
    return folder


def make_data(work: Path) -> Path:
    """long_sft (one long assistant turn) and long_dpo (long chosen and rejected) in a dataset folder."""
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    words = " ".join(str(i % 97) for i in range(3000))  # thousands of tokens: every row is cut at its cap
    sft = [{"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": words}]}] * 64
    dpo = [{"prompt": [{"role": "user", "content": "count"}], "chosen": [{"role": "assistant", "content": words}],
            "rejected": [{"role": "assistant", "content": words[::-1]}]}] * 64  # fmt: skip
    for name, rows in (("long_sft", sft), ("long_dpo", dpo)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "dataset_info.yaml").write_text(
        "long_sft: {file_name: long_sft.jsonl, formatting: openai}\n"
        "long_dpo: {file_name: long_dpo.jsonl, formatting: trl, ranking: true}\n"
    )
    return folder


CHILD = """import json, sys, torch
from rlfactory.cli import main
code = main(sys.argv[1:])
print("PLAN_CHECK " + json.dumps({"rc": code, "max_allocated": torch.cuda.max_memory_allocated(),
                                  "max_reserved": torch.cuda.max_memory_reserved()}), flush=True)
"""


def visible_gpus() -> str:
    """nvidia-smi's indexes of the GPUs this process sees (nvidia-smi itself ignores CUDA_VISIBLE_DEVICES)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES") or "0"


def used_mib() -> list[float]:
    """memory.used (MiB) of each visible GPU."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", visible_gpus()]
    out = subprocess.run(query, capture_output=True, text=True)
    return [float(x) for x in out.stdout.split()] if out.returncode == 0 else []


def poll_used(stop: threading.Event, base: list[float], peak: list[float]) -> None:
    """Every 50 ms, each visible GPU's memory.used above its value before the run; the highest of any GPU kept."""
    while not stop.is_set():
        for used, before in zip(used_mib(), base, strict=False):
            peak[0] = max(peak[0], used - before)
        time.sleep(0.05)


def seconds_per_step(log: Path) -> float | None:
    """Mean wall seconds per step after the first (its compile and allocator warm-up), from the log's elapsed_s."""
    if not log.is_file():
        return None
    rows = [json.loads(x) for x in log.read_text().splitlines() if '"elapsed_s"' in x]
    rows = [r for r in rows if "elapsed_s" in r and "step" in r]
    if len(rows) < 2:
        return None
    return round((rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]) / (rows[-1]["step"] - rows[0]["step"]), 3)


def ranks_peak_gb(log: Path) -> float | None:
    """The fullest rank's torch peak (``max_memory_gb``, logged by the offline loop on GPUs)."""
    if not log.is_file():
        return None
    values = [json.loads(x).get("max_memory_gb") for x in log.read_text().splitlines()]
    return max((v for v in values if v is not None), default=None)


def run_case(name: str, work: Path, steps: int, plan_only: bool = False, timeout: float = 600) -> dict:
    from rlfactory.engine import plan_terms
    from rlfactory.engine.plan_report import plan_config

    config, shape, overrides = CASES[name]
    model = make_model(shape, work, weights=not plan_only)
    data = [] if config == GRPO else [f"data.dataset_dir={make_data(work)}"]  # grpo: the bundled prompts
    overrides = [f"model.name_or_path={model}", *data, *COMMON, *overrides,
                 f"train.max_steps={steps}", f"output_dir={work / 'runs' / name}",
                 "overwrite_output_dir=true"]  # fmt: skip
    planned = dict(gpu_memory_gb=80, gpu_name="H100") if plan_only else {}
    (plan,) = plan_config(config, overrides, **planned)
    if plan_only:
        return {"case": name, "estimate_gb": round(plan.peak / plan_terms.GiB, 2), "phase": plan.peak_phase}
    stop, used, base = threading.Event(), [0.0], used_mib()
    poller = threading.Thread(target=poll_used, args=(stop, base, used), daemon=True)
    poller.start()
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-c", CHILD, "train", config, *overrides]
    child_proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = child_proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the whole group: launched ranks and vLLM's engine processes hold GPU memory
        os.killpg(child_proc.pid, signal.SIGKILL)
        stdout, stderr = child_proc.communicate()
        stderr += f"\nTIMEOUT after {timeout:.0f} s"
    stop.set()
    poller.join()
    line = next((x for x in stdout.splitlines() if x.startswith("PLAN_CHECK ")), None)
    child = json.loads(line[len("PLAN_CHECK ") :]) if line else {"rc": child_proc.returncode}
    gib = plan_terms.GiB
    if not child.get("max_allocated"):  # several processes: the launcher allocates nothing; the log has the ranks'
        logged = ranks_peak_gb(work / "runs" / name / "trainer_log.jsonl")
        child["max_allocated"] = logged * gib if logged else 0
    result = {
        "case": name,
        "estimate_gb": round(plan.peak / gib, 2),
        "phase": plan.peak_phase,
        "allocated_gb": round(child.get("max_allocated", 0) / gib, 2),
        "allocated_plus_context_gb": round((child.get("max_allocated", 0) + plan_terms.CUDA_OVERHEAD) / gib, 2),
        "smi_peak_gb": round(used[0] / 1024, 2),
        "rc": child.get("rc"),
    }
    if result["rc"] != 0:
        result["stderr"] = stderr[-1500:]
    result["s_per_step"] = seconds_per_step(work / "runs" / name / "trainer_log.jsonl")
    # the device's own count when there is one: under vLLM's sleep mode torch's counter keeps the engine's pool,
    # whose memory is handed back to the driver while the engine sleeps
    measured = result["smi_peak_gb"] or result["allocated_plus_context_gb"]
    result["error_pct"] = round(100 * (result["estimate_gb"] - measured) / measured, 1) if measured else None
    torch_count = result["allocated_plus_context_gb"]  # what an out-of-memory error depends on, without vLLM's sleep
    result["error_vs_torch_pct"] = round(100 * (result["estimate_gb"] - torch_count) / torch_count, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", default="/tmp/plan_check", help="models, data and runs go here")
    parser.add_argument("--plan-only", action="store_true", help="print the estimates (80 GiB H100), run nothing")
    parser.add_argument("--case-timeout", type=float, default=600, help="seconds before a case is killed")
    args = parser.parse_args()
    work = Path(args.work)
    results = []
    for name in args.cases.split(","):
        results.append(run_case(name, work, args.steps, args.plan_only, args.case_timeout))
        print(json.dumps(results[-1]), flush=True)
        shutil.rmtree(work / "runs" / name, ignore_errors=True)  # a 7B run's output: the disk is not large
    if args.plan_only:
        return
    columns = ("plan GiB", 9), ("alloc+ctx", 10), ("smi peak", 9), ("error", 7), ("vs torch", 9), ("s/step", 7)
    print(f"\n{'case':<22} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for r in results:
        print(f"{r['case']:<22} {r['estimate_gb']:>9} {r['allocated_plus_context_gb']:>10} {r['smi_peak_gb']:>9} "
              f"{r['error_pct']!s:>6}% {r['error_vs_torch_pct']!s:>8}% {r.get('s_per_step')!s:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
