"""Training throughput, ours vs TRL, side by side on the same card, model shape, data and batch.

    python bench/train_bench.py --cases sft_full,sft_lora --impls ours,trl_padded,trl_wrapped
    python bench/train_bench.py --cases dpo_lora,rm_full --impls ours,ours_compile,trl
    python bench/train_bench.py --shape tiny --steps 4 --warmup 1 --lr 1e-3   # CPU smoke run + loss agreement

Cases: sft_full, sft_lora (LoRA r=16 all-linear), dpo_lora (sigmoid DPO, beta 0.1, reference = adapter
disabled, no precomputed reference), rm_full / rm_lora (Bradley-Terry reward model, 1-output score head).
Impls: ``ours`` (the stage's own loss path through the shared engine), ``ours_compile``
(``train.torch_compile``, which leaves Liger's layer kernels out), ``ours_torchlp`` / ``ours_compile-torchlp``
(the torch loop instead of Liger's kernel for the chunked LM-head log-probs), and TRL:
``trl_wrapped`` / ``trl_bfd`` / ``trl_padded`` / ``trl_wrapped_liger`` (SFT packing variants) or ``trl``
(DPOTrainer / RewardTrainer; any ``trl*`` name selects them for the dpo and rm cases).
Levers under test append to an ``ours*`` name: ``-c8192`` (LM-head rows per chunk in sft's loss; default:
a 1.25 GB logits budget), ``-cudagraphs`` (``train.cuda_graphs``: the compiled layers replayed as CUDA graphs),
``-autotune`` (the per-layer compile in mode max-autotune-no-cudagraphs), ``-decoder`` (the whole decoder compiled
as one graph), ``-mem`` (GPU memory after the forward, after the loss and at the backward's peak, per step),
``-ddpsplit`` (dynamo's DDP graph split left on: each compiled layer cut at the gradient buckets, as before the change),
``-compiledce`` (sft's compiled head chunk instead of Liger's cross-entropy kernel, as before the nineteenth session),
``-pageable`` (batches copied to the GPU with blocking copies, a host wait per batch tensor, as before the
nineteenth session), ``-peftswitch`` (PEFT's own adapter switches, ``disable_adapter()`` and
``disable_input_dtype_casting``, which walk every module on each use, as before the fourteenth session),
``-static`` / ``-bigbucket`` / ``-bucketview``
(DDP's static_graph, a 1 GB bucket, gradient_as_bucket_view),
``-masksel`` (dpo: response positions selected by a boolean mask on the GPU, a host wait per forward, instead of
the collate's host-side row indices) and ``-indexadd`` (those rows taken with ``index_select``, whose backward
adds with atomics), both as before the thirteenth session.
``--profile`` writes each worker's kernel-time table (torch.profiler) to $OUT.

Each (case, impl) runs in its own subprocess (a fresh CUDA context, so peak memory is its own); with
``--gpus 1,2`` each also runs on 2 GPUs through torchrun (DDP for both ours and TRL; the same per-GPU batch, so
the global batch grows with the GPU count and tokens/s counts every GPU's tokens; TRL starts through
``accelerate launch`` on GPUs).
The model is a Qwen2.5-0.5B-shaped Qwen2 with random bf16 weights; every step trains on
`batch` sequences (sft) or pairs (dpo, rm) of `seq` random tokens, all full length, so padding costs
nothing and "padded" equals "packed" in work. A pair is a shared prompt of seq/4 tokens and two
responses of 3 seq/4 tokens; tokens/s counts both sequences of a pair. Step time is the median over the
timed steps after warmup. MFU = 6 x parameters x tokens/s / peak (989e12 bf16 dense FLOP/s for
H100/H200 SXM); the same formula for every case (LoRA skips weight gradients, DPO adds a reference forward).
Both implementations see the same data in the same order from the same initial weights (TRL's sampler is
made sequential), and each result carries the first logged losses for the agreement check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    # a model that does not fit one GPU for full fine-tuning with AdamW (7.6B parameters x 16 bytes of bf16
    # weights and gradients, fp32 master weights and two moments = 122 GB): the ZeRO-3 / FSDP2 runs
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
PEAK_FLOPS = 989e12


def build_model(shape: str, device: str, case: str = "sft_full", attention: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if case.startswith("rm"):
        config.num_labels = 1
        auto = AutoModelForSequenceClassification
    else:
        auto = AutoModelForCausalLM
    with torch.device(device):  # initialised on the device: seconds instead of a minute of CPU init
        return auto.from_config(config, dtype=dtype, attn_implementation=attention)


def build_tokenizer(vocab_size: int):
    """A tokenizer that decodes any id (word-level over `t<i>`); trainers only need it to save/pad."""
    from tokenizers import Tokenizer, models
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    # specials must not be substrings of the words ("t1" would split "t180"), so they have names of their own
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()  # "t5 t9" -> [5, 9]: TRL's DPOTrainer tokenizes text itself
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def random_sequences(n: int, seq: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (n, seq), generator=g).tolist()


def random_pairs(sequences: list[list[int]]) -> list[dict[str, list[int]]]:
    """Pairs from two sequences each: a prompt of seq/4 tokens and two responses of 3 seq/4, ending in eos (2)."""
    cut = len(sequences[0]) // 4
    return [
        {"prompt_ids": a[:cut], "chosen_ids": a[cut:-1] + [2], "rejected_ids": b[cut:-1] + [2]}
        for a, b in zip(sequences[::2], sequences[1::2], strict=True)
    ]


def _ours_kernels(args):
    """The run's LM-head kernels as the stages decide them (``model.loader.head_kernels``), with the levers
    under test: ``ours_torchlp`` (the torch loop instead of Liger's kernel), ``-c8192`` (rows per chunk)."""
    import dataclasses

    from rlfactory.config.schema import ModelConfig, TrainConfig
    from rlfactory.model.loader import head_kernels

    compiled = args.impl.startswith("ours_compile")
    kernels = head_kernels(ModelConfig(name_or_path="bench"), TrainConfig(torch_compile=compiled))
    if args.impl == "ours_torchlp" or "torchlp" in args.impl.split("-")[1:]:  # also ours_compile-torchlp
        kernels = dataclasses.replace(kernels, logprobs="torch")
    for variant in args.impl.split("-")[1:]:  # levers under test: ours_compile-c8192-cudagraphs
        if variant.startswith("c") and variant[1:].isdigit():
            kernels = dataclasses.replace(kernels, chunk_rows=int(variant[1:]))  # rows per LM-head chunk in sft
    return kernels


def _ours_parts(args, model, tokenizer, sequences):
    """(model, StageParts) as the stage modules build them."""
    from rlfactory.config.schema import DPOConfig, LoraConfig, RMConfig
    from rlfactory.engine.offline import StageParts
    from rlfactory.model.loader import apply_lora, maybe_apply_liger
    from rlfactory.model.reference import ReferencePolicy
    from rlfactory.stages import dpo, preference_data, rm, sft

    lora = LoraConfig(r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    if args.case.startswith("rm"):
        if args.case.endswith("lora"):
            from rlfactory.config.loader import validate_config
            from rlfactory.model.heads import _apply_lora

            torch_seed()
            model = _apply_lora(
                model,
                validate_config(
                    {
                        "stage": "rm",
                        "model": {"name_or_path": "bench"},
                        "data": {"dataset": "bench"},
                        "lora": lora.model_dump(),
                    },
                    "bench",
                ),
            )
        items = [
            {**p, "chosen_mask": [True] * len(p["chosen_ids"]), "rejected_mask": [True] * len(p["rejected_ids"])}
            for p in random_pairs(sequences)
        ]
        return model, StageParts(items, _pair_collate(args), rm.make_loss(RMConfig()), preference_data.count_pairs)
    finetuning = "lora" if args.case.endswith("lora") else "full"  # as the model loader does:
    maybe_apply_liger(model, None, finetuning, compiled=args.impl.startswith("ours_compile"))
    if args.case.endswith("lora"):
        torch_seed()
        model = apply_lora(model, lora, False)
    kernels = _ours_kernels(args)
    if args.case.startswith("dpo"):
        items = [
            {**p, "chosen_mask": [True] * len(p["chosen_ids"]), "rejected_mask": [True] * len(p["rejected_ids"])}
            for p in random_pairs(sequences)
        ]
        loss, traits = dpo.check_loss_type("sigmoid")
        ref = ReferencePolicy(model)  # LoRA: the adapter-disabled policy, no copy (what build_reference picks for LoRA)
        loss_fn = dpo.make_loss(DPOConfig(), loss, traits, ref, kernels)
        return model, StageParts(items, _pair_collate(args), loss_fn, preference_data.count_pairs)
    items = [{"input_ids": s, "labels": s} for s in sequences]
    loss_fn = functools.partial(sft.nll_sum, kernels=kernels)
    return model, StageParts(items, sft.collate_padded(0), loss_fn, sft.count_tokens)


def _shares_prompts(args) -> bool:
    """The ``-share`` lever: ``data.share_prompt`` (each pair one row, its prompt computed once; sdpa_varlen)."""
    return args.impl.startswith("ours") and "share" in args.impl.split("-")[1:]


def _pair_collate(args):
    from rlfactory.stages import preference_data

    if _shares_prompts(args):
        return functools.partial(preference_data.collate_shared_pairs, pad_id=0)
    return preference_data.collate_pairs(0)


def torch_seed() -> None:
    """Seed right before adapters or heads are created, the same way for ours and TRL (same initial weights)."""
    import torch

    torch.manual_seed(1234)


def run_ours(args, model, tokenizer, sequences, out: str) -> tuple[list[float], list[float]]:
    from rlfactory.config.loader import validate_config
    from rlfactory.engine.offline import train
    from rlfactory.engine.run_dir import read_log

    model, parts = _ours_parts(args, model, tokenizer, sequences)
    cuda_graphs = False
    for variant in args.impl.split("-")[1:]:  # levers under test (-c<rows>: in _ours_kernels)
        if variant == "cudagraphs":  # train.cuda_graphs
            cuda_graphs = True
        elif variant in COMPILE_MODES:
            from rlfactory.engine import shared

            shared.compile_layers = functools.partial(_compile_layers_with_mode, mode=COMPILE_MODES[variant])
        elif variant == "decoder":
            from rlfactory.engine import shared

            shared.compile_layers = _compile_decoder
        elif variant == "ddpsplit":  # dynamo's DDP graph split left on (before the seventh session's change)
            from rlfactory.engine import shared

            shared.keep_layer_graphs_whole = lambda: None
        elif variant == "mem":
            parts.loss_fn = _memory_phases(model, parts.loss_fn)
        elif variant == "masksel":  # dpo/rm: response rows selected by a boolean mask on the GPU (before session 13)
            parts.collate = _without_host_rows(parts.collate)
        elif variant == "peftswitch":  # PEFT's own adapter switches, which walk the model each time (before)
            _peft_switches()
        elif variant == "compiledce":  # sft's compiled head chunk instead of Liger's kernel (before session 19)
            from rlfactory.algos import common

            common._LIGER_CE_FAILED.add("cuda")
        elif variant == "pageable":  # batches copied to the GPU from pageable memory, a host wait each (before)
            _pageable_batches()
        elif variant in DDP_LEVERS:  # DDP's own switches, through Accelerate's kwargs handler
            _ddp_kwargs.update(DDP_LEVERS[variant])
        elif variant == "indexadd":  # the head's row selection with index_select's atomic-add backward (before)
            from rlfactory.model import lm_head

            lm_head.select_rows = lambda source, rows: source.index_select(0, rows)
        elif variant == "share":  # dpo/rm: data.share_prompt (read by _pair_collate and the worker's model)
            pass
        elif variant != "torchlp" and not (variant.startswith("c") and variant[1:].isdigit()):  # _ours_kernels' own
            raise SystemExit(f"unknown lever -{variant} in {args.impl} (a typo would time the code without it)")
    if _ddp_kwargs:
        _with_ddp_kwargs(_ddp_kwargs)
    stage = args.case.split("_")[0]
    cfg = validate_config(
        {
            "stage": stage,
            "output_dir": out,
            "model": {"name_or_path": "bench"},
            "data": {"dataset": "bench", "shuffle": False},
            "train": {
                "max_steps": args.warmup + args.steps,
                "per_device_batch_size": args.batch,
                "grad_accum_steps": args.accum,
                "learning_rate": args.lr,
                "lr_scheduler": "constant",
                "mixed_precision": "bf16" if args.device == "cuda" else "no",
                **({"torch_compile": True} if args.impl.startswith("ours_compile") else {}),
                **({"cuda_graphs": True} if cuda_graphs else {}),
            },
            "logging": {"logging_steps": 1, "plot_loss": False, "progress_bar": False},
        },
        "bench",
    )
    train(cfg, model, tokenizer, parts, None)
    records = [r for r in read_log(out) if "loss" in r]
    elapsed = [r["elapsed_s"] for r in records]
    steps = [b - a for a, b in zip(elapsed, elapsed[1:], strict=False)][args.warmup - 1 :]
    return steps, [r["loss"] for r in records]


DDP_LEVERS = {
    "static": {"static_graph": True},
    "bigbucket": {"bucket_cap_mb": 1024},
    "bucketview": {"gradient_as_bucket_view": True},
}
_ddp_kwargs: dict = {}


def _with_ddp_kwargs(kwargs: dict) -> None:
    """Every Accelerator built from now on wraps the model in DDP with these switches."""
    import accelerate
    from accelerate.utils import DistributedDataParallelKwargs

    base = accelerate.Accelerator

    class WithDDPKwargs(base):
        def __init__(self, *a, **k):
            super().__init__(*a, kwargs_handlers=[DistributedDataParallelKwargs(**kwargs)], **k)

    accelerate.Accelerator = WithDDPKwargs


def _pageable_batches() -> None:
    """Every Accelerator built from now on copies its loaders' batches with blocking copies (before session 19)."""
    from rlfactory.engine import offline, shared

    build = shared.build_accelerator

    def blocking(cfg):
        accelerator = build(cfg)
        accelerator.dataloader_config.non_blocking = False
        return accelerator

    offline.build_accelerator = blocking


def _peft_switches() -> None:
    """The adapter switches as before the fourteenth session: PEFT's context managers, not ``model.adapters``."""
    import peft.helpers

    from rlfactory.model import adapters, reference

    reference.adapters_off = lambda model: model.disable_adapter()
    adapters.input_casting_off = peft.helpers.disable_input_dtype_casting  # imported by the engine at each use


def _without_host_rows(collate):
    """The collate without its host-side ``logp_rows``: ``forward_logps`` then selects rows with a boolean mask."""

    def wrapped(items):
        batch = collate(items)
        batch.pop("logp_rows", None)
        return batch

    return wrapped


COMPILE_MODES = {"autotune": "max-autotune-no-cudagraphs"}


def _compile_layers_with_mode(model, mode: str) -> int:
    """The engine's per-layer compile with a torch.compile mode (a lever under test, not a config option)."""
    import torch

    blocks = [
        b for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith("layers") for b in m
    ]
    for block in blocks:
        block.compile(mode=mode)
    return len(blocks)


def _memory_phases(model, loss_fn):
    """Wraps the loss to print, per step, the GPU memory (GB, allocated / peak) after the decoder's forward,
    after the loss (the LM head), and the peak of backward + optimizer step: where a peak comes from."""
    import torch

    gb = lambda n: round(n / 2**30, 2)  # noqa: E731
    marks: dict[str, tuple[float, float]] = {}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "get_decoder"):
        base.get_decoder().register_forward_hook(
            lambda *_: marks.__setitem__(
                "decoder", (gb(torch.cuda.memory_allocated()), gb(torch.cuda.max_memory_allocated()))
            )
        )

    def wrapped(model, batch):
        backward_peak = gb(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        out = loss_fn(model, batch)
        head = (gb(torch.cuda.memory_allocated()), gb(torch.cuda.max_memory_allocated()))
        print(
            f"MEM backward+step peak {backward_peak} | after decoder {marks.get('decoder')} | after loss {head}",
            file=sys.stderr,
            flush=True,
        )
        torch.cuda.reset_peak_memory_stats()
        return out

    return wrapped


def _compile_decoder(model) -> int:
    """The whole decoder (embedding, mask, every layer, final norm) as one graph instead of one per layer; its
    ``forward`` is compiled, not the module, so the loss's forward hook stays outside the graph."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    decoder.forward = torch.compile(decoder.forward)
    return 1


def run_trl(args, model, tokenizer, sequences, out: str) -> tuple[list[float], list[float]]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    marks: list[float] = []
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.append(time.perf_counter())
            progress(f"TRL step {len(marks)}")

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    peft_config = None
    if args.case.endswith("lora"):
        from peft import LoraConfig

        task = "SEQ_CLS" if args.case.startswith("rm") else "CAUSAL_LM"
        peft_config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type=task,
            modules_to_save=["score"] if task == "SEQ_CLS" else None,
        )
    flags = set(args.impl.split("_")[1:])  # trl_<packing>[_liger][_compile]: TRL's own switches
    common = dict(
        use_liger_kernel="liger" in flags,
        torch_compile="compile" in flags,
        output_dir=out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        max_steps=args.warmup + args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=args.device == "cuda",
        gradient_checkpointing=False,
        max_length=args.seq,
        use_cpu=args.device == "cpu",
        dataloader_drop_last=True,
    )
    if args.case.startswith("dpo"):
        from trl import DPOConfig, DPOTrainer

        text = lambda ids: " ".join(tokenizer.convert_ids_to_tokens(ids))  # noqa: E731 (decodes to the same ids)
        pairs = random_pairs(sequences)
        dataset = Dataset.from_dict(
            {
                "prompt": [text(p["prompt_ids"]) for p in pairs],
                "chosen": [" " + text(p["chosen_ids"]) for p in pairs],
                "rejected": [" " + text(p["rejected_ids"]) for p in pairs],
            }
        )
        config = DPOConfig(**common, precompute_ref_log_probs=False, beta=0.1, loss_type=["sigmoid"])
        trainer_cls = DPOTrainer
    elif args.case.startswith("rm"):
        from trl import RewardConfig, RewardTrainer

        pairs = random_pairs(sequences)
        dataset = Dataset.from_dict(
            {
                "chosen_ids": [p["prompt_ids"] + p["chosen_ids"] for p in pairs],
                "rejected_ids": [p["prompt_ids"] + p["rejected_ids"] for p in pairs],
            }
        )
        config, trainer_cls = RewardConfig(**common), RewardTrainer
    else:
        from trl import SFTConfig, SFTTrainer

        packing = next((f for f in ("wrapped", "bfd", "padded") if f in flags), "padded")
        config = SFTConfig(
            **common,
            packing=packing != "padded",
            packing_strategy="wrapped" if packing == "wrapped" else "bfd",
            padding_free=packing == "bfd",
        )
        dataset, trainer_cls = Dataset.from_dict({"input_ids": sequences}), SFTTrainer
    if peft_config is not None:  # the adapter made here, seeded as ours, so both start from the same weights
        from peft import get_peft_model

        torch_seed()
        model = get_peft_model(model, peft_config)
    trainer = trainer_cls(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Timer()]
    )
    # ours reads the data in order (data.shuffle: false); so does TRL here, so the loss curves are comparable
    trainer._get_train_sampler = lambda *_a, **_k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    trainer.train()
    return [b - a for a, b in zip(marks, marks[1:], strict=False)][args.warmup - 1 :], losses


def worker(args) -> None:
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: one process per GPU
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if _shares_prompts(args):
        from rlfactory.model.attention import attention_implementation

        model = build_model(args.shape, args.device, args.case, attention_implementation("sdpa_varlen"))
    else:
        model = build_model(args.shape, args.device, args.case)
    progress("model built")
    n_params = sum(p.numel() for p in model.parameters())
    tokenizer = build_tokenizer(SHAPES[args.shape]["vocab_size"])
    rows = args.batch * args.accum * (1 if args.case.startswith("sft") else 2)  # a pair is two sequences
    vocab = SHAPES[args.shape]["vocab_size"]
    sequences = random_sequences(rows * world * (args.warmup + args.steps + 1), args.seq, vocab)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runner = run_ours if args.impl.startswith("ours") else run_trl
    progress("data ready")
    if args.trace_step:  # one optimizer step of the offline loop (ours only), every rank
        sys.path.insert(0, str(Path(__file__).parent))
        from step_trace import record_step

        trace_dir = Path(os.environ.get("TRACE_DIR") or os.environ.get("OUT", "."))
        trace_dir.mkdir(parents=True, exist_ok=True)
        record_step(args.trace_step, lambda r: trace_dir / f"trace_{args.case}_{args.impl}_{world}gpu_r{r}.json.gz")
    profiler = contextlib.nullcontext()
    if args.profile:  # kernel time by name over the whole run (warmup included), to $OUT or the cwd
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        profiler = profile(activities=activities)
    # every process writes into the same output_dir (the parent's, under torchrun), as a real run does
    with contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory() as out, profiler:
        steps, losses = runner(args, model, tokenizer, sequences, out)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if args.profile:
        path = Path(os.environ.get("OUT", ".")) / f"profile_{args.case}_{args.impl}_{world}gpu.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        table = profiler.key_averages().table(
            sort_by="self_device_time_total" if args.device == "cuda" else "self_cpu_time_total",
            row_limit=60,
            max_name_column_width=90,
        )
        # the whole run: the compile's tuning kernels and the final save's copies are in it too
        path.write_text(f"{args.warmup + args.steps} steps, compile and final save included\n{table}")
    step_s = statistics.median(steps)
    tokens_per_s = rows * world * args.seq / step_s  # each pair counted as two sequences, in every layout
    # MFU from the tokens computed: a shared-prompt row computes a pair's seq/4-token prompt once (random_pairs)
    computed = 7 / 8 if _shares_prompts(args) else 1.0
    print(
        "RESULT "
        + json.dumps(
            {
                "case": args.case,
                "impl": args.impl,
                "gpus": world,
                "step_s": round(step_s, 4),
                "tokens_per_s": round(tokens_per_s),
                "mfu": round(6 * n_params * tokens_per_s * computed / world / PEAK_FLOPS, 4),
                "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device == "cuda" else None,
                "timed_steps": len(steps),
                "steps_ms": [round(1000 * x, 1) for x in steps],  # each timed step: drift or periodic slow steps
                "losses": [round(x, 5) for x in losses[:6]],
            }
        ),
        flush=True,
    )


def _run_with_limit(cmd: list[str], env: dict, limit: int) -> subprocess.CompletedProcess:
    """``cmd``'s output; at ``limit`` seconds (0: none) its whole process group is killed -- torchrun's and
    accelerate's workers too, which would otherwise keep their GPUs -- and returncode is None."""
    import signal

    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit or None)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return subprocess.CompletedProcess(cmd, None, stdout, stderr)
    except BaseException:  # Ctrl-C: the run's own session does not get the terminal's signal, so stop it here
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def progress(label: str) -> None:
    """A ``PROGRESS`` line on rank 0's stderr: what --run-timeout prints of a run it stopped."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"PROGRESS {label} at {time.perf_counter() - STARTED:.1f} s", file=sys.stderr, flush=True)


STARTED = time.perf_counter()


def free_port() -> int:
    """A TCP port nobody listens on now (accelerate's default, 29500, would clash between runs side by side)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="sft_full,sft_lora")
    parser.add_argument("--impls", default="ours,trl_padded,trl_wrapped")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (one all-reduce each)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--profile", action="store_true", help="torch.profiler kernel table per worker, to $OUT")
    parser.add_argument("--trace-step", type=int, default=0, help="Chrome trace + summary of this step (step_trace.py)")
    parser.add_argument("--gpus", default="1", help="GPU counts to run each case on, e.g. 1,2,4 (torchrun, DDP)")
    parser.add_argument(
        "--run-timeout",
        type=int,
        default=0,
        help="seconds before a (case, impl, GPUs) run is stopped, all its processes, and how far it got is "
        "printed (its PROGRESS lines: model built, each TRL step); 0: no limit",
    )
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "IMPL"))
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a worker's output_dir, shared by ranks
    args = parser.parse_args()
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        args.case, args.impl = args.worker
        worker(args)
        return
    rows = []
    runs = [(c, i, int(g)) for c in args.cases.split(",") for i in args.impls.split(",") for g in args.gpus.split(",")]
    for case, impl, gpus in runs:
        out = tempfile.mkdtemp()
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if gpus > 1 else []
        if gpus > 1 and impl.startswith("trl") and args.device == "cuda":  # TRL as its docs run it on several GPUs
            launcher = ["-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={gpus}"]
            # a free port of its own, so that runs on disjoint GPUs of one host can go side by side
            launcher += ["--mixed_precision=bf16", f"--main_process_port={free_port()}"]
        cmd = [
            sys.executable,
            *launcher,
            __file__,
            "--out",
            out,
            "--worker",
            case,
            impl,
            "--shape",
            args.shape,
            "--batch",
            str(args.batch),
            "--accum",
            str(args.accum),
            "--seq",
            str(args.seq),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--lr",
            str(args.lr),
            *(["--profile"] if args.profile else []),
            *(["--trace-step", str(args.trace_step)] if args.trace_step else []),
        ]
        # exactly `gpus` GPUs visible: TRL's Trainer would otherwise spread one process over all (nn.DataParallel)
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(32)))),
        }
        env["CUDA_VISIBLE_DEVICES"] = ",".join(env["CUDA_VISIBLE_DEVICES"].split(",")[:gpus])
        # as `rlfactory train distributed.num_processes=N` starts its processes (torchrun alone would set 1 thread)
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // gpus)))
        proc = _run_with_limit(cmd, env, args.run_timeout)
        shutil.rmtree(out, ignore_errors=True)
        if proc.returncode is None:  # stopped at --run-timeout: say how far it got (start-up or steps)
            progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("PROGRESS ")]
            print(f"{case}/{impl}/{gpus} GPUs stopped after {args.run_timeout} s; got to:", file=sys.stderr)
            print("\n".join(progress[-6:]) or "(no PROGRESS line)", file=sys.stderr)
            print(proc.stderr[-1500:], file=sys.stderr)
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            # a rank's own error comes first; torchrun's summary of the stopped ranks fills the tail
            errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln and "Warning" not in ln][:12]
            print(f"{case}/{impl}/{gpus} GPUs failed:\n" + "\n".join(errors), file=sys.stderr)
            print(proc.stderr[-3000:], file=sys.stderr)
            continue
        for line in [ln for ln in proc.stdout.splitlines() if ln.startswith("TRACE ")]:
            print(f"{case}/{impl}/{gpus} {line}", flush=True)
        for line in [ln for ln in proc.stderr.splitlines() if ln.startswith("MEM ")][-3:]:
            print(f"{case}/{impl} {line}", flush=True)
        rows.append(json.loads(lines[-1][7:]))
        print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| case | impl | GPUs | step s | tokens/s | MFU per GPU | peak GB (rank 0) | vs best TRL | vs 1 GPU |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    for row in rows:
        same = [r for r in rows if r["case"] == row["case"] and r["gpus"] == row["gpus"]]
        trl = [r["tokens_per_s"] for r in same if r["impl"].startswith("trl")]
        ratio = f"{row['tokens_per_s'] / max(trl):.2f}x" if trl else "-"
        one = [r for r in rows if (r["case"], r["impl"], r["gpus"]) == (row["case"], row["impl"], 1)]
        scaling = f"{row['tokens_per_s'] / one[0]['tokens_per_s']:.2f}x" if one and row["gpus"] > 1 else "-"
        print(
            f"| {row['case']} | {row['impl']} | {row['gpus']} | {row['step_s']} | {row['tokens_per_s']} | "
            f"{row['mfu']:.1%} | {row['peak_mem_gb']} | {ratio} | {scaling} |"
        )
    print("\nfirst losses (each of ours vs each TRL impl, max |difference| over the shared steps):")
    for ours in [r for r in rows if r["impl"].startswith("ours")]:
        for trl in [
            r for r in rows if (r["case"], r["gpus"]) == (ours["case"], ours["gpus"]) and r["impl"].startswith("trl")
        ]:
            diff = max((abs(a - b) for a, b in zip(ours["losses"], trl["losses"], strict=False)), default=float("nan"))
            pair = f"{ours['impl']} {ours['losses']} | {trl['impl']} {trl['losses']}"
            print(f"{ours['case']}: {pair} | max diff {diff:.2e}")


if __name__ == "__main__":
    main()
