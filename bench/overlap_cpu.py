"""What rollout.overlap saves per step: the same grpo run with overlap off and on, alternated, on the bundled model.

    python bench/overlap_cpu.py [--steps 8] [--repeats 2] [--out /tmp/overlap-bench]

Each run is ``rlfactory train`` in a subprocess (8 prompts x 8 samples, responses up to 48 tokens, full fine-tuning,
two mini-batches, no evaluation); the report is the mean ``timing_s/step`` over steps 2..N (step 1 has nothing to
overlap with), with ``timing_s/gen`` (what the step waited for generation) and ``timing_s/gen_overlapped`` (the
generation that ran behind the previous update). Off and on alternate so that a machine's load drifts over both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def config(out: Path, overlap: bool, steps: int) -> dict:
    return {
        "stage": "grpo",
        "output_dir": str(out),
        "model": {"name_or_path": str(ROOT / "data" / "models" / "tiny-arith"), "finetuning": "full"},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(ROOT / "data")},
        "rollout": {"prompts_per_step": 8, "num_samples": 8, "max_response_len": 48, "overlap": overlap},
        "reward": {"functions": {"answer_match": 1.0, "format_regex": 0.5}},
        "algorithm": {"num_mini_batches": 2},
        "train": {"max_steps": steps, "per_device_batch_size": 32, "learning_rate": 5e-5, "save_steps": None},
        "logging": {"progress_bar": False, "plot_loss": False, "rollout_trace_steps": None},
    }


def one_run(folder: Path, overlap: bool, steps: int) -> dict[str, float]:
    out = folder / ("on" if overlap else "off")
    shutil.rmtree(out, ignore_errors=True)
    path = folder / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config(out, overlap, steps)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-m", "rlfactory", "train", str(path)], check=True, env=env)
    rows = [json.loads(line) for line in (out / "trainer_log.jsonl").open()]
    steps_after_first = [r for r in rows if "timing_s/step" in r and r["step"] > 1]
    mean = lambda key: sum(r.get(key, 0.0) for r in steps_after_first) / len(steps_after_first)
    keys = ("timing_s/step", "timing_s/gen", "timing_s/gen_overlapped", "timing_s/update_actor")
    return {key: mean(key) for key in keys} | {"score/mean": mean("score/mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/overlap-bench"))
    args = parser.parse_args()
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for repeat in range(args.repeats):
        for overlap in (False, True):
            folder = args.out / f"r{repeat}"
            folder.mkdir(parents=True, exist_ok=True)
            results[overlap].append(one_run(folder, overlap, args.steps))
            print(f"repeat {repeat} overlap {overlap}: {results[overlap][-1]}", flush=True)
    for overlap, runs in results.items():
        step = [r["timing_s/step"] for r in runs]
        print(f"overlap {'on ' if overlap else 'off'}: s/step (steps 2-{args.steps}) per repeat {step}")
    off = sum(r["timing_s/step"] for r in results[False]) / args.repeats
    on = sum(r["timing_s/step"] for r in results[True]) / args.repeats
    print(f"mean s/step off {off:.3f}, on {on:.3f}: on / off = {on / off:.3f}")


if __name__ == "__main__":
    main()
