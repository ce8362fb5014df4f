"""Rollout benchmarks on the GPU machine, one command: vLLM vs HF generation, GRPO steps with vLLM in both LoRA
sync modes side by side with TRL's GRPOTrainer, and peak GPU memory with and without sleep mode.

    source .gpu/vllm/setup.sh && export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH HF_HUB_OFFLINE=1
    python3 -c "import zipfile,glob; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('.gpu/bwhl/*.whl')]"
    python3 bench/rollout_bench.py                                  # all cases, Qwen2.5-0.5B shape
    python3 bench/rollout_bench.py --cases gen --shape tiny --prompts 8 --samples 2 --tokens 32   # smoke

Model: a Qwen2.5-0.5B-shaped Qwen2 with random bf16 weights (written once to a temp dir with the bundled
tiny model's tokenizer, so the arithmetic prompts render with its chat template). Random weights almost never
emit the end-of-turn token (1 in 151,936 per token), so GRPO completions run to the fixed length as well.

- gen:    64 prompts x 8 samples x 256 new tokens (ignore_eos): HFBackend vs VLLMBackend (CUDA graphs), tokens/s.
- grpo:   GRPO, LoRA r=16 all-linear, 8 prompts x 8 samples x 256 tokens, beta 0, vLLM with CUDA graphs and
          torch.compile, no gradient checkpointing, one on-policy update per step (no extra log-prob pass), for
          each ``--grpo-runs`` pair lora_sync:micro-batch (train.per_device_batch_size; 16 is TRL's micro-batch
          here, 64 the whole step in one forward/backward): step time, timing_s/* breakdown,
          rollout/logprob_diff_{mean,max}, rollout/prob_pearson, peak device memory.
- trl:    TRL's GRPOTrainer on the same model, data, batch and lengths: LoRA r=16 all-linear, use_vllm +
          vllm_mode colocate, beta 0, 16 completions per micro-batch x 4 accumulation steps = one generation of
          8 prompts x 8 samples per optimizer step, ignore_eos; TRL's other defaults (gradient checkpointing,
          vLLM importance-sampling correction, so its extra no-grad log-prob pass). ``--trl-runs`` names TRL
          variants (``nogc``, ``microN``, ``nois``, ``liger`` joined by ':'); the table's ratio is against the
          fastest TRL run of the call. ``--trl-no-gc`` is ``--trl-runs default,nogc``.
- memory: the ``--sleep-runs`` pairs again with enable_sleep_mode (peak device memory vs the same grpo run).
- ``--var-lengths 32:1024 --tokens 1024``: every case again with variable response lengths: each sample's
          max_tokens drawn from 32..1024 (``--length-seed``), the same draw for ours and TRL (``vary_lengths``
          wraps vLLM's generate in each case's process; vLLM cases only, the hf backend keeps --tokens).

Step time, for ours and TRL alike: the wall-clock interval between consecutive step ends, median over the steps
after ``--warmup``. Each case runs in its own subprocess (a fresh CUDA context, so peak memory is its own);
one JSON line each (also appended to ``--out``), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
# the benchmark model shape is defined once, in train_bench.py (this script runs from bench/, so it imports)
from train_bench import SHAPES as TRAIN_SHAPES  # noqa: E402
from train_bench import free_port  # noqa: E402

SHAPES = {
    "qwen2.5-0.5b": TRAIN_SHAPES["qwen2.5-0.5b"],
    "qwen2.5-7b": TRAIN_SHAPES["qwen2.5-7b"],
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
BREAKDOWN = ("gen", "reward", "ref", "old_logprob", "adv", "update_actor", "sync")
# TRL's own profiling names (_prepare_inputs holds the generation, rewards and the no-grad log-prob pass;
# compute_loss the forward of the update, without its backward), and our timer of that no-grad pass
TRL_BREAKDOWN = (
    "vLLM.generate",
    "transformers.generate",
    "sync_weights",
    "logps_nograd",
    "_prepare_inputs",
    "compute_loss",
)


def make_model_dir(shape: str, out: Path) -> Path:
    """A random-weight model of ``shape`` with the tiny model's tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=2, pad_token_id=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):  # initialised on the GPU: seconds for a 7B shape instead of minutes on the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
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


class StepClock:
    """Wall-clock intervals between consecutive step ends (the first interval starts at ``start``)."""

    def __init__(self):
        self.last: float | None = None
        self.intervals: list[float] = []

    def start(self) -> None:
        self.last = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.intervals.append(now - self.last)
            if os.environ.get("RANK", "0") == "0":  # one line per step, for a case that is stopped later
                print(f"STEP {len(self.intervals)} {self.intervals[-1]:.4f}", flush=True)
        self.last = now


def timed_out_steps(stdout: str, warmup: int) -> dict | None:
    """What a case stopped at its timeout had measured: the ``STEP`` lines its clock printed, and the median of those
    past ``warmup`` (None: no step past the warmup). Not a ratio: the case's other numbers were never printed."""
    intervals = [float(line.split()[2]) for line in stdout.splitlines() if line.startswith("STEP ")]
    steady = intervals[warmup:]
    if not steady:
        return None
    return {"partial_steps": len(steady), "partial_step_s": round(_median(steady), 4), "intervals_s": intervals}


def draw_max_tokens(low: int, high: int, seed: int):
    """The per-request budget of the variable-length variant: one draw from [low, high] per sample, from one seeded
    stream, in request order. Ours (a group is one request with n samples) and TRL (n requests of one sample each,
    a prompt's repeats back to back) ask for a step's samples in the same order, so sample i of every step gets the
    same budget on both sides."""
    import random

    rng = random.Random(seed)
    return lambda: rng.randint(low, high)


def expand_requests(prompts: list, params: list, draw) -> tuple[list, list, list[int]]:
    """Each request of n samples -> n requests of one sample, each with its own drawn ``max_tokens`` (vLLM cannot give
    the samples of one request different budgets); and each original request's n, to merge the outputs back."""
    flat_prompts, flat_params, counts = [], [], []
    for prompt, param in zip(prompts, params, strict=True):
        counts.append(param.n)
        for _ in range(param.n):
            one = param.clone()
            one.n, one.max_tokens = 1, draw()
            flat_prompts.append(prompt)
            flat_params.append(one)
    return flat_prompts, flat_params, counts


def merge_outputs(outputs: list, counts: list[int]) -> list:
    """The outputs of ``expand_requests``' requests -> one output per original request, its samples indexed 0..n-1."""
    merged, start = [], 0
    for n in counts:
        group = outputs[start : start + n]
        start += n
        for index, out in enumerate(group):
            out.outputs[0].index = index
        group[0].outputs = [out.outputs[0] for out in group]
        merged.append(group[0])
    return merged


def vary_lengths(spec: str, seed: int) -> None:
    """``--var-lengths LOW:HIGH``: every ``vllm.LLM.generate`` of this process (ours and TRL's alike) gives each
    sample its own max_tokens, drawn by ``draw_max_tokens``: real GRPO's response lengths vary 10x within a group,
    which random weights (never ending a turn) cannot show by themselves."""
    import vllm

    low, high = (int(x) for x in spec.split(":"))
    draw, inner = draw_max_tokens(low, high, seed), vllm.LLM.generate

    def generate(self, prompts, sampling_params=None, *args, **kwargs):
        single = not isinstance(prompts, list)
        prompts = [prompts] if single else prompts
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        flat_prompts, flat_params, counts = expand_requests(prompts, params, draw)
        return merge_outputs(inner(self, flat_prompts, flat_params, *args, **kwargs), counts)

    generate.unvaried = inner  # case_gen's latency floor runs one request at its full length
    vllm.LLM.generate = generate


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def case_gen(args, model_dir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfactory.config.schema import RunConfig
    from rlfactory.rollout.backends import build_backend
    from rlfactory.rollout.base import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda" if cuda else "cpu").eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 1000, (args.prompts, 32), generator=gen).tolist()
    repeated = [p for p in prompts for _ in range(args.samples)]
    engine = "vllm" if args.impl == "vllm_mp" else args.impl  # vllm_mp: the env of run_case's caller (main)
    cfg = _grpo_cfg(args, model_dir, Path(tempfile.mkdtemp()), engine, "adapter", False)
    cfg["model"]["finetuning"] = "full"
    cfg["rollout"]["generation_batch_size"] = len(repeated)
    backend = build_backend(RunConfig.model_validate(cfg), model, tokenizer)
    params = SamplingParams(args.tokens, temperature=1.0, ignore_eos=True)
    backend.generate(repeated[: args.samples], SamplingParams(8, 1.0, ignore_eos=True))  # warmup
    times = []
    for _ in range(args.repeats if engine == "vllm" else 1):  # HF generate is slow: one timed run
        sync()
        start = time.perf_counter()
        out = backend.generate(repeated, params)
        sync()
        times.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for c in out)
    result = {
        "case": "gen",
        "impl": args.impl,
        "sequences": len(repeated),
        "tokens": tokens,
        "seconds": round(statistics.median(times), 4),
        "tokens_per_s": round(tokens / statistics.median(times), 1),
    }
    if engine == "vllm":  # where a GRPO step's generation goes: its shape, with and without sampler log-probs
        from rlfactory.rollout import vllm as vllm_backend

        step_batch = repeated[: args.grpo_prompts * args.samples]
        with_logprobs = vllm_backend.vllm_sampling
        for label, fn in (("logprobs", with_logprobs), ("no_logprobs", _no_logprobs(with_logprobs))):
            vllm_backend.vllm_sampling = fn
            times = []
            for _ in range(3):
                sync()
                start = time.perf_counter()
                backend.generate(step_batch, params)
                sync()
                times.append(time.perf_counter() - start)
            result[f"step_batch_s/{label}"] = round(statistics.median(times), 4)
        vllm_backend.vllm_sampling = with_logprobs
        # The decode latency floor of a step: its longest response alone (--tokens tokens, no length draw). With
        # varying lengths the batch's tail is a few long samples, so a step's generation cannot beat this number.
        import vllm

        varied, vllm.LLM.generate = vllm.LLM.generate, getattr(vllm.LLM.generate, "unvaried", vllm.LLM.generate)
        times = []
        for _ in range(3):
            sync()
            start = time.perf_counter()
            alone = backend.generate(step_batch[:1], params)
            sync()
            times.append(time.perf_counter() - start)
        vllm.LLM.generate = varied
        result.update(one_request_s=round(statistics.median(times), 4), one_request_tokens=len(alone[0].token_ids))
    return result


def _no_logprobs(fn):
    def sampling(*args, **kwargs):
        params = fn(*args, **kwargs)
        params.logprobs = None
        return params

    return sampling


def _grpo_cfg(args, model_dir: Path, out: Path, backend: str, sync: str, sleep: bool) -> dict:
    import torch

    return {
        "stage": "grpo",
        "output_dir": str(out),
        "overwrite_output_dir": True,
        "model": {
            "name_or_path": str(model_dir),
            "finetuning": "lora",
            "dtype": "bfloat16" if torch.cuda.is_available() else "float32",
            "gradient_checkpointing": False,
            # :flex: flex attention, whose block mask skips a packed row's cross-sample blocks (one packed row per
            # micro-batch); sdpa, the default, packs rows as long as the longest sample (:padded: no packing)
            **({"attn_implementation": "flex_attention"} if args.flex else {}),
            # :varlen: sdpa_varlen, a micro-batch as one packed row through torch's flash-attention varlen kernel
            **({"attn_implementation": "sdpa_varlen"} if args.varlen or args.shared else {}),
        },
        "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear", "dropout": 0.0},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(ROOT / "data")},
        "rollout": {
            "backend": backend,
            "lora_sync": sync,
            "prompts_per_step": args.grpo_prompts * args.gpus,
            "num_samples": args.samples,
            "max_prompt_len": 256,
            "max_response_len": args.tokens,
            "enable_sleep_mode": sleep,
            "gpu_memory_utilization": args.gpu_mem,
            "enforce_eager": args.eager,
            "generation_batch_size": 512,
            "overlap": args.overlap,
            # :greenN: while an overlapped round generates, the update's kernels on N SMs (a CUDA green context)
            "overlap_update_sms": args.update_sms,
            # :shared: rollout.packing shared, each group's prompt computed once per micro-batch (sdpa_varlen)
            "packing": "off" if args.padded else "shared" if args.shared else "auto",
            # :misN: the sampled tokens' log-probs (mismatch metrics) on one step in N only
            "mismatch_every": args.mismatch_every,
            # :tokN: micro-batches of at most N prompt + response tokens (and at most the micro-batch's samples)
            "micro_batch_tokens": args.micro_tokens,
            # :fp8 / :kvfp8: vLLM's own fp8 weights / KV cache for the rollouts (the trainer stays bf16)
            "engine_args": engine_args(args),
        },
        "reward": {"functions": {"answer_match": 1.0}},
        # data parallel: one colocated engine per GPU, the same prompts per GPU (the step's prompts are split)
        **({"distributed": {"num_processes": args.gpus}} if args.gpus > 1 else {}),
        # skip_zero_advantage_backward off: random weights never solve a problem, so every group has zero advantage
        # and the skip would leave one micro-batch's backward per step; TRL runs every row's: like for like
        "algorithm": {
            "adv_estimator": "grpo",
            "kl_loss_coef": 0.0,
            "loss_agg": "token-mean",
            "skip_zero_advantage_backward": False,
        },
        "train": {
            "max_steps": args.steps,
            "per_device_batch_size": args.micro,
            "learning_rate": 1e-5,
            "lr_scheduler": "constant",
            "torch_compile": args.compile,
        },
        "evaluation": {"dataset": None},
        "logging": {"logging_steps": 1, "progress_bar": False, "plot_loss": False, "rollout_trace_steps": None},
    }


def torch_peaks() -> dict:
    """This process's torch allocator peaks in GB (every stream's pool), beside the device-wide peak."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {
        "torch_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "torch_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }


def engine_args(args) -> dict:
    """``rollout.engine_args`` of a run's ``:fp8`` (fp8 weights, re-quantized at each sync) and ``:kvfp8`` fields."""
    return {
        **({"quantization": "fp8"} if getattr(args, "fp8", False) else {}),
        **({"kv_cache_dtype": "fp8"} if getattr(args, "kvfp8", False) else {}),
    }


def trace_phases(step: int, trace_dir: Path, which: str = "update") -> None:
    """``--trace-step N``: step N's update (``phases.update_models``) and/or (``which``: update, generate, both)
    step N+1's generation (``phases.collect``), each under torch.profiler: a Chrome trace per phase in ``trace_dir`` and
    ``bench/step_trace.py``'s summary (GPU busy time, idle stretches, kernel time by kind) on stdout, each line
    starting with ``TRACE <phase>``. Two phases, two traces: the kernel shares of decoding and of the update do not
    mix. Without overlap (with it, the round runs beside the update in the trace). The generation's trace is slow to
    record (every decoding step's host side: a 7B round of 1,024 tokens ran past a 215 s case limit)."""
    import gzip

    import torch
    from step_trace import summarize
    from torch.profiler import ProfilerActivity, profile

    from rlfactory.engine.online import phases

    def traced(name: str, at: int, inner):
        def wrapper(run, *rest):
            index = rest[-1] if name == "update" else rest[0]
            if index != at:
                return inner(run, *rest)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = inner(run, *rest)
                torch.cuda.synchronize()
            raw = trace_dir / f"trace_{name}_step{index}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                dst.write(src.read())
            raw.unlink()
            for line in summarize(f"{raw}.gz", gaps=6).splitlines():
                print(f"TRACE {name} {line}", flush=True)
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
            for line in table.splitlines():
                print(f"TRACE {name} ops| {line}", flush=True)
            return result

        return wrapper

    trace_dir.mkdir(parents=True, exist_ok=True)
    if which in ("update", "both"):
        phases.update_models = traced("update", step, phases.update_models)
    if which in ("generate", "both"):
        phases.collect = traced("generate", step + 1, phases.collect)


def case_grpo(args, model_dir: Path) -> dict:
    """GRPO through the real CLI entry point, in this process (the engine is colocated)."""
    import yaml

    from rlfactory.cli import main
    from rlfactory.config.schema import RunConfig
    from rlfactory.engine.environment import online_allocator_setting
    from rlfactory.engine.online import loop as online
    from rlfactory.engine.run_dir import read_log
    from rlfactory.model.attention import resolved_attention

    out = Path(tempfile.mkdtemp())
    cfg = _grpo_cfg(args, model_dir, out / "run", args.impl, args.sync, args.sleep)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    clock, inner = StepClock(), online.step

    def timed_step(run, index):
        if clock.last is None:
            clock.start()
        result = inner(run, index)
        clock.tick()
        return result

    online.step = timed_step
    if args.trace_step is not None:
        trace_phases(args.trace_step, Path(args.trace_dir or out), args.trace_phase)
    if args.switch_us:  # :switchN: the overlap thread's decode loop and the update contend for the GIL
        sys.setswitchinterval(args.switch_us / 1e6)
    with PeakMemory() as memory:
        code = main(["train", str(out / "run.yaml")])
    records = [r for r in read_log(out / "run") if "score/mean" in r]
    steps, intervals = records[args.warmup :], clock.intervals[args.warmup :]
    if args.overlap and len(steps) > 1:  # the last step launches no next round: a step without generation
        steps, intervals = steps[:-1], intervals[:-1]
    median = lambda key: _median([r[key] for r in steps if key in r])
    keys = sorted({k for r in steps for k in r if k.startswith(("timing_s/", "rollout/logprob", "rollout/prob"))})
    # on several GPUs the CLI starts its own processes (the step clock above does not reach them): the log's own
    # step time, which the scaling table uses for every GPU count alike
    log_step_s = median("timing_s/step")
    step_s = _median(intervals) if args.gpus == 1 else log_step_s
    generated = median("rollout/generated_samples") or 0
    length = median("response_length/mean") or 0
    return {
        "case": args.case,
        "impl": args.impl,
        "sync": args.sync,
        "sleep": args.sleep,
        "micro": args.micro,
        "compile": args.compile,
        "overlap": args.overlap,
        "flex": args.flex,
        "varlen": args.varlen,
        "attention": resolved_attention(RunConfig.model_validate(cfg).model),  # what `auto` (the default) became
        "padded": args.padded,
        "shared": args.shared,
        "mismatch_every": args.mismatch_every,
        "micro_batch_tokens": args.micro_tokens,
        "switch_interval_us": round(sys.getswitchinterval() * 1e6),
        "update_sms": args.update_sms,
        "engine_args": engine_args(args),
        # what the run's allocator used: the user's setting, else the online stages' default (the product's rule)
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        or online_allocator_setting(RunConfig.model_validate(cfg), dict(os.environ))
        or "",
        "exit": code,
        "gpus": args.gpus,
        "log_step_s": log_step_s,
        "log_tokens_per_s": median("perf/throughput"),
        "steps": len(steps),
        "step_s": round(step_s, 4) if step_s else None,
        "gen_tokens_per_s": round(generated * length / step_s, 1) if step_s else None,
        "response_length": length,
        "peak_device_gb": round(memory.peak / 2**30, 2),
        # torch's own peaks (this process's allocator pools, every stream's): against the device's, vLLM's share
        **torch_peaks(),
        "intervals_s": [round(x, 4) for x in clock.intervals],
        **{k: median(k) for k in keys},
        "logprob_diff_mean_per_step": [r.get("rollout/logprob_diff_mean") for r in records],
        # the CUDA allocator's cache flushes per step (a step at the memory limit stalls on them)
        "alloc_flushes_per_step": [r.get("perf/alloc_flushes") for r in records],
        "per_step": [
            {k.removeprefix("timing_s/"): v for k, v in r.items() if k.startswith("timing_s/")} for r in records
        ],
    }


# each a --flag of a case
RUN_FIELDS = {"compile", "overlap", "flex", "varlen", "padded", "shared", "fixedseg", "fp8", "kvfp8"}
NUMBERED_FIELDS = {"mis": "--mismatch-every", "tok": "--micro-tokens", "switch": "--switch-us", "green": "--update-sms"}


def run_flags(extras: list[str]) -> list[str]:
    """A ``--grpo-runs`` entry's extra fields -> the case's flags: ``mis8`` -> ``--mismatch-every=8``, ``tok16384`` ->
    ``--micro-tokens=16384``, ``switch500`` -> ``--switch-us=500``, ``green100`` -> ``--update-sms=100``,
    ``overlap`` -> ``--overlap``, ``fp8`` ->
    ``--fp8`` (``kvfp8`` likewise)."""
    flags = []
    for extra in extras:
        prefix = next((k for k in NUMBERED_FIELDS if re.fullmatch(f"{k}[0-9]+", extra)), None)
        flags.append(f"{NUMBERED_FIELDS[prefix]}={extra[len(prefix) :]}" if prefix else f"--{extra}")
    return flags


def trl_micro(variant: set[str], completions: int) -> int:
    """TRL's completions per micro-batch for a ``--trl-runs`` variant: ``microN``'s N, else 16; at most a step's."""
    micros = [int(f.removeprefix("micro")) for f in variant if re.fullmatch(r"micro[0-9]+", f)]
    return min(micros[0] if micros else 16, completions)


def case_trl(args, model_dir: Path) -> dict:
    """TRL 1.16 GRPOTrainer, run the same way (see the module doc)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from rlfactory.data.loader import load_examples

    cuda = torch.cuda.is_available()
    examples = load_examples(["arith_prompts"], "prompt", str(ROOT / "data"))
    dataset = Dataset.from_list([{"prompt": ex["messages"], "answer": str(ex["answer"])} for ex in examples])

    def answer_match(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(a in text) for text, a in zip(texts, answer, strict=True)]

    # TRL's own phase timers (vLLM.generate, sync_weights) go to wandb/mlflow only: collect them here
    phases: dict[str, float] = {}
    profiling.ProfilingContext._log_metrics = lambda self, d: phases.__setitem__(
        self.name.split(".", 1)[-1], phases.get(self.name.split(".", 1)[-1], 0.0) + d
    )
    logps_inner = GRPOTrainer._get_per_token_logps_and_entropies

    def timed_logps(self, *a, **k):
        if torch.is_grad_enabled():
            return logps_inner(self, *a, **k)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = logps_inner(self, *a, **k)
        if cuda:
            torch.cuda.synchronize()
        phases["logps_nograd"] = phases.get("logps_nograd", 0.0) + time.perf_counter() - start
        return out

    GRPOTrainer._get_per_token_logps_and_entropies = timed_logps
    clock, per_step, records = StepClock(), [], []

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock.start()

        def on_step_end(self, *a, **k):
            clock.tick()
            per_step.append(dict(phases))
            phases.clear()

        def on_log(self, a, state, control, logs=None, **k):
            records.append(dict(logs or {}))

    # TRL's switches (--trl-runs fields): nogc = no gradient checkpointing, microN = N completions per forward,
    # nois = vllm_importance_sampling_correction off (no extra no-grad log-prob pass), liger = Liger's GRPO loss
    variant = set(args.trl_variant.split(":")) - {"default", ""}
    micro = trl_micro(variant, args.grpo_prompts * args.samples)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=args.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.grpo_prompts * args.samples // micro,
        num_generations=args.samples,
        max_completion_length=args.tokens,
        temperature=1.0,
        beta=0.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=cuda,
        gradient_checkpointing="nogc" not in variant,
        vllm_importance_sampling_correction="nois" not in variant,
        use_liger_kernel="liger" in variant,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
        use_vllm=cuda,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.gpu_mem,
        vllm_max_model_length=256 + args.tokens,
        generation_kwargs={"ignore_eos": True} if cuda else None,
        seed=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=answer_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Timer()],
    )
    with PeakMemory() as memory:
        trainer.train()
    step_s = _median(clock.intervals[args.warmup :])
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under accelerate launch: each process its own generation
    steps = [r for r in records if "completions/mean_length" in r][args.warmup :]
    length = _median([r["completions/mean_length"] for r in steps]) or 0
    kept = per_step[args.warmup :]
    breakdown = {f"trl_s/{k}": round(_median([p.get(k, 0.0) for p in kept]), 4) for k in sorted(set().union(*kept))}
    return {
        "case": args.case,
        "impl": "trl",
        "gpus": world,
        "gradient_checkpointing": "nogc" not in variant,
        "variant": args.trl_variant,
        "micro": micro,
        "steps": len(clock.intervals[args.warmup :]),
        "step_s": round(step_s, 4) if step_s else None,
        "gen_tokens_per_s": round(world * args.grpo_prompts * args.samples * length / step_s, 1) if step_s else None,
        "response_length": length,
        "peak_device_gb": round(memory.peak / 2**30, 2),
        "intervals_s": [round(x, 4) for x in clock.intervals],
        **breakdown,
    }


def run_one(args) -> None:
    model_dir = Path(args.model_dir)
    if args.var_lengths:
        vary_lengths(args.var_lengths, args.length_seed)
    cases = {"gen": case_gen, "trl": case_trl}
    result = cases.get(args.case, case_grpo)(args, model_dir)
    if args.var_lengths:
        result["var_lengths"] = f"{args.var_lengths} seed {args.length_seed}"
    print("RESULT " + json.dumps(result), flush=True)


def case_limit(case_timeout: float, budget: float, elapsed: float, least: float = 30.0) -> float | None:
    """Seconds the next case may run: ``--case-timeout``, cut to what is left of ``--budget`` (0: no budget); None
    when less than ``least`` is left (the case is skipped, and says so). Why: an outer ``timeout`` around the bench
    killed it whole, with the cases it had not begun, while a budget ends the call with every finished case kept."""
    if budget <= 0:
        return case_timeout
    left = budget - elapsed
    return min(case_timeout, left) if left >= least else None


def run_case(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, str, int]:
    """(stdout, stderr, exit code) of one case; a case past ``timeout`` is killed and reported with what it printed
    (exit -9, "TIMEOUT" at the end of stderr). On POSIX the output a timed-out child left is BYTES even with
    ``text=True`` (``subprocess`` attaches what it read so far, undecoded), or None: both become text here."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = lambda out: out.decode(errors="replace") if isinstance(out, bytes) else (out or "")  # noqa: E731
        return text(exc.stdout), text(exc.stderr) + "\nTIMEOUT", -9


def table(results: list[dict]) -> str:
    """The summary: generation throughput, then GRPO steps with the ratio to TRL (default config) and breakdown."""
    lines = []
    gen = [r for r in results if r.get("case") == "gen"]
    if gen:
        lines += ["| generation | sequences | tokens | s | tokens/s |", "|---|---|---|---|---|"]
        for r in gen:
            row = (r["impl"], r["sequences"], r["tokens"], r["seconds"], f"{r['tokens_per_s']:,.0f}")
            lines.append("| " + " | ".join(map(str, row)) + " |")
        for r in gen:
            if "step_batch_s/logprobs" in r:
                lines.append(
                    f"\n{r['impl']}, one GRPO step's batch: {r['step_batch_s/logprobs']} s with sampler log-probs, "
                    f"{r['step_batch_s/no_logprobs']} s without; its longest response alone "
                    f"({r.get('one_request_tokens')} tokens, the decode latency floor): {r.get('one_request_s')} s"
                )
        lines.append("")
    steps = [r for r in results if r.get("case") in ("grpo", "memory", "trl") and r.get("step_s")]
    trl = min((r for r in steps if r["impl"] == "trl"), key=lambda r: r["step_s"], default=None)  # TRL's fastest
    if steps:
        lines += [
            "| run | step s | gen tokens/s | ours/TRL | peak GB | logprob diff mean / max | breakdown s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            if r["impl"] == "trl":
                name = f"TRL GRPOTrainer ({r.get('variant', 'default')}, micro {r.get('micro', 16)})"
                name += f", {r['gpus']} GPUs" if r.get("gpus", 1) > 1 else ""
                parts = {k: r[f"trl_s/{k}"] for k in TRL_BREAKDOWN if r.get(f"trl_s/{k}") is not None}
                diff = "-"
            else:
                name = f"ours {r['impl']} {r['sync']} micro {r['micro']}" + (" +sleep" if r.get("sleep") else "")
                name += f", {r['gpus']} GPUs" if r.get("gpus", 1) > 1 else ""
                name += " +compile" if r.get("compile") else ""
                name += " +overlap" if r.get("overlap") else ""
                name += " +flex (packed)" if r.get("flex") else ""
                name += " +sdpa_varlen (one packed row)" if r.get("varlen") else ""
                name += " +padded" if r.get("padded") else ""
                name += " +shared prompts" if r.get("shared") else ""
                name += " +fixed segments" if "expandable_segments:False" in r.get("alloc_conf", "") else ""
                name += f" +mismatch_every {r['mismatch_every']}" if r.get("mismatch_every", 1) > 1 else ""
                name += f" +micro_batch_tokens {r['micro_batch_tokens']}" if r.get("micro_batch_tokens") else ""
                name += "".join(f" +{k} {v}" for k, v in (r.get("engine_args") or {}).items())
                name += f" +update on {r['update_sms']} SMs" if r.get("update_sms") else ""
                switch = r.get("switch_interval_us", 5000)
                name += f" +switch interval {switch} us" if switch != 5000 else ""
                parts = {k: r[f"timing_s/{k}"] for k in BREAKDOWN if r.get(f"timing_s/{k}") is not None}
                mean, mx = r.get("rollout/logprob_diff_mean"), r.get("rollout/logprob_diff_max")
                diff = f"{mean:.2e} / {mx:.2e}" if mean is not None else "-"
            ratio = f"{trl['step_s'] / r['step_s']:.2f}x" if trl else "-"
            text = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
            lines.append(
                f"| {name} | {r['step_s']:.3f} | {r['gen_tokens_per_s']:,.0f} | {ratio} | {r['peak_device_gb']} | "
                f"{diff} | {text} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="gen,grpo,trl,memory", help="any of gen, grpo, trl, memory")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=64, help="gen: prompts")
    parser.add_argument("--grpo-prompts", type=int, default=8, help="grpo/trl: prompts per step")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="grpo steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--grpo-runs",
        default="adapter:16,adapter:64,merged:64",
        help="grpo: lora_sync:micro-batch pairs (train.per_device_batch_size; 16 = TRL's micro-batch here); "
        "more fields: :compile adds train.torch_compile, :overlap rollout.overlap, :padded rollout.packing off, "
        ":misN rollout.mismatch_every N, :tokN rollout.micro_batch_tokens N, :switchN Python's thread switch interval "
        "in microseconds (sys.setswitchinterval; 5000 by default), :fixedseg torch's fixed-size segments "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False; the online stages use expandable ones by default "
        "without sleep mode), :greenN rollout.overlap_update_sms N, :fp8 / :kvfp8 rollout.engine_args quantization / "
        "kv_cache_dtype fp8, :flex flex attention with packed "
        "updates, :varlen model.attn_implementation sdpa_varlen, :shared rollout.packing shared (with sdpa_varlen) "
        "(e.g. adapter:64:compile:overlap)",
    )
    parser.add_argument("--sleep-runs", default="adapter:64,merged:64", help="memory: the same, with sleep mode")
    parser.add_argument("--gpu-mem", type=float, default=0.3, help="vLLM gpu_memory_utilization (both)")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    parser.add_argument("--trl-no-gc", action="store_true", help="trl: also a run without gradient checkpointing")
    parser.add_argument(
        "--trl-runs",
        default="default",
        help="trl: TRL GRPOTrainer variants, comma-separated, each fields joined by ':' from nogc (no gradient "
        "checkpointing), microN (N completions per micro-batch, e.g. micro64; 16 without it), nois "
        "(vllm_importance_sampling_correction off), liger (use_liger_kernel), or default; the ratio is against the "
        "fastest",
    )
    parser.add_argument(
        "--gen-impls",
        default="vllm,hf",
        help="gen: backends to time: vllm, hf, vllm_mp (vLLM's engine core in its own process, as vLLM runs it "
        "by default; the product keeps it in process to reach its weights)",
    )
    parser.add_argument("--trl-variant", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default=None, help="grpo/memory: rollout backend (vllm; hf for CPU smoke)")
    parser.add_argument(
        "--gpus", type=int, default=1, help="grpo/trl: GPUs (data parallel, one colocated vLLM engine each)"
    )
    parser.add_argument("--out", default=None, help="append every result line (JSON) to this file")
    parser.add_argument("--make-model", default=None, help="only write a random model of --shape to this dir")
    parser.add_argument("--log", default=None, help="append every case's stdout/stderr to this file")
    parser.add_argument("--case-timeout", type=int, default=420, help="seconds before a case is killed")
    parser.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds for all cases together (0: none): each case gets what is left, up to --case-timeout, and a "
        "case with under 30 s left is skipped and reported; use it instead of an outer timeout, which loses the "
        "whole call",
    )
    parser.add_argument(
        "--var-lengths",
        default=None,
        metavar="LOW:HIGH",
        help="vLLM cases: each sample's max_tokens drawn from LOW..HIGH (e.g. 32:1024; --tokens must be >= HIGH), "
        "the same seeded draw for ours and TRL",
    )
    parser.add_argument("--length-seed", type=int, default=0, help="--var-lengths: the draw's seed")
    # internal: one case in a subprocess
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--sync", default="adapter", help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--sleep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--flex", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--varlen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shared", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fixedseg", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mismatch-every", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--micro-tokens", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--switch-us", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--update-sms", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fp8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kvfp8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument(
        "--trace-step",
        type=int,
        default=None,
        help="grpo runs: profile step N's update and/or step N+1's generation (--trace-phase; torch.profiler; "
        "summaries on stdout as TRACE lines, Chrome traces in --trace-dir)",
    )
    parser.add_argument("--trace-dir", default=None, help="--trace-step: where the traces go (default: a temp dir)")
    parser.add_argument("--trace-phase", default="update", choices=["update", "generate", "both"], help="--trace-step")
    args = parser.parse_args()
    if args.one:
        return run_one(args)
    if args.make_model:
        return print(make_model_dir(args.shape, Path(args.make_model)))
    model_dir = make_model_dir(args.shape, Path(tempfile.mkdtemp()) / "model")
    impl = args.impl or "vllm"
    runs = []
    cases = args.cases.split(",")
    # the side-by-side speed runs first: what a cut-off call still brings back
    trl_runs = [v for v in args.trl_runs.split(",") if v] + (["nogc"] if args.trl_no_gc else [])
    unknown = {f for v in trl_runs for f in v.split(":")} - {"default", "nogc", "nois", "liger"}
    unknown = {f for f in unknown if not re.fullmatch(r"micro[1-9][0-9]*", f)}
    if unknown:
        parser.error(f"unknown --trl-runs field(s) {sorted(unknown)}: use default, nogc, microN, nois, liger")
    if "trl" in cases:  # the first TRL variant first: what a cut-off call still brings back
        runs += [["--case", "trl", "--trl-variant", trl_runs[0]]]
    # "sync:micro" plus optional fields ":compile" (train.torch_compile) and ":overlap" (rollout.overlap)
    pairs = lambda text: [(p.split(":")[0], p.split(":")[1], p.split(":")[2:]) for p in text.split(",") if p]
    unknown = {e for text in (args.grpo_runs, args.sleep_runs) for _, _, extras in pairs(text) for e in extras}
    unknown = {e for e in unknown if not re.fullmatch(rf"({'|'.join(NUMBERED_FIELDS)})[1-9][0-9]*", e)}
    if unknown - RUN_FIELDS:
        parser.error(
            f"unknown run field(s) {sorted(unknown - RUN_FIELDS)}: use {sorted(RUN_FIELDS)}, misN, tokN or switchN"
        )
    flag = run_flags
    if "grpo" in cases:
        runs += [
            ["--case", "grpo", "--impl", impl, "--sync", s, "--micro", m, *flag(c)] for s, m, c in pairs(args.grpo_runs)
        ]
    if "trl" in cases:
        runs += [["--case", "trl", "--trl-variant", v] for v in trl_runs[1:]]
    if "memory" in cases:  # the same runs with sleep mode (sleep off: the grpo runs)
        runs += [
            ["--case", "memory", "--impl", impl, "--sync", s, "--micro", m, "--sleep", *flag(c)]
            for s, m, c in pairs(args.sleep_runs)
        ]
    if "gen" in cases:
        runs += [["--case", "gen", "--impl", i] for i in args.gen_impls.split(",")]
    keep = ("prompts", "grpo_prompts", "samples", "tokens", "steps", "warmup", "repeats", "gpu_mem", "gpus")
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keep]
    passthrough += [f"--trace-step={args.trace_step}"] if args.trace_step is not None else []
    passthrough += [f"--trace-dir={args.trace_dir}"] if args.trace_dir else []
    passthrough += [f"--trace-phase={args.trace_phase}"]
    passthrough += ["--eager"] if args.eager else []
    if args.var_lengths:
        high = int(args.var_lengths.split(":")[1])
        if args.tokens < high:
            parser.error(f"--var-lengths {args.var_lengths} needs --tokens >= {high} (the run's max_response_len)")
        passthrough += [f"--var-lengths={args.var_lengths}", f"--length-seed={args.length_seed}"]
    results, began = [], time.perf_counter()
    for extra in runs:
        limit = case_limit(args.case_timeout, args.budget, time.perf_counter() - began)
        if limit is None:
            results.append({"run": extra, "error": f"skipped: --budget {args.budget} s spent", "wall_s": 0.0})
            print(json.dumps(results[-1]), flush=True)
            continue
        cmd = [sys.executable, __file__, "--one", "--model-dir", str(model_dir), *passthrough, *extra]
        if "trl" in extra and args.gpus > 1:  # TRL's multi-GPU path: accelerate launch (DDP), bf16
            launch = ["-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={args.gpus}"]
            launch += ["--mixed_precision=bf16", f"--main_process_port={free_port()}"]  # side-by-side runs
            cmd = [sys.executable, *launch, *cmd[1:]]
        start = time.perf_counter()
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"} if "--fixedseg" in extra else None
        if "vllm_mp" in extra:  # apply_model's functions cross the process boundary pickled
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        stdout, stderr, code = run_case(cmd, limit, env)
        wall = round(time.perf_counter() - start, 1)
        if args.log:
            with open(args.log, "a") as f:
                f.write(f"===== {' '.join(extra)} ({wall} s, exit {code})\n{stdout}\n----- stderr\n{stderr}\n")
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            result = {"run": extra, "error": stderr[-2500:], "wall_s": wall}
            result.update(timed_out_steps(stdout, args.warmup) or {})
        else:  # a case that printed its result and then failed or hung on its way out still counts, marked
            result = {**json.loads(lines[-1].removeprefix("RESULT ")), "wall_s": wall}
            result.update({"exit_after_result": code, "stderr_tail": stderr[-600:]} if code != 0 else {})
        results.append(result)
        line = json.dumps(result)
        print(line if "error" not in result else line[-3000:], flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    print(table([r for r in results if "error" not in r]), flush=True)
    for r in results:
        if "partial_step_s" in r:  # stopped before its result: its steady steps so far, to size the next call
            print(
                f"stopped: {' '.join(r['run'])}: {r['partial_steps']} steps past the warmup, median "
                f"{r['partial_step_s']} s (intervals {r['intervals_s']})",
                flush=True,
            )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
