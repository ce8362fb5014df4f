"""Allocator cache flushes in the logs (``engine.shared.allocator_flushes``): the online loop counts them per phase
(nested phases included), the offline loop per log line, and the first line with flushes warns once. On CPU the
counter is 0; a fake counter stands in for the CUDA allocator's ``num_alloc_retries`` here, the real one is
exercised in tests/gpu/test_gpu_allocator.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from rlfactory.config.schema import TrainConfig
from rlfactory.engine import offline
from rlfactory.engine.host_reads import HostCopy
from rlfactory.engine.online.phases import PhaseTimer
from rlfactory.engine.shared import NonFiniteGuard, allocator_flushes


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


def test_the_first_offline_line_with_flushes_warns_once_and_says_what_to_lower(tmp_path, caplog):
    logged: list[dict] = []
    setup = SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=1, is_main_process=True, log_with=None),
        health=SimpleNamespace(observe=logged.append),
        warned_flushes=False,
    )
    guard = NonFiniteGuard(TrainConfig(), setup.accelerator, tmp_path)
    bar = SimpleNamespace(set_postfix=lambda **_: None)

    def line(step: int, flushes: int) -> offline._PendingLog:
        # [loss sum, loss weight, tokens, peak GB, flushes]: _queue_log's layout
        values = HostCopy(torch.tensor([0.5 * step, 1.0, 100.0, 0.0, float(flushes)], dtype=torch.float64))
        record = {"step": step, "epoch": 0.1 * step, "lr": 1e-3}
        return offline._PendingLog(record, 1.0, {"elapsed_s": 1.0, "eta_s": 1.0}, ["loss"], values)

    with caplog.at_level(logging.WARNING, logger="rlfactory.engine.offline"):
        offline._write_log(setup, tmp_path, line(1, 0), guard, bar)
        assert not caplog.records
        offline._write_log(setup, tmp_path, line(2, 3), guard, bar)
        offline._write_log(setup, tmp_path, line(3, 2), guard, bar)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("step 2: torch's CUDA allocator flushed its cache 3 time(s)")
    assert "train.per_device_batch_size" in warnings[0] and "alloc_flushes" in warnings[0]
    assert [r["loss"] for r in logged] == [0.5, 1.0, 1.5]
