"""`rlfactory eval`: the report's metrics against hand-computed values, the command on the bundled tool-calling
model (k samples through the agent loop), greedy eval == the in-run evaluation on the same prompts, bad input."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from itertools import combinations
from math import comb
from pathlib import Path

import pytest
import yaml
from tests.conftest import DATA_DIR, ROOT, run_cli

from rlfactory.engine.eval_metrics import EVAL_METRICS, Attempts, pass_at_k, report_ks, summarise
from rlfactory.errors import UserError

TOOL_MODEL = ROOT / "data" / "models" / "tiny-arith-tools"


def _problem(scores, answers=None) -> Attempts:
    n = len(scores)
    return Attempts(tuple(scores), tuple(answers or [None] * n), (10,) * n, (False,) * n)


# --------------------------------------------------------------------------- the metrics
def test_pass_at_k_is_the_unbiased_estimator_hand_computed():
    """n = 5 samples, c = 2 correct: pass@k = 1 - C(3, k) / C(5, k) = 2/5, 7/10, 9/10, 1, 1; the same as the share of
    k-subsets of the 5 samples holding a correct one (counted by enumeration)."""
    expected = [Fraction(2, 5), Fraction(7, 10), Fraction(9, 10), Fraction(1), Fraction(1)]
    correct = [True, False, True, False, False]
    for k, value in enumerate(expected, start=1):
        assert pass_at_k(5, 2, k) == pytest.approx(float(value), abs=1e-15)
        subsets = list(combinations(correct, k))
        assert Fraction(sum(any(s) for s in subsets), comb(5, k)) == value
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(5, 2, 6)
    # averaged over problems, correct at score >= threshold: (7/10 + 0) / 2 at threshold 1, both problems' own at 0.5
    problems = [_problem([1.0, 0.0, 1.0, 0.0, 0.0]), _problem([0.5, 0.0, 0.0, 0.0, 0.0])]
    assert EVAL_METRICS.get("pass")(problems, 2, 1.0) == pytest.approx(0.35, abs=1e-15)
    assert EVAL_METRICS.get("pass")(problems, 2, 0.5) == pytest.approx((0.7 + 0.4) / 2, abs=1e-15)


def test_maj_at_k_votes_on_the_extracted_answers():
    """Answers 3, 4, 4, 3, 5 (4 is right): maj@1 votes '3' (wrong), maj@2 ties 3/4 -> the first seen, '3' (wrong),
    maj@3 '4' (right), maj@4 ties again -> '3', maj@5 likewise. A problem without any extracted answer is wrong;
    completions without one do not vote."""
    voted = _problem([0.0, 1.0, 1.0, 0.0, 0.0], ["3", "4", "4", "3", "5"])
    maj = EVAL_METRICS.get("maj")
    assert [maj([voted], k, 1.0) for k in range(1, 6)] == [0.0, 0.0, 1.0, 0.0, 0.0]
    silent = _problem([0.0, 1.0, 1.0], [None, "7", "7"])
    none = _problem([0.0, 0.0], [None, None])
    assert maj([silent], 1, 1.0) == 0.0 and maj([silent], 3, 1.0) == 1.0
    assert maj([voted, silent, none], 3, 1.0) == pytest.approx(2 / 3)


def test_summary_names_and_unknown_metric_names():
    assert report_ks(1) == [1] and report_ks(4) == [1, 2, 4] and report_ks(6) == [1, 2, 4, 6]
    p = Attempts((1.0, 0.0), ("1", "2"), (10, 30), (False, True), (2, 0), (1, 0), (2, 0))
    out = summarise([p], samples=2, tools=True)
    assert out == {
        "maj@1": 1.0, "maj@2": 1.0, "mean_length": 20.0, "mean_score": 0.5, "pass@1": 0.5, "pass@2": 1.0,
        "tool_calls_per_problem": 1.0, "tool_error_rate": 0.5, "truncation_rate": 0.5,
    }  # fmt: skip
    assert "tool_calls_per_problem" not in summarise([p], samples=2)  # no tools ran: not reported
    with pytest.raises(UserError, match="valid names: maj, mean_length, mean_score, pass, "):
        EVAL_METRICS.get("pass@k")


# --------------------------------------------------------------------------- the command
# measured: 17 s and 19 s with the machine's 2 cores at load 5, 41 s and 64 s at load 10
@pytest.mark.slow
def test_sampled_eval_with_tools_on_the_bundled_model(tmp_path: Path):
    out = tmp_path / "eval"
    result = run_cli(
        "eval", str(TOOL_MODEL), "--tools", "calculator", "--dataset", "arith_tool_prompts_test",
        "--max-samples", "16", "--samples", "4", "--temperature", "1.0", "--max-new-tokens", "80", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = report["metrics"]
    assert (report["problems"], report["samples_per_problem"], report["completions"], len(rows)) == (16, 4, 64, 64)
    assert set(metrics) == {
        "mean_score", "pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4", "mean_length", "truncation_rate",
        "tool_calls_per_problem", "tool_error_rate",
    }  # fmt: skip
    assert metrics["pass@1"] == pytest.approx(metrics["mean_score"], abs=1e-12)  # 0/1 scores: pass@1 = mean score
    assert metrics["pass@4"] >= metrics["pass@2"] >= metrics["pass@1"] > 0
    assert metrics["tool_calls_per_problem"] > 0.5  # the model calls the calculator on most prompts
    # the report follows from the per-sample lines: every prompt's 4 samples, each with its score and answer
    assert [r["problem"] for r in rows] == [i for i in range(16) for _ in range(4)]
    assert all({"prompt", "completion", "answer", "extracted", "score", "tool_calls", "turns"} <= set(r) for r in rows)
    correct = [sum(r["score"] >= 1.0 for r in rows if r["problem"] == i) for i in range(16)]
    assert metrics["pass@4"] == pytest.approx(sum(c > 0 for c in correct) / 16)
    assert metrics["mean_length"] == pytest.approx(sum(r["length"] for r in rows) / 64)
    assert metrics["tool_calls_per_problem"] == pytest.approx(sum(r["tool_calls"] for r in rows) / 64)
    assert "pass@4" in result.stdout and "report.json" in result.stdout
    assert len({r["completion"] for r in rows}) > 16  # sampled: a prompt's completions differ


@pytest.mark.slow
def test_greedy_eval_of_a_run_dir_scores_what_the_run_evaluation_scores(tmp_path: Path):
    """A run's output dir (the bundled model with an sft run's config.yaml beside it): `rlfactory eval RUN` takes the
    run's evaluation settings (dataset, tools, budget) and gives the in-run evaluation's score, sample by sample."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfactory.config.loader import load_config
    from rlfactory.stages.common import evaluate_generation, load_eval_prompts

    run = tmp_path / "run"
    shutil.copytree(TOOL_MODEL, run)
    cfg = {
        "stage": "sft",
        "output_dir": str(run),
        "model": {"name_or_path": str(ROOT / "data" / "models" / "tiny-arith"), "finetuning": "full"},
        "data": {"dataset": "arith_tool_sft", "dataset_dir": str(DATA_DIR)},
        "evaluation": {
            "dataset": "arith_tool_prompts_test", "max_samples": 8, "max_new_tokens": 80, "tools": ["calculator"],
        },
    }  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    result = run_cli("eval", str(run), "--out", str(tmp_path / "eval"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert (report["problems"], report["temperature"], report["tools"]) == (8, 0.0, ["calculator"])

    config = load_config(run / "config.yaml")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(run), AutoTokenizer.from_pretrained(run)
    in_run = evaluate_generation(model, tokenizer, load_eval_prompts(config), config.evaluation)
    assert report["metrics"]["mean_score"] == in_run["score"]
    assert [r["completion"] for r in rows] == [s["completion"] for s in in_run["samples"]]
    assert sum(r["tool_calls"] for r in rows) > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--dataset", "no_such_set"], "dataset 'no_such_set' is not in"),
        (["--dataset", "arith_tool_prompts_test", "--metric", "accuracy"], "valid names: answer_match"),
        (["--dataset", "arith_tool_prompts_test", "--samples", "4", "--temperature", "0"], "--samples 4"),
        (["--dataset", "arith_tool_prompts_test", "--tools", "nope.py:f"], "file 'nope.py' does not exist"),
        (["--dataset", "arith_tool_prompts_test", "--backend", "tgi"], "unknown rollout backend 'tgi'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(tmp_path: Path, capsys, options, message):
    from rlfactory.cli import main

    assert main(["eval", str(TOOL_MODEL), *options, "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "eval").exists()


def test_bad_dataset_through_the_real_command(tmp_path: Path):
    result = run_cli("eval", str(TOOL_MODEL), "--dataset", "no_such_set", "--out", str(tmp_path / "eval"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "no_such_set" in result.stderr


def test_vllm_backend_without_vllm_is_a_clear_error(tmp_path: Path, capsys):
    import importlib.util

    from rlfactory.cli import main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: tests/test_vllm_eval.py runs the command on it")
    options = ["--dataset", "arith_tool_prompts_test", "--backend", "vllm", "--out", str(tmp_path / "eval")]
    assert main(["eval", str(TOOL_MODEL), *options]) == 2
    assert "--backend vllm needs the 'vllm' package" in capsys.readouterr().err


def test_a_run_yaml_supplies_the_defaults_and_options_win():
    """examples/quickstart/grpo.yaml: its evaluation section, its own tools and agent settings (ppo/grpo validate
    with them), its model and seed; options override each."""
    from rlfactory.cli import _parser
    from rlfactory.use.evaluate import resolve_job

    yaml_path = str(ROOT / "examples" / "quickstart" / "grpo.yaml")
    job = resolve_job(_parser().parse_args(["eval", yaml_path]))
    assert (job.dataset, job.max_samples, job.max_new_tokens, job.seed) == ("arith_tool_prompts_test", 200, 96, 42)
    assert [t.function for t in job.tools] == ["calculator"] and (job.max_turns, job.parser) == (3, "hermes")
    assert job.source.base.endswith("tiny-arith") and (job.samples, job.temperature) == (1, 0.0)
    options = ["--tools", "none", "--max-new-tokens", "10", "--samples", "2", "--dataset", "arith_prompts_test"]
    job = resolve_job(_parser().parse_args(["eval", yaml_path, *options]))
    assert (job.tools, job.max_new_tokens, job.temperature, job.dataset) == ([], 10, 1.0, "arith_prompts_test")
