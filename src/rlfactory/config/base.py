"""The base of every config section (shared by schema.py and online_schema.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _as_list(value: Any) -> Any:
    """Accept a single string where a list of strings is expected (``dataset: name``)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


def _comma_list(value: Any) -> Any:
    """A list of names, also written as one comma-separated string (``dataset: a,b``, LLaMA-Factory's way)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return _as_list(value)
