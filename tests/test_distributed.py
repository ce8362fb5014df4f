"""Several processes on CPU (gloo): the same global batch gives the same run on 1 and 2 processes.

Every run here is a real CLI run on the bundled tiny model in float32. 2-process runs go through the three ways a
user starts them: `rlfactory train` with `distributed.num_processes: 2` (the CLI starts torchrun itself),
`torchrun -m rlfactory train` directly, and two torchrun "nodes" on one machine meeting at a localhost rendezvous.

Tolerance: losses agree to rel 1e-4. The two runs see the same examples at every step (Accelerate's seedable
sampler draws one permutation per epoch; process p takes micro-batches p, p + W, ..., so a step's global batch is
the same contiguous slice of the permutation); what differs is float32 summation order (two partial sums reduced
over gloo instead of one sum; other padded widths per micro-batch change the matmul blocking). Measured: about
1e-7 relative at step 1, 1e-6 after a few steps; a step changes the loss by 1e-2 or more, so a wrong batch, a
double-stepped LR schedule or a missing gradient average fails by orders of magnitude.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, ROOT, TINY_MODEL, expect_train_error, failure_output, run_cli, write_yaml

from rlfactory.engine.run_dir import read_log

REL = 1e-4


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _curve(out: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_log(out) if key in r}


def _same_curve(a: Path, b: Path, key: str = "loss") -> None:
    one, two = _curve(a, key), _curve(b, key)
    assert one and one.keys() == two.keys(), (one, two)
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=REL), (key, step, one, two)


def _one_writer(out: Path, steps: int) -> dict:
    """One log line per step (not one per process), one model, one summary."""
    records = read_log(out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))
    assert len([r for r in records if r["step"] == 0]) <= 1
    assert len(list(out.glob("*.safetensors"))) == 1
    return json.loads((out / "run_summary.json").read_text())


def _sft(tmp_path: Path, name: str, batch: int, processes: int = 1, **train) -> dict:
    return {
        "stage": "sft",
        "output_dir": str(tmp_path / name),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "arith_sft", "eval_dataset": "arith_sft_eval", "dataset_dir": str(DATA_DIR),
                 "max_samples": 64, "cutoff_len": 128},
        "train": {"max_steps": 4, "per_device_batch_size": batch, "learning_rate": 1e-3, **train},
        "evaluation": {"dataset": "arith_prompts_test", "max_samples": 6, "max_new_tokens": 8},
        "logging": {"progress_bar": False, "plot_loss": False},
        "distributed": {"num_processes": processes},
    }


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory) -> Path:
    """One process, batch 8: the run every 2-process sft run below must reproduce."""
    tmp = tmp_path_factory.mktemp("sft_ref")
    cfg = _sft(tmp, "ref", batch=8)
    result = run_cli("train", str(write_yaml(tmp / "ref.yaml", cfg)))
    assert result.returncode == 0, failure_output(result.stderr)
    return Path(cfg["output_dir"])


@pytest.mark.slow
def test_sft_self_launched_on_two_processes_matches_one(sft_reference: Path, tmp_path: Path):
    """`rlfactory train run.yaml` with distributed.num_processes: 2 starts torchrun itself; batch 4 x 2 processes
    gives the curve of batch 8 x 1, one log, one model, one summary, the same generation scores."""
    cfg = _sft(tmp_path, "two", batch=4, processes=2)
    result = run_cli("train", str(write_yaml(tmp_path / "two.yaml", cfg)))
    assert result.returncode == 0, failure_output(result.stderr)
    assert "launching: torchrun" in result.stdout and "x 2 process(es)" in result.stdout
    assert result.stdout.count("saved full model") == 1  # the summary is printed once
    out = Path(cfg["output_dir"])
    _same_curve(sft_reference, out)
    _same_curve(sft_reference, out, "eval_loss")
    summary, reference = _one_writer(out, 4), json.loads((sft_reference / "run_summary.json").read_text())
    key = "answer_match (arith_prompts_test)"
    assert summary[key]["n"] == reference[key]["n"] == 6  # the sharded generation eval gathered every prompt once
    assert summary[key]["before"] == reference[key]["before"]


@pytest.mark.slow
def test_two_nodes_on_one_machine_match_one_node(sft_reference: Path, tmp_path: Path):
    """Two torchrun "nodes" (--nnodes 2, one process each) at a localhost rendezvous, started by the CLI from the
    distributed section (node_rank given per node on the command line): the same run as one node."""
    cfg = _sft(tmp_path, "nodes", batch=4)
    cfg["distributed"] = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": _free_port()}
    path = str(write_yaml(tmp_path / "nodes.yaml", cfg))
    nodes = [
        subprocess.Popen([sys.executable, "-m", "rlfactory", "train", path, f"distributed.node_rank={rank}"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert "--nnodes=2 --node_rank=1" in outputs[1][0]
    _same_curve(sft_reference, Path(cfg["output_dir"]))
    _one_writer(Path(cfg["output_dir"]), 4)


def _dpo(tmp_path: Path, name: str, batch: int, accum: int) -> dict:
    return {
        "stage": "dpo",
        "output_dir": str(tmp_path / name),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "lora"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"dataset": "arith_pref", "eval_dataset": "arith_pref_test", "dataset_dir": str(DATA_DIR),
                 "max_samples": 48, "cutoff_len": 128},
        "dpo": {"beta": 0.5},
        "train": {"max_steps": 4, "per_device_batch_size": batch, "grad_accum_steps": accum, "learning_rate": 5e-3},
        "logging": {"progress_bar": False, "plot_loss": True},
    }


@pytest.mark.slow
def test_dpo_under_torchrun_matches_one_process(tmp_path: Path):
    """`torchrun -m rlfactory train` (the launcher's processes, no self-launch): pairs 2 x accum 2 x 2 processes
    give the curve of pairs 8 x accum 1 x 1 process; one adapter, one plot."""
    one = _dpo(tmp_path, "one", batch=8, accum=1)
    result = run_cli("train", str(write_yaml(tmp_path / "one.yaml", one)))
    assert result.returncode == 0, failure_output(result.stderr)
    two = _dpo(tmp_path, "two", batch=2, accum=2)
    result = _torchrun("--standalone", "--nproc_per_node", "2", "-m", "rlfactory", "train",
                       str(write_yaml(tmp_path / "two.yaml", two)))
    assert result.returncode == 0, failure_output(result.stderr)
    assert "launching" not in result.stdout and "x 2 process(es)" in result.stdout
    assert result.stdout.count("saved adapter model") == 1
    a, b = Path(one["output_dir"]), Path(two["output_dir"])
    for key in ("loss", "rewards/accuracies", "eval_loss", "eval_rewards/margins"):
        _same_curve(a, b, key)
    assert _one_writer(b, 4)["saved_as"] == "adapter"
    assert (b / "adapter_config.json").is_file() and (b / "loss.png").is_file()


@pytest.mark.slow
def test_sigterm_stops_both_processes_at_one_step_with_a_checkpoint_and_resumes(sft_reference: Path, tmp_path: Path):
    """SIGTERM to the CLI (what a scheduler sends): torchrun passes it on, both processes agree on the step to stop
    at (the flag is reduced), save one checkpoint together and exit 143 with one message; the resume ends with the
    uninterrupted run's losses."""
    cfg = _sft(tmp_path, "stopped", batch=4, processes=2, max_steps=4)
    path = write_yaml(tmp_path / "stopped.yaml", cfg)
    out = Path(cfg["output_dir"])
    proc = subprocess.Popen([sys.executable, "-m", "rlfactory", "train", str(path)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 300
    while not _curve(out) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.count("stopped: SIGTERM at step") == 1 and "Traceback" not in err, err[-3000:]
    [checkpoint] = out.glob("checkpoint-*")
    saved = {p.name for p in checkpoint.iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"} <= saved  # both ranks saved
    resumed = run_cli("train", str(path), "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, failure_output(resumed.stderr)
    assert f"resumed from {checkpoint}" in resumed.stdout
    _same_curve(sft_reference, out)


@pytest.mark.slow
def test_a_stop_signal_on_one_process_reaches_every_process_at_once_or_a_step_late(tmp_path: Path):
    """The stop flag is reduced on the device: every process answers alike, at the call after the signal or, read
    without waiting for the GPU (the offline loop under a fused optimizer), one call later."""
    script = "tests/distributed_stop_flag.py"
    result = _torchrun("--standalone", "--nproc_per_node", "2", script, str(tmp_path), timeout=300)
    assert result.returncode == 0, failure_output(result.stderr)
    answers = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    term = int(signal.SIGTERM)
    assert sorted(a["rank"] for a in answers) == [0, 1]
    for a in answers:
        assert a["False"] == [0, 0, term, term, term] and a["True"] == [0, 0, 0, term, term], a


def test_killed_two_process_run_resumes(sft_reference: Path, tmp_path: Path):
    """kill -9 of a 2-process run (its whole process group) after a checkpoint; `resume_from_checkpoint: auto` on 2
    processes ends with the losses of the uninterrupted run, and so does a resume on 1 process with the same global
    batch (8 x 1 instead of 4 x 2)."""
    cfg = _sft(tmp_path, "killed", batch=4, processes=2, max_steps=4, save_steps=1)
    cfg["logging"]["logging_steps"] = 1
    path = write_yaml(tmp_path / "killed.yaml", cfg)
    out = Path(cfg["output_dir"])
    proc = subprocess.Popen([sys.executable, "-m", "rlfactory", "train", str(path)], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not list(out.glob("checkpoint-*/trainer_state.json")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI, torchrun's agent in it and both training processes
    proc.wait()
    assert list(out.glob("checkpoint-*/trainer_state.json")), "a checkpoint should exist before the kill"
    assert not (out / "run_summary.json").exists(), "the run finished before it was killed"
    one_process = tmp_path / "killed-1"
    shutil.copytree(out, one_process)

    resumed = run_cli("train", str(path), "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, failure_output(resumed.stderr)
    assert "resumed from" in resumed.stdout
    _same_curve(sft_reference, out)
    _one_writer(out, 4)

    resumed = run_cli("train", str(path), "resume_from_checkpoint=auto", f"output_dir={one_process}",
                      "distributed.num_processes=1", "train.per_device_batch_size=8")
    assert resumed.returncode == 0, failure_output(resumed.stderr)
    _same_curve(sft_reference, one_process)
    refused = run_cli("train", str(path), "resume_from_checkpoint=auto", f"output_dir={out}",
                      "distributed.num_processes=1", "overwrite_output_dir=false")
    assert refused.returncode == 2 and "global batch" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.slow
def test_failed_start_leaves_nothing_that_blocks_the_same_command(sft_config: dict, tmp_path: Path):
    """A run that fails after creating its output dir (here: fewer examples than one optimizer step, found when the
    loop is set up) leaves only run.json and config.yaml; the same command, fixed, then runs without
    overwrite_output_dir. A run that trained a step is still refused."""
    cfg = {**sft_config, "data": {**sft_config["data"], "max_samples": 6},
           "train": {**sft_config["train"], "max_steps": 2, "per_device_batch_size": 8, "grad_accum_steps": 2}}
    path = write_yaml(tmp_path / "run.yaml", cfg)
    failed = run_cli("train", str(path))
    assert failed.returncode == 2 and "fewer than one optimizer step" in failed.stderr, failed.stderr[-2000:]
    assert "Traceback" not in failed.stderr
    out = Path(cfg["output_dir"])
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "run.json"]
    marker = json.loads((out / "run.json").read_text())["run_id"]

    fixed = run_cli("train", str(path), "train.grad_accum_steps=1")
    assert fixed.returncode == 0, failure_output(fixed.stderr)
    assert json.loads((out / "run.json").read_text())["run_id"] != marker  # a new run, a new marker
    again = run_cli("train", str(path), "train.grad_accum_steps=1")
    assert again.returncode == 2 and "already holds a run" in again.stderr


# --------------------------------------------------------------------------- the section and the launcher (no run)
def _validate(**keys):
    from rlfactory.config.loader import validate_config

    raw = {"stage": "sft", "model": {"name_or_path": str(TINY_MODEL)}, "data": {"dataset": "arith_sft"}, **keys}
    return validate_config(raw, "run.yaml")


@pytest.mark.parametrize(("keys", "fragment"), [
    ({"distributed": {"num_processes": 0}}, "distributed.num_processes"),
    ({"distributed": {"nnodes": 2}}, "master_addr and master_port"),
    ({"distributed": {"nnodes": 2, "node_rank": 2, "master_addr": "a", "master_port": 1}}, "node_rank (2)"),
    ({"distributed": {"strategy": "zero4"}}, "distributed.strategy"),
    ({"distributed": {"strategy": "zero3"}, "train": {"deepspeed": "ds.json"}}, "remove one"),
    ({"stage": "dpo", "data": {"dataset": "arith_pref"}, "model": {"name_or_path": "m", "finetuning": "full"},
      "distributed": {"strategy": "zero3"}}, "dpo.precompute_ref_logps: true"),
    ({"stage": "kto", "data": {"dataset": "arith_pref"}, "model": {"name_or_path": "m", "finetuning": "freeze"},
      "distributed": {"strategy": "fsdp2"}}, "model.finetuning: lora"),
    ({"stage": "rm", "data": {"dataset": "arith_pref"}, "distributed": {"strategy": "zero3_offload"}}, "stage rm"),
])
def test_bad_distributed_settings_are_refused_with_the_key(keys: dict, fragment: str):
    from rlfactory.errors import UserError

    with pytest.raises(UserError) as error:
        _validate(**keys)
    assert fragment in str(error.value)


def test_sharded_dpo_with_precomputed_reference_or_lora_is_accepted():
    full = {"name_or_path": "m", "finetuning": "full"}
    pref = {"stage": "dpo", "data": {"dataset": "arith_pref"}, "distributed": {"strategy": "zero3"}}
    assert _validate(**pref, model=full, dpo={"precompute_ref_logps": True}).sharded()
    assert _validate(**pref, model={"name_or_path": "m"}).sharded()


def test_pipeline_stages_share_one_launch():
    from rlfactory.config.loader import validate_config
    from rlfactory.errors import UserError

    base = {"stage": "sft", "model": {"name_or_path": "m"}, "data": {"dataset": "arith_sft"}}
    raw = {"stages": [{**base, "name": "a"}, {**base, "name": "b", "distributed": {"num_processes": 2}}]}
    with pytest.raises(UserError, match="same distributed section"):
        validate_config(raw, "pipe.yaml")


def test_a_two_process_pipeline_announces_each_stage_once(sft_config: dict, tmp_path: Path):
    """Every process runs the pipeline; the stage banners, and on a rerun the "already finished" lines, are printed
    by one (they were printed by each)."""
    stage = {k: v for k, v in sft_config.items() if k != "output_dir"}
    stage["train"] = {**stage["train"], "max_steps": 2}
    pipe = {
        "output_dir": str(tmp_path / "pipe"),
        "defaults": {"distributed": {"num_processes": 2}},
        "stages": [{**stage, "name": "a"}, {**stage, "name": "b", "model": {**stage["model"], "from_stage": "a"}}],
    }
    path = write_yaml(tmp_path / "pipe.yaml", pipe)
    first = run_cli("train", str(path))
    assert first.returncode == 0, failure_output(first.stderr)
    assert first.stdout.count("=== pipeline stage") == 2, first.stdout
    again = run_cli("train", str(path), "resume_from_checkpoint=auto")
    assert again.returncode == 0, failure_output(again.stderr)
    assert again.stdout.count("=== pipeline stage") == 2 and again.stdout.count("already finished") == 2, again.stdout


def test_torchrun_arguments():
    from rlfactory.config.schema import DistributedConfig
    from rlfactory.launch import torchrun_argv

    one = torchrun_argv(DistributedConfig(num_processes=4), ["run.yaml", "seed=1"])
    assert one == ["--standalone", "--nnodes=1", "--nproc_per_node=4", "-m", "rlfactory", "train", "run.yaml", "seed=1"]
    nodes = DistributedConfig(num_processes=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    assert torchrun_argv(nodes, ["r.yaml"])[:4] == [
        "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500"]
    assert torchrun_argv(DistributedConfig(num_processes="auto"), [])[2] == "--nproc_per_node=1"  # no GPU here


def test_launched_processes_share_the_cores_unless_the_user_set_omp_threads(monkeypatch):
    """torchrun gives each process 1 CPU thread when OMP_NUM_THREADS is unset; the self-launch shares the usable
    cores out instead (1 each on a 2-core machine with 2 processes), and leaves a value the user set alone."""
    from rlfactory.launch import cpu_threads_per_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)), raising=False)
    assert [cpu_threads_per_process(n) for n in (1, 4, 8, 128)] == [64, 16, 8, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert cpu_threads_per_process(2) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_process(2) is None


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_bundled_deepspeed_configs_fill_from_the_run(strategy: str):
    """Accelerate's DeepSpeedPlugin reads each bundled JSON and fills its "auto" keys from the run's config (as
    build_accelerator passes them; building the Accelerator itself needs GPUs)."""
    from accelerate import DeepSpeedPlugin

    from rlfactory.engine.shared import deepspeed_config_path

    cfg = _validate(distributed={"strategy": strategy}, train={"grad_accum_steps": 3, "max_grad_norm": 0.5})
    plugin = DeepSpeedPlugin(
        hf_ds_config=deepspeed_config_path(cfg), gradient_accumulation_steps=3, gradient_clipping=0.5)
    ds = plugin.deepspeed_config
    assert ds["zero_optimization"]["stage"] == (2 if strategy == "zero2" else 3)
    assert ds["gradient_accumulation_steps"] == 3 and ds["gradient_clipping"] == 0.5
    assert (ds["zero_optimization"].get("offload_param", {}).get("device") == "cpu") == (strategy == "zero3_offload")
    if strategy != "zero2":
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]  # a normal HF directory at the end


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only")
def test_sharded_strategies_are_refused_on_cpu_before_anything_is_written(sft_config: dict, tmp_path: Path):
    """On CPU Accelerate would quietly run DDP instead of DeepSpeed/FSDP: one message, exit 2, nothing written."""
    expect_train_error(tmp_path, {**sft_config, "distributed": {"strategy": "zero2"}}, "needs GPUs", "use ddp")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only")
def test_flex_attention_is_refused_on_cpu_before_anything_is_written(sft_config: dict, tmp_path: Path):
    """torch's FlexAttention has no backward on CPU (it would fail at the first step with a traceback)."""
    cfg = {**sft_config, "model": {**sft_config["model"], "attn_implementation": "flex_attention"}}
    expect_train_error(tmp_path, cfg, "flex_attention needs a GPU to train", "use sdpa")


def test_a_one_process_group_ends_without_a_barrier(tmp_path: Path, monkeypatch):
    """vLLM's in-process engine sets up a group of one process in a one-GPU run; a barrier there was the group's
    first collective (on NCCL: a communicator built at the run's very end, which hung an H200 grpo run after its
    save). Nothing to wait for: the group is closed (gloo) without one."""
    from rlfactory.launch import close_process_group

    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    barriers: list[int] = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: barriers.append(1))
    try:
        close_process_group(finished=True)
        assert barriers == []
        assert not torch.distributed.is_initialized()  # a gloo group is still torn down (its worker threads)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
