"""Shared fixtures: the bundled tiny model, a CLI runner, and YAML helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = Path(os.environ.get("RLFACTORY_TEST_MODEL", ROOT / "data" / "models" / "tiny-arith"))
DATA_DIR = ROOT / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _preload_native_stacks() -> None:
    """Child processes of the tests (CLI runs, torchrun ranks) print the native stack of a thread that aborts or
    crashes (tests/native/abort_backtrace.c): a rank has now and then died of "terminate called without an active
    exception" in a C++ thread, where Python's faulthandler shows no frame. Built once per source version with the
    C compiler; without one, nothing changes."""
    import hashlib
    import shutil
    import tempfile

    source = ROOT / "tests" / "native" / "abort_backtrace.c"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not source.exists():
        return
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    library = Path(tempfile.gettempdir()) / f"rlfactory-abort-backtrace-{digest}.so"
    if not library.exists():
        partial = library.with_name(f"{library.name}.{os.getpid()}")  # xdist workers build side by side
        built = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(partial), str(source)], check=False)
        if built.returncode != 0:
            return
        os.replace(partial, library)
    preloaded = os.environ.get("LD_PRELOAD", "")
    if str(library) not in preloaded.split(":"):
        os.environ["LD_PRELOAD"] = f"{preloaded}:{library}".strip(":")


_preload_native_stacks()


def failure_output(stderr: str, tail: int = 4000) -> str:
    """The end of a failed run's stderr, with the native stack of an aborted thread (tests/native) kept in front
    when the tail would cut it off: torchrun's report of the stopped ranks comes after it."""
    start = stderr.rfind("*** native stack of the thread")
    if 0 <= start < len(stderr) - tail:
        return f"{stderr[start : start + 4000]}\n...\n{stderr[-tail:]}"
    return stderr[-tail:]


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 900, cold: bool = False
) -> subprocess.CompletedProcess:
    """Run the real CLI in its own process (exit code, stdout and stderr as a user sees them).

    The process is forked from a warm one that imported torch, transformers and the project already
    (``tests/cli_zygote.py``), one per environment; ``cold=True`` (or ``RLFACTORY_TEST_WARM_CLI=0``) starts a plain
    ``python -m rlfactory`` instead, for what depends on a fresh interpreter (import times, lazy imports)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "rlfactory", *args]
    if not cold and os.environ.get("RLFACTORY_TEST_WARM_CLI", "1") != "0":
        from tests.warm_cli import run_warm

        result = run_warm(command, args, cwd or ROOT, env, timeout)
        if result is not None:
            return result
    return subprocess.run(command, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def sft_config(tmp_path: Path) -> dict:
    """A fast SFT run on the bundled model and data."""
    return {
        "stage": "sft",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "lora"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"dataset": "arith_sft", "dataset_dir": str(DATA_DIR), "max_samples": 64, "cutoff_len": 128},
        "train": {"max_steps": 4, "per_device_batch_size": 8, "learning_rate": 1e-3},
        "logging": {"progress_bar": False, "plot_loss": False},
    }


def expect_train_error(tmp_path: Path, cfg: dict, *fragments: str) -> None:
    """`rlfactory train` on bad input: exit 2, no traceback, every fragment in the message, nothing written."""
    result = run_cli("train", str(write_yaml(tmp_path / "bad.yaml", cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert not Path(cfg["output_dir"]).exists()


def random_prompts(n: int, copies: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random ordinary token ids (3..999 of the tiny model), each ``copies`` times in a row. On
    them the tiny model's next-token distributions are flat; on the task's prompts it is too sure of itself for a
    sampling setting such as min_p to show in a few hundred tokens."""
    import torch

    ids = torch.randint(3, 1000, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()
    return [prompt for prompt in ids for _ in range(copies)]


def sampled_prob_ratios(model, prompts: list[list[int]], completions: list) -> torch.Tensor:
    """p(sampled token) / p(most likely token) under the model's own softmax (temperature 1), for every sampled
    token: min_p sampling keeps exactly the tokens whose ratio is at least min_p."""
    import torch

    ratios = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = completion.token_ids
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
            probs = logits.softmax(-1)
            ratios.append(probs[torch.arange(len(ids)), ids] / probs.max(-1).values)
    return torch.cat(ratios)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the files that hold end-to-end (`slow`) tests first, each file kept together (module fixtures are set up
    once): pytest-xdist hands tests out in this order, so the minutes-long ones start early instead of leaving one
    worker busy with them at the end while the other idles (test_webui.py sorts last alphabetically)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file is kept
