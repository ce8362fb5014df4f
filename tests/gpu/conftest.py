"""GPU tests: run on the lent GPU machine (see docs/BENCHMARKS.md for the command); skipped without CUDA."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
