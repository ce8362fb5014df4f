"""What users and bundled code plug in by name: registries of functions with traits, and user files.

``Registry`` (the verl ``core_algos`` pattern): each estimator/loss/reward/environment/backend is a small
function (or class) registered under a name with optional *traits* (what it needs, e.g.
``needs_reference=True``). Stages look entries up by the name given in YAML and ask the traits instead of
branching on names. ``load_user_function`` loads a ``path/to/file.py:name`` given in YAML (a reward, a
tool, an environment). Both sit at the package root, below ``config``, so any layer can use them.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
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


def load_user_function(spec: str, what: str = "reward.functions") -> Callable[..., Any]:
    """``path/to/file.py:function`` -> the function (clear errors for a missing file or name); ``what`` is the YAML
    key named in errors."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"{what}: '{spec}': file '{path}' does not exist")
    module_spec = importlib.util.spec_from_file_location(f"rlfactory_user_reward_{path.stem}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # the user's module: any error (an exit() too) is theirs to fix
        raise UserError(f"{what}: importing '{path}' failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")]
        raise UserError(f"{what}: '{path}' has no function '{name}'; functions there: {', '.join(found)}")
    return fn
