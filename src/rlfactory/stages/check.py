"""``rlfactory config check``: everything that can be validated without training.

In the stages layer, not in ``config``: it loads datasets, a tokenizer and each stage's own ``check``,
all of which sit above the schema (config imports nothing of the package but errors and plugins).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfactory.config.schema import PipelineConfig, RunConfig
from rlfactory.errors import UserError


def _load(run: RunConfig, names: list[str], max_samples: int | None) -> tuple[list[dict], str]:
    """Examples of each dataset, validated as the kind the stage reads it as (and that kind, for the notes)."""
    from rlfactory.data.loader import is_ranking, load_examples
    from rlfactory.data.registry import load_registry
    from rlfactory.stages import dataset_kind

    folder, specs = load_registry(run.data.dataset_dir)
    examples, kinds = [], set()
    for name in names:
        kind = dataset_kind(run.stage, is_ranking(name, folder, specs))
        kinds.add(kind)
        examples += load_examples([name], kind, run.data.dataset_dir, max_samples, run.data.max_bad_rows)
    return examples, "+".join(sorted(kinds))


TEMPLATE_SAMPLE = 256  # rows rendered and read back by `config check` (training renders and reads back every row)


def check_template(tokenizer: object, examples: list[dict]) -> str:
    """Render a sample of rows as their stage will and read them back (raises UserError naming the row)."""
    from rlfactory.render.chat import check_example, template_name

    sample = examples[:TEMPLATE_SAMPLE]
    split = sum(check_example(tokenizer, example) > 1 for example in sample)
    note = (
        f"{template_name(tokenizer)}: {len(sample)} of {len(examples)} rows rendered and read back, every "
        "message, tool call and tool schema kept"
    )
    if split:
        note += f"; it rewrites earlier turns, so {split} of them train one sequence per rewritten turn"
    return note


def check_run(run: RunConfig, here: bool = False) -> list[str]:
    """Everything ``train`` checks before its first step: the DeepSpeed file, the resume target and output_dir,
    datasets (rows converted and validated), the stage's own rules (names, user code), the model folder (config,
    weights, adapters), its tokenizer and chat template, and the data rendered as the stage renders it. Raises
    UserError. What this machine lacks (a GPU, a package, a hub model not in the cache when offline) is a warning
    line, since the file may be for another machine; with ``here`` (the run starts on this machine, as from the
    WebUI) it is the error train would stop with."""
    from rlfactory.engine import run_dir
    from rlfactory.engine.environment import environment_problems
    from rlfactory.engine.shared import check_deepspeed_file

    label = f"[{run.name or run.stage}]"
    check_deepspeed_file(run)
    notes = [f"{label} warning: {warning}" for warning in run.unused_sections()]
    problems = environment_problems(run)
    if here and problems:
        raise UserError(problems[0])
    notes += [f"{label} warning: on this machine, {problem}" for problem in problems]
    resume_from = run_dir.resolve_resume(run.output_dir, run.resume_from_checkpoint)
    run_dir.check_output_dir(run.output_dir, run.overwrite_output_dir, resume_from)
    train, kind = _load(run, run.data.dataset, run.data.max_samples)
    notes.append(f"{label} data: {len(train)} {kind} examples from {', '.join(run.data.dataset)}")
    if run.data.eval_dataset:
        held, _ = _load(run, run.data.eval_dataset, None)
        notes.append(f"{label} eval data: {len(held)} examples")
    if run.evaluation.dataset and run.rollout is None:  # ppo/grpo check theirs in the stage's own check
        from rlfactory.stages.common import load_eval_prompts

        load_eval_prompts(run)
    from rlfactory.stages import get_stage

    stage_check = getattr(get_stage(run.stage), "check", None)  # the stage's own rules (names, columns, files)
    if stage_check is not None:
        notes += list(stage_check(run) or [])
    notes.append(_check_model(run, label, here))
    if Path(str(run.model.name_or_path)).expanduser().is_dir() and run.model.from_stage is None:
        from rlfactory.model.loader import load_tokenizer

        tokenizer = load_tokenizer(run.model)
        notes.append(f"{label} chat template: {check_template(tokenizer, train)}")
        fit_counts = getattr(get_stage(run.stage), "fit_counts", None)  # what the length limit does to the rows
        if fit_counts is not None:
            notes.append(f"{label} data {fit_counts(run, tokenizer, train).summary()}")
        render = RENDERERS.get(run.stage)  # the stage's own rendering: what train would refuse before step 1
        if render is not None:
            kept = render(run, tokenizer)
            notes.append(f"{label} rendered: {kept} training examples fit (data.cutoff_len / rollout.max_prompt_len)")
    return notes


# What each stage renders before its first step, from the same functions: a cutoff nothing fits, a chat template
# that rewrites history, KTO data with one label only fail here as they would in train.
def _render_sft(run: RunConfig, tokenizer: Any) -> int:
    from rlfactory.stages.sft import render_examples

    examples, _ = _load(run, run.data.dataset, run.data.max_samples)
    return len(render_examples(run, tokenizer, examples))


def _render_pairs(run: RunConfig, tokenizer: Any) -> int:
    from rlfactory.stages.preference_data import load_train_eval, render_pairs

    train, held = load_train_eval(run, "pairwise")
    if held:
        render_pairs(run, tokenizer, held)
    return len(render_pairs(run, tokenizer, train))


def _render_unpaired(run: RunConfig, tokenizer: Any) -> int:
    from rlfactory.stages.kto import check_labels, load_kto_examples, render_unpaired

    assert run.kto is not None
    examples = load_kto_examples(run, run.data.dataset)
    check_labels(examples, run.data.dataset, run.kto)
    return len(render_unpaired(run, tokenizer, examples))


def _render_prompts(run: RunConfig, tokenizer: Any) -> int:
    from rlfactory.stages.rl import load_prompt_sets, render_prompts

    train, evals, _ = load_prompt_sets(run)
    if evals:
        render_prompts(run, tokenizer, evals)
    return len(render_prompts(run, tokenizer, train))


RENDERERS: dict[str, Callable[[RunConfig, Any], int]] = {
    "sft": _render_sft,
    "rm": _render_pairs,
    "dpo": _render_pairs,
    "orpo": _render_pairs,
    "kto": _render_unpaired,
    "ppo": _render_prompts,
    "grpo": _render_prompts,
}


def _check_model(run: RunConfig, label: str, here: bool = False) -> str:
    """The model folder and adapters (from a pipeline's earlier stage: known when that stage has run)."""
    if run.model.from_stage is not None:
        return f"{label} model: from stage {run.model.from_stage} (checked when that stage has run)"
    from rlfactory.model.loader import check_model_paths, is_hub_id

    path = str(run.model.name_or_path)
    if not is_hub_id(path) or Path(path).expanduser().exists():
        check_model_paths(run.model)
        return f"{label} model: {path} (config and weights OK)"
    try:  # a hub id: whether it can be had is a matter of this machine (its cache, its network)
        check_model_paths(run.model)
    except UserError as exc:
        if here:
            raise
        return f"{label} warning: on this machine, {exc}"
    return f"{label} model: {path} (a hub id: downloaded or read from the cache when the run starts)"


def check_config(config: RunConfig | PipelineConfig, here: bool = False) -> list[str]:
    """Every run's ``check_run`` (a finished stage a rerun would skip is not checked); ``here``: see check_run."""
    from rlfactory.engine import run_dir

    runs = config.stages if isinstance(config, PipelineConfig) else [config]
    notes = []
    for run in runs:
        if run_dir.skips_finished(run.output_dir, run.resume_from_checkpoint, len(runs) > 1) is not None:
            notes.append(f"[{run.name or run.stage}] finished already in {run.output_dir}: skipped (resume)")
            continue
        notes += check_run(run, here)
    return notes
