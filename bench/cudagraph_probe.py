"""Which training runs CUDA graphs survive (issue 15): the per-layer compile in torch.compile's reduce-overhead mode
(what ``train.cuda_graphs`` sets; here without the option, so that only the variant marks) on the bundled model's
sft LoRA, with and without gradient accumulation, on batches of varying widths (padded) or of one width (packed),
with three ways of starting a new generation of CUDA graph trees, and with graphs left out for dynamic-shape
recompiles.

    python bench/cudagraph_probe.py                      # on a GPU host: one PROBE line per run, then a table
    python bench/cudagraph_probe.py --variants 3-pad-micro,3-pad-window

A variant is ``<accum>-<pad|pack>-<mark>[-skipdyn]``: ``mark`` is ``none``, ``micro`` (torch.compiler.
cudagraph_mark_step_begin before each micro-batch) or ``window`` (before each optimizer step's first one);
``skipdyn`` sets inductor's ``cudagraph_skip_dynamic_graphs``. Each run is its own process (the trees are
process-wide) and is compared with the compiled run without graphs of the same accumulation and layout: it
passes when it finishes and its per-step losses match (float32, relative 1e-4). Why: a first attempt at a
``train.cuda_graphs`` option (docs/BENCHMARKS.md, seventeenth session) failed in a run with accumulation and
varying widths ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
Measured on an H200 (eighteenth session): ``none`` and ``micro`` fail with accumulation, packed or padded;
``window`` passes both with losses equal to the compiled run's, and is what ``train.cuda_graphs`` does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (
    "1-pack-none,1-pad-none,3-pack-none,3-pad-none,3-pad-micro,3-pad-window,3-pack-micro,3-pack-window,"
    "3-pad-window-skipdyn"
)


def worker(variant: str, out: Path) -> dict:
    """One sft LoRA run of the bundled model as the variant says (``compiled-<accum>-<layout>``: no graphs)."""
    import functools

    import torch

    from rlfactory.config.loader import validate_config
    from rlfactory.engine import offline, shared
    from rlfactory.engine.run_dir import read_log
    from rlfactory.stages import sft

    parts = variant.split("-")
    graphs = parts[0] != "compiled"
    accum, layout = (int(parts[0]), parts[1]) if graphs else (int(parts[1]), parts[2])
    mark = parts[2] if graphs else "none"
    if graphs:  # as train_bench.py's -cudagraphs lever
        from train_bench import _compile_layers_with_mode

        shared.compile_layers = functools.partial(_compile_layers_with_mode, mode="reduce-overhead")
    if "skipdyn" in parts:
        torch._inductor.config.triton.cudagraph_skip_dynamic_graphs = True
    if mark == "micro":  # the offline loop enters autocast_forward once per micro-batch, before its forward
        forward = offline.autocast_forward

        def marked(*args, **kwargs):
            torch.compiler.cudagraph_mark_step_begin()
            return forward(*args, **kwargs)

        offline.autocast_forward = marked
    elif mark == "window":
        window = offline._train_window

        @functools.wraps(window)
        def marked_window(*args, **kwargs):
            torch.compiler.cudagraph_mark_step_begin()
            return window(*args, **kwargs)

        offline._train_window = marked_window
    cfg = validate_config(
        {
            "stage": "sft",
            "output_dir": str(out),
            "model": {"name_or_path": str(ROOT / "data" / "models" / "tiny-arith"), "finetuning": "lora"},
            "lora": {"r": 8, "alpha": 16},
            "data": {
                "dataset": "arith_sft",
                "dataset_dir": str(ROOT / "data"),
                "max_samples": 400,
                "shuffle": False,
                "packing": layout == "pack",
                "cutoff_len": 256,
            },
            "train": {
                "max_steps": 8,
                "per_device_batch_size": 8,
                "grad_accum_steps": accum,
                "learning_rate": 2e-3,
                "lr_scheduler": "constant",
                "mixed_precision": "no",
                "torch_compile": True,
            },
            "logging": {"progress_bar": False, "plot_loss": False},
        },
        "probe",
    )
    started = time.perf_counter()
    try:
        sft.run(cfg)
    except Exception as error:  # noqa: BLE001 (the probe reports any failure as its result)
        return {"variant": variant, "error": f"{type(error).__name__}: {str(error)[:400]}"}
    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    return {"variant": variant, "losses": losses, "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as out:
            print("PROBE " + json.dumps(worker(args.worker, Path(out) / "run")), flush=True)
        return
    variants = args.variants.split(",")
    references = sorted({"compiled-" + "-".join(v.split("-")[:2]) for v in variants})
    results: dict[str, dict] = {}
    for variant in references + variants:
        command = [sys.executable, __file__, "--worker", variant]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
            results[variant] = json.loads(lines[-1][6:]) if lines else {"variant": variant, "error": done.stderr[-400:]}
        except subprocess.TimeoutExpired:
            results[variant] = {"variant": variant, "error": f"no result in {args.timeout} s"}
        print("PROBE " + json.dumps(results[variant]), flush=True)
    print("\n| variant | result | max relative loss difference to the compiled run | seconds |\n|---|---|---|---|")
    for variant in variants:
        result, reference = results[variant], results["compiled-" + "-".join(variant.split("-")[:2])]
        if "error" in result or "error" in reference:
            print(f"| {variant} | failed: {result.get('error') or 'reference ' + reference['error']} | - | - |")
            continue
        pairs = list(zip(result["losses"], reference["losses"], strict=False))
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else float("nan")
        same = len(result["losses"]) == len(reference["losses"]) and worst <= 1e-4
        print(f"| {variant} | {'pass' if same else 'losses differ'} | {worst:.1e} | {result['seconds']} |")


if __name__ == "__main__":
    main()
