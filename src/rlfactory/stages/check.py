"""``rlfactory config check``: everything that can be validated without training.

In the stages layer, not in ``config``: it loads datasets, a tokenizer and each stage's own ``check``,
all of which sit above the schema (config imports nothing of the package but errors and plugins).
"""

from __future__ import annotations

from pathlib import Path

from rlfactory.config.schema import PipelineConfig, RunConfig


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


def check_run(run: RunConfig) -> list[str]:
    """Datasets (rows converted and validated), model path and chat template. Raises UserError."""
    from rlfactory.data.loader import load_examples

    notes = []
    train, kind = _load(run, run.data.dataset, run.data.max_samples)
    notes.append(f"[{run.name or run.stage}] data: {len(train)} {kind} examples from {', '.join(run.data.dataset)}")
    if run.data.eval_dataset:
        held, _ = _load(run, run.data.eval_dataset, None)
        notes.append(f"[{run.name or run.stage}] eval data: {len(held)} examples")
    if run.evaluation.dataset:
        load_examples([run.evaluation.dataset], "prompt", run.data.dataset_dir, 1, run.data.max_bad_rows)
    from rlfactory.stages import get_stage

    stage_check = getattr(get_stage(run.stage), "check", None)  # the stage's own rules (names, columns, files)
    if stage_check is not None:
        notes += list(stage_check(run) or [])
    if run.model.from_stage is None and run.model.name_or_path and Path(run.model.name_or_path).is_dir():
        from rlfactory.model.loader import load_tokenizer

        tokenizer = load_tokenizer(run.model)
        notes.append(f"[{run.name or run.stage}] model: {run.model.name_or_path} (tokenizer loads)")
        notes.append(f"[{run.name or run.stage}] chat template: {check_template(tokenizer, train)}")
        fit_counts = getattr(get_stage(run.stage), "fit_counts", None)  # what the length limit does to the rows
        if fit_counts is not None:
            notes.append(f"[{run.name or run.stage}] data {fit_counts(run, tokenizer, train).summary()}")
    else:
        notes.append(
            f"[{run.name or run.stage}] model: {run.model.name_or_path or 'from stage ' + str(run.model.from_stage)}"
            " (not a local directory: checked when the run starts)"
        )
    return notes


def check_config(config: RunConfig | PipelineConfig) -> list[str]:
    runs = config.stages if isinstance(config, PipelineConfig) else [config]
    return [line for run in runs for line in check_run(run)]
