"""``rlfactory config check``: everything that can be validated without training."""

from __future__ import annotations

from pathlib import Path

from rlfactory.config.schema import PipelineConfig, RunConfig


def check_run(run: RunConfig) -> list[str]:
    """Datasets (rows converted and validated), model path and chat template. Raises UserError."""
    from rlfactory.data.loader import load_examples
    from rlfactory.stages import data_kind

    notes = []
    kind = data_kind(run.stage)
    train = load_examples(run.data.dataset, kind, run.data.dataset_dir, run.data.max_samples, run.data.max_bad_rows)
    notes.append(f"[{run.name or run.stage}] data: {len(train)} {kind} examples from {', '.join(run.data.dataset)}")
    if run.data.eval_dataset:
        held = load_examples(run.data.eval_dataset, kind, run.data.dataset_dir, None, run.data.max_bad_rows)
        notes.append(f"[{run.name or run.stage}] eval data: {len(held)} examples")
    if run.evaluation.dataset:
        load_examples([run.evaluation.dataset], "prompt", run.data.dataset_dir, 1, run.data.max_bad_rows)
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
