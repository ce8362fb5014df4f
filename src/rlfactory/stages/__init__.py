"""Stage registry: stage name -> module with ``run(cfg) -> summary``. Modules import lazily."""

from __future__ import annotations

import importlib
from typing import Any

from rlfactory.errors import UserError

# stage -> (module, the kind of example its data must provide; see data.loader.EXAMPLE_KINDS)
STAGE_MODULES: dict[str, tuple[str, str]] = {
    "sft": ("rlfactory.stages.sft", "sft"),
}
PLANNED = {
    "rm": "pairwise",
    "dpo": "pairwise",
    "kto": "unpaired",
    "orpo": "pairwise",
    "ppo": "prompt",
    "grpo": "prompt",
}


def data_kind(stage: str) -> str:
    return STAGE_MODULES[stage][1] if stage in STAGE_MODULES else PLANNED[stage]


def get_stage(stage: str) -> Any:
    if stage not in STAGE_MODULES:
        raise UserError(
            f"stage '{stage}' is not available in this version of rlfactory; available: {', '.join(STAGE_MODULES)}"
        )
    return importlib.import_module(STAGE_MODULES[stage][0])
