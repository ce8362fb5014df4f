"""The dataset registry: ``dataset_info.yaml`` maps a name to a file (or a `datasets` dir) and its format.

Same spirit as LLaMA-Factory's ``dataset_info.json`` (``formatting``, ``columns``, ``tags``,
``ranking``) so its users recognise it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlfactory.errors import UserError, did_you_mean

REGISTRY_FILE = "dataset_info.yaml"


class Columns(BaseModel):
    """Which source column holds each canonical field (only those that apply need be given)."""

    model_config = ConfigDict(extra="forbid")
    messages: str | None = Field(None, description="sharegpt/openai: the conversation list.")
    prompt: str | None = Field(None, description="alpaca: the instruction.")
    query: str | None = Field(None, description="alpaca: the optional input appended to the instruction.")
    response: str | None = Field(None, description="alpaca: the answer.")
    history: str | None = Field(None, description="alpaca: earlier [instruction, answer] pairs.")
    system: str | None = Field(None, description="A system prompt column.")
    tools: str | None = Field(None, description="Tool JSON schemas (list, or a JSON string).")
    chosen: str | None = Field(None, description="Preference data: the preferred response.")
    rejected: str | None = Field(None, description="Preference data: the dispreferred response.")
    kto_tag: str | None = Field(None, description="KTO data: true (desirable) / false (undesirable).")
    answer: str | None = Field(None, description="Ground truth for verifiable rewards.")
    margin: str | None = Field(None, description="Reward modelling: optional per-pair margin.")


class Tags(BaseModel):
    """sharegpt role tags."""

    model_config = ConfigDict(extra="forbid")
    role_tag: str = "from"
    content_tag: str = "value"
    user_tag: str = "human"
    assistant_tag: str = "gpt"
    observation_tag: str = "observation"
    function_tag: str = "function_call"
    system_tag: str = "system"


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file_name: str | None = Field(None, description="File or folder relative to the registry's folder.")
    hf_path: str | None = Field(None, description="A `datasets` path/name (must be cached when offline).")
    subset: str | None = None
    split: str = "train"
    formatting: Literal["alpaca", "sharegpt", "openai", "trl"] = Field(
        "openai",
        description="Row layout. openai rows without a `messages` column are read as a TRL dataset type "
        "(text, prompt, prompt/completion, chosen/rejected, prompt/completion/label), as `trl` reads them.",
    )
    ranking: bool = Field(False, description="Preference (chosen/rejected) data.")
    columns: Columns = Field(default_factory=Columns)
    tags: Tags = Field(default_factory=Tags)


def default_dataset_dir() -> Path:
    """./data when it has a registry, else the data/ folder of this source checkout."""
    local = Path("data")
    if (local / REGISTRY_FILE).is_file():
        return local
    return Path(__file__).resolve().parents[3] / "data"


def load_registry(dataset_dir: str | Path | None) -> tuple[Path, dict[str, DatasetSpec]]:
    """Read and validate dataset_info.yaml; returns (its folder, name -> spec)."""
    from rlfactory.config.yaml_io import load_yaml_file

    folder = Path(dataset_dir) if dataset_dir else default_dataset_dir()
    path = folder / REGISTRY_FILE
    if not path.is_file():
        raise UserError(f"dataset registry '{path}' not found; set data.dataset_dir to the folder holding it")
    raw = load_yaml_file(path, "dataset registry") or {}
    if not isinstance(raw, dict):
        raise UserError(
            f"{path}: the top level must be a mapping of dataset names to entries (mine: {{file_name: ...}}), "
            f"not a {type(raw).__name__}"
        )
    specs = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise UserError(
                f"{path}: dataset '{name}' must be a mapping (file_name: ..., formatting: ...), "
                f"not a {type(entry).__name__}"
            )
        try:
            specs[name] = DatasetSpec.model_validate(entry)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UserError(f"{path}: dataset '{name}': {where}: {first['msg']}") from None
        if not specs[name].file_name and not specs[name].hf_path:
            raise UserError(f"{path}: dataset '{name}' needs `file_name` or `hf_path`")
    return folder, specs


def get_spec(name: str, folder: Path, specs: dict[str, DatasetSpec]) -> DatasetSpec:
    if name not in specs:
        raise UserError(
            f"dataset '{name}' is not in {folder / REGISTRY_FILE}{did_you_mean(name, specs)}; "
            f"registered: {', '.join(sorted(specs)) or 'none'}"
        )
    return specs[name]
