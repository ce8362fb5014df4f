"""Which environment class an agent loop uses: a bundled one by name, or the user's ``path/to/file.py:Class``.

Above every environment module, so it can import them all (their import registers them in
``ENVIRONMENTS``), while each imports only the interface in :mod:`rlfactory.envs.base`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfactory.envs import arith_feedback as _arith_feedback  # noqa: F401 - registers the bundled example
from rlfactory.envs.base import ENVIRONMENTS, Env
from rlfactory.plugins import load_user_function
from rlfactory.tools.execute import ExecLimits
from rlfactory.tools.spec import Tool


def build_env_factory(
    ref: str, tools: dict[str, Tool], limits: ExecLimits, kwargs: dict[str, Any]
) -> Callable[[], Env]:
    """``agent.env`` (a registered name or ``path/to/file.py:Class``) -> a zero-argument factory of instances."""
    cls = env_class(ref)
    return lambda: cls(tools, limits, **kwargs)


def env_class(ref: str) -> Callable[..., Env]:
    """The environment class ``agent.env`` names: a user file is imported here (its errors are UserErrors), so
    ``config check`` and the start of a run find them before any model loads."""
    if ref.endswith(".py") or ".py:" in ref:
        return load_user_function(ref, what="agent.env")
    return ENVIRONMENTS.get(ref)
