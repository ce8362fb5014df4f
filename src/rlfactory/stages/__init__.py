"""Stage registry: stage name -> module with ``run(cfg) -> summary``. Modules import lazily."""

from __future__ import annotations

import importlib
from typing import Any

from rlfactory.errors import UserError

# stage -> (module, the kind of example its data must provide; see data.loader.EXAMPLE_KINDS)
STAGE_MODULES: dict[str, tuple[str, str]] = {
    "pt": ("rlfactory.stages.pt", "text"),  # continued pre-training on raw text
    "sft": ("rlfactory.stages.sft", "sft"),
    "rm": ("rlfactory.stages.rm", "pairwise"),
    "dpo": ("rlfactory.stages.dpo", "pairwise"),
    "kto": ("rlfactory.stages.kto", "unpaired"),  # also takes ranking data: each pair gives one of each label
    "orpo": ("rlfactory.stages.orpo", "pairwise"),
    "ppo": ("rlfactory.stages.rl", "prompt"),  # ppo and grpo: one recipe, a default estimator each
    "grpo": ("rlfactory.stages.rl", "prompt"),
}
PLANNED: dict[str, str] = {}
# stages that also take ranking (chosen/rejected) datasets: kto splits each pair into one example per label
TAKES_RANKING = {"kto"}


def data_kind(stage: str) -> str:
    return STAGE_MODULES[stage][1] if stage in STAGE_MODULES else PLANNED[stage]


def dataset_kind(stage: str, ranking: bool) -> str:
    """The kind one dataset is loaded and validated as: pairwise for ranking data where the stage takes it."""
    return "pairwise" if ranking and stage in TAKES_RANKING else data_kind(stage)


def get_stage(stage: str) -> Any:
    if stage not in STAGE_MODULES:
        raise UserError(
            f"stage '{stage}' is not available in this version of rlfactory; available: {', '.join(STAGE_MODULES)}"
        )
    return importlib.import_module(STAGE_MODULES[stage][0])
