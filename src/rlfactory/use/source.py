"""What a path given to chat, eval, export or serve holds, and loading it.

A path is a model dir (``config.json``), a LoRA adapter dir (``adapter_config.json``) or a run's output dir (the
final model or adapter, with the run's ``config.yaml`` beside it). An adapter resolves to its base model -- the one
given, else the run's ``model.name_or_path``, else the adapter's own ``base_model_name_or_path`` -- plus the
adapters the run itself started from, merged first. The template is the one given, else the run's, else the
tokenizer's own. The WebUI's Chat and Export tabs and the CLI commands share this, so a run dir means the same
thing everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlfactory.errors import UserError

# (path, what it is) -> None or UserError: the WebUI checks every path against its workspace roots
PathCheck = Callable[[str, str], None]


@dataclass
class ModelSource:
    """What to load: a base model, the adapters merged into it, and the template."""

    base: str
    adapters: list[str]
    template: str | None
    tokenizer_from: str


def _run_model_section(folder: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return raw.get("model") or {} if isinstance(raw, dict) else {}


def resolve_source(path: str, base: str = "", template: str = "", check: PathCheck | None = None) -> ModelSource:
    """A model dir, an adapter dir or a run's output dir -> base + adapters + template (see the module doc).

    ``check`` is called on every local path read (given or taken from the run) before it is used."""
    check = check or (lambda _path, _what: None)
    if path.strip():
        check(path.strip(), "model")
    folder = Path(path.strip()).expanduser()
    if not path.strip() or not folder.is_dir():
        raise UserError(f"'{path}' is not a directory: give a model dir, a LoRA adapter dir or a run's output dir")
    run_model = _run_model_section(folder)
    chosen_template = template or run_model.get("template") or None
    if not (folder / "adapter_config.json").is_file():
        if not (folder / "config.json").is_file():
            raise UserError(f"'{path}' holds neither a model (config.json) nor a LoRA adapter (adapter_config.json)")
        return ModelSource(str(folder), [], chosen_template, str(folder))
    try:
        adapter_cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / 'adapter_config.json'}: not readable JSON ({exc})") from None
    base_path = base.strip() or run_model.get("name_or_path") or adapter_cfg.get("base_model_name_or_path")
    if not base_path:
        raise UserError(f"'{path}' is a LoRA adapter without a known base model: give the base model")
    earlier = [] if base.strip() else list(run_model.get("adapter_paths") or [])
    for what, source in [("model.name_or_path", str(base_path))] + [
        (f"model.adapter_paths.{i}", a) for i, a in enumerate(earlier)
    ]:
        check(source, what)  # may be a Hub name: the check tells them apart
    has_tokenizer = (folder / "tokenizer_config.json").is_file()
    return ModelSource(
        str(base_path), [*earlier, str(folder)], chosen_template, str(folder if has_tokenizer else base_path)
    )


def load_source(source: ModelSource, dtype: str = "auto") -> tuple[Any, Any]:
    """(model, tokenizer) for inference: adapters merged, the template applied to the tokenizer; ``dtype`` as
    ``model.dtype``."""
    from rlfactory.config.schema import FreezeConfig, LoraConfig, ModelConfig
    from rlfactory.model.loader import load_model, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path=source.tokenizer_from, template=source.template))
    cfg = ModelConfig(name_or_path=source.base, adapter_paths=source.adapters, template=source.template, dtype=dtype)
    model = load_model(cfg, LoraConfig(), FreezeConfig(), trainable=False)
    return model, tokenizer
