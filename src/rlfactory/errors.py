"""User-facing errors: shown as one clear message with exit code 2, never a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A problem the user can fix (bad YAML, missing file, malformed row, ...).

    The CLI prints ``str(error)`` and exits with code 2. Messages should name the file,
    row or key and say what to do.
    """

    exit_code = 2
    prefix = "error"  # the CLI prints "<prefix>: <message>"


class RunStopped(UserError):
    """The run stopped itself on purpose, with a message saying why and what was saved: a signal (exit code
    128 + its number), divergence (1), reward functions failing in a row (2). No traceback either."""

    prefix = "stopped"

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean 'x'?)' for the closest candidate, or '' if none is close."""
    close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
