"""YAML + ``key.sub=value`` overrides -> a validated RunConfig or PipelineConfig.

Every failure becomes one UserError that names the file and the YAML path and says what to do.
"""

from __future__ import annotations

import copy
import difflib
import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlfactory.config.schema import PipelineConfig, RunConfig
from rlfactory.config.yaml_io import load_yaml_file
from rlfactory.errors import UserError

log = logging.getLogger(__name__)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping, with clear errors for a missing file, a non-UTF-8 file, bad syntax or a duplicate key."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"config file '{path}' does not exist; pass the path of a run YAML (see examples/)")
    data = load_yaml_file(path, "config file")
    if data is None:
        raise UserError(f"{path}: the file is empty; it needs at least `stage`, `model` and `data`")
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level must be a mapping of keys (stage: ..., model: ...)")
    return data


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "command line") -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, returning a copy.

    In a pipeline, ``<stage name>.key=value`` or ``stages.<i>.key=value`` address one stage.
    """
    raw = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"{source}: override '{item}' must look like key.sub=value")
        value = _override_value(text, item, source)
        parts = key.split(".")
        if "stages" in raw and parts[0] != "stages" and parts[0] not in PipelineConfig.model_fields:
            index = _stage_index(raw["stages"], parts[0])
            parts = ["stages", str(index), *parts[1:]] if index is not None else ["defaults", *parts]
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise UserError(f"{source}: override '{key}': '{part}' is not a valid index")
                node = node[int(part)]
                continue
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict | list):
                where = ".".join(parts[: depth + 1])
                raise UserError(f"{source}: override '{key}': '{where}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _override_value(text: str, item: str, source: str) -> Any:
    """An override's value, parsed as YAML (``[1, 2]`` is a list, ``1e-4`` a number)."""
    if not text:
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(
            f"{source}: override '{item}' is not valid YAML ({problem}); fix the value, or quote it to pass a string"
        ) from None


def _stage_index(stages: Any, name: str) -> int | None:
    if not isinstance(stages, list):
        return None
    for index, stage in enumerate(stages):
        if isinstance(stage, dict) and (stage.get("name") or stage.get("stage")) == name:
            return index
    return None


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``top`` over ``base`` (values in ``top`` win)."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _expand_pipeline(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge `defaults` into each stage and give each stage its own output_dir."""
    defaults = raw.get("defaults") or {}
    root = raw.get("output_dir", PipelineConfig.model_fields["output_dir"].default)
    stages = raw.get("stages")
    if not isinstance(stages, list):
        return raw
    expanded = []
    for stage in stages:
        if not isinstance(stage, dict):
            expanded.append(stage)
            continue
        merged = deep_merge(defaults, stage)
        merged.setdefault("output_dir", str(Path(root) / str(merged.get("name") or merged.get("stage"))))
        expanded.append(merged)
    return {**raw, "stages": expanded}


def format_validation_error(exc: ValidationError, source: str, model: type[BaseModel]) -> str:
    """Turn pydantic's errors into lines that name the YAML path and the fix."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        path = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            valid = _valid_keys(model, loc[:-1])
            hint = _key_hint(model, loc)
            lines.append(f"unknown key '{path}'{hint}; valid keys here: {', '.join(valid)}")
        elif err["type"] == "missing":
            lines.append(f"missing required key '{path}'")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = "" if err["type"].startswith("value_error") else f" (got {err.get('input')!r})"
            lines.append(f"{path}: {msg}{got}" if loc else msg)
    head = f"{source}: invalid config" + (":" if len(lines) > 1 else ": ")
    return head + ("\n  - " + "\n  - ".join(lines) if len(lines) > 1 else lines[0])


def _dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the schema as a full dotted path (``data.dataset``), sections included."""
    keys = []
    for name, info in model.model_fields.items():
        keys.append(prefix + name)
        section = _section_class(info.annotation)
        if section is not None and name != "stages":
            keys += _dotted_keys(section, f"{prefix}{name}.")
    return keys


def _key_hint(model: type[BaseModel], loc: list[str]) -> str:
    """' (did you mean 'data.dataset'?)': the full key to write, also when the right key lives in another
    section (``dataset`` at the top level, ``learning_rate`` under ``model``). A LLaMA-Factory key name in our
    file is answered with its mapping."""
    from rlfactory.config.llamafactory import mapped_target

    keys = _dotted_keys(RunConfig)
    inside = [part for part in loc[:-1] if not part.isdigit() and part not in ("stages", "defaults")]
    here = ".".join(inside)
    wrong = loc[-1]
    target = mapped_target(wrong)
    if target:  # a LLaMA-Factory key name
        return f" (did you mean '{target}'?)"
    exact = [k for k in keys if k.rpartition(".")[2] == wrong and k.rpartition(".")[0] != here]
    if exact:
        return f" (did you mean {' or '.join(repr(k) for k in exact)}?)"
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == here}
    close = difflib.get_close_matches(wrong, list(siblings), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{siblings[close[0]]}'?)"
    by_leaf = {k.rpartition(".")[2]: k for k in keys if "." in k}
    close = difflib.get_close_matches(wrong, list(by_leaf), n=1, cutoff=0.75)
    return f" (did you mean '{by_leaf[close[0]]}'?)" if close else ""


def _valid_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    """Keys accepted at ``loc`` inside ``model`` (follows nested sections and list indices)."""
    current: Any = model
    for part in loc:
        if part.isdigit():
            continue
        field = current.model_fields.get(part) if isinstance(current, type) else None
        if field is None:
            return []
        current = _section_class(field.annotation)
    return sorted(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _section_class(annotation: Any) -> Any:
    """The BaseModel class inside ``X``, ``X | None`` or ``list[X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_class(arg)
        if found is not None:
            return found
    return None


def validate_config(raw: dict[str, Any], source: str) -> RunConfig | PipelineConfig:
    """Validate a raw mapping as a single run, or a pipeline when it has `stages:`."""
    model: type[BaseModel] = PipelineConfig if "stages" in raw else RunConfig
    if model is PipelineConfig:
        raw = _expand_pipeline(raw)
    try:
        config = model.model_validate(raw)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, source, model)) from None
    if isinstance(config, RunConfig) and config.model.from_stage is not None:
        raise UserError(
            f"{source}: model.from_stage ('{config.model.from_stage}') names an earlier stage of a pipeline, and this "
            "is a single run; set model.name_or_path to that stage's output_dir, or write a pipeline (`stages:`)"
        )
    return config  # type: ignore[return-value]


def resolve_raw(path: str | os.PathLike[str], overrides: list[str] | None = None) -> tuple[dict[str, Any], Any]:
    """The file's mapping in our schema, with overrides applied, and the LLaMA-Factory conversion (or None).

    A LLaMA-Factory file is converted first (``config/llamafactory.py``); overrides without a dot are its own flat
    keys (``model_name_or_path=...``) and apply before the conversion, dotted ones (ours) after it."""
    from rlfactory.config import llamafactory

    raw = read_yaml(path)
    overrides = overrides or []
    if not llamafactory.is_llamafactory(raw):
        return apply_overrides(raw, overrides), None
    flat = [item for item in overrides if "." not in item.partition("=")[0]]
    dotted = [item for item in overrides if item not in flat]
    conversion = llamafactory.convert(apply_overrides(raw, flat))
    return apply_overrides(conversion.out, dotted), conversion


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> RunConfig | PipelineConfig:
    """Read, override and validate a run or pipeline YAML (ours, or LLaMA-Factory's flat one: its notice is
    logged)."""
    raw, conversion = resolve_raw(path, overrides)
    if conversion is None:
        return validate_config(raw, str(path))
    for line in conversion.notes(str(path)):
        log.info("%s", line)
    try:
        return validate_config(raw, str(path))
    except UserError as exc:
        from rlfactory.config.llamafactory import explain_error

        raise UserError(explain_error(str(exc), conversion)) from None


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML (what is saved as ``config.yaml`` in the output dir)."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude_none=True), sort_keys=False)
