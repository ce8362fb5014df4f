"""ppo / grpo on several processes (gloo on CPU, launched by torchrun): the update on fixed rollouts equals one
process's, and real runs through the CLI write once, log what one process logs where they should, use dynamic
sampling without hanging, and resume after kill -9 exactly.

Each multi-process command runs in its own session with a timeout; on a timeout the whole process group is killed
(torchrun and its workers), so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests import test_stage_grpo as stage_grpo
from tests.conftest import ROOT, TINY_MODEL, failure_output, run_cli, write_yaml

from rlfactory.engine.run_dir import read_log

pytestmark = pytest.mark.slow

F32 = torch.finfo(torch.float32).eps  # 1.19e-7
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
TIMEOUT = 240  # seconds per command; each takes 20-40 s on 2 busy cores


def torchrun(*args: str, processes: int = 2, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N <args>`` (``-m rlfactory ...`` or a script), in a new session."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(args)} on {processes} processes ran past {timeout} s (a hang?)\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def train(cfg: dict, tmp_path: Path, *overrides: str, processes: int = 2) -> subprocess.CompletedProcess:
    path = write_yaml(tmp_path / f"{Path(cfg['output_dir']).name}.yaml", cfg)
    if processes == 1:
        result = run_cli("train", str(path), *overrides, timeout=TIMEOUT)
    else:
        result = torchrun("-m", "rlfactory", "train", str(path), *overrides, processes=processes)
    assert result.returncode == 0, failure_output(result.stderr)
    return result


# --------------------------------------------------------------------------- the update on fixed rollouts
def test_an_update_on_fixed_rollouts_is_the_same_on_one_and_two_processes(tmp_path: Path):
    """tests/distributed_rl_update.py runs the real phases (to_batch, score_batch, update_models) on 8 fixed samples
    with grpo + token-mean + KL loss, reinforce_plus_plus (batch whitening) + seq-mean-token-mean, and gae (a
    critic, batch whitening, the adaptive in-reward KL) + seq-mean-token-sum-norm, that again with packed
    micro-batches (``rollout.packing: on``), grpo with packed micro-batches cut by a token budget
    (``rollout.micro_batch_tokens``: the ranks run different numbers of micro-batches), and that without a KL or
    entropy term with three groups of one reward each (their rows run forward only, and one rank has no row with a
    gradient: it still runs a zero backward for DDP), 2 optimizer steps each; on two processes each rank trains 4 of
    the 8 rows.

    Tolerances: the first step's gradient (after DDP's sync, unclipped; the parameters are still the initial ones)
    differs only by float32 rounding of sums taken in another order over differently trimmed micro-batches: within
    100 x eps of its largest entry (measured: 1.7e-6 to 3.5e-6 relative on two CPUs). The second step's gradient is
    taken at parameters that already differ by that rounding, passed through AdamW: within 2e-3 (measured: 3.5e-5 on
    one CPU, up to 2.7e-4 on another, the packed gae case; neither a 100x larger AdamW epsilon nor a clip range that
    never clips brought it below 6e-5 there: it is the loss's sensitivity to parameters that differ after one step,
    not a discontinuity). The parameters' change over the two AdamW steps: AdamW moves a coordinate by about
    lr x g / (|g| + eps), so a coordinate whose gradient is at the level of the rounding moves up to lr either way
    (8 of 1.8M coordinates differ by more than 0.1 x lr here); the change as a whole is compared: within 1e-2 of its
    norm (measured: up to 7.3e-4). A wrong gradient scale (the x N that undoes DDP's average left out) or a per-rank
    aggregation fails each gradient check by 0.5 or more.
    """
    script = str(ROOT / "tests" / "distributed_rl_update.py")
    command = [sys.executable, script, str(tmp_path / "one")]
    one = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert one.returncode == 0, failure_output(one.stderr)
    two = torchrun(script, str(tmp_path / "two"))
    assert two.returncode == 0, failure_output(two.stderr)
    for case in (
        "grpo_token_mean",
        "rpp_seq_mean",
        "gae_seq_sum_norm",
        "gae_seq_sum_norm_packed",
        "grpo_token_budget_packed",
        "grpo_zero_advantage_packed",
    ):
        a, b = (torch.load(tmp_path / run / f"{case}.pt") for run in ("one", "two"))
        assert a["grads"].keys() == b["grads"].keys()
        for step_key in sorted({".".join(k.split(".")[:2]) for k in a["grads"]}):  # policy.0, policy.1, critic.0, ...
            names = [k for k in a["grads"] if k.startswith(step_key + ".")]
            largest = max(float(a["grads"][k].abs().max()) for k in names)
            diff = max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in names)
            bound = 100 * F32 if step_key.endswith(".0") else 2e-3
            assert diff <= bound * largest, (case, step_key, diff / largest)
        change, other = (torch.cat([u.flatten() for u in run["updates"].values()]) for run in (a, b))
        assert float((change - other).norm()) <= 1e-2 * float(change.norm()), case
        assert a["advantages"] == pytest.approx(b["advantages"], abs=1e-6)  # the estimator saw every rank's rows
        one_metrics, (rank0, rank1) = a["metrics"][0], b["metrics"]
        assert rank0 == rank1  # reduced over the ranks: the same numbers on both
        assert (one_metrics["rows"], rank0["rows"]) == (8, 4)
        assert one_metrics["packed"] == rank0["packed"] == float(case.endswith("_packed"))
        if case == "grpo_zero_advantage_packed":  # 6 rows without advantage and the truncated one (no loss tokens)
            alone, shared = one_metrics.pop("actor/rows_forward_only"), rank0.pop("actor/rows_forward_only")
            assert alone == 7 / 8 and 0 < shared < alone, (alone, shared)  # the rank without a gradient runs one
        elif case.startswith("grpo"):
            assert "actor/rows_forward_only" not in one_metrics  # a KL or entropy term: every row's backward runs
        for key, value in one_metrics.items():
            if not key.startswith("timing_s") and key != "rows":
                assert rank0[key] == pytest.approx(value, rel=2e-4, abs=1e-6), (case, key)


# --------------------------------------------------------------------------- through the CLI
def grpo_config(out: Path, **sections) -> dict:
    """test_stage_grpo's tiny grpo run (4 prompts x 2 samples, 3 steps, a checkpoint at step 2), into ``out``."""
    return {**stage_grpo.grpo_config(out.parent, **sections), "output_dir": str(out), "seed": 3}


def trace(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts" / f"{name}.jsonl").read_text().splitlines()]


# one process samples all of a step's prompts in one stream, each rank its share in its own: the generated texts
# (and all that follows from them) differ. What does not depend on them is equal:
SAME_AS_ONE_PROCESS = ("step", "epoch", "actor/lr", "rollout/generated_samples", "rollout/kept_samples")
NOT_COMPARED = ("timing_s/", "perf/", "elapsed_s", "eta_s")  # wall time and memory


def test_two_process_grpo_run_writes_once_logs_as_one_process_and_resumes_after_kill_9(tmp_path: Path):
    one, two, killed = tmp_path / "one", tmp_path / "two", tmp_path / "killed"
    alone = train(grpo_config(one), tmp_path, processes=1).stderr
    result = train(grpo_config(two), tmp_path)
    said = result.stderr
    assert said.count("Loading weights") == alone.count("Loading weights") > 0  # rank 0's progress bars only
    # rank 0 logs what every rank would, once (the packing choice is made on every rank); the other ranks warn only
    assert said.count("INFO rlfactory.engine.online.loop: rollout.packing auto:") == 1, said[-3000:]
    # nor does DeepSpeed (installed, unused, imported by Accelerate) say per process that it found no GPU
    assert "unable to detect it" not in said + result.stdout, result.stdout[-3000:]

    log = read_log(two)
    lines = [ln for ln in (two / "trainer_log.jsonl").read_text().splitlines() if '"health"' not in ln]  # alerts
    assert len(lines) == len(set(lines)) == 5  # written once: val at step 0, steps 1-3, val at step 3
    assert [r["step"] for r in log if "score/mean" in r] == [1, 2, 3]
    assert [r["step"] for r in log if "val/score" in r] == [0, 3]
    assert (two / "model.safetensors").is_file() and json.loads((two / "run_summary.json").read_text())["global_step"]
    saved = {p.name for p in (two / "checkpoint-2").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "trainer_state.json"} <= saved  # each rank's RNG
    names = sorted(p.name for p in (two / "rollouts").iterdir())
    alerted = {r["step"] for r in log if "health" in r}  # a step where a health rule fired is traced too
    traced = sorted(f"step_{s:05d}.jsonl" for s in {1, 2} | alerted)
    assert names == [*traced, "val_step_00000.jsonl", "val_step_00003.jsonl"], (names, alerted)
    # the step's samples of both ranks, once, in the order of one process: the same prompts, groups in order
    for name in ("step_00001", "step_00002"):
        rows, alone = trace(two, name), trace(one, name)
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in alone] and len(rows) == 8
        assert [r["group"] for r in rows] == [r["group"] for r in alone]
    assert [r["prompt"] for r in trace(two, "val_step_00000")] == [r["prompt"] for r in trace(one, "val_step_00000")]

    alone = read_log(one)
    # step 0 validation: greedy completions of the same model on the same prompts, split over the ranks
    assert log[0] == alone[0]
    for mine, theirs in zip(log[1:4], alone[1:4], strict=True):
        assert {k: mine[k] for k in SAME_AS_ONE_PROCESS} == {k: theirs[k] for k in SAME_AS_ONE_PROCESS}
        assert mine.keys() == theirs.keys()

    # kill -9 the whole process group once checkpoint-2 is complete, then resume: step 3 is redone exactly
    cfg = grpo_config(killed)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*launcher, "-m", "rlfactory", "train", str(write_yaml(tmp_path / "killed.yaml", cfg))]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + TIMEOUT
    try:
        while not (killed / "checkpoint-2" / "trainer_state.json").is_file():
            assert proc.poll() is None, "the run ended before its checkpoint"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (killed / "model.safetensors").exists()  # it was killed before the end
    train(cfg, tmp_path, "resume_from_checkpoint=auto")
    resumed = read_log(killed)
    assert [r["step"] for r in resumed] == [r["step"] for r in log]
    same = lambda r: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)}
    assert [same(r) for r in resumed] == [same(r) for r in log]


def test_dynamic_sampling_lora_kl_and_mini_batches_on_two_processes(tmp_path: Path):
    """Dynamic sampling decides on the gathered samples, so both ranks run the same rounds (a rank running one more
    would wait forever in its gather: the timeout would fail the test); LoRA with the adapter-disabled reference,
    two epochs of two mini-batches (DDP syncs once per mini-batch)."""
    out = tmp_path / "dapo"
    cfg = grpo_config(
        out,
        model={"finetuning": "lora"},
        lora={"r": 4, "alpha": 8},
        rollout={"dynamic_sampling": True, "max_sampling_rounds": 3},
        reward={"functions": {"answer_match": 1.0}},  # 0 or 1: many groups of two are all-equal
        algorithm={"kl_loss_coef": 0.05, "ppo_epochs": 2, "num_mini_batches": 2, "clip_high": 0.28},
        train={"max_steps": 2, "save_steps": None, "per_device_batch_size": 2, "learning_rate": 1e-3},
        evaluation={"dataset": None},
    )
    train(cfg, tmp_path)
    steps = [r for r in read_log(out) if "score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all("actor/kl_loss" in r for r in steps)
    assert all(r["rollout/generated_samples"] % 4 == 0 for r in steps)  # rounds drew whole shares of both ranks
    assert any(r["rollout/generated_samples"] > 8 for r in steps)  # groups were dropped and refilled
    rows = trace(out, "step_00001")
    assert len(rows) == 8  # always prompts_per_step groups: informative ones first
    informative = [len({r["score"] for r in rows[i : i + 2]}) > 1 for i in range(0, 8, 2)]
    assert informative == sorted(informative, reverse=True)
    assert sum(informative) * 2 == steps[0]["rollout/kept_samples"]
    assert (out / "adapter_config.json").is_file()


def test_overlap_on_two_processes_draws_as_one_process_writes_once_and_resumes_mid_round(tmp_path: Path):
    """rollout.overlap with several processes: each rank's sampler thread generates its share of the next step while
    the ranks train (no collective in the thread: scoring and every gather run on the main thread once the round is
    taken). The steps draw the prompts and groups of one process, each step after the first samples the weights one
    step older, the log is written once, and a resume from the checkpoint taken while step 3's round was pending
    trains step 3 on the same prompts, generated from the checkpoint's weights."""
    one, two = tmp_path / "one", tmp_path / "two"
    overlap = {"rollout": {"overlap": True}, "evaluation": {"dataset": None}, "logging": {"rollout_trace_steps": 1}}
    train(grpo_config(one, **overlap), tmp_path, processes=1)
    train(grpo_config(two, **overlap), tmp_path)

    log, alone = read_log(two), read_log(one)
    steps = [r for r in log if "score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0]
    assert all("timing_s/gen_overlapped" in r for r in steps[1:])
    lines = [ln for ln in (two / "trainer_log.jsonl").read_text().splitlines() if '"health"' not in ln]
    assert len(lines) == len(set(lines)) == 3  # written once
    for mine, theirs in zip(steps, [r for r in alone if "score/mean" in r], strict=True):
        assert {k: mine[k] for k in SAME_AS_ONE_PROCESS} == {k: theirs[k] for k in SAME_AS_ONE_PROCESS}
        assert mine.keys() == theirs.keys()
    drawn = lambda rows: [(r["group"], r["prompt"]) for r in rows]
    for index, name in enumerate(("step_00001", "step_00002", "step_00003")):
        rows = trace(two, name)
        assert drawn(rows) == drawn(trace(one, name)) and len(rows) == 8  # both ranks' shares, in one order
        assert {r["policy_version"] for r in rows} == {max(index - 1, 0)}

    state = json.loads((two / "checkpoint-2" / "trainer_state.json").read_text())
    assert (state["cursor"], state["group"]) == (8, 8)  # the steps trained, not the round drawn for step 3
    uninterrupted = trace(two, "step_00003")
    result = train(grpo_config(two, **overlap), tmp_path, "resume_from_checkpoint=auto")
    assert "resumed from" in result.stdout + result.stderr
    resumed = trace(two, "step_00003")
    assert drawn(resumed) == drawn(uninterrupted)
    assert {r["policy_version"] for r in resumed} == {2}  # generated from checkpoint-2's weights
    assert [r["step"] for r in read_log(two) if "score/mean" in r] == [1, 2, 3]


def untied_copy(folder: Path) -> Path:
    """The bundled model with its LM head untied from the embeddings (as in larger models, e.g. 7B Qwen2.5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    model.config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(model.config)
    weights = {**model.state_dict(), "lm_head.weight": model.get_input_embeddings().weight.detach().clone()}
    untied.load_state_dict(weights)
    untied.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(folder)
    return folder


def test_ppo_full_critic_with_an_untied_head_on_two_processes(tmp_path: Path):
    """ppo with a fully trained critic (GAE over every rank's rows), the adaptive in-reward KL and critic warmup, on
    a model whose LM head is untied: the critic never runs it, and DDP must be told (else: "Expected to have finished
    reduction in the prior iteration" at the second step)."""
    out = tmp_path / "ppo"
    cfg = grpo_config(
        out,
        stage="ppo",
        model={"name_or_path": str(untied_copy(tmp_path / "untied"))},
        rollout={"num_samples": 1},
        algorithm={"adv_estimator": "gae", "kl_in_reward_coef": 0.05, "kl_controller": "adaptive", "kl_target": 0.1},
        critic={"learning_rate": 1e-3, "warmup_steps": 1},
        train={"max_steps": 3, "save_steps": None},
        evaluation={"dataset": None},
    )
    train(cfg, tmp_path)
    steps = [r for r in read_log(out) if "score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all("critic/vf_loss" in r for r in steps)
    assert "actor/pg_loss" not in steps[0] and "actor/pg_loss" in steps[1]  # the critic's warmup step
    assert steps[0]["actor/kl_coef"] != steps[1]["actor/kl_coef"]  # the controller moved on the global KL
    assert (out / "critic" / "value_head.safetensors").is_file()


def test_prompts_that_do_not_split_over_the_processes_are_a_clear_error(tmp_path: Path):
    out = tmp_path / "odd"
    path = write_yaml(tmp_path / "odd.yaml", grpo_config(out))
    result = torchrun("-m", "rlfactory", "train", str(path), "rollout.prompts_per_step=3")
    workers = result.stderr.split("failed (exitcode: 2)")[0]  # what follows is torchrun's own report (a traceback)
    assert result.returncode != 0 and "failed (exitcode: 2)" in result.stderr  # UserError: exit 2
    assert "rollout.prompts_per_step (3) must divide by the number of processes (2)" in workers
    assert "prompts_per_step: 4" in workers and "Traceback" not in workers and not out.exists()
