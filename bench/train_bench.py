"""Training throughput, ours vs TRL, side by side on the same card, model shape, data and batch.

    python bench/train_bench.py --cases sft_full,sft_lora --impls ours,trl_padded,trl_wrapped
    python bench/train_bench.py --shape tiny --steps 4 --warmup 1          # CPU smoke run

Each (case, impl) runs in its own subprocess (a fresh CUDA context, so peak memory is its own).
The model is a Qwen2.5-0.5B-shaped Qwen2 with random bf16 weights; every step trains on
`batch` sequences of `seq` random tokens (all full length, so padding costs nothing and
"padded" equals "packed" in work). Step time is the median over the timed steps after warmup.
MFU = 6 x parameters x tokens/s / peak (989e12 bf16 dense FLOP/s for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}
PEAK_FLOPS = 989e12


def build_model(shape: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)


def build_tokenizer(vocab_size: int):
    """A tokenizer that decodes any id (word-level over `t<i>`); trainers only need it to save/pad."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                   pad_token="t0", eos_token="t2", unk_token="t1")


def random_sequences(n: int, seq: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (n, seq), generator=g).tolist()


def run_ours(args, model, tokenizer, sequences, out: str) -> list[float]:
    from rlfactory.config.loader import validate_config
    from rlfactory.config.schema import LoraConfig
    from rlfactory.engine.run_dir import read_log
    from rlfactory.engine.trainer import StageParts, train
    from rlfactory.model.loader import apply_lora, maybe_apply_liger
    from rlfactory.stages import sft

    maybe_apply_liger(model, None, "lora" if args.case.endswith("lora") else "full")  # as the model loader does

    if args.case.endswith("lora"):
        model = apply_lora(model, LoraConfig(r=16, alpha=32, target_modules="all-linear"), False)
    cfg = validate_config({
        "stage": "sft", "output_dir": out, "model": {"name_or_path": "bench"}, "data": {"dataset": "bench",
                                                                                      "shuffle": False},
        "train": {"max_steps": args.warmup + args.steps, "per_device_batch_size": args.batch, "learning_rate": 1e-5,
                  "lr_scheduler": "constant", "mixed_precision": "bf16" if args.device == "cuda" else "no"},
        "logging": {"logging_steps": 1, "plot_loss": False, "progress_bar": False},
    }, "bench")
    items = [{"input_ids": s, "labels": s} for s in sequences]
    parts = StageParts(items, sft.collate_padded(0), sft.nll_sum, sft.count_tokens)
    train(cfg, model, tokenizer, parts, None)
    elapsed = [r["elapsed_s"] for r in read_log(out) if "loss" in r]
    return [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)][args.warmup - 1:]


def run_trl(args, model, tokenizer, sequences, out: str) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    marks: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    peft_config = None
    if args.case.endswith("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    packing = args.impl.removeprefix("trl_").removesuffix("_liger")
    config = SFTConfig(
        output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps, learning_rate=1e-5,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        bf16=args.device == "cuda", gradient_checkpointing=False, max_length=args.seq,
        packing=packing != "padded", packing_strategy="wrapped" if packing == "wrapped" else "bfd",
        padding_free=packing == "bfd", use_cpu=args.device == "cpu", dataloader_drop_last=True,
        use_liger_kernel=args.impl.endswith("_liger"),
    )
    dataset = Dataset.from_dict({"input_ids": sequences})
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[Timer()])
    trainer.train()
    return [b - a for a, b in zip(marks, marks[1:], strict=False)][args.warmup - 1:]


def worker(args) -> None:
    import torch

    model = build_model(args.shape, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    tokenizer = build_tokenizer(SHAPES[args.shape]["vocab_size"])
    sequences = random_sequences(args.batch * (args.warmup + args.steps + 1), args.seq, SHAPES[args.shape]["vocab_size"])
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        runner = run_ours if args.impl == "ours" else run_trl
        steps = runner(args, model, tokenizer, sequences, out)
    step_s = statistics.median(steps)
    tokens_per_s = args.batch * args.seq / step_s
    print("RESULT " + json.dumps({
        "case": args.case, "impl": args.impl, "step_s": round(step_s, 4), "tokens_per_s": round(tokens_per_s),
        "mfu": round(6 * n_params * tokens_per_s / PEAK_FLOPS, 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
        "timed_steps": len(steps),
    }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="sft_full,sft_lora")
    parser.add_argument("--impls", default="ours,trl_padded,trl_wrapped")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "IMPL"))
    args = parser.parse_args()
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        args.case, args.impl = args.worker
        worker(args)
        return
    rows = []
    for case in args.cases.split(","):
        for impl in args.impls.split(","):
            cmd = [sys.executable, __file__, "--worker", case, impl, "--shape", args.shape, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"{case}/{impl} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(lines[-1][7:]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n| case | impl | step s | tokens/s | MFU | peak GB | vs best TRL |\n|---|---|---|---|---|---|---|")
    for row in rows:
        trl = [r["tokens_per_s"] for r in rows if r["case"] == row["case"] and r["impl"].startswith("trl")]
        ratio = f"{row['tokens_per_s'] / max(trl):.2f}x" if trl else "-"
        print(f"| {row['case']} | {row['impl']} | {row['step_s']} | {row['tokens_per_s']} | {row['mfu']:.1%} | "
              f"{row['peak_mem_gb']} | {ratio} |")


if __name__ == "__main__":
    main()
