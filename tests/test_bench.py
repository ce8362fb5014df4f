"""The benches' own plumbing that runs before any GPU does (the benches themselves run on the GPU machine): a case
past its timeout is reported, not a crash; the variable-length variant's requests and draw; the training bench's
own cases on the tiny shape."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace

import pytest
from tests.conftest import ROOT

from rlfactory.config.online_schema import RolloutConfig


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # rollout_bench imports train_bench as the bench scripts do
    try:
        import rollout_bench

        yield rollout_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_a_case_past_its_timeout_is_reported_with_its_output(bench):
    """subprocess hands a timed-out child's output back as bytes even with text=True (the crash was
    ``TypeError: can't concat str to bytes``): it comes back as text, with exit -9 and TIMEOUT."""
    child = "import sys, time; print('RESULT partial', flush=True); print('warn', file=sys.stderr, flush=True); "
    child += "time.sleep(30)"
    stdout, stderr, code = bench.run_case([sys.executable, "-c", child], timeout=3)
    assert (stdout, code) == ("RESULT partial\n", -9)
    assert stderr.startswith("warn") and stderr.endswith("\nTIMEOUT")
    silent = bench.run_case([sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
    assert silent == ("", "\nTIMEOUT", -9)
    assert bench.run_case([sys.executable, "-c", "print('ok')"], timeout=30) == ("ok\n", "", 0)


def test_a_case_stopped_at_its_timeout_keeps_the_steps_it_measured(bench, capsys):
    """The step clock prints one line per step, so a case stopped by its timeout still tells the steady step time it
    had reached (the median past the warmup), or nothing when it never got past the warmup."""
    clock = bench.StepClock()
    clock.start()
    for _ in range(4):
        clock.tick()
    printed = capsys.readouterr().out
    assert [line.split()[:2] for line in printed.splitlines()] == [["STEP", str(i)] for i in range(1, 5)]
    stdout = "noise\nSTEP 1 9.0\nSTEP 2 3.0\nwarn\nSTEP 3 2.5\nSTEP 4 2.7\nSTEP 5 2.6\n"
    assert bench.timed_out_steps(stdout, warmup=2) == {
        "partial_steps": 3,
        "partial_step_s": 2.6,
        "intervals_s": [9.0, 3.0, 2.5, 2.7, 2.6],
    }
    assert bench.timed_out_steps("STEP 1 9.0\nSTEP 2 3.0\n", warmup=2) is None
    assert bench.timed_out_steps("", warmup=0) is None


def test_a_budget_cuts_the_last_cases_instead_of_the_whole_call(bench):
    assert bench.case_limit(150, budget=0, elapsed=900) == 150  # no budget: every case its own timeout
    assert bench.case_limit(150, budget=500, elapsed=100) == 150
    assert bench.case_limit(150, budget=500, elapsed=400) == 100  # what is left of the budget
    assert bench.case_limit(150, budget=500, elapsed=480) is None  # under 30 s left: skipped, and reported


@dataclass
class Params:  # the two fields of vllm.SamplingParams the variant touches, and its clone()
    n: int
    max_tokens: int

    def clone(self):
        return replace(self)


@dataclass
class Sample:
    text: str
    index: int = 0


@dataclass
class Output:
    outputs: list = field(default_factory=list)


def test_run_fields_become_the_cases_flags(bench):
    assert bench.run_flags(["compile", "mis8", "tok16384", "switch500", "overlap"]) == [
        "--compile", "--mismatch-every=8", "--micro-tokens=16384", "--switch-us=500", "--overlap"
    ]  # fmt: skip
    assert bench.run_flags(["fp8", "kvfp8"]) == ["--fp8", "--kvfp8"]
    assert bench.run_flags(["green100"]) == ["--update-sms=100"]
    assert {"fp8", "kvfp8", "overlap", "compile"} <= bench.RUN_FIELDS  # what --grpo-runs accepts
    fp8 = bench.engine_args(argparse.Namespace(fp8=True, kvfp8=False))
    assert fp8 == {"quantization": "fp8"} and bench.engine_args(argparse.Namespace()) == {}
    rollout = RolloutConfig(backend="vllm", engine_args=bench.engine_args(argparse.Namespace(fp8=True, kvfp8=True)))
    assert rollout.engine_args == {"quantization": "fp8", "kv_cache_dtype": "fp8"}  # the schema takes them
    assert bench.trl_micro({"nogc", "micro4"}, 64) == 4
    assert bench.trl_micro({"nois"}, 64) == 16  # TRL's micro-batch without the field
    assert bench.trl_micro({"micro64"}, 32) == 32  # never more than a step's completions


def test_variable_lengths_one_draw_per_sample_in_order_for_both_sides(bench):
    """Ours asks for a group as one request of n samples, TRL for n requests of one sample: both become the same
    requests with the same drawn budgets, and ours gets its groups back in order."""
    ours = bench.expand_requests(["a", "b"], [Params(3, 1024), Params(3, 1024)], bench.draw_max_tokens(32, 1024, 0))
    trl = bench.expand_requests(list("aaabbb"), [Params(1, 1024)] * 6, bench.draw_max_tokens(32, 1024, 0))
    assert ours[0] == trl[0] == list("aaabbb") and ours[2] == [3, 3] and trl[2] == [1] * 6
    budgets = [p.max_tokens for p in ours[1]]
    assert budgets == [p.max_tokens for p in trl[1]] and all(p.n == 1 for p in ours[1])
    assert all(32 <= b <= 1024 for b in budgets) and len(set(budgets)) == 6
    outputs = [Output([Sample(f"{p}{i}")]) for i, p in enumerate(ours[0])]
    merged = bench.merge_outputs(outputs, ours[2])
    assert [[(s.text, s.index) for s in out.outputs] for out in merged] == [
        [("a0", 0), ("a1", 1), ("a2", 2)],
        [("b3", 0), ("b4", 1), ("b5", 2)],
    ]


@pytest.mark.parametrize(("case", "trl"), [("sft_lora", "trl_wrapped"), ("dpo_lora", "trl")])
def test_train_bench_runs_our_cases_and_trls_on_the_tiny_shape_with_the_same_losses(case, trl):
    """The training bench's own path through our stages and TRL's trainers, on CPU with the tiny shape (a GPU call
    once found the dpo case broken by a changed signature, after the machine had started). Both sides start from the
    same weights and see the same data in the same order, so their first losses agree (float32 on CPU, printed to 5
    decimals: 2e-5 allows one rounding step each way); the GPU tables' ratios rest on that."""
    import json
    import os
    import subprocess

    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_bench.py"), "--cases", case, "--impls", f"ours,{trl}",
         "--shape", "tiny", "--batch", "2", "--seq", "64", "--steps", "2", "--warmup", "1", "--lr", "1e-3"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [(r["case"], r["impl"], r["timed_steps"]) for r in results] == [(case, "ours", 2), (case, trl, 2)], (
        run.stdout[-2000:] + run.stderr[-2000:]
    )
    ours, theirs = results
    assert ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0 and len(ours["losses"]) == 3
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=2e-5)
    assert len(set(ours["losses"])) > 1  # the steps trained: not the same number three times


def test_step_trace_summary_finds_the_idle_gpu_and_what_launched_after_it(tmp_path):
    """``bench/step_trace.py`` read the fourteenth session's traces: the GPU's busy share, its waits on the host and,
    for the longest idle stretch, the host operation that launched the next kernel (there: PEFT's adapter switch)."""
    import gzip
    import json

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import step_trace
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts,
            "dur": 5,
            "tid": 1,
            "args": {"correlation": corr},
        }

    events = [
        kernel("gemm", 0, 400, 1),
        launch(0, 1),
        kernel("ncclDevKernel_AllReduce", 400, 100, 2),
        launch(10, 2),
        {"ph": "X", "cat": "cpu_op", "name": "aten::zeros_like", "ts": 1990, "dur": 20, "tid": 1},
        kernel("fill", 2000, 500, 3),
        launch(2000, 3),  # 1.5 ms idle before it
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 2100, "dur": 400, "tid": 1},
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    lines = step_trace.summarize(path).splitlines()
    assert lines[0] == "wall 2.5 ms, GPU busy 1.0 ms (40%), 3 kernels, collectives 0.1 ms in 1 kernels"
    assert lines[1].startswith("host waits for the GPU: 0.4 ms in 1 calls")
    assert lines[2] == "GPU idle stretches > 0.1 ms: 1, 1.5 ms in all"
    assert "1.50 ms at +0.5 ms, before fill (launched in: aten::zeros_like)" in lines[3]
