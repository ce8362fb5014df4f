"""What packing saves in an online update pass: one micro-batch of rollouts of very different lengths through the
policy's forward and backward (``engine.online.update.policy_forward``), padded, as one packed row and as packed rows
no longer than the longest sample (``update.PackLayout``), alternated, on one model.

    python bench/packed_update.py                                   # the bundled model's shape, sdpa, CPU
    python bench/packed_update.py --shape qwen2.5-0.5b --lengths 32:1024 --samples 64   # on a GPU (bf16)
    python bench/packed_update.py --attn flex_attention --layouts padded,row             # GPU only (flex backward)
    python bench/packed_update.py --attn sdpa_varlen --layouts padded,rows,row   # one row through torch's varlen kernel
    python bench/packed_update.py --sft --lengths 64:1024 --samples 8   # sft's data.packing collates, nll_sum

Prompts are ``--prompt`` tokens, responses drawn from ``--lengths`` (seeded); random weights. Reported per layout:
the positions the forward computes (padded: samples x the widest prompt + response), the median seconds of a
forward + backward over ``--repeats`` rounds after one warmup round, and the ratio to padded. Why: sdpa and eager
compute a row's whole attention, so one long packed row cost more than padding where attention dominates; rows as
long as the longest sample bound that cost by the padded one while the matrix products run on about the real tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_model(shape: str, attn: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    if shape == "bundled":
        config = AutoConfig.from_pretrained(ROOT / "data" / "models" / "tiny-arith")
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from train_bench import SHAPES

        config = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, eos_token_id=2, pad_token_id=0)
    from rlfactory.model.attention import attention_implementation

    config._attn_implementation = attention_implementation(attn)  # sdpa_varlen: registered with transformers first
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train(), config.vocab_size


def build_batch(samples: int, prompt: int, lengths: str, vocab: int, seed: int, device, group: int = 1):
    import torch

    from rlfactory.rollout.base import Completion
    from rlfactory.rollout.batch import pack_rollouts

    low, high = (int(x) for x in lengths.split(":"))
    gen = torch.Generator().manual_seed(seed)
    drawn = torch.randint(low, high + 1, (samples,), generator=gen).tolist()
    # a group's samples share one prompt (consecutive rows, as a rollout batch holds them)
    prompts = [torch.randint(3, vocab, (prompt,), generator=gen).tolist() for _ in range(-(-samples // group))]
    prompts = [p for p in prompts for _ in range(group)][:samples]
    completions = [Completion(torch.randint(3, vocab, (n,), generator=gen).tolist(), "length") for n in drawn]
    batch = pack_rollouts(prompts, completions, pad_id=0, mask_truncated=False)
    batch.advantages = torch.randn(batch.responses.shape, generator=gen) * batch.response_mask
    return batch.to(device), drawn


def time_alternated(model, loss, layouts: list[str], repeats: int) -> dict[str, list[float]]:
    """Seconds of ``loss(layout).backward()`` per layout: one warmup round, then ``repeats`` rounds alternating the
    layouts, so that a machine's drift spreads over all of them."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def step(name: str) -> float:
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        loss(name).backward()
        sync()
        return time.perf_counter() - start

    for name in layouts:
        step(name)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(repeats):
        for name in layouts:
            times[name].append(step(name))
    return times


def print_table(times: dict[str, list[float]], positions: dict[str, int], rows: dict[str, int]) -> None:
    print("| layout | positions | rows | s (median) | vs padded |\n|---|---|---|---|---|")
    base = statistics.median(times["padded"]) if "padded" in times else None
    for name, seconds in ((n, statistics.median(t)) for n, t in times.items()):
        ratio = f"{base / seconds:.2f}x" if base else "-"
        print(f"| {name} | {positions[name]:,} | {rows[name]} | {seconds:.4f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="bundled", help="bundled (the tiny model's config) or a train_bench shape")
    parser.add_argument("--attn", default="sdpa", help="model.attn_implementation")
    parser.add_argument("--samples", type=int, default=32, help="the micro-batch's samples")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sample")
    parser.add_argument("--lengths", default="16:256", metavar="LOW:HIGH", help="response lengths drawn from")
    parser.add_argument("--layouts", default="padded,row,rows", help="any of padded, row, rows, shared")
    parser.add_argument("--group", type=int, default=1, help="samples per prompt (layout shared: prompt once)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft", action="store_true", help="sft's collates and loss (documents of --lengths tokens)")
    parser.add_argument(
        "--compile", action="store_true", help="compile the layers as train.torch_compile does (engine.shared)"
    )
    args = parser.parse_args()
    if args.sft:
        return sft_main(args)

    import torch

    from rlfactory.engine.online.packed_rows import host_prompt_groups
    from rlfactory.engine.online.update import host_lengths, packed_micro_batch, policy_forward

    cuda = torch.cuda.is_available()
    model, vocab = build_model(args.shape, args.attn)
    if args.compile:
        from rlfactory.engine.shared import compile_layers, keep_layer_graphs_whole

        compile_layers(model)
        keep_layer_graphs_whole()
    device = next(model.parameters()).device
    batch, drawn = build_batch(args.samples, args.prompt, args.lengths, vocab, args.seed, device, args.group)
    rows = torch.arange(args.samples, device=device)
    prompt, response = host_lengths(batch)
    layouts = args.layouts.split(",")
    packed = {
        name: None
        if name == "padded"
        else packed_micro_batch(batch, prompt, response, list(range(args.samples)), name, host_prompt_groups(batch))
        for name in layouts
    }
    positions = {name: batch.input_ids.numel() if p is None else p.position_ids.numel() for name, p in packed.items()}

    def loss(name: str):
        logprobs, _ = policy_forward(model, batch, rows, packed=packed[name])
        return (logprobs * batch.advantages).sum()

    times = time_alternated(model, loss, layouts, args.repeats)
    real = sum(prompt) + sum(response)
    print(
        f"{args.shape}, {args.attn}{' compiled' * args.compile}, {'cuda' if cuda else 'cpu'}: {args.samples} samples, "
        f"prompt {args.prompt} (groups of {args.group}), "
        f"responses {min(drawn)}..{max(drawn)} (mean {statistics.mean(drawn):.0f}); real tokens {real:,}"
    )
    n_rows = {name: args.samples if p is None else p.position_ids.shape[0] for name, p in packed.items()}
    print_table(times, positions, n_rows)


def sft_main(args) -> None:
    """The same comparison for sft's ``data.packing``: padded rows, one packed row, packed rows (``stages.sft``)."""
    import torch

    from rlfactory.data.packing import ALIGN_COLUMNS
    from rlfactory.stages import sft

    model, vocab = build_model(args.shape, args.attn)
    device = next(model.parameters()).device
    low, high = (int(x) for x in args.lengths.split(":"))
    gen = torch.Generator().manual_seed(args.seed)
    drawn = torch.randint(low, high + 1, (args.samples,), generator=gen).tolist()
    items = []
    for n in drawn:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        items.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4 :]})
    collates = {
        "padded": sft.collate_padded(0, ALIGN_COLUMNS),
        "row": sft.collate_packed,
        "rows": sft.collate_packed_rows(0, ALIGN_COLUMNS),
    }
    layouts = args.layouts.split(",")
    batches = {name: {k: v.to(device) for k, v in collates[name](items).items()} for name in layouts}

    times = time_alternated(model, lambda name: sft.nll_sum(model, batches[name])[0], layouts, args.repeats)
    span = f"{min(drawn)}..{max(drawn)} tokens ({sum(drawn):,})"
    print(f"sft, {args.shape}, {args.attn}: {args.samples} documents of {span}")
    shapes = {name: batches[name]["input_ids"].shape for name in layouts}
    print_table(times, {n: s.numel() for n, s in shapes.items()}, {n: s[0] for n, s in shapes.items()})


if __name__ == "__main__":
    main()
