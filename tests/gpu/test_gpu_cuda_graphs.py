"""train.cuda_graphs on a GPU: the compiled layers replayed as CUDA graphs train exactly as without them.

Batches of varying widths (no packing: each new width records its graphs) and gradient accumulation (a micro-batch's
gradients are accumulated while the next micro-batch's graphs replay) are the cases where a replay could overwrite
something still in use; the losses of every step must match the compiled run without graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.engine.run_dir import read_log


def _losses(tmp_path: Path, name: str, finetuning: str, processes: int, **train: object) -> list[float]:
    cfg = {
        "stage": "sft",
        "output_dir": str(tmp_path / name),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": finetuning},
        "data": {"dataset": "arith_sft", "dataset_dir": str(DATA_DIR), "max_samples": 400, "shuffle": False},
        "lora": {"r": 8, "alpha": 16},
        "train": {
            "max_steps": 8,
            "per_device_batch_size": 8,
            "grad_accum_steps": 3,
            "learning_rate": 2e-3 if finetuning == "lora" else 2e-4,
            "lr_scheduler": "constant",
            "mixed_precision": "no",  # float32: the two runs' kernels are the same, so the losses agree closely
            "torch_compile": True,
            **train,
        },
        "distributed": {"num_processes": processes},
        "logging": {"progress_bar": False, "plot_loss": False},
    }
    result = run_cli("train", str(write_yaml(tmp_path / f"{name}.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in read_log(cfg["output_dir"]) if "loss" in r]


# the 2-process case first: a device call that runs out of time still has it
@pytest.mark.parametrize(("finetuning", "processes"), [("lora", 2), ("lora", 1), ("full", 1)])
def test_cuda_graphs_train_as_the_compiled_layers_do(tmp_path: Path, finetuning: str, processes: int):
    if torch.cuda.device_count() < processes:
        pytest.skip(f"needs {processes} GPUs")
    plain = _losses(tmp_path, "compiled", finetuning, processes)
    graphs = _losses(tmp_path, "graphs", finetuning, processes, cuda_graphs=True)
    assert len(plain) == len(graphs) == 8
    assert graphs == pytest.approx(plain, rel=1e-4), (plain, graphs)
