"""Allocator cache flushes in the logs (``engine.shared.allocator_flushes``): the online loop counts them per phase
(nested phases included), the offline loop per log line, and the ``memory_pressure`` health rule alerts on the first
line with flushes. On CPU the counter is 0; a counter the test advances stands in for the CUDA allocator's
``num_alloc_retries`` here, the real one is exercised in tests/gpu/test_gpu_allocator.py."""

from __future__ import annotations

import json

import torch

from rlfactory.config.health_schema import HealthConfig
from rlfactory.engine import offline
from rlfactory.engine.health import HEALTH_RULES, HealthMonitor
from rlfactory.engine.online.phases import PhaseTimer
from rlfactory.engine.shared import allocator_flushes


class Counter:
    """A cumulative flush count that the test advances, as the allocator's would grow."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        return self.n


def test_on_cpu_the_counter_is_zero():
    assert not torch.cuda.is_available()
    assert allocator_flushes() == 0


def test_flushes_count_in_the_phase_they_happen_in_and_in_the_enclosing_step():
    count = Counter()
    timer = PhaseTimer(flushes=count)
    with timer("step"):
        with timer("gen"):
            count.n += 2
        with timer("update_actor"):
            pass
        with timer("gen"):  # a phase that repeats adds up
            count.n += 1
        count.n += 4  # outside any inner phase: the step's only
    assert timer.pop_flushes() == {"step": 7, "gen": 3}
    assert timer.pop_flushes() == {}  # cleared
    assert set(timer.pop()) == {"timing_s/step", "timing_s/gen", "timing_s/update_actor"}


def test_the_offline_clock_reports_the_flushes_since_its_last_lap(monkeypatch):
    count = Counter()
    count.n = 5  # flushes before the run started are not the run's
    monkeypatch.setattr(offline, "allocator_flushes", count)
    clock = offline._Clock(start_step=0)
    count.n += 3
    assert clock.flushes_since_lap() == 3
    assert clock.flushes_since_lap() == 0
    count.n += 1
    assert clock.flushes_since_lap() == 1


def _monitor(tmp_path):
    rules = {name: {"action": "ignore"} for name in HEALTH_RULES.names() if name != "memory_pressure"}
    return HealthMonitor(HealthConfig(**rules), tmp_path)


def test_memory_pressure_alerts_once_on_the_first_line_with_flushes_and_says_what_to_lower(tmp_path):
    monitor = _monitor(tmp_path)
    assert monitor.observe({"step": 1, "loss": 0.5, "alloc_flushes": 0}) == []
    assert monitor.observe({"step": 2, "loss": 0.4}) == []  # a CPU line has no count
    (alert,) = monitor.observe({"step": 3, "loss": 0.3, "alloc_flushes": 3})
    assert (alert.rule, alert.metric, alert.value, alert.action) == ("memory_pressure", "alloc_flushes", 3.0, "warn")
    assert "emptied its cache 3 time(s) since the last logged step: the run is at its GPU memory limit" in (
        alert.message
    )
    assert "train.per_device_batch_size" in alert.fixes and "gradient_checkpointing" in alert.fixes
    assert monitor.observe({"step": 4, "loss": 0.3, "alloc_flushes": 5}) == []  # once per run
    logged = [json.loads(line) for line in (tmp_path / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["health"]["rule"] for r in logged] == ["memory_pressure"] and logged[0]["step"] == 3


def test_online_memory_pressure_names_the_phases_that_flushed(tmp_path):
    record = {"step": 7, "perf/alloc_flushes": 2, "perf/alloc_flushes/gen": 2, "timing_s/gen": 1.0}
    (alert,) = _monitor(tmp_path).check(record)
    assert alert.metric == "perf/alloc_flushes"
    assert "emptied its cache 2 time(s) since the last logged step (in gen 2)" in alert.message


def test_memory_pressure_can_stop_the_run(tmp_path):
    rules = {name: {"action": "ignore"} for name in HEALTH_RULES.names()} | {"memory_pressure": {"action": "stop"}}
    monitor = HealthMonitor(HealthConfig(**rules), tmp_path)
    monitor.observe({"step": 1, "perf/alloc_flushes": 1})
    assert monitor.stop is not None and monitor.stop.rule == "memory_pressure"
