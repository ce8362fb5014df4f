"""RL run health (engine/health.py): each rule on hand-made metric streams (fires once, at the right step, not
before), the actions, the trainer_log.jsonl record, resume, the metrics the rules read; then real runs on the
bundled model built to go wrong, and a healthy one that fires nothing."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.health_schema import HealthConfig
from rlfactory.engine.health import HEALTH_RULES, STOP_EXIT_CODE, Alert, HealthMonitor, stopped


def settings(**rules: dict) -> HealthConfig:
    """Every rule ignored except those given (so a stream tests one rule alone)."""
    return HealthConfig(**{name: {"action": "ignore"} for name in HEALTH_RULES.names()} | rules)


def feed(records: list[dict], **rules: dict) -> list[Alert]:
    monitor = HealthMonitor(settings(**rules))
    return [alert for record in records for alert in monitor.check(record)]


def stream(metric: str, values: list[float], first_step: int = 1, **others: float) -> list[dict]:
    return [{"step": first_step + i, metric: v, **others} for i, v in enumerate(values)]


def fired(alerts: list[Alert]) -> list[tuple[int, str, str]]:
    return [(a.step, a.rule, a.metric) for a in alerts]


# --------------------------------------------------------------------------- one rule at a time
def test_reward_hacking_fires_when_train_reward_rises_and_val_score_does_not():
    """val 0.50 at steps 0 and 4, train flat at 0.3 over steps 1-4 (two validations: nothing to compare yet); train
    0.3, 0.4, 0.6, 0.7 over steps 5-8 (mean 0.5: +0.2) while val falls to 0.45 at step 8 (fires); val 0.40 at step
    12 (already fired: nothing more)."""
    records = [{"step": 0, "val/score": 0.5}]
    records += stream("score/mean", [0.3, 0.3, 0.3, 0.3]) + [{"step": 4, "val/score": 0.5}]
    records += stream("score/mean", [0.3, 0.4, 0.6, 0.7], first_step=5) + [{"step": 8, "val/score": 0.45}]
    records += stream("score/mean", [0.8, 0.8, 0.9, 0.9], first_step=9) + [{"step": 12, "val/score": 0.40}]
    alerts = feed(records, reward_hacking={})
    assert fired(alerts) == [(8, "reward_hacking", "val/score")]
    assert alerts[0].value == 0.45
    assert (
        "rose 0.300 -> 0.500 (mean score/mean of steps 1-4, then 5-8) while val/score went 0.500 -> 0.450"
        in alerts[0].message
    )


def test_reward_hacking_stays_quiet_while_the_held_out_score_follows():
    """Interval means 0.6 -> 1.075 while val goes 0.50 -> 0.55: a gain, no alert (unless max_val_gain allows 0.1);
    one noisy step (0.3 -> 0.9) between two validations alone is never compared."""
    records = [{"step": 0, "val/score": 0.5}, *stream("score/mean", [0.3, 0.5, 0.7, 0.9])]
    records.append({"step": 4, "val/score": 0.5})
    assert feed(records, reward_hacking={}) == []
    records += [*stream("score/mean", [0.9, 1.0, 1.1, 1.3], first_step=5), {"step": 8, "val/score": 0.55}]
    assert feed(records, reward_hacking={}) == []
    loose = feed(records, reward_hacking={"max_val_gain": 0.1})
    assert fired(loose) == [(8, "reward_hacking", "val/score")]
    assert feed(records, reward_hacking={"max_val_gain": 0.1, "min_train_rise": 0.5}) == []  # a rise of 0.475


def test_entropy_collapse_by_factor_and_by_floor():
    """window 3: baseline mean(1.9, 1.8, 1.9) = 1.867; the recent mean first falls below 1.867 / 10 at step 8."""
    values = [1.9, 1.8, 1.9, 1.0, 0.5, 0.2, 0.1, 0.05, 0.05, 0.04]
    alerts = feed(stream("actor/entropy", values), entropy_collapse={})
    assert fired(alerts) == [(8, "entropy_collapse", "actor/entropy")]
    assert alerts[0].value == pytest.approx((0.2 + 0.1 + 0.05) / 3)
    assert "entropy collapsed from 1.87 to 0.117" in alerts[0].message
    # an entropy low from the start never falls by the factor: the floor catches it
    low = [0.03, 0.02, 0.012, 0.009, 0.008]  # means of two: 0.0105 at step 4, 0.0085 < 0.01 at step 5
    assert fired(feed(stream("actor/entropy", low), entropy_collapse={"window": 2})) == [
        (5, "entropy_collapse", "actor/entropy")
    ]


def test_reference_kl_above_the_ceiling_and_by_growth():
    ceiling = feed(stream("actor/kl_loss", [0.01, 0.02, 0.03, 0.2, 0.6, 0.9, 1.2]), reference_kl={"growth": 1e9})
    assert fired(ceiling) == [(6, "reference_kl", "actor/kl_loss")]  # mean(0.2, 0.6, 0.9) = 0.567 > 0.5
    # window 2: 0.0025 -> 0.055 is 22-fold and above the floor 0.05 at step 6; at step 5 0.0165 is under the floor
    growth = feed(stream("actor/kl_loss", [0.001, 0.002, 0.002, 0.003, 0.03, 0.08]), reference_kl={"window": 2})
    assert fired(growth) == [(6, "reference_kl", "actor/kl_loss")] and "grew 22-fold" in growth[0].message
    # the in-reward KL is a sum over the response: per token it is divided by the mean response length
    records = [{"step": s, "actor/reward_kl": kl, "response_length/mean": 20.0} for s, kl in enumerate([2, 8, 12], 1)]
    alerts = feed(records, reference_kl={"window": 1})
    assert fired(alerts) == [(3, "reference_kl", "actor/reward_kl")] and alerts[0].value == pytest.approx(0.6)


def test_policy_kl_reads_the_absolute_value():
    alerts = feed(stream("actor/ppo_kl", [0.001, -0.002, -0.2, 0.01]), policy_kl={"window": 1, "growth": 1e9})
    assert fired(alerts) == [(3, "policy_kl", "actor/ppo_kl")] and alerts[0].value == pytest.approx(0.2)


@pytest.mark.parametrize(
    "rule, metric",
    [
        ("truncation", "response_length/clip_ratio"),
        ("zero_advantage", "rollout/zero_adv_groups"),
        ("clip_fraction", "actor/pg_clipfrac"),
        ("sampler_mismatch", "rollout/ratio_over_cap"),
    ],
)
def test_rate_rules_fire_on_the_mean_of_their_window(rule: str, metric: str):
    """window 3, ceiling 0.25: steps 1-2 have too few values; mean(0.1, 0.3, 0.5) = 0.3 at step 3 fires; once."""
    alerts = feed(stream(metric, [0.1, 0.3, 0.5, 0.9, 0.9]), **{rule: {"window": 3, "max_rate": 0.25}})
    assert fired(alerts) == [(3, rule, metric)] and alerts[0].value == pytest.approx(0.3)
    assert feed(stream(metric, [0.1, 0.3, 0.35]), **{rule: {"window": 3, "max_rate": 0.25}}) == []  # mean 0.25


def test_non_finite_fires_on_skipped_updates_and_on_nan_values():
    records = [
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": math.nan, "skipped_steps": 1.0},
        {"step": 3, "loss": 0.4, "skipped_steps": 1.0},  # skipped_steps already alerted
        {"step": 4, "loss": 0.4, "eval_loss": math.inf},
    ]
    alerts = feed(records, non_finite={})
    assert fired(alerts) == [(2, "non_finite", "skipped_steps"), (4, "non_finite", "eval_loss")]
    assert "1 update(s) skipped: the loss or gradient norm was not finite (loss nan)" in alerts[0].message


def test_constant_component_needs_the_whole_window():
    records = [
        {"step": s, "reward/format/mean": 1.0, "reward/answer/mean": 0.1 * s, "val/reward/format/mean": 1.0}
        for s in range(1, 8)
    ]
    alerts = feed(records, constant_component={"window": 5})
    assert fired(alerts) == [(5, "constant_component", "reward/format/mean")]
    assert "reward component 'format' was 1 on each of the last 5 logged steps" in alerts[0].message


# --------------------------------------------------------------------------- actions, records, resume
def test_actions_ignore_warn_stop(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    values = stream("response_length/clip_ratio", [0.9, 0.9, 0.9, 0.9])
    assert HealthMonitor(settings(truncation={"action": "ignore"})).rules == {}
    warn = HealthMonitor(settings(truncation={"action": "warn"}), tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlfactory.engine.health"):
        alerts = [a for r in values for a in warn.observe(r)]
    assert fired(alerts) == [(3, "truncation", "response_length/clip_ratio")] and warn.stop is None
    record = json.loads((tmp_path / "trainer_log.jsonl").read_text())
    assert record == {
        "step": 3,
        "health": {
            "rule": "truncation",
            "action": "warn",
            "metric": "response_length/clip_ratio",
            "value": 0.9,
            "message": "responses run to the length cap: 0.9 (response_length/clip_ratio, mean of 3 logged steps), "
            "above 0.25",
            "fixes": HEALTH_RULES.traits("truncation")["fixes"],
        },
    }
    assert [r.getMessage() for r in caplog.records] == [alerts[0].line()]
    assert alerts[0].line().startswith("health: truncation at step 3: responses run to the length cap: 0.9")
    stop = HealthMonitor(settings(truncation={"action": "stop"}))
    for record in values:
        stop.check(record)
    assert stop.stop is not None and stop.stop.step == 3
    error = stopped(stop.stop, tmp_path / "checkpoint-3")
    assert error.exit_code == STOP_EXIT_CODE == 3
    assert "health rule truncation at step 3" in str(error) and "checkpoint-3" in str(error)
    assert "health.truncation.action=warn resume_from_checkpoint=auto" in str(error)


def test_other_ranks_decide_but_do_not_write(tmp_path: Path):
    monitor = HealthMonitor(settings(truncation={"action": "stop"}), tmp_path, main=False)
    for record in stream("response_length/clip_ratio", [0.9, 0.9, 0.9]):
        monitor.observe(record)
    assert monitor.stop is not None and not (tmp_path / "trainer_log.jsonl").exists()


def test_a_resumed_run_continues_its_windows_and_does_not_alert_twice():
    records = stream("actor/entropy", [1.0, 1.0, 1.0, 0.05, 0.05, 0.05, 0.01])
    first = HealthMonitor(settings(entropy_collapse={}))
    log = []
    for record in records[:6]:
        log.append(record)
        log += [a.record() for a in first.check(record)]
    assert [r["step"] for r in log if "health" in r] == [6]  # mean(0.05, 0.05, 0.05) < 1.0 / 10
    resumed = HealthMonitor(settings(entropy_collapse={}))
    resumed.replay(log)
    assert resumed.check(records[6]) == []  # fired before the checkpoint
    fresh = HealthMonitor(settings(entropy_collapse={}))
    fresh.replay(log[:4])  # checkpoint at step 4: the windows go on, the rule fires at step 6 as before
    assert fresh.check(records[4]) == []
    assert fired(fresh.check(records[5])) == [(6, "entropy_collapse", "actor/entropy")]


def test_rules_and_config_name_the_same_set_and_bad_names_are_clear():
    from rlfactory.config.loader import validate_config
    from rlfactory.errors import UserError

    assert set(HealthConfig.model_fields) == set(HEALTH_RULES.names())
    assert all(HEALTH_RULES.traits(name)["fixes"] for name in HEALTH_RULES.names())
    with pytest.raises(UserError, match="valid names: clip_fraction, constant_component, entropy_collapse"):
        HEALTH_RULES.get("entropy")
    raw = {"stage": "grpo", "model": {"name_or_path": "m"}, "data": {"dataset": "d"}}
    raw["reward"] = {"functions": {"answer_match": 1.0}}
    with pytest.raises(UserError, match="entropy_colapse.*entropy_collapse"):
        validate_config({**raw, "health": {"entropy_colapse": {"action": "stop"}}}, "run.yaml")
    with pytest.raises(UserError, match="health.truncation.action"):
        validate_config({**raw, "health": {"truncation": {"action": "halt"}}}, "run.yaml")
    cfg = validate_config({**raw, "health": {"truncation": {"action": "stop", "max_rate": 0.5}}}, "run.yaml")
    assert cfg.health.truncation.max_rate == 0.5 and cfg.health.entropy_collapse.action == "warn"


# --------------------------------------------------------------------------- the metrics the rules read
def test_ratio_over_cap_counts_tokens_whose_trainer_sampler_ratio_is_above_the_threshold():
    from rlfactory.algos.rollout_correction import mismatch_metrics

    sampler = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -0.5, -0.5]])
    trainer = sampler + torch.log(torch.tensor([[3.0, 0.5, 100.0], [1.5, 2.5, 1.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert mismatch_metrics(trainer, sampler, mask, threshold=2.0)["rollout/ratio_over_cap"] == pytest.approx(2 / 5)
    assert "rollout/ratio_over_cap" not in mismatch_metrics(trainer, sampler, mask)


def test_zero_advantage_groups_share():
    from types import SimpleNamespace

    from rlfactory.engine.online.phases import zero_advantage_groups

    sample = lambda group, score: SimpleNamespace(group=group, score=score)
    samples = [sample(0, 1.0), sample(0, 1.0), sample(1, 0.0), sample(1, 1.0), sample(2, 0.5), sample(2, 0.5)]
    assert zero_advantage_groups(samples, "grpo") == {"rollout/zero_adv_groups": pytest.approx(2 / 3)}
    assert zero_advantage_groups(samples, "rloo") == {"rollout/zero_adv_groups": pytest.approx(2 / 3)}
    assert zero_advantage_groups([sample(0, 1.0), sample(1, 1.0)], "grpo") == {}  # no groups: one sample per prompt
    # a critic's or the batch's baseline gives a one-reward group an advantage: no share, no zero_advantage alert
    assert zero_advantage_groups(samples, "gae") == zero_advantage_groups(samples, "reinforce_plus_plus") == {}


# --------------------------------------------------------------------------- real runs built to go wrong
def grpo_run(tmp_path: Path, **sections: dict) -> dict:
    """A short grpo run on the bundled model (full fine-tuning, 8 prompts x 4 samples, no evaluation)."""
    cfg = {
        "stage": "grpo",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
        "rollout": {"prompts_per_step": 8, "num_samples": 4, "max_response_len": 24},
        "reward": {"functions": {"answer_match": 1.0}},
        "train": {"max_steps": 6, "per_device_batch_size": 16, "lr_scheduler": "constant", "save_steps": None},
        "logging": {"progress_bar": False, "plot_loss": False, "rollout_trace_steps": None},
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def train(tmp_path: Path, cfg: dict, exit_code: int = 0) -> tuple[list[dict], str]:
    """Run it; the log's alerts as (step, rule, metric) and stderr."""
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == exit_code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    log = [json.loads(line) for line in (Path(cfg["output_dir"]) / "trainer_log.jsonl").open()]
    return log, result.stderr


def alerts_of(log: list[dict]) -> list[tuple[int, str, str]]:
    return [(r["step"], r["health"]["rule"], r["health"]["metric"]) for r in log if "health" in r]


PAYS_LENGTH = '''
def pays_length(prompt, completion, answer, example):
    """Pays characters, not the answer: longer numbers and rambling score more."""
    return len(completion) / 30
'''


@pytest.mark.slow
def test_a_reward_that_pays_length_is_caught_hacking_and_running_to_the_cap(tmp_path: Path):
    """Sampled at temperature 1.5, GRPO on a length reward learns to write longer: the training reward rises (mean
    1.22 over steps 1-4, 1.71 over steps 5-8), held-out accuracy falls (0.31 -> 0.19 at step 4 -> 0.125 at step 8)
    and the responses run to the 24-token cap (share cut 0.09 -> 0.44 at step 5). About 1-2 minutes on 2 cores."""
    (tmp_path / "rewards.py").write_text(PAYS_LENGTH)
    cfg = grpo_run(
        tmp_path,
        rollout={"temperature": 1.5},
        reward={"functions": {f"{tmp_path / 'rewards.py'}:pays_length": 1.0}},
        train={"max_steps": 8, "per_device_batch_size": 32, "learning_rate": 5e-4, "eval_steps": 4},
        evaluation={"dataset": "arith_prompts_test", "max_samples": 16, "max_new_tokens": 24},
    )
    log, stderr = train(tmp_path, cfg)
    assert alerts_of(log) == [(5, "truncation", "response_length/clip_ratio"), (8, "reward_hacking", "val/score")]
    hacking = next(r["health"] for r in log if "health" in r and r["health"]["rule"] == "reward_hacking")
    val = {r["step"]: r["val/score"] for r in log if "val/score" in r}
    assert hacking["action"] == "warn" and hacking["value"] == val[8] <= val[4] < val[0]
    assert f"(mean score/mean of steps 1-4, then 5-8) while val/score went {val[4]:.3f} -> " in hacking["message"]
    assert f"health: reward_hacking at step 8: {hacking['message']}; likely fixes: " in stderr
    # each alert follows the record that fired it: the step-5 metrics, the step-8 validation
    before = [log[i - 1] for i, r in enumerate(log) if "health" in r]
    assert [r["step"] for r in before] == [5, 8] and "score/mean" in before[0] and "val/score" in before[1]


CONSTANT = '''
def always_one(prompt, completion, answer, example):
    return 1.0
'''


def test_a_warning_mid_run_prints_above_the_progress_bar_not_glued_to_it(tmp_path: Path):
    """With the progress bar on, the health warnings at step 3 are lines of their own: what stderr shows last on
    each line (after the last carriage return) is either the bar or a warning, never the bar with the first warning
    after it (as printed before: "grpo:  75%|...| 3/4 [...]WARNING rlfactory.engine.health: ...")."""
    (tmp_path / "rewards.py").write_text(CONSTANT)
    cfg = grpo_run(
        tmp_path,
        rollout={"prompts_per_step": 2, "num_samples": 2, "max_response_len": 8},
        reward={"functions": {f"{tmp_path / 'rewards.py'}:always_one": 1.0}},
        train={"max_steps": 4, "per_device_batch_size": 4},
        logging={"progress_bar": True},
    )
    log, stderr = train(tmp_path, cfg)
    assert (3, "zero_advantage", "rollout/zero_adv_groups") in alerts_of(log)
    shown = [line.split("\r")[-1] for line in stderr.splitlines()]
    warnings = [line for line in shown if "health: " in line]  # zero_advantage and truncation, both at step 3
    assert len(warnings) >= 2 and all(w.startswith("WARNING rlfactory.engine.health: health: ") for w in warnings)
    assert any(line.startswith("grpo: 100%") for line in stderr.replace("\r", "\n").splitlines())  # the bar ran


@pytest.mark.slow
def test_a_constant_reward_stops_the_run_with_a_checkpoint(tmp_path: Path):
    """Every group has one reward: zero_advantage (action stop) and constant_component (window 3) fire at step 3;
    the run saves checkpoint-3 and stops with exit code 3 and the fixes; resuming with the rule on warn finishes
    without alerting again."""
    (tmp_path / "rewards.py").write_text(CONSTANT)
    cfg = grpo_run(
        tmp_path,
        rollout={"prompts_per_step": 4},
        reward={"functions": {f"{tmp_path / 'rewards.py'}:always_one": 1.0}},
        train={"max_steps": 5, "learning_rate": 1e-4},
        health={"zero_advantage": {"action": "stop"}, "constant_component": {"window": 3}},
    )
    log, stderr = train(tmp_path, cfg, exit_code=STOP_EXIT_CODE)
    assert alerts_of(log) == [  # in the registry's (alphabetical) order
        (3, "constant_component", "reward/always_one/mean"),
        (3, "zero_advantage", "rollout/zero_adv_groups"),
    ]
    assert [r["rollout/zero_adv_groups"] for r in log if "score/mean" in r] == [1.0, 1.0, 1.0]
    out = Path(cfg["output_dir"])
    assert "stopped: health rule zero_advantage at step 3: groups with one reward for all samples" in stderr
    assert f"saved {out / 'checkpoint-3'}" in stderr and "turn on rollout.dynamic_sampling" in stderr
    assert (out / "checkpoint-3" / "trainer_state.json").is_file() and not (out / "model.safetensors").exists()
    cfg["health"]["zero_advantage"]["action"] = "warn"
    cfg["resume_from_checkpoint"] = "auto"
    log, _ = train(tmp_path, cfg)
    assert [r["step"] for r in log if "score/mean" in r] == [1, 2, 3, 4, 5]
    assert alerts_of(log) == [  # the alerts before the checkpoint, kept; none again after it
        (3, "constant_component", "reward/always_one/mean"),
        (3, "zero_advantage", "rollout/zero_adv_groups"),
    ]


@pytest.mark.slow
def test_a_huge_learning_rate_blows_up_both_kls(tmp_path: Path):
    """lr 3e-3 with two mini-batches per step: the KL to the reference per token reaches 0.86, 1.66, 2.86 and the
    policy-ratio KL 0.61, 0.30, 0.21 over the first three steps (both rules fire at step 3, their first full window);
    the policy loses the task (every group scores 0: zero_advantage) and rambles to the cap (truncation)."""
    cfg = grpo_run(tmp_path, algorithm={"kl_loss_coef": 0.05, "num_mini_batches": 2}, train={"learning_rate": 3e-3})
    log, _ = train(tmp_path, cfg)
    fired_rules = alerts_of(log)
    assert (3, "policy_kl", "actor/ppo_kl") in fired_rules and (3, "reference_kl", "actor/kl_loss") in fired_rules
    assert {rule for _, rule, _ in fired_rules} <= {"policy_kl", "reference_kl", "zero_advantage", "truncation"}


@pytest.mark.slow
def test_a_sampler_one_step_behind_a_huge_learning_rate_is_caught(tmp_path: Path):
    """rollout.overlap trains step k on samples of step k-1's weights; at lr 3e-3 those weights are far from the
    trainer's (measured: |log-prob difference| 1.3-2.0 nats per token from step 2, 1.4-4% of the tokens over the IS
    cap of 2): sampler_mismatch fires at its first window whose mean share is above 0.02 (step 4, measured 0.0265).
    Step 1 samples the weights it trains (nothing stale yet: 0 tokens over the cap)."""
    cfg = grpo_run(tmp_path, rollout={"overlap": True}, train={"max_steps": 5, "learning_rate": 3e-3})
    log, stderr = train(tmp_path, cfg)
    steps = [r for r in log if "score/mean" in r]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert steps[0]["rollout/ratio_over_cap"] == 0.0 and steps[0]["rollout/logprob_diff_max"] < 1e-3
    mismatch = [r["health"] for r in log if "health" in r and r["health"]["rule"] == "sampler_mismatch"]
    assert len(mismatch) == 1 and mismatch[0]["value"] > 0.02, mismatch
    fired_at = next(r["step"] for r in log if "health" in r and r["health"]["rule"] == "sampler_mismatch")
    assert fired_at in (4, 5)
    window = [r["rollout/ratio_over_cap"] for r in steps if fired_at - 3 < r["step"] <= fired_at]
    assert mismatch[0]["value"] == pytest.approx(sum(window) / 3, abs=1e-5)
    assert "with rollout.overlap (a sampler one step behind) lower train.learning_rate" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_a_healthy_run_fires_nothing(tmp_path: Path, overlap: bool):
    """The quickstart (examples/quickstart/grpo.yaml: the calculator tool, its five reward parts, a KL term, two
    mini-batches) at a test's size, 4 prompts x 8 samples for 6 steps: held-out accuracy rises and no rule fires;
    with rollout.overlap too (a sampler one step behind at the quickstart's learning rate stays under the IS cap).
    (The plain task without tools is not healthy on this model: its answers are nearly fixed per prompt, and in 6
    steps at 4 samples over 80% of the groups scored alike at step 6: zero_advantage fired, rightly.)"""
    from rlfactory.config.loader import read_yaml

    quickstart = read_yaml(Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "grpo.yaml")
    cfg = grpo_run(
        tmp_path,
        **{k: quickstart[k] for k in ("data", "agent", "reward", "algorithm")},
        rollout={**quickstart["rollout"], "prompts_per_step": 4, "overlap": overlap},
        train={**quickstart["train"], "max_steps": 6, "eval_steps": 3, "save_steps": None},
        evaluation={**quickstart["evaluation"], "max_samples": 16},
    )
    cfg["tools"] = quickstart["tools"]
    cfg["data"]["dataset_dir"] = str(DATA_DIR)
    log, stderr = train(tmp_path, cfg)
    assert alerts_of(log) == [] and "health:" not in stderr
    scores = [r["val/score"] for r in log if "val/score" in r]
    assert len(scores) == 3 and scores[-1] > scores[0], scores
    assert all("rollout/zero_adv_groups" in r for r in log if "score/mean" in r)
    if overlap:  # the mismatch was measured at every step, and stayed under the rule's ceiling
        over_cap = [r["rollout/ratio_over_cap"] for r in log if "score/mean" in r]
        assert len(over_cap) == 6 and max(over_cap) <= 0.02, over_cap


@pytest.mark.slow
def test_four_epochs_per_batch_clip_the_ratio_and_move_the_policy_too_far(tmp_path: Path):
    """ppo_epochs 4 x 2 mini-batches at lr 8e-4 on a dense reward (pays_length, temperature 1.5): the clip fraction
    climbs 0.17, 0.23, 0.24, 0.30 and |ppo_kl| reaches 0.35 at step 1 (measured)."""
    (tmp_path / "rewards.py").write_text(PAYS_LENGTH)
    cfg = grpo_run(
        tmp_path,
        rollout={"temperature": 1.5},
        reward={"functions": {f"{tmp_path / 'rewards.py'}:pays_length": 1.0}},
        algorithm={"ppo_epochs": 4, "num_mini_batches": 2},
        train={"max_steps": 4, "learning_rate": 8e-4},
    )
    log, _ = train(tmp_path, cfg)
    fired_rules = {(rule, metric): step for step, rule, metric in alerts_of(log)}
    assert fired_rules.get(("clip_fraction", "actor/pg_clipfrac")) in (3, 4), fired_rules
    assert fired_rules.get(("policy_kl", "actor/ppo_kl")) in (3, 4), fired_rules


PAYS_SHORT = '''
def pays_short(prompt, completion, answer, example):
    """Pays for stopping: the shorter the completion, the higher the reward."""
    return -len(completion) / 30
'''


@pytest.mark.slow
def test_a_reward_for_stopping_collapses_the_entropy(tmp_path: Path):
    """A reward that pays short completions, sampled at temperature 1.5 with lr 5e-3: the policy learns to end at
    once (18 tokens -> 1 by step 5) and its token entropy collapses (measured 0.58, 1.30, 1.37 over steps 1-3,
    0.096, 0.064, 0.048 over steps 5-7): entropy_collapse fires at step 7, the first window under a tenth of the
    start's. About 15 s on 2 idle cores, up to a minute on busy ones."""
    (tmp_path / "rewards.py").write_text(PAYS_SHORT)
    cfg = grpo_run(
        tmp_path,
        rollout={"temperature": 1.5},
        reward={"functions": {f"{tmp_path / 'rewards.py'}:pays_short": 1.0}},
        train={"max_steps": 7, "per_device_batch_size": 32, "learning_rate": 5e-3},
    )
    log, stderr = train(tmp_path, cfg)
    assert (7, "entropy_collapse", "actor/entropy") in alerts_of(log)
    entropy = [r["actor/entropy"] for r in log if "actor/entropy" in r]
    collapse = next(r["health"] for r in log if "health" in r and r["health"]["rule"] == "entropy_collapse")
    start, now = sum(entropy[:3]) / 3, sum(entropy[-3:]) / 3
    assert now < start / 10 and collapse["value"] == pytest.approx(now, abs=1e-5)
    assert f"entropy collapsed from {start:.3g} to {now:.3g}" in collapse["message"]
    lengths = [r["response_length/mean"] for r in log if "response_length/mean" in r]
    assert lengths[0] > 10 and lengths[-1] < 2  # it learned to stop: the collapse is the policy's, not sampling's
    assert "health: entropy_collapse at step 7" in stderr
