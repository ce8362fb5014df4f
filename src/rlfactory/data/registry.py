"""The dataset registry: ``dataset_info.yaml`` (ours) and ``dataset_info.json`` (LLaMA-Factory's) map a name to a
file (or a `datasets` dir, or a hub dataset) and its format.

Both files are read when a folder has them. The JSON file gets LLaMA-Factory's defaults and keys
(``llamafactory_entry``: alpaca unless stated, ``hf_hub_url``, ``ms_hub_url``, ``script_url``, media columns);
the YAML file ours (``formatting`` openai unless stated, ``hf_path``). An entry that cannot be used (a bad key, a
ModelScope-only hub dataset, image columns) does not break the file: it becomes an ``UnusableEntry`` whose error
is raised only when a run names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlfactory.errors import UserError, did_you_mean

REGISTRY_FILE = "dataset_info.yaml"
LLAMAFACTORY_FILE = "dataset_info.json"
REGISTRY_FILES = (REGISTRY_FILE, LLAMAFACTORY_FILE)


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
    data_dir: str | None = Field(None, description="hf_path: a folder inside the dataset repository.")
    revision: str | None = Field(None, description="hf_path: a branch, tag or commit of the dataset repository.")
    formatting: Literal["alpaca", "sharegpt", "openai", "trl"] = Field(
        "openai",
        description="Row layout. openai rows without a `messages` column are read as a TRL dataset type "
        "(text, prompt, prompt/completion, chosen/rejected, prompt/completion/label), as `trl` reads them.",
    )
    ranking: bool = Field(False, description="Preference (chosen/rejected) data.")
    columns: Columns = Field(default_factory=Columns)
    tags: Tags = Field(default_factory=Tags)


@dataclass(frozen=True)
class UnusableEntry:
    """A registry entry that cannot be used; its error is raised only when a run names it."""

    message: str


def default_dataset_dir() -> Path:
    """./data when it has a registry, else the data/ folder of this source checkout."""
    local = Path("data")
    if any((local / name).is_file() for name in REGISTRY_FILES):
        return local
    return Path(__file__).resolve().parents[3] / "data"


def _read(path: Path) -> dict[str, Any]:
    """One registry file (YAML through the project's loader: UTF-8 and duplicate keys checked; JSON)."""
    from rlfactory.config.yaml_io import load_yaml_file
    from rlfactory.errors import read_text

    if path.suffix == ".json":
        try:
            raw = json.loads(read_text(path, "dataset registry"))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: syntax error: {exc}") from None
    else:
        raw = load_yaml_file(path, "dataset registry")
    if raw is not None and not isinstance(raw, dict):
        raise UserError(
            f"{path}: the top level must be a mapping of dataset names to entries (mine: {{file_name: ...}}), "
            f"not a {type(raw).__name__}"
        )
    return raw or {}


def _validate(name: str, entry: Any, path: Path) -> DatasetSpec | UnusableEntry:
    if path.name == LLAMAFACTORY_FILE:
        from rlfactory.data.llamafactory import llamafactory_entry

        converted = llamafactory_entry(name, entry, path)
        if isinstance(converted, str):
            return UnusableEntry(converted)
        entry = converted
    if not isinstance(entry, dict):
        return UnusableEntry(
            f"{path}: dataset '{name}' must be a mapping (file_name: ..., formatting: ...), "
            f"not a {type(entry).__name__}"
        )
    try:
        spec = DatasetSpec.model_validate(entry)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return UnusableEntry(f"{path}: dataset '{name}': {where}: {first['msg']}")
    if not spec.file_name and not spec.hf_path:
        return UnusableEntry(f"{path}: dataset '{name}' needs `file_name` or `hf_path`")
    return spec


def load_registry(dataset_dir: str | Path | None) -> tuple[Path, dict[str, DatasetSpec | UnusableEntry]]:
    """Read dataset_info.yaml and/or dataset_info.json; returns (their folder, name -> spec or unusable entry)."""
    folder = Path(dataset_dir) if dataset_dir else default_dataset_dir()
    paths = [folder / name for name in REGISTRY_FILES if (folder / name).is_file()]
    if not paths:
        raise UserError(
            f"no dataset registry in '{folder}' ({' or '.join(REGISTRY_FILES)}); set data.dataset_dir to the folder "
            "holding it"
        )
    specs: dict[str, DatasetSpec | UnusableEntry] = {}
    for path in paths:
        for name, entry in _read(path).items():
            if name in specs:
                specs[name] = UnusableEntry(
                    f"dataset '{name}' is registered in both {REGISTRY_FILE} and {LLAMAFACTORY_FILE} of {folder}; "
                    "keep one of the two entries"
                )
                continue
            specs[name] = _validate(str(name), entry, path)
    return folder, specs


def get_spec(name: str, folder: Path, specs: dict[str, DatasetSpec | UnusableEntry]) -> DatasetSpec:
    if name not in specs:
        files = " or ".join(str(folder / file) for file in REGISTRY_FILES if (folder / file).is_file())
        raise UserError(
            f"dataset '{name}' is not in {files}{did_you_mean(name, specs)}; "
            f"registered: {', '.join(sorted(specs)) or 'none'}"
        )
    spec = specs[name]
    if isinstance(spec, UnusableEntry):
        raise UserError(spec.message)
    return spec
