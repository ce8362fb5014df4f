"""Named registries of pure functions (the verl ``core_algos`` pattern).

Each estimator/loss/KL/aggregation is a small function registered under a name with
optional *traits* (what it needs, e.g. ``needs_reference=True``). Stages look entries up
by the name given in YAML and ask the traits instead of branching on names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfactory.errors import UserError, did_you_mean


class Registry:
    """A mapping name -> function with traits; duplicate names raise, unknown names list valid ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable[..., Any]] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``@REGISTRY.register("name", needs_reference=True)``."""

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = fn
            self._traits[name] = dict(traits)
            return fn

        return decorator

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._entries:
            raise UserError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._entries)}; "
                f"valid names: {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def traits(self, name: str) -> dict[str, Any]:
        self.get(name)
        return self._traits[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
