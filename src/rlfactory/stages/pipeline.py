"""Run a single stage or a pipeline of stages (later stages may start from earlier outputs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlfactory.config.schema import PipelineConfig, RunConfig
from rlfactory.engine import run_dir
from rlfactory.stages import get_stage


def resolve_from_stage(run: RunConfig, outputs: dict[str, RunConfig]) -> RunConfig:
    """Point ``model`` at an earlier stage's result: its full weights, or base + its adapter."""
    source_name = run.model.from_stage
    if source_name is None:
        return run
    source = outputs[source_name]
    summary = json.loads(Path(source.output_dir, "run_summary.json").read_text())
    model = run.model.model_copy()
    if summary["saved_as"] == "adapter":
        model.name_or_path = source.model.name_or_path
        model.adapter_paths = [*source.model.adapter_paths, source.output_dir]
    else:
        model.name_or_path = source.output_dir
        model.adapter_paths = []
    model.template = model.template or source.model.template
    model.from_stage = None
    return run.model_copy(update={"model": model})


def run_config(config: RunConfig | PipelineConfig) -> list[dict[str, Any]]:
    """Run every stage in order; returns their summaries. A pipeline rerun with ``resume_from_checkpoint`` skips
    the stages that finished (their output_dir holds run_summary.json, written last) and resumes the first that
    did not."""
    runs = config.stages if isinstance(config, PipelineConfig) else [config]
    if len(runs) > 1:  # a bad later stage fails now, not after the earlier stages have trained
        from rlfactory.stages.check import check_config

        check_config(config)
    done: dict[str, RunConfig] = {}
    summaries = []
    says = os.environ.get("RANK", "0") == "0"  # every process runs the pipeline (launched: torchrun's RANK); one says
    for index, run in enumerate(runs):
        run = resolve_from_stage(run, done)
        if len(runs) > 1 and says:
            print(f"=== pipeline stage {index + 1}/{len(runs)}: {run.name or run.stage} ({run.stage}) ===")
        finished = run_dir.skips_finished(run.output_dir, run.resume_from_checkpoint, len(runs) > 1)
        if finished is not None:
            if says:
                print(f"already finished ({Path(run.output_dir) / run_dir.SUMMARY_FILE}): skipped")
            summaries.append(finished)
        else:
            summaries.append(get_stage(run.stage).run(run))
            if index + 1 < len(runs):
                _wait_for_every_process()
        done[run.name or run.stage] = run
    return summaries


def _wait_for_every_process() -> None:
    """Between a pipeline's stages: the main process writes a stage's model and run_summary.json after the others
    have finished the stage, and the next stage reads them (``from_stage``) on every process."""
    from rlfactory.engine.shared import process_state

    state = process_state()
    if state.num_processes > 1:
        state.wait_for_everyone()
