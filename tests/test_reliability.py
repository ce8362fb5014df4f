"""Runs that meet failing user code, divergence, signals, kills and crash leftovers: they finish or stop cleanly with
the reason logged, save nothing non-finite, and resume to the uninterrupted run's numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import DATA_DIR, ROOT, TINY_MODEL, run_cli, write_yaml

from rlfactory.engine.run_dir import checkpoint_problem, list_checkpoints, read_log

pytestmark = pytest.mark.slow  # end-to-end runs of the CLI

# float32 sums over ~1e3 tokens: a relative error up to ~1e3 x eps (1.2e-7) is rounding, not a different run
F32_TOL = 1e3 * 1.1920929e-07


def grpo(tmp_path: Path, **train) -> dict:
    """A short grpo run without evaluation (fast), a step per log line."""
    return {
        "stage": "grpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
        "rollout": {"prompts_per_step": 4, "num_samples": 2, "max_response_len": 16},
        "reward": {"functions": {"answer_match": 1.0, "format_regex": 0.5}},
        "train": {"max_steps": 3, "per_device_batch_size": 8, "learning_rate": 1e-4, **train},
        "logging": {"progress_bar": False, "rollout_trace_steps": None, "plot_loss": False},
    }


def sft(tmp_path: Path, **train) -> dict:
    return {
        "stage": "sft",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "arith_sft", "dataset_dir": str(DATA_DIR), "max_samples": 64, "cutoff_len": 128,
                 "shuffle": True},
        "train": {"max_steps": 4, "per_device_batch_size": 4, "learning_rate": 1e-3, **train},
        "logging": {"progress_bar": False, "plot_loss": False},
    }  # fmt: skip


def model_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.safetensors")) + sorted(p.name for p in out.glob("adapter_*"))


# --------------------------------------------------------------------------------------------- user code in a run
REWARDS = """
import math, random, sys, time
def flaky(prompt, completion, answer, example):
    if len(completion) % 2:
        raise ValueError("odd completion")
    return 1.0
def spin(prompt, completion, answer, example):
    while True:
        pass
def nan(prompt, completion, answer, example):
    return math.nan
def leave(prompt, completion, answer, example):
    print("bye")
    sys.exit(4)
def always(prompt, completion, answer, example):
    raise KeyError("no such column")
"""


def test_a_run_with_raising_hanging_nan_and_exiting_rewards_finishes_and_logs_each(tmp_path: Path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    cfg = grpo(tmp_path, max_steps=2)
    cfg["reward"] = {
        "functions": {"answer_match": 1.0, **{f"{rewards}:{n}": 0.5 for n in ("flaky", "spin", "nan", "leave")}},
        "timeout_s": 1.0,
    }
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_log(tmp_path / "out") if "score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert record["reward/spin/failures"] == record["reward/nan/failures"] == record["reward/leave/failures"] == 8
        assert record["reward/answer_match/failures"] == 0
        assert all(v == v for v in record.values())  # no NaN reached the scores
    assert "reward 'spin' failed on 8/8 samples (first: timed out after 1s" in result.stderr
    assert "reward 'leave' failed on 8/8 samples (first: SystemExit: 4)" in result.stderr
    assert "reward 'nan' failed on 8/8 samples (first: returned nan" in result.stderr
    assert "bye" not in result.stdout
    assert model_files(tmp_path / "out")


def test_a_reward_failing_in_a_row_stops_the_run_with_a_checkpoint_and_its_error(tmp_path: Path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    cfg = grpo(tmp_path, max_steps=4)
    cfg["reward"] = {"functions": {"answer_match": 1.0, f"{rewards}:always": 1.0}, "max_failures_in_a_row": 16}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (
        "stopped: reward function 'always' failed 16 calls in a row (reward.max_failures_in_a_row: 16), the last: "
        "KeyError: 'no such column'" in result.stderr
    )
    out = tmp_path / "out"
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"] and not model_files(out)
    assert [r["reward/always/failures"] for r in read_log(out) if "score/mean" in r] == [8, 8]


# --------------------------------------------------------------------------------------------------- divergence
def test_a_diverging_sft_run_stops_saves_no_model_and_a_rerun_is_not_blocked(tmp_path: Path):
    path = write_yaml(tmp_path / "run.yaml", sft(tmp_path, learning_rate=1e30))
    result = run_cli("train", str(path))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "stopped: training diverged at step 2: loss nan" in result.stderr
    assert "Lower train.learning_rate (now 1e+30)" in result.stderr
    out = tmp_path / "out"
    assert not model_files(out) and not (out / "run_summary.json").exists()
    # it saved nothing to continue from: the same command starts again (and stops again), never "already holds a run"
    again = run_cli("train", str(path))
    assert again.returncode == 1 and "training diverged at step 2" in again.stderr, again.stderr[-2000:]


def test_skipping_non_finite_steps_logs_them_then_stops(tmp_path: Path):
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", sft(tmp_path, learning_rate=1e30, max_steps=8,
                                                                            skip_nonfinite_steps=2))))  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "update skipped (1 in a row, train.skip_nonfinite_steps 2)" in result.stderr
    assert "stopped: training diverged at step 4" in result.stderr  # steps 2 and 3 skipped, the third in a row stops
    records = read_log(tmp_path / "out")
    log = [r for r in records if "health" not in r]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert log[1]["skipped_steps"] == log[2]["skipped_steps"] == 1.0
    assert log[1]["loss"] != log[1]["loss"]  # NaN is logged, not dropped
    # health alerts: the first skipped update (rule non_finite, once), and the guard's stop
    alerts = [(r["step"], r["health"]["rule"], r["health"]["action"], r["health"]["metric"]) for r in records
              if "health" in r]  # fmt: skip
    assert alerts == [(2, "non_finite", "warn", "skipped_steps"), (4, "non_finite", "stop", "loss")]
    assert "health: non_finite at step 2: 1 update(s) skipped" in result.stderr


def _fused_adamw(model, lr, train):
    """The engine's AdamW (its groups and settings) as torch's fused kernel, as on CUDA, here on the CPU."""
    import torch

    from rlfactory.engine import shared

    groups = [
        {**group, "fused": True, "foreach": None} for group in shared.make_optimizer(model, lr, train).param_groups
    ]
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def test_the_fused_optimizer_skips_non_finite_updates_itself_and_the_run_ends_alike(tmp_path: Path, monkeypatch):
    """Under a fused AdamW (CUDA's) a non-finite update is skipped by the optimizer on the device and the host counts
    it a step later (NonFiniteGuard.step_on_device, settle): the same log lines, skips, alerts and stop as the
    host check's run of the test above, and the same losses (CPU, fused AdamW against the foreach one)."""
    import math

    from rlfactory.config.loader import validate_config
    from rlfactory.engine import offline
    from rlfactory.engine.shared import NonFiniteGuard
    from rlfactory.errors import RunStopped
    from rlfactory.stages import sft as sft_stage

    on_device = []
    step_on_device = NonFiniteGuard.step_on_device
    monkeypatch.setattr(
        NonFiniteGuard,
        "step_on_device",
        lambda self, step, *a: (on_device.append(step), step_on_device(self, step, *a)),
    )
    runs = {}
    for fused in (False, True):
        cfg = sft(tmp_path, learning_rate=1e30, max_steps=8, skip_nonfinite_steps=2)
        cfg["output_dir"] = str(tmp_path / f"fused{fused}")
        with monkeypatch.context() as patch:
            if fused:
                patch.setattr(offline, "make_optimizer", _fused_adamw)
            with pytest.raises(RunStopped) as stop:
                sft_stage.run(validate_config(cfg, "test"))
        runs[fused] = str(stop.value), read_log(tmp_path / f"fused{fused}")
    # only the fused run's steps, each decided on the device; its host learns of step 4's third skip in a row once
    # step 5 is queued (that step's update may apply: the run stops without saving either way)
    assert on_device == [1, 2, 3, 4, 5]
    (host_stop, host_log), (device_stop, device_log) = runs[False], runs[True]
    assert "training diverged at step 4" in host_stop and device_stop == host_stop
    drop = ("elapsed_s", "eta_s", "tokens_per_s", "loss", "grad_norm", "lr")
    assert [{k: v for k, v in r.items() if k not in drop} for r in device_log] == [
        {k: v for k, v in r.items() if k not in drop} for r in host_log
    ]
    for fused_record, host_record in zip(device_log, host_log, strict=True):
        for key in ("loss", "grad_norm"):
            if key in host_record:
                a, b = fused_record[key], host_record[key]
                assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5), (key, a, b)


def test_a_fused_optimizer_run_writes_its_lines_a_step_late_with_the_same_values(tmp_path: Path, monkeypatch):
    """Under a fused AdamW the loop writes each step's line once the next step is queued (the host reads the values
    without waiting for the GPU): the same lines in the same order, evaluations and a checkpoint between them, as the
    run that writes each line at once; losses equal within the two AdamW kernels' rounding."""
    import math

    from rlfactory.config.loader import validate_config
    from rlfactory.engine import offline
    from rlfactory.stages import sft as sft_stage

    logs = {}
    for fused in (False, True):
        cfg = sft(tmp_path, max_steps=5, eval_steps=2, save_steps=3)
        cfg["data"]["eval_split"] = 0.2
        cfg["output_dir"] = str(tmp_path / f"fused{fused}")
        with monkeypatch.context() as patch:
            if fused:
                patch.setattr(offline, "make_optimizer", _fused_adamw)
            sft_stage.run(validate_config(cfg, "test"))
        logs[fused] = read_log(tmp_path / f"fused{fused}")
        assert list_checkpoints(tmp_path / f"fused{fused}")[-1].name.endswith("3")
    host, device = logs[False], logs[True]
    times = ("elapsed_s", "eta_s", "tokens_per_s")
    assert [sorted(set(r) - set(times)) for r in device] == [sorted(set(r) - set(times)) for r in host]
    assert [(r["step"], "eval_loss" in r) for r in device] == [(0, True), (1, False), (2, False), (2, True),
                                                                (3, False), (4, False), (4, True), (5, False),
                                                                (5, True)]  # fmt: skip
    for d, h in zip(device, host, strict=True):
        for key in set(h) - set(times):
            assert not isinstance(h[key], float) or math.isclose(d[key], h[key], rel_tol=1e-4), (key, d, h)


def test_an_infinite_learning_rate_never_saves_a_nan_model(tmp_path: Path):
    """`.inf` is refused as a config error; a finite but absurd rate diverges and stops without a model."""
    result = run_cli("train", str(write_yaml(tmp_path / "inf.yaml", sft(tmp_path, learning_rate=float("inf"),
                                                                            max_steps=1))))  # fmt: skip
    assert result.returncode == 2 and "train.learning_rate" in result.stderr and "finite" in result.stderr
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", sft(tmp_path, learning_rate=1e30, max_steps=4,
                                                                            max_grad_norm=None))))  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "stopped:" in result.stderr and "Traceback" not in result.stderr
    assert not model_files(tmp_path / "out")


def test_a_diverging_grpo_run_stops_without_a_model(tmp_path: Path):
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", grpo(tmp_path, learning_rate=1e30,
                                                                            max_grad_norm=None))))  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "stopped: training diverged at step" in result.stderr and "Traceback" not in result.stderr
    assert not model_files(tmp_path / "out")
    stop = read_log(tmp_path / "out")[-1]["health"]  # the stop is an alert in the log too (the WebUI's alerts)
    assert stop["rule"] == "non_finite" and stop["action"] == "stop" and "training diverged" in stop["message"]


# ------------------------------------------------------------------------------------------- crash leftovers
def test_resume_tolerates_crash_leftovers(tmp_path: Path):
    """A torn last log line, an empty trainer_state.json and a missing optimizer.bin: `auto` takes the newest
    complete checkpoint; naming a broken one is a clear error."""
    cfg = sft(tmp_path, max_steps=4, save_steps=1, save_total_limit=None)
    path = write_yaml(tmp_path / "run.yaml", cfg)
    reference = run_cli("train", str(path), f"output_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert run_cli("train", str(path), "train.max_steps=4").returncode == 0
    out = tmp_path / "out"
    for name in ("model.safetensors", "run_summary.json"):
        (out / name).unlink()  # as if killed at step 4, before the final save
    (out / "checkpoint-3" / "optimizer.bin").unlink()
    (out / "checkpoint-2" / "trainer_state.json").write_text("")
    with open(out / "trainer_log.jsonl", "a") as log:
        log.write('{"step": 4, "loss": 0.12')  # torn by the kill
    assert checkpoint_problem(out / "checkpoint-3") == "optimizer.bin is missing"
    assert checkpoint_problem(out / "checkpoint-2") == "trainer_state.json is unreadable (JSONDecodeError)"

    named = run_cli("train", str(path), f"resume_from_checkpoint={out / 'checkpoint-3'}")
    assert named.returncode == 2 and "Traceback" not in named.stderr
    assert "is not a complete checkpoint (optimizer.bin is missing)" in named.stderr

    resumed = run_cli("train", str(path), "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in resumed.stdout
    losses = {r["step"]: r["loss"] for r in read_log(out) if "loss" in r}
    ref = {r["step"]: r["loss"] for r in read_log(tmp_path / "ref") if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]
    assert losses == pytest.approx(ref, rel=F32_TOL)


def test_a_pipeline_rerun_with_resume_skips_the_finished_stage(tmp_path: Path):
    stage = sft(tmp_path, max_steps=2)
    defaults = {k: stage[k] for k in ("data", "logging")}
    pipeline = {
        "output_dir": str(tmp_path / "pipe"),
        "defaults": defaults,
        "stages": [
            {"stage": "sft", "name": "first", "model": stage["model"], "train": stage["train"]},
            {"stage": "sft", "name": "second", "model": {"from_stage": "first", "finetuning": "full"},
             "train": {**stage["train"], "learning_rate": 1e30}},
        ],
    }  # fmt: skip
    failed = run_cli("train", str(write_yaml(tmp_path / "pipe.yaml", pipeline)))
    assert failed.returncode == 1 and "training diverged" in failed.stderr, failed.stderr[-2000:]
    first_model = (tmp_path / "pipe" / "first" / "model.safetensors").stat().st_mtime_ns
    pipeline["stages"][1]["train"]["learning_rate"] = 1e-4
    rerun = run_cli("train", str(write_yaml(tmp_path / "pipe.yaml", pipeline)), "resume_from_checkpoint=auto")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"already finished ({tmp_path / 'pipe' / 'first' / 'run_summary.json'}): skipped" in rerun.stdout
    assert (tmp_path / "pipe" / "first" / "model.safetensors").stat().st_mtime_ns == first_model
    assert json.loads((tmp_path / "pipe" / "second" / "run_summary.json").read_text())["global_step"] == 2


# ------------------------------------------------------------------------------------ kills, signals and resume
def _start(path: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "rlfactory", "train", str(path), *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _logged_steps(out: Path) -> int:
    try:
        return max((r["step"] for r in read_log(out) if "loss" in r), default=0)
    except Exception:  # noqa: BLE001 - a line being written
        return 0


def _wait(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, f"the run ended before the interruption: {proc.communicate()[1][-2000:]}"


def _signal_after(path: Path, out: Path, step: int, signum: int, *overrides: str) -> tuple[int, str]:
    """Start (or resume) the run, send ``signum`` once ``step`` is logged; its exit code and stderr."""
    proc = _start(path, *overrides)
    _wait(proc, lambda: _logged_steps(out) >= step)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def _kill_while_writing_a_checkpoint(path: Path, out: Path, *overrides: str) -> str:
    """SIGKILL the moment a checkpoint-N.partial folder appears (save_steps: 1 gives a chance each step)."""
    proc = _start(path, *overrides)
    _wait(proc, lambda: any(out.glob("checkpoint-*.partial")))
    proc.kill()
    proc.communicate()
    [partial] = out.glob("checkpoint-*.partial")
    return partial.name


def _interrupt_and_resume_four_ways(path: Path, out: Path) -> list[str]:
    """SIGTERM, SIGINT, SIGKILL during a step, SIGKILL while writing a checkpoint, each followed by a resume."""
    seen = []
    code, err = _signal_after(path, out, 1, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
    assert "stopped: SIGTERM at step" in err and "continue with resume_from_checkpoint=auto" in err
    seen.append(err.strip().splitlines()[-1])
    code, err = _signal_after(path, out, _logged_steps(out) + 1, signal.SIGINT, "resume_from_checkpoint=auto")
    assert code == 128 + signal.SIGINT and "stopped: SIGINT at step" in err, err[-2000:]
    seen.append(err.strip().splitlines()[-1])
    proc = _start(path, "resume_from_checkpoint=auto")
    _wait(proc, lambda: _logged_steps(out) >= len(seen) + 2)  # mid-run, after a step beyond the last checkpoint
    proc.kill()
    proc.communicate()
    seen.append(_kill_while_writing_a_checkpoint(path, out, "resume_from_checkpoint=auto"))
    resumed = run_cli("train", str(path), "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list(out.glob("checkpoint-*.partial"))
    return seen


def _same_steps(out: Path, ref: Path, keys: tuple[str, ...]) -> None:
    got = {r["step"]: r for r in read_log(out) if "loss" in r}
    want = {r["step"]: r for r in read_log(ref) if "loss" in r}
    assert sorted(got) == sorted(want)  # no step lost or logged twice
    for step, record in want.items():
        for key in keys:
            assert got[step][key] == pytest.approx(record[key], rel=F32_TOL, abs=1e-6), (step, key)


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_sigterm_sigint_and_sigkill_in_a_step_or_a_checkpoint_write_resume_to_the_uninterrupted_run(
    tmp_path: Path, stage: str
):
    # no periodic checkpoint but every step's (save_steps 1) for the checkpoint-write kill; 8 steps, 1 per log line
    cfg = sft(tmp_path, max_steps=8) if stage == "sft" else grpo(tmp_path, max_steps=8)
    cfg["train"].update(save_steps=1, save_total_limit=2)
    path = write_yaml(tmp_path / "run.yaml", cfg)
    reference = run_cli("train", str(path), f"output_dir={tmp_path / 'ref'}")
    assert reference.returncode == 0, reference.stderr[-2000:]
    seen = _interrupt_and_resume_four_ways(path, tmp_path / "out")
    assert seen[2].endswith(".partial")
    rl_keys = ("score/mean", "actor/entropy", "actor/grad_norm", "actor/pg_loss")
    keys = ("loss", "grad_norm") if stage == "sft" else rl_keys
    _same_steps(tmp_path / "out", tmp_path / "ref", keys)
