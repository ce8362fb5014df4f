"""Run health in the WebUI (issue 18): the alerts panel, the markers on the charts, the rollout browser an alert
opens (the samples its rule points to, reward parts, the loss mask), and the memory estimate next to Start.
The two browser tests take 35-40 s each on a busy 2-core machine (a WebUI start, and the grpo run: about 15 s).

First the parts without a browser (the trace's token parts against the loss mask, the picks, the markers), then a
real Chromium on the WebUI (the fixtures of tests/webui_browser.py): a short grpo run built to trip the truncation rule,
its alert clicked, the rollout it points to shown; and `rlfactory plan` on the form.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests import webui_browser as kit
from tests.conftest import DATA_DIR, ROOT, TINY_MODEL, run_cli, write_yaml
from tests.webui_browser import box, choose, expect, load_yaml, shot

from rlfactory.engine.health import HEALTH_RULES

app_url, browser, page = kit.app_url, kit.browser, kit.page  # the fixtures: the served app, Chromium, a page


# --------------------------------------------------------------------------- the trace's token parts
def test_trace_segments_follow_the_loss_mask_token_for_token():
    """token_kinds gives the loss mask pack_rollouts trains with (observations out; a cut response out under
    mask_truncated), and the segments decode exactly the response's runs of one kind."""
    from rlfactory.config.schema import ModelConfig
    from rlfactory.engine.online.phases import response_segments, token_kinds
    from rlfactory.model.loader import load_tokenizer
    from rlfactory.rollout.base import Completion
    from rlfactory.rollout.batch import pack_rollouts

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    ids = tokenizer("3 * 4 = 12. The answer is 12.")["input_ids"][:8]
    tool = Completion(ids, "stop", mask=[1, 1, 1, 0, 0, 0, 1, 1])
    cut = Completion(ids[:5], "length")
    done = Completion(ids[:3], "stop")
    completions = [tool, cut, done]
    for mask_truncated in (False, True):
        batch = pack_rollouts([[5, 6]] * 3, completions, tokenizer.pad_token_id, mask_truncated)
        for row, completion in enumerate(completions):
            kinds = token_kinds(completion, mask_truncated)
            n = len(completion.token_ids)
            assert [k == "trained" for k in kinds] == batch.loss_mask[row, :n].bool().tolist()
    kinds = token_kinds(tool, mask_truncated=True)
    assert kinds == ["trained"] * 3 + ["observation"] * 3 + ["trained"] * 2
    assert response_segments(tokenizer, ids, kinds) == [
        [tokenizer.decode(ids[:3]), "trained"],
        [tokenizer.decode(ids[3:6]), "observation"],
        [tokenizer.decode(ids[6:]), "trained"],
    ]
    assert token_kinds(cut, mask_truncated=True) == ["masked"] * 5
    assert token_kinds(cut, mask_truncated=False) == ["trained"] * 5


# --------------------------------------------------------------------------- which samples an alert opens
def sample(group: int, completion: str, score: float, answer: str = "12", **more) -> dict:
    return {"group": group, "completion": completion, "score": score, "answer": answer, **more}


def test_each_rule_points_to_its_samples():
    from rlfactory.webui import rollout_view as rv

    assert set(rv.RULE_PICKS) == set(HEALTH_RULES.names()) and set(rv.RULE_PICKS.values()) <= set(rv.PICKS)
    rows = [
        sample(0, "The answer is 12.", 1.0, response_tokens=6, finish_reason="stop", advantage=0.5),
        sample(0, "12 12 12 12 12 12 12 The answer is 13.", 1.4, response_tokens=20, finish_reason="length"),
        sample(1, "The answer is 7.", 0.2, response_tokens=6, finish_reason="stop", advantage=-0.9),
        sample(1, "The answer is 7.", 0.2, response_tokens=6, finish_reason="stop", advantage=0.1),
        sample(2, "so", 0.9, answer=None, response_tokens=24, finish_reason="length"),
    ]
    pick = lambda name: [rows.index(r) for r in rv.PICKS[name].select(rows)]  # noqa: E731
    assert pick("high_reward_wrong") == [1, 2, 3]  # wrong answers by reward; no answer is never "wrong"
    assert pick("truncated") == [4, 1]
    assert pick("longest") == [4, 1, 0, 2, 3]
    assert pick("repeated") == [2, 3, 4, 0, 1]  # group 1 repeats one answer (group 2 has one sample)
    assert pick("same_reward") == [2, 3, 4]
    assert pick("largest_advantage") == [2, 0, 3, 1, 4]
    assert pick("highest_reward") == [1, 0, 4, 2, 3]


def test_an_alert_opens_its_step_or_the_nearest_trace(tmp_path: Path):
    from rlfactory.webui import rollout_view as rv

    (tmp_path / "rollouts").mkdir()
    for step in (1, 10):
        row = sample(0, f"<b>{step}</b> The answer is 3.", 1.0, segments=[[f"<b>{step}</b>", "trained"]])
        (tmp_path / "rollouts" / f"step_{step:05d}.jsonl").write_text(json.dumps(row) + "\n")
    assert rv.trace_steps(tmp_path) == [1, 10] and rv.nearest_step([1, 10], 5) == 1
    alert = {"step": 8, "rule": "reward_hacking", "message": "rose"}
    step, pick, note, body = rv.for_alert(tmp_path, alert)
    assert (step, pick) == (10, "high_reward_wrong")
    assert "no trace of step 8 (an older run): the nearest, step 10, is shown" in note
    assert "`rollouts/step_00010.jsonl` · highest reward with a wrong answer: 1 of 1 samples" in note
    assert '<mark class="trained" style="" title="trained">&lt;b&gt;10&lt;/b&gt;</mark>' in body  # escaped
    assert rv.for_alert(tmp_path / "none", alert)[0] is None


def test_alert_markers_go_on_the_chart_of_their_metric():
    from rlfactory.webui import monitor

    records = [{"step": s, "loss": 0.5 + s, "actor/entropy": 1.0 / s} for s in (1, 2, 3)]
    alerts = [
        {"step": 3, "rule": "entropy_collapse", "metric": "actor/entropy"},
        {"step": 2, "rule": "non_finite", "metric": "skipped_steps"},  # no chart: the first one
    ]
    charts = dict(monitor.alert_markers(monitor.chart_series(records), alerts))
    marks = lambda title: [r for r in charts[title] if r["series"].startswith("⚠")]  # noqa: E731
    assert marks("entropy") == [
        {"step": 3, "value": pytest.approx(1 / 3), "series": "⚠ entropy_collapse @ 3"},
        {"step": 3, "value": 1.0, "series": "⚠ entropy_collapse @ 3"},
    ]
    assert [(r["step"], r["value"]) for r in marks("loss")] == [(2, 1.5), (2, 3.5)]


# --------------------------------------------------------------------------- in the browser
def truncating_run(output_dir: Path) -> dict:
    """grpo on the bundled model with an 8-token cap: every answer (about 18 tokens) is cut, so truncation (window 2)
    fires at step 2; mask_truncated keeps the cut responses out of the loss. rollout_trace_steps is 10: the trace of
    step 2 exists because the rule fired there."""
    return {
        "stage": "grpo",
        "output_dir": str(output_dir),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
        "rollout": {"prompts_per_step": 4, "num_samples": 4, "max_response_len": 8, "mask_truncated": True},
        "reward": {"functions": {"answer_match": 1.0}},
        "train": {"max_steps": 2, "per_device_batch_size": 16, "learning_rate": 1e-4, "save_steps": None},
        "health": {"truncation": {"window": 2}},
        "logging": {"progress_bar": False, "plot_loss": False, "rollout_trace_steps": 10},
    }


@pytest.mark.slow
def test_an_alert_in_the_panel_opens_the_rollouts_it_points_to(page, app_url):
    """A real run trips truncation at step 2: the panel lists the alert, the response-length charts carry its
    marker, and clicking it opens step 2's trace at the cut samples, their tokens struck out of the loss."""
    _, workdir = app_url
    out = workdir / "outputs" / "truncating"
    cfg = truncating_run(out.relative_to(workdir))  # run in the workspace: the page names it as outputs/truncating
    result = run_cli("train", str(write_yaml(workdir / "truncating.yaml", cfg)), cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step_00001.jsonl", "step_00002.jsonl"]
    trace = [json.loads(line) for line in (out / "rollouts" / "step_00002.jsonl").open()]
    assert len(trace) == 16 and all(r["finish_reason"] == "length" and r["trained_tokens"] == 0 for r in trace)

    page.get_by_role("tab", name="Monitor").click()
    choose(page, "monitor-run", "outputs/truncating")
    expect(page.locator("#monitor-health")).to_contain_text("1 alert(s)", timeout=30_000)
    alerts = page.locator("#monitor-alerts")
    expect(alerts).to_contain_text("responses run to the length cap")
    expect(page.locator("[id^=chart-]").filter(has_text="⚠ truncation @ 2")).to_have_count(1)
    alerts.get_by_text("truncation", exact=True).filter(visible=True).first.click()
    note = page.locator("#rollout-note")
    expect(note).to_contain_text("rollouts/step_00002.jsonl", timeout=30_000)
    expect(note).to_contain_text("cut at the length cap, longest first: 16 of 16 samples (the first 4 shown)")
    samples = page.locator("#rollout-samples")
    expect(samples.locator("del.masked")).to_have_count(4)
    expect(samples.locator(".rf-sample").first).to_contain_text("finish length")
    expect(samples.locator(".rf-parts").first).to_contain_text("answer_match")
    first = trace[0]["segments"][0][0]
    expect(samples.locator("del.masked").first).to_have_text(first)
    expect(box(page, "rollout-step")).to_have_value("step 2")
    shot(page, "health.png", between=(page.locator("#monitor-status"), samples.locator(".rf-sample").nth(1)))


@pytest.mark.slow
def test_the_estimate_next_to_start_is_rlfactory_plan(page, app_url, monkeypatch: pytest.MonkeyPatch):
    """The form's config through the plan's own code: on 1 GiB the grpo quickstart does not fit and the change that
    makes it fit is shown; on 80 GiB it fits; the peak is the one `plan_runs` gives for the same YAML."""
    from rlfactory.config.loader import load_config
    from rlfactory.engine.plan import detect_gpu
    from rlfactory.engine.plan_report import plan_runs

    monkeypatch.chdir(ROOT)
    expected = plan_runs(load_config("examples/quickstart/grpo.yaml"), detect_gpu(1, 1.0))[0]
    load_yaml(page, "examples/quickstart/grpo.yaml")
    box(page, "plan-gpu-memory").fill("1")
    page.locator("#btn-plan").click()
    answer = page.locator("#plan-estimate")
    expect(answer).to_contain_text("DOES NOT FIT", timeout=60_000)
    expect(answer).to_contain_text(f"per-GPU peak {expected.peak / 2**30:.2f} GiB ({expected.peak_phase})")
    best = expected.suggestions[0]
    assert best["fits"]
    expect(answer).to_contain_text(f"{' '.join(best['overrides'])}: -{best['saves_gb']:.2f} GiB")
    box(page, "plan-gpu-memory").fill("80")
    page.locator("#btn-validate").click()  # Validate shows the estimate too
    expect(answer).to_contain_text(f"FITS: {expected.peak / 2**30:.1f} of GPU with 80.0 GiB", timeout=60_000)
