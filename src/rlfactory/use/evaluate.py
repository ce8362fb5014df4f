"""``rlfactory eval PATH --dataset NAME``: greedy or sampled evaluation of a model, adapter, run dir or run YAML.

The completions come from the one evaluation path that runs use (``engine.evaluate.evaluate``): the same rendering,
backend, agent loop and scorer, so a greedy ``rlfactory eval`` of a model scores what the run's evaluation scored
on the same prompts. On top of it this command samples k completions per prompt and reports what the registry of
``engine.eval_metrics`` states (mean score, pass@k, maj@k, length, truncation, tool use), as ``report.json`` and
``samples.jsonl`` (every completion with its score, extracted answer and tool calls) in ``--out``.

Settings come from the options, else from the run's config (a run YAML, or the ``config.yaml`` of a run dir):
``evaluation.dataset`` / ``metric`` / ``max_samples`` / ``max_new_tokens`` / ``batch_size``, the tools and agent
settings (``evaluation.tools`` for offline stages, ``tools`` + ``agent`` for ppo/grpo), ``data.dataset_dir`` and
``seed``. Everything that can fail on input (paths, dataset, metric, tools, backend, the output folder) is checked
before the model loads; the files are written last, each atomically.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfactory.config.schema import EvaluationConfig, RunConfig
from rlfactory.errors import UserError
from rlfactory.use.source import ModelSource, resolve_source

if TYPE_CHECKING:
    from rlfactory.rewards.stack import RewardStack

log = logging.getLogger(__name__)

REPORT, SAMPLES = "report.json", "samples.jsonl"
MARK = "rlfactory eval"  # report.json's "tool": an --out folder holding it may be written over


@dataclass
class EvalJob:
    """What one ``rlfactory eval`` evaluates, every setting resolved."""

    path: str
    source: ModelSource
    dataset: str
    dataset_dir: str | None
    metric: str
    samples: int
    temperature: float
    top_p: float
    max_samples: int | None
    max_new_tokens: int
    batch_size: int
    backend: str
    threshold: float
    seed: int
    out: Path
    tools: list[Any] = field(default_factory=list)
    max_turns: int = 3
    parser: str = "hermes"
    agent: dict[str, Any] = field(default_factory=dict)  # ppo/grpo runs: limits and env of their agent section


def run_command(args: argparse.Namespace) -> int:
    """The CLI handler: resolve, check, load, evaluate, write, print."""
    job = resolve_job(args)
    prompts = load_prompts(job)
    check_out(job.out)
    check_backend(job.backend)
    report, rows = evaluate_job(job, prompts)
    from rlfactory.engine.shared import process_state

    if process_state().is_main_process:
        write_outputs(job.out, report, rows)
        print(format_table(report))
        print(f"wrote {job.out / REPORT} and {job.out / SAMPLES} ({len(rows)} completions)")
    return 0


# --------------------------------------------------------------------------- settings
def _run_config(path: Path) -> RunConfig | None:
    """The run's config (a YAML given, or a run dir's config.yaml); None when there is none to read."""
    from rlfactory.config.loader import load_config

    file = path if path.is_file() else path / "config.yaml"
    if not file.is_file():
        return None
    try:
        config = load_config(file)
    except UserError as exc:
        if file is path:  # the YAML given is what to evaluate: its errors are the user's to fix
            raise
        # a run dir's saved config (e.g. of an older version): the model is still there; the options decide
        log.warning("%s not used for defaults: %s", file, str(exc).splitlines()[0])
        return None
    if not isinstance(config, RunConfig):
        raise UserError(f"{file} is a pipeline: evaluate one of its stages' output dirs (<output_dir>/<stage name>)")
    return config


def _source_of(path: str, run: RunConfig | None) -> ModelSource:
    """A run YAML's model section, or what a model / adapter / run dir holds."""
    if not Path(path).is_file():
        return resolve_source(path)
    assert run is not None
    return run_source(run, path)


def run_source(run: RunConfig, where: str) -> ModelSource:
    """The model a run starts from (its model section: base, adapters, template); ``where`` names the run in
    errors."""
    model = run.model
    if model.name_or_path is None:
        raise UserError(f"{where}: model.from_stage is set; evaluate the earlier stage's output dir instead")
    base = str(model.name_or_path)
    return ModelSource(base, list(model.adapter_paths), model.template, base)


def _run_eval_settings(run: RunConfig | None) -> tuple[EvaluationConfig, list[Any], dict[str, Any]]:
    """The run's evaluation section, the tools its evaluation runs, its agent section (ppo/grpo: the agent loop
    with the run's own tools, as their validation runs)."""
    from rlfactory.rollout.agent import agent_enabled

    if run is None:
        return EvaluationConfig(), [], {}
    if agent_enabled(run) and run.agent is not None:
        return run.evaluation, list(run.tools), run.agent.model_dump()
    return run.evaluation, list(run.evaluation.tools), {}


def resolve_job(args: argparse.Namespace) -> EvalJob:
    """Options over the run's settings over the defaults (module doc)."""
    path = str(args.path)
    if not Path(path).exists():
        raise UserError(
            f"'{path}' does not exist: give a model dir, a LoRA adapter dir, a run's output dir or a run YAML"
        )
    run = _run_config(Path(path).expanduser())
    source = _source_of(path, run)
    ev, run_tools, agent = _run_eval_settings(run)
    dataset = args.dataset or ev.dataset
    if not dataset:
        raise UserError("--dataset: which prompt+answer dataset to evaluate on (the run names no evaluation.dataset)")
    samples = args.samples
    temperature = args.temperature if args.temperature is not None else (0.0 if samples == 1 else 1.0)
    if samples > 1 and temperature <= 0:
        raise UserError(f"--samples {samples} with --temperature {temperature}: greedy completions are all the same; "
                        "give a temperature above 0 (e.g. 1.0) or --samples 1")  # fmt: skip
    tools = run_tools if args.tools is None else tool_entries([] if args.tools == ["none"] else args.tools)
    max_samples = args.max_samples if args.max_samples is not None else (ev.max_samples if run else None)
    name = Path(path).stem if Path(path).is_file() else Path(path).resolve().name
    return EvalJob(
        path=path,
        source=source,
        dataset=dataset,
        dataset_dir=args.dataset_dir or (run.data.dataset_dir if run else None),
        metric=args.metric or ev.metric,
        samples=samples,
        temperature=temperature,
        top_p=args.top_p,
        max_samples=max_samples,
        max_new_tokens=args.max_new_tokens or ev.max_new_tokens,
        batch_size=args.batch_size or ev.batch_size,
        backend=args.backend,
        threshold=args.threshold,
        seed=args.seed if args.seed is not None else (run.seed if run else 0),
        out=Path(args.out or Path("outputs") / "eval" / f"{name}-{dataset}").expanduser(),
        tools=tools,
        max_turns=agent.get("max_turns", ev.max_turns),
        parser=agent.get("parser", ev.parser),
        agent=agent,
    )


def tool_entries(given: list[str]) -> list[Any]:
    """``--tools`` as the schema reads a ``tools:`` list (builtin names, ``file.py:function``)."""
    from pydantic import ValidationError

    try:
        return list(EvaluationConfig(tools=given).tools)
    except ValidationError as exc:
        raise UserError(f"--tools {' '.join(given)}: {exc.errors()[0]['msg']}") from None


def load_prompts(job: EvalJob) -> list[dict[str, Any]]:
    """The dataset's prompt+answer rows, the metric and tools checked (before any model loads)."""
    from rlfactory.data.loader import load_examples
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS
    from rlfactory.stages.common import check_columns

    REWARD_FUNCTIONS.get(job.metric)  # unknown: the valid names
    if job.samples < 1 or job.max_new_tokens < 1 or job.batch_size < 1:
        raise UserError("--samples, --max-new-tokens and --batch-size must be at least 1")
    prompts = load_examples([job.dataset], "prompt", job.dataset_dir, job.max_samples)
    needs = [f"--metric {job.metric}"] if REWARD_FUNCTIONS.traits(job.metric).get("needs_answer") else []
    check_columns(prompts, needs, job.dataset)
    if job.tools:
        from rlfactory.rollout.agent import offer_tools

        offer_tools(job.tools, job.parser, prompts)
    return prompts


def check_out(out: Path) -> None:
    """``--out`` may be new, empty, or an earlier ``rlfactory eval`` output (its two files are replaced)."""
    if out.is_symlink() or out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: not a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    try:
        ours = json.loads((out / REPORT).read_text()).get("tool") == MARK
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise UserError(f"--out {out} holds other files; give a new or empty folder (or an earlier eval's)")


def check_backend(name: str) -> None:
    """A known backend whose package is installed (vllm is an optional extra), before any model loads."""
    import importlib.util

    from rlfactory.rollout.backends import BACKENDS

    package = BACKENDS.traits(name)["package"]
    if package is not None and importlib.util.find_spec(package) is None:
        raise UserError(
            f"--backend {name} needs the '{package}' package, which is not installed here: "
            f"pip install 'rlfactory[{package}]' (GPU), or use --backend hf"
        )


# --------------------------------------------------------------------------- evaluation
def backend_config(job: EvalJob, longest_prompt: int) -> RunConfig:
    """A run config holding what the rollout backend builders read (``rollout.backend`` and its sizes), so the
    command builds its backend through ``rollout.backends`` as an online run does."""
    return RunConfig(
        stage="grpo",
        seed=job.seed,
        model={"name_or_path": job.source.base, "template": job.source.template, "finetuning": "full"},
        data={"dataset": job.dataset, "dataset_dir": job.dataset_dir},
        reward={"functions": {job.metric: 1.0}},
        rollout={
            "backend": job.backend,
            "generation_batch_size": job.batch_size,
            "max_prompt_len": longest_prompt,
            "max_response_len": job.max_new_tokens,
            "enable_sleep_mode": False,  # nothing trains between generations: the engine stays awake
        },
        evaluation={"max_new_tokens": job.max_new_tokens},
    )


def _rollouts(job: EvalJob, model: Any, tokenizer: Any, longest_prompt: int) -> Any:
    from rlfactory.rollout.agent import AgentSettings, Rollouts, agent_rollouts
    from rlfactory.rollout.backends import BACKENDS

    backend = BACKENDS.get(job.backend)(backend_config(job, longest_prompt), model, tokenizer)
    if backend.syncs_weights and job.source.adapters:  # the engine loaded the base alone: push the merged weights
        backend.sync_weights(model)
    if not job.tools and not job.agent.get("env"):
        return Rollouts(backend, None)
    from rlfactory.tools.execute import ExecLimits

    ag = job.agent
    limits = None  # offline runs and no run: the default limits, as their in-run evaluation
    if ag:
        limits = ExecLimits(
            ag["tool_timeout_s"], ag["max_concurrency"], ag["tool_memory_mb"], ag["max_tool_response_chars"]
        )
    settings = AgentSettings(job.max_turns, job.parser, ag.get("max_tokens_per_turn"))
    return agent_rollouts(backend, tokenizer, job.tools, settings, limits, ag.get("env") or "tools", ag.get("env_args"))


def evaluate_job(
    job: EvalJob, prompts: list[dict[str, Any]], rewards: RewardStack | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Load the model, run the evaluation path, and make the report and the per-sample rows; with ``rewards`` (the
    WebUI's reward test) every row also carries the stack's total and parts."""
    from transformers import set_seed

    from rlfactory.engine.evaluate import evaluate, render_eval_prompts
    from rlfactory.render.plain import tokenizer_for
    from rlfactory.rollout.base import SamplingParams
    from rlfactory.use.source import load_source

    model, tokenizer = load_source(job.source)
    tokenizer = tokenizer_for(tokenizer, prompts)
    rendered = render_eval_prompts(tokenizer, prompts)
    rollouts = _rollouts(job, model, tokenizer, max(len(p["prompt_ids"]) for p in rendered))
    params = SamplingParams(max_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p)
    set_seed(job.seed)
    try:
        result = evaluate(rollouts, tokenizer, rendered, params, job.metric, samples=job.samples, rewards=rewards)
    finally:
        rollouts.close()
    rows = [sample_row(s) for s in result.scored]
    return make_report(job, rows, len(prompts)), rows


def _tool_counts(example: dict[str, Any]) -> tuple[int, int, int]:
    """(calls made, calls executed, executed calls that failed) in one episode, as ``episode_metrics`` counts."""
    calls = [c for turn in example.get("agent", {}).get("turns", []) for c in turn["calls"]]
    executed = [c for c in calls if c["error_kind"] is None]
    return len(calls), len(executed), sum(c.get("tool_error") is not None for c in executed)


def sample_row(scored: Any) -> dict[str, Any]:
    """One line of samples.jsonl: the prompt, the completion, its score and extracted answer, and the episode."""
    from rlfactory.rewards.builtin import extract_final_answer

    s = scored.sample
    calls, executed, failed = _tool_counts(s.example)
    stack = {"reward": scored.reward, "rewards": {**scored.components, **scored.parts}} if scored.components else {}
    return {
        "problem": scored.problem,
        "source": s.example.get("source"),
        **scored.row(),
        "extracted": extract_final_answer(s.completion),
        "length": s.response_length,
        "finish_reason": scored.finish_reason,
        "tool_calls": calls,
        "tool_calls_executed": executed,
        "tool_calls_failed": failed,
        **stack,
    }


def attempts(rows: list[dict[str, Any]], problems: int, tools: bool) -> list[Any]:
    """The rows grouped by problem (in sampling order) as the metrics registry reads them."""
    from rlfactory.engine.eval_metrics import Attempts

    grouped: list[list[dict[str, Any]]] = [[] for _ in range(problems)]
    for row in rows:
        grouped[row["problem"]].append(row)
    column = lambda group, key: tuple(r[key] for r in group) if tools else ()
    return [
        Attempts(
            scores=tuple(r["score"] for r in group),
            answers=tuple(r["extracted"] for r in group),
            lengths=tuple(r["length"] for r in group),
            truncated=tuple(r["finish_reason"] == "length" for r in group),
            tool_calls=column(group, "tool_calls"),
            tool_failures=column(group, "tool_calls_failed"),
            tool_executed=column(group, "tool_calls_executed"),
        )
        for group in grouped
    ]


def make_report(job: EvalJob, rows: list[dict[str, Any]], problems: int) -> dict[str, Any]:
    from rlfactory import __version__
    from rlfactory.engine.eval_metrics import summarise

    tools = bool(job.tools)
    metrics = summarise(attempts(rows, problems, tools), job.samples, job.threshold, tools)
    return {
        "tool": MARK,
        "version": __version__,
        "model": job.path,
        "source": asdict(job.source),
        "dataset": job.dataset,
        "problems": problems,
        "max_samples": job.max_samples,
        "samples_per_problem": job.samples,
        "completions": len(rows),
        "metric": job.metric,
        "threshold": job.threshold,
        "temperature": job.temperature,
        "top_p": job.top_p,
        "max_new_tokens": job.max_new_tokens,
        "backend": job.backend,
        "tools": [t.name or t.function for t in job.tools],
        "seed": job.seed,
        "metrics": metrics,
    }


# --------------------------------------------------------------------------- output
def write_outputs(out: Path, report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """samples.jsonl, then report.json (its presence marks a finished eval), each written atomically."""
    from rlfactory.engine.run_dir import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / SAMPLES, "".join(json.dumps(row) + "\n" for row in rows))
    write_atomic(out / REPORT, json.dumps(report, indent=2) + "\n")


def format_table(report: dict[str, Any]) -> str:
    """The printed summary: what was evaluated, one metric a line, where the files went."""
    sampling = "greedy" if report["temperature"] <= 0 else f"temperature {report['temperature']:g}"
    tools = f", tools {', '.join(report['tools'])}" if report["tools"] else ""
    head = (
        f"{report['model']} on {report['dataset']}: {report['problems']} problems x {report['samples_per_problem']} "
        f"sample(s), {sampling}, metric {report['metric']}{tools}"
    )
    lines = [head] + [f"  {name:<24}{value:10.3f}" for name, value in report["metrics"].items()]
    return "\n".join(lines)
