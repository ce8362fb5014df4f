"""A steady-state offline step on a GPU never makes the host wait for the GPU in our code (``bench/sync_probe.py``:
torch's CUDA sync debug mode from the third optimizer step, each synchronizing call counted by site).

The waits allowed are a graph's compilation (inductor folds constants on the host: the 16 waits an H200 showed
inside ``add_node_replacement``, a compile-time pass; the packed rows' widths change, so an early step recompiles
once for dynamic shapes), the run's end (the final save, the weights' finite check) and two inside transformers'
mask building that no input of ours avoids: whether a padding mask is all ones (``_ignore_causal_mask_sdpa``; packed
batches have none) and whether a packed row holds more than one sequence (``find_packed_sequence_indices``). A batch
copied from pageable memory (3.5 waits per step before the loaders pinned their batches), a ``.item()`` in the loop
or a boolean index on the device would show here with its line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT

END_OF_RUN = ("(save_model)", "(save_reward_model)", "(nonfinite_weights)", "<- set_sync_debug_mode")
IN_TRANSFORMERS = ("<- _ignore_causal_mask_sdpa", "<- find_packed_sequence_indices")


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import sync_probe

        yield sync_probe
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_a_steady_state_sft_step_never_waits_for_the_gpu(probe, tmp_path: Path, finetuning: str):
    raw = probe.probe_config("sft", finetuning, steps=10, compiled=True, packing=True, out=str(tmp_path))
    sites, steps = probe.count_syncs(raw)
    assert steps == 8
    ours = {
        site: n
        for site, n in sites.items()
        if not site.endswith(IN_TRANSFORMERS)
        and not any(marker in site for marker in END_OF_RUN)
        and not site.startswith(probe.COMPILING)
    }
    assert ours == {}, f"synchronizing calls in {steps} steps: {ours}"
