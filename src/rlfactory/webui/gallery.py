"""The Start page's examples: the bundled quickstarts (every stage and the pipeline, runnable offline on the bundled
model) and the real-model examples, each with what this machine lacks to run it (a model that is neither a local
folder nor in the Hugging Face cache, a GPU, a package), found the way ``rlfactory train`` would find it.

A file with ``stages:`` is a pipeline, as for the CLI (``config.loader.validate_config``); the page starts it with
the same ``rlfactory train`` (``runner.start``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfactory.errors import UserError

EXAMPLES_DIR = "examples"
QUICKSTART_DIR = "quickstart"
TITLE_PREFIXES = ("rlfactory quickstart pipeline", "rlfactory quickstart:")


@dataclass(frozen=True)
class Example:
    path: str  # as the page shows it (relative to the workspace)
    title: str  # the file's first "###" line
    stages: tuple[str, ...]  # one stage, or a pipeline's stages in order
    models: tuple[str, ...]  # the model.name_or_path values it starts from (a pipeline's later stages excluded)
    quickstart: bool
    pipeline: bool  # a `stages:` file
    problem: str  # what this machine lacks to run it; "" when it runs here
    output_dir: str

    @property
    def key(self) -> str:
        """A name for element ids: a quickstart's file stem (its stage, or ``pipeline``)."""
        return Path(self.path).stem


def title_of(text: str) -> str:
    """The example's first sentence of ``###`` comment lines (it may run on to the next one), without the quickstart
    prefix."""
    title = ""
    for line in text.splitlines():
        if not line.startswith("###"):
            if title:
                break
            continue
        title = f"{title} {line.lstrip('#').strip()}".strip()
        if title.endswith((".", ":", ")")):
            break
    for prefix in TITLE_PREFIXES:
        if title.startswith(prefix):
            title = ("pipeline" if "pipeline" in prefix else "") + title[len(prefix) :]
    return title.strip(" :")


def model_problem(name: str) -> str:
    """ "" when ``name`` loads here: a local model folder, or a hub id in the Hugging Face cache; else what is missing.
    Offline (HF_HUB_OFFLINE=1) a hub id must be cached, as train requires; online it would be downloaded."""
    from rlfactory.model.loader import is_hub_id

    folder = Path(name).expanduser()
    if folder.is_dir():
        return "" if (folder / "config.json").is_file() else f"'{name}' has no config.json"
    if not is_hub_id(name):
        return f"model folder '{name}' does not exist"
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return ""
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    how = "this WebUI runs offline" if offline else "it is downloaded at Start (network needed)"
    return f"needs {name} in the Hugging Face cache (not there; {how}: `hf download {name}`)"


def _runs(config: Any) -> list[Any]:
    from rlfactory.config.schema import PipelineConfig

    return list(config.stages) if isinstance(config, PipelineConfig) else [config]


def read_example(path: Path, shown: str) -> Example:
    """One example file: its stages, the models it starts from and what this machine lacks (first problem only)."""
    from rlfactory.config.loader import read_yaml, validate_config
    from rlfactory.engine.environment import environment_problems

    text = path.read_text(encoding="utf-8")
    raw = read_yaml(path)
    config = validate_config(raw, shown)
    runs = _runs(config)
    models = tuple(dict.fromkeys(run.model.name_or_path for run in runs if run.model.from_stage is None))
    problems = [p for name in models if (p := model_problem(str(name)))]
    problems += [p for run in runs for p in environment_problems(run)]
    quick = path.parent.name == QUICKSTART_DIR
    stages = tuple(run.stage for run in runs)
    problem = problems[0] if problems else ""
    return Example(shown, title_of(text), stages, models, quick, "stages" in raw, problem, config.output_dir)


def examples(folder: str = EXAMPLES_DIR) -> list[Example]:
    """The quickstarts first (stage order, the pipeline last), then the other examples by path. A file that does not
    validate is left out (the example-validation test keeps the bundled ones valid)."""
    from rlfactory.config.schema import STAGES

    order = {stage: index for index, stage in enumerate(STAGES)}
    found = []
    for path in sorted(Path(folder).rglob("*.yaml")):
        try:
            found.append(read_example(path, str(path)))
        except (UserError, OSError, UnicodeDecodeError):
            continue

    def rank(example: Example) -> tuple:
        stage = 100 if example.pipeline else order.get(example.stages[0], 99)
        return (not example.quickstart, stage if example.quickstart else 0, example.path)

    return sorted(found, key=rank)


def status_text(example: Example) -> str:
    """One cell: ready, or what is missing."""
    if example.problem:
        return f"✗ {example.problem}"
    return "✓ runs here (bundled model, offline)" if example.quickstart else "✓ runs here"
