"""SFT on a GPU in bf16 through the real CLI: LoRA and full fine-tuning, padded and packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, run_cli, write_yaml

from rlfactory.engine.run_dir import read_log


def _cfg(tmp_path: Path, finetuning: str, packing: bool, attn: str = "sdpa") -> dict:
    return {
        "stage": "sft",
        "output_dir": str(tmp_path / f"{finetuning}-{packing}-{attn}"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": finetuning, "dtype": "auto",
                  "attn_implementation": attn},
        "data": {"dataset": "arith_sft", "eval_dataset": "arith_sft_eval", "dataset_dir": str(DATA_DIR),
                 "max_samples": 2000, "packing": packing},
        "lora": {"r": 8, "alpha": 16},
        "train": {"num_epochs": 2, "per_device_batch_size": 16, "learning_rate": 2e-3 if finetuning == "lora" else 2e-4,
                  "warmup_ratio": 0.1, "eval_steps": 50, "mixed_precision": "auto"},
        "logging": {"progress_bar": False, "plot_loss": False},
    }


@pytest.mark.parametrize(
    ("finetuning", "packing", "attn"), [("lora", False, "sdpa"), ("full", True, "sdpa"), ("lora", True, "sdpa_varlen")]
)
def test_bf16_sft_learns_on_gpu(tmp_path: Path, finetuning: str, packing: bool, attn: str):
    """sdpa_varlen: each micro-batch one packed row through torch's flash-attention varlen kernel."""
    cfg = _cfg(tmp_path, finetuning, packing, attn)
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mixed precision bf16" in result.stdout
    evals = [r["eval_loss"] for r in read_log(cfg["output_dir"]) if "eval_loss" in r]
    assert evals[-1] < evals[0] * 0.98, evals
    if finetuning == "full":
        from safetensors import safe_open

        with safe_open(str(Path(cfg["output_dir"]) / "model.safetensors"), "pt") as f:
            # dtype auto: fp32 master weights for full fine-tuning (bf16 autocast does the compute)
            assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float32
