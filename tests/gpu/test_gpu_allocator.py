"""The online stages' allocator default on CUDA (``engine.environment.apply_online_allocator_setting``): set after
torch's import and before the first allocation, the segments that follow are expandable; a user's
``PYTORCH_CUDA_ALLOC_CONF`` is left alone. Each case in a fresh process: the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import torch
from rlfactory.config.schema import RunConfig
from rlfactory.engine.environment import apply_online_allocator_setting
cfg = RunConfig.model_validate({
    "stage": "grpo", "output_dir": "/tmp/unused", "model": {"name_or_path": "unused"},
    "data": {"dataset": "unused"}, "rollout": {"backend": "vllm"}, "reward": {"functions": {"answer_match": 1.0}},
})
print("applied", apply_online_allocator_setting(cfg))
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
segments = torch.cuda.memory._snapshot()["segments"]
print("expandable", all(s.get("is_expandable") for s in segments), len(segments))
"""


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_online_runs_allocate_expandable_segments():
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = _run(env)
    assert "applied expandable_segments:True" in out and "expandable True" in out, out


def test_the_users_allocator_setting_wins():
    out = _run({**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert "applied None" in out and "expandable False" in out, out


FLUSH_CODE = """
import torch
from rlfactory.engine.online.phases import PhaseTimer
from rlfactory.engine.shared import allocator_flushes
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(0.25)  # the allocator's limit: a quarter of the card
first = torch.empty(int(total * 0.15), dtype=torch.uint8, device="cuda")
del first  # cached, not returned to the driver
before = allocator_flushes()
timer = PhaseTimer()
with timer("step"), timer("update_actor"):
    # does not fit beside the cached 15% within the 25% limit: the allocator frees its cache and retries
    second = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
print("flushes", allocator_flushes() - before, sorted(timer.pop_flushes().items()))
"""


def test_a_cache_flush_is_counted_in_the_phase_that_caused_it():
    """``allocator_flushes`` reads the allocator's own retry count: an allocation that fits only after the cache is
    emptied counts once, in the phase it happened in. (Classic segments: an expandable segment would grow into the
    freed block instead of flushing, so this layout does not force a flush there.)"""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    out = subprocess.run([sys.executable, "-c", FLUSH_CODE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "flushes 1 [('step', 1), ('update_actor', 1)]" in out.stdout, out.stdout
