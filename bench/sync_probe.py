"""Where an offline training step still makes the host wait for the GPU (issue 15): the bundled model's sft on a
GPU, with torch's CUDA sync debug mode on from the third optimizer step, every synchronizing call counted by the
line of our code (or the library's) that made it.

    python bench/sync_probe.py                    # on a GPU host: a table of call sites and how often per step
    python bench/sync_probe.py --stage dpo --finetuning lora
    python bench/sync_probe.py --compile --packing  # tests/gpu/test_gpu_host_syncs.py holds this one at zero

Why: under the fused AdamW the loop reads its check and log values a step late (``engine/host_reads.py``), so a
steady-state step should make no synchronizing call; any that is left shows here with its place.
"""

from __future__ import annotations

import argparse
import collections
import functools
import tempfile
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILING = "[while compiling] "  # the prefix of a site reached from inductor's compile_fx


def probe_config(stage: str, finetuning: str, steps: int, compiled: bool, packing: bool, out: str) -> dict:
    """The bundled model's run of ``stage`` on its arithmetic data (bf16 on a GPU)."""
    import torch

    gpu = torch.cuda.is_available()
    return {
        "stage": stage,
        "output_dir": out,
        "model": {"name_or_path": str(ROOT / "data" / "models" / "tiny-arith"), "finetuning": finetuning},
        "data": {
            "dataset": "arith_sft" if stage == "sft" else "arith_pref",
            "dataset_dir": str(ROOT / "data"),
            "max_samples": 400,
            "cutoff_len": 256,
            **({"packing": True} if packing else {}),
        },
        "train": {
            "max_steps": steps,
            "per_device_batch_size": 8,
            "mixed_precision": "bf16" if gpu else "no",
            "torch_compile": compiled,
        },
        "logging": {"progress_bar": False, "plot_loss": False},
    }


def count_syncs(raw: dict, first_step: int = 3) -> tuple[collections.Counter[str], int]:
    """Run ``raw`` (an offline stage's config) with torch's CUDA sync debug mode on from optimizer step
    ``first_step``: the synchronizing calls by site ("file:line (our function) <- the call"), and the steps watched.
    Without a GPU the run goes through and counts nothing."""
    import torch

    from rlfactory.config.loader import validate_config
    from rlfactory.engine import offline
    from rlfactory.stages import dpo, rm, sft

    gpu = torch.cuda.is_available()
    sites: collections.Counter[str] = collections.Counter()
    steps_watched = 0
    window = offline._train_window

    @functools.wraps(window)
    def watched(s, cfg, parts, batches, meter, guard, step):
        nonlocal steps_watched
        if step >= first_step and gpu:  # past compilation and the first log line
            torch.cuda.set_sync_debug_mode("warn")
            steps_watched += 1
        return window(s, cfg, parts, batches, meter, guard, step)

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
        ours = [f for f in frames if "/rlfactory/" in f.filename] or frames
        # inductor compiling a graph (a new width's one recompile under dynamic shapes) reads constants on the
        # host as it folds them: a wait once per compile, not per step, so it is counted apart
        compiling = any(f.filename.endswith("_inductor/compile_fx.py") for f in frames)
        site = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} ({ours[-1].name}) <- {frames[-1].name}"
        sites[COMPILING + site if compiling else site] += 1

    shown = warnings.showwarning
    offline._train_window, warnings.showwarning = watched, record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            {"sft": sft, "dpo": dpo, "rm": rm}[raw["stage"]].run(validate_config(raw, "probe"))
    finally:
        offline._train_window, warnings.showwarning = window, shown
        if gpu:
            torch.cuda.set_sync_debug_mode(0)
    return sites, steps_watched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", default="sft", choices=["sft", "dpo", "rm"])
    parser.add_argument("--finetuning", default="full", choices=["full", "lora"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="train.torch_compile")
    parser.add_argument("--packing", action="store_true", help="data.packing (sft: no padding, no padding mask)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        raw = probe_config(args.stage, args.finetuning, args.steps, args.compile, args.packing, out)
        sites, steps_watched = count_syncs(raw)
    print(f"\n{sum(sites.values())} synchronizing calls in {steps_watched} watched steps (and the run's end)")
    print("| calls | per step | where (our frame <- the call) |\n|---|---|---|")
    for site, count in sites.most_common():
        print(f"| {count} | {count / max(steps_watched, 1):.2f} | {site} |")


if __name__ == "__main__":
    main()
