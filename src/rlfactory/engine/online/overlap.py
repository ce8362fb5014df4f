"""Overlapped generation (``rollout.overlap``): step k+1's rollouts are generated while step k trains.

One step off-policy, as AReaL's and verl's one-step-off schedules::

    main thread    | take k (wait) | sync sampler <- W_k | launch k+1 | score, passes, update W_k -> W_k+1 | take k+1
    sampler thread                                      | generate k+1 on W_k .......................|

- the sampler is a copy of the policy (``rollout.hf.CopyBackend``, sampling from its own generator), or with
  ``rollout.backend: vllm`` the engine itself, which holds its own weights; it is synced only while no generation
  runs (after the pending round was taken, or waited for: validation on the vLLM engine), so the update never races
  it.
- what is shared state stays on the main thread: the prompt order (``LoopState.cursor``) and the group ids are
  drawn when a round is launched (``phases.draw_round``), scoring and every collective (the gathers over processes)
  run after it is taken. The thread only generates.
- each round carries the version of the weights that generated it (``Round.version``: the steps done when the
  sampler was last synced), and the sampler's log-probs come back with every completion: the trainer's importance-
  sampling correction and the mismatch metrics (``rollout/logprob_diff_*``, ``rollout/ratio_over_cap``) measure and
  correct the staleness, as they do for vLLM's precision mismatch.
- on CUDA the thread generates on a stream of the highest priority: decoding is a long chain of small kernels, and
  on the default stream each waited behind the update's large ones (generation beside the update took 1.25 s
  instead of 0.81 s on an H200, so overlap did not pay on one GPU); the GPU's block scheduler starts a high-priority
  stream's blocks first as SMs free up, and CUDA graphs replay at the priority of the stream they are launched on.
  Events order the streams: the round waits for what the main thread enqueued before launching it (the sampler's
  weight sync), and the main thread's stream waits for the round's kernels once it is taken. (vLLM's runner caches
  the stream it first ran on; ``rollout.vllm.VLLMBackend.generate`` points it at this thread's.)
- the priority alone does not keep decoding fast beside the update (on an H200 a round beside a 7B update took
  about as long as the two one after the other): a running block is not preempted, and the update's large kernels
  fill every SM. ``rollout.overlap_update_sms`` confines the main thread's kernels to that many SMs while a round
  is pending (``Prefetch.confined``: a stream of a CUDA green context), leaving the rest to the round.
- a checkpoint taken while a round is pending records the prompt cursor and group id from before that round
  (``rewind``): a resumed run draws the same prompts again, and generates its first step from the checkpoint's
  weights (the weights one step older are not saved).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rlfactory.errors import UserError


@dataclass
class Round:
    """One generation round: this rank's share of the round's prompts (each repeated ``copies`` times) with their
    group ids, the weights' version that generates it, and once generated, the sampler's output."""

    examples: list[dict]
    groups: list[int]
    version: int
    rewind: dict[str, Any]  # LoopState's cursor, group and epoch before this round drew its prompts
    completions: list[Any] = field(default_factory=list)
    finals: list[str | None] = field(default_factory=list)
    seen: list[dict] = field(default_factory=list)  # the examples as rewards see them (multi-turn: with the episode)
    seconds: float = 0.0  # generation time (in the thread: hidden behind the update)


def generate_round(rollouts: Any, round_: Round, params: Any, autocast: Callable[[], Any]) -> Round:
    """Generate the round's samples with ``rollouts`` (in this thread's autocast: its state is per thread)."""
    start = time.perf_counter()
    with autocast():
        round_.completions, round_.finals, round_.seen = rollouts.generate(round_.examples, params)
    round_.seconds = time.perf_counter() - start
    return round_


class Prefetch:
    """At most one round generating in a daemon thread (a hung environment step must not keep the process alive at
    exit, which an executor's joined worker would); ``take`` waits for it and re-raises what it raised."""

    def __init__(self, update_sms: int | None = None) -> None:
        self.pending: tuple[Round, Future] | None = None
        self.stream: Any = None  # CUDA: the thread's high-priority stream, made at the first launch
        self.done: Any = None  # CUDA: an event after the pending round's kernels
        self.update_sms = update_sms  # rollout.overlap_update_sms
        self.green: Any = None  # CUDA: the green context of update_sms SMs (its streams die with it: kept here)
        self.green_stream: Any = None
        if update_sms is not None and _current_cuda_device() is not None:
            self._make_green()  # now: a GPU without green contexts is refused before the first step

    @contextmanager
    def confined(self) -> Iterator[None]:
        """While a round is pending, this thread's CUDA kernels run on ``update_sms`` SMs only (a stream of a
        green context); a no-op without ``update_sms``, a pending round or CUDA. The green stream waits for what
        this thread enqueued before, and this thread's stream for the green one after, so tensors cross the
        boundary in order (and a block the allocator hands out again on the green stream was last used before)."""
        device = _current_cuda_device() if self.update_sms is not None and self.pending is not None else None
        if device is None:
            yield
            return
        import torch

        if self.green is None:
            self._make_green()
        outer = torch.cuda.current_stream()
        self.green_stream.wait_stream(outer)
        try:
            with torch.cuda.stream(self.green_stream):
                yield
        finally:
            outer.wait_stream(self.green_stream)

    def _make_green(self) -> None:
        device = _current_cuda_device()
        assert self.update_sms is not None and device is not None
        self.green = _green_context(self.update_sms, device)
        self.green_stream = self.green.Stream()

    def launch(self, round_: Round, generate: Callable[[Round], Round]) -> None:
        assert self.pending is None, "one round in flight at a time"
        future: Future = Future()
        device = _current_cuda_device()
        ready = done = None
        if device is not None:
            import torch

            if self.stream is None:  # a priority below the range maps to the highest the device has
                self.stream = torch.cuda.Stream(device, priority=-100)
            ready, done = torch.cuda.Event(), torch.cuda.Event()
            ready.record()  # after what this thread enqueued so far: the sampler's weight sync
        stream, self.done = self.stream, done

        def work() -> None:
            try:
                if device is None:
                    future.set_result(generate(round_))
                    return
                import torch

                torch.cuda.set_device(device)  # the current CUDA device is per thread: a new one starts on device 0
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    result = generate(round_)
                    done.record(stream)
                future.set_result(result)
            except BaseException as exc:  # re-raised on the main thread by take()
                future.set_exception(exc)

        threading.Thread(target=work, daemon=True, name="rollout-overlap").start()
        self.pending = (round_, future)

    def _join_streams(self) -> None:
        """This thread's stream waits for the finished round's kernels (CUDA; the round's future is done)."""
        if self.done is not None:
            import torch

            torch.cuda.current_stream().wait_event(self.done)
            self.done = None

    def take(self) -> Round | None:
        """The pending round once generated (None if none was launched)."""
        if self.pending is None:
            return None
        _, future = self.pending
        self.pending = None
        try:
            return future.result()
        finally:
            self._join_streams()

    def rewind(self) -> dict[str, Any]:
        """LoopState fields as they were before the pending round drew its prompts ({} when none is pending)."""
        return {} if self.pending is None else dict(self.pending[0].rewind)

    def finish(self) -> None:
        """Wait until the pending round has generated, keeping it pending (``take`` still returns it, or raises what
        it raised): before the sampler is used on this thread (a vLLM engine that validates or is synced)."""
        if self.pending is not None:
            self.pending[1].exception()
            self._join_streams()

    def wait(self) -> None:
        """Let a pending round finish (its result is dropped): before the sampler is closed at the end of a run."""
        self.finish()
        self.pending = None


def _green_context(sms: int, device: int) -> Any:
    """A CUDA green context of ``sms`` SMs on ``device``, or a clear error where torch or the driver has none."""
    import torch

    available = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= available:
        raise UserError(
            f"rollout.overlap_update_sms is {sms}, but GPU {device} has {available} SMs; set it below {available}"
        )
    try:
        from torch.cuda.green_contexts import GreenContext

        return GreenContext.create(num_sms=sms, device_id=device)
    except Exception as exc:  # torch < 2.9 (no module), a build or driver without green contexts
        raise UserError(
            f"rollout.overlap_update_sms needs CUDA green contexts, which this torch/driver does not give "
            f"({type(exc).__name__}: {exc}); remove overlap_update_sms"
        ) from exc


def _current_cuda_device() -> int | None:
    """This thread's CUDA device, or None without CUDA (torch imported only where it is already loaded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()
