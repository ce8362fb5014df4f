"""The WebUI's Evaluate tab and the Train tab's reward editor, in headless Chromium (helpers and fixtures from
tests/webui_browser.py), then their logic without a browser: options, before/after targets, adding rewards and their
errors."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
from tests import webui_browser as kit
from tests.conftest import ROOT, run_cli
from tests.webui_browser import PAGE_OPEN_MS, blank_form, box, choose, expect, grid, grid_rows, shot

from rlfactory.errors import UserError

app_url, browser, page = kit.app_url, kit.browser, kit.page  # the fixtures: the served app, Chromium, a page
TOOL_MODEL = ROOT / "data" / "models" / "tiny-arith-tools"
BREVITY = '''def words(prompt, completion, answer, example):
    return float(len(completion.split()))
'''


def _tool_run(workdir: Path) -> Path:
    """A run's output dir: the bundled tool-calling model, trained from the bundled base (its config.yaml says so)."""
    run = workdir / "outputs" / "tools-run"
    if not run.exists():
        shutil.copytree(TOOL_MODEL, run)
        (run / "config.yaml").write_text(
            "stage: sft\noutput_dir: outputs/tools-run\n"
            "model: {name_or_path: data/models/tiny-arith, finetuning: full}\ndata: {dataset: arith_tool_sft}\n"
            "evaluation: {dataset: arith_tool_prompts_test, max_new_tokens: 80, tools: [calculator]}\n"
        )
    return run


@pytest.mark.slow
def test_evaluate_tab_shows_what_rlfactory_eval_reports(page, app_url):
    """Evaluate a run, sampled (k = 2) with before/after: the page shows the report of `rlfactory eval` on the run
    (run here on the same inputs, number for number), the base model's own report beside it, and one trace row per
    completion."""
    _, workdir = app_url
    _tool_run(workdir)
    page.get_by_role("tab", name="Evaluate").click()
    choose(page, "eval-model", "outputs/tools-run")
    page.locator("#eval-mode").get_by_text("sampled").click()
    box(page, "eval-k").fill("2")
    box(page, "eval-max").fill("4")
    page.locator("#eval-before").locator("input").check()
    page.locator("#eval-run").click()
    status = page.locator("#eval-status")
    expect(status).to_contain_text("evaluating", timeout=60_000)  # feedback while the command runs
    expect(status).to_contain_text("evaluated: 8 completion(s)", timeout=240_000)

    cli = run_cli("eval", "outputs/tools-run", "--samples", "2", "--temperature", "1.0", "--max-samples", "4",
                  "--out", "cli-eval", cwd=workdir)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-2000:]
    after = json.loads((workdir / "cli-eval" / "report.json").read_text())
    before = json.loads((workdir / "outputs/eval/tools-run-before/report.json").read_text())
    assert before["source"]["base"] == "data/models/tiny-arith" and after["samples_per_problem"] == 2
    assert {"pass@2", "maj@2", "mean_length", "truncation_rate", "tool_calls_per_problem"} <= set(after["metrics"])
    report = page.locator("#eval-report")
    for run, data in (("after", after), ("before", before)):
        for name, value in data["metrics"].items():
            expect(report.locator(f'td[data-metric="{name}"][data-run="{run}"]')).to_have_text(f"{value:.4f}")
    shot(page, "evaluate.png", between=(None, report))
    rows = [json.loads(line) for line in (workdir / "cli-eval" / "samples.jsonl").read_text().splitlines()]
    expect(grid_rows(page, "eval-traces")).to_have_count(8)
    shown = grid(page, "eval-traces")
    assert [(r["after completion"], r["after score"]) for r in shown] == [
        (row["completion"], f"{row['score']:g}") for row in rows
    ]


def _eval_processes(out: Path) -> list:
    """The `rlfactory eval` processes writing into ``out`` (found by their command line)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            if "eval" in cmdline and str(out.resolve()) in cmdline and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def test_a_reloaded_page_reattaches_to_the_evaluation_going_on(page, app_url):
    """Start an evaluation (every held-out prompt sampled 8 times: minutes), reload the page: the Evaluate tab shows
    it going on with the settings it was started with, and its Stop, with the form changed since, ends the command's
    process; no report is written (issue 16's reattach, for Evaluate)."""
    _, workdir = app_url
    _tool_run(workdir)
    out = "outputs/eval/reattach"
    page.get_by_role("tab", name="Evaluate").click()
    choose(page, "eval-model", "outputs/tools-run")
    page.locator("#eval-mode").get_by_text("sampled").click()
    box(page, "eval-k").fill("8")
    box(page, "eval-max-new").fill("40")
    box(page, "eval-out").fill(out)
    page.locator("#eval-run").click()
    status = page.locator("#eval-status")
    expect(status).to_contain_text("evaluating", timeout=60_000)
    assert _eval_processes(workdir / out), "the evaluation's command is not running"

    page.reload()
    expect(page.locator("#gallery-start-sft")).to_be_visible(timeout=PAGE_OPEN_MS)
    page.get_by_role("tab", name="Evaluate").click()
    # the reloaded page holds no job of its own: a status line of the evaluation going on comes only from the page
    # load's reattach (its "· reattached" note lasts until the Evaluate timer's next tick, which on a loaded
    # machine can come before this tab is open, so the note itself is not waited for)
    expect(status).to_contain_text("evaluating (after, 1/1) outputs/tools-run", timeout=30_000)
    expect(box(page, "eval-model")).to_have_value("outputs/tools-run")
    expect(box(page, "eval-out")).to_have_value(out)
    expect(box(page, "eval-max-new")).to_have_value("40")
    expect(box(page, "eval-k")).to_have_value("8")
    box(page, "eval-out").fill("outputs/eval/something-else")  # Stop follows the job, not the form
    page.locator("#eval-stop").click()
    expect(status).to_contain_text("stopped", timeout=30_000)
    assert not _eval_processes(workdir / out)
    assert not (workdir / out / "report.json").exists()


def test_reward_editor_builds_and_tests_a_two_part_reward(page, app_url):
    """From the blank grpo form: a built-in reward and a function from a file (a wrong name first: its error shows
    beside the file field), the reward: YAML they make, and Test rewards scoring each part per sample (the file's
    part is its word count, total = answer_match + 0.5 x words); nothing is started."""
    _, workdir = app_url
    (workdir / "rewards").mkdir(exist_ok=True)
    (workdir / "rewards" / "brevity.py").write_text(BREVITY)
    blank_form(page, "grpo", "arith_prompts", "outputs/reward-test")
    choose(page, "reward-builtin", "answer_match")
    page.locator("#reward-add-builtin").click()
    expect(box(page, "field-reward-functions")).to_have_value("{answer_match: 1.0}", timeout=20_000)
    box(page, "reward-file").fill("rewards/brevity.py")
    box(page, "reward-function").fill("brevity")
    box(page, "reward-file-weight").fill("0.5")
    page.locator("#reward-add-file").click()
    expect(page.locator("#reward-error")).to_contain_text("has no function 'brevity'; functions there: words")
    box(page, "reward-function").fill("words")
    page.locator("#reward-add-file").click()
    expect(page.locator("#reward-error")).to_be_hidden(timeout=20_000)
    expect(page.locator("#reward-yaml")).to_contain_text("rewards/brevity.py:words: 0.5")
    expect(page.locator("#reward-yaml")).to_contain_text("answer_match: 1.0")

    page.locator("#reward-test").click()
    message = page.locator("#reward-test-message")
    scored = "4 sample(s) scored by answer_match x1, rewards/brevity.py:words x0.5"
    expect(message).to_contain_text(scored, timeout=120_000)
    expect(grid_rows(page, "reward-test-table")).to_have_count(4)
    for cells in grid(page, "reward-test-table"):
        words = float(len(cells["completion"].split()))
        assert float(cells["words"]) == words
        assert float(cells["answer_match"]) in (0.0, 1.0)
        assert float(cells["total"]) == pytest.approx(float(cells["answer_match"]) + 0.5 * words, abs=1e-3)
    assert not (workdir / "outputs" / "reward-test").exists()


# --------------------------------------------------------------------------- without a browser
def test_eval_options_and_before_after_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The page's choices become the CLI's options; before/after evaluates the run's config.yaml (the model it started
    from) into OUT-before, and is refused for a model dir that is not a run."""
    from rlfactory.webui import evaluation, workspace

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(ROOT / "data")
    workspace.configure(str(tmp_path), [str(ROOT / "data")])
    run = _tool_run(tmp_path)
    req = evaluation.EvalRequest("outputs/tools-run", dataset="arith_prompts_test", samples=4, temperature=0.7,
                                 max_samples=8, before=True)  # fmt: skip
    assert evaluation.options(req) == ["--dataset", "arith_prompts_test", "--samples", "4", "--temperature", "0.7",
                                       "--max-samples", "8"]  # fmt: skip
    before, after = evaluation.plan(req)
    out = tmp_path / "outputs/eval/tools-run-arith_prompts_test"
    assert (before.label, before.target, before.out) == ("before", str(run.relative_to(tmp_path) / "config.yaml"),
                                                         out.with_name(out.name + "-before"))  # fmt: skip
    assert (after.target, after.out) == ("outputs/tools-run", out)
    with pytest.raises(UserError, match="is not a run's output dir"):
        evaluation.plan(evaluation.EvalRequest("data/models/tiny-arith", before=True))
    with pytest.raises(UserError, match="outside the WebUI workspace"):
        evaluation.plan(evaluation.EvalRequest("outputs/tools-run", out="/tmp/elsewhere"))


def test_reward_editor_adds_parts_and_refuses_bad_functions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Parts are added to the field's text as the schema reads it; a file's function is loaded and its signature
    checked as a run does, each failure one message naming the file or function."""
    from rlfactory.webui import reward_editor as editor
    from rlfactory.webui import workspace

    monkeypatch.chdir(tmp_path)
    workspace.configure(str(tmp_path))
    (tmp_path / "r.py").write_text(BREVITY + "def two(completion, answer):\n    return 1.0\nimport sys\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU here')\n")
    text = editor.add_builtin("answer_match", "tool_format", 0.1)  # a bare name weighs 1.0
    text = editor.add_from_file(text, "r.py", "words", "0.5")
    assert editor.parse_functions(text) == {"answer_match": 1.0, "tool_format": 0.1, "r.py:words": 0.5}
    assert editor.reward_yaml({"reward": {"functions": editor.parse_functions(text)}}).splitlines() == [
        "reward:", "  functions:", "    answer_match: 1.0", "    tool_format: 0.1", "    r.py:words: 0.5"
    ]  # fmt: skip
    bad = [
        (("nope.py", "words"), "file 'nope.py' does not exist"),
        (("r.py", "missing"), "'r.py' has no function 'missing'; functions there: words, two"),
        (("r.py", "two"), "reward function 'r.py:two' cannot be called as fn(prompt, completion, answer, example)"),
        (("broken.py", "f"), "importing 'broken.py' failed: RuntimeError: no GPU here"),
        (("r.txt", "words"), "'r.txt' is not a Python file"),
        (("/etc/passwd.py", "f"), "outside the WebUI workspace"),
    ]
    for (file, fn), message in bad:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            editor.add_from_file(text, file, fn, 1.0)
    with pytest.raises(UserError, match="valid names"):
        editor.add_builtin(text, "accuracy", 1.0)
