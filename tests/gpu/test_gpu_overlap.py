"""Overlapped generation's CUDA streams (``engine.online.overlap.Prefetch``): the round generates on a stream of the
highest priority, after what the main thread enqueued before launching it, and the main thread's stream waits for
the round's kernels once it is taken. Long GPU work on each side makes a missing wait show as a wrong value."""

from __future__ import annotations

import pytest
import torch

from rlfactory.engine.online.overlap import Prefetch, Round
from rlfactory.errors import UserError


def _busy(size: int = 4096, times: int = 20) -> torch.Tensor:
    """Some milliseconds of GPU work on the current stream."""
    a = torch.randn(size, size, device="cuda")
    for _ in range(times):
        a = torch.tanh(a @ a * 1e-3)
    return a


def test_the_round_runs_on_a_high_priority_stream_ordered_with_the_main_thread():
    torch.cuda.set_device(0)
    weights = torch.zeros(1 << 20, device="cuda")
    seen: dict[str, float] = {}
    out = torch.zeros(1 << 20, device="cuda")

    def generate(round_: Round) -> Round:
        stream = torch.cuda.current_stream()
        seen["priority"] = stream.priority
        seen["default"] = float(stream == torch.cuda.default_stream())
        seen["weights"] = float(weights.sum().item())  # the main thread's write before launch must be visible
        _busy()
        out.fill_(2.0)  # after long work on the round's stream: the main stream must wait for it
        return round_

    prefetch = Prefetch()
    _busy()
    weights.fill_(1.0)  # the "weight sync", queued behind long work on the main stream
    prefetch.launch(Round([], [], 0, {}), generate)
    taken = prefetch.take()
    total = out.sum().item()  # on the main stream, after take
    assert taken is not None
    assert seen["priority"] < torch.cuda.default_stream().priority and not seen["default"]  # lower: sooner
    assert seen["weights"] == weights.numel()
    assert total == 2.0 * out.numel()


def test_a_confined_update_runs_on_a_green_stream_ordered_with_the_main_thread():
    """``rollout.overlap_update_sms``: while a round is pending, the main thread's kernels go to a green context's
    stream, which waits for what the main stream had queued, and the main stream waits for it after."""
    torch.cuda.set_device(0)
    params = torch.zeros(1 << 20, device="cuda")
    prefetch = Prefetch(update_sms=16)  # CUDA is up: the green context is made here
    assert prefetch.green_stream is not None
    started = []

    def generate(round_: Round) -> Round:
        started.append(1)
        _busy(times=10)
        return round_

    _busy()
    params.fill_(1.0)  # queued behind long work on the main stream: the confined update must see it
    prefetch.launch(Round([], [], 0, {}), generate)
    main = torch.cuda.current_stream()
    with prefetch.confined():
        inside = torch.cuda.current_stream()
        seen = params.sum()
        _busy(times=10)
        params.mul_(3.0)  # after long work on the green stream: the main stream must wait for it
    total = params.sum().item()
    assert prefetch.take() is not None and started
    assert inside != main and torch.cuda.current_stream() == main
    assert seen.item() == params.numel() and total == 3.0 * params.numel()
    with prefetch.confined():  # no round pending: the main stream itself
        assert torch.cuda.current_stream() == main
    with pytest.raises(UserError, match="rollout.overlap_update_sms is 100000, but GPU 0 has"):
        Prefetch(update_sms=100_000)
