"""``rlfactory config check``: everything that can be validated without training.

In the stages layer, not in ``config``: it loads datasets, a tokenizer and each stage's own ``check``,
all of which sit above the schema (config imports nothing of the package but errors and plugins).
"""

from __future__ import annotations

from pathlib import Path

from rlfactory.config.schema import PipelineConfig, RunConfig


def _load(run: RunConfig, names: list[str], max_samples: int | None) -> tuple[list[dict], str]:
    """Examples of each dataset, validated as the kind the stage reads it as (and that kind, for the notes)."""
    from rlfactory.data.loader import load_examples
    from rlfactory.data.registry import get_spec, load_registry
    from rlfactory.stages import dataset_kind

    folder, specs = load_registry(run.data.dataset_dir)
    examples, kinds = [], set()
    for name in names:
        kind = dataset_kind(run.stage, get_spec(name, folder, specs).ranking)
        kinds.add(kind)
        examples += load_examples([name], kind, run.data.dataset_dir, max_samples, run.data.max_bad_rows)
    return examples, "+".join(sorted(kinds))


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
        prompts = load_examples([run.evaluation.dataset], "prompt", run.data.dataset_dir, 1, run.data.max_bad_rows)
        if run.evaluation.tools:
            from rlfactory.rollout.agent import offer_tools

            offer_tools(run.evaluation.tools, run.evaluation.parser, prompts)
    from rlfactory.stages import get_stage

    stage_check = getattr(get_stage(run.stage), "check", None)  # the stage's own rules (names, columns, files)
    if stage_check is not None:
        notes += list(stage_check(run) or [])
    if run.model.from_stage is None and run.model.name_or_path and Path(run.model.name_or_path).is_dir():
        from rlfactory.model.loader import load_tokenizer

        load_tokenizer(run.model)
        notes.append(f"[{run.name or run.stage}] model: {run.model.name_or_path} (tokenizer and chat template OK)")
    else:
        notes.append(
            f"[{run.name or run.stage}] model: {run.model.name_or_path or 'from stage ' + str(run.model.from_stage)}"
            " (not a local directory: checked when the run starts)"
        )
    return notes


def check_config(config: RunConfig | PipelineConfig) -> list[str]:
    runs = config.stages if isinstance(config, PipelineConfig) else [config]
    return [line for run in runs for line in check_run(run)]
