"""User-facing errors: shown as one clear message with exit code 2, never a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


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


def read_text(path: Path | str, what: str = "") -> str:
    """A user's text file as UTF-8: a file in another encoding (or binary) is a UserError naming the file, the line
    and the byte, where Python would raise a UnicodeDecodeError without the file's name."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        label = f"{what} " if what else ""
        raise UserError(
            f"{label}{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}); "
            "save it as UTF-8 (a binary file cannot be read here)"
        ) from None


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of a library's error message (they run to pages), for a UserError that quotes it; a first
    line that only announces the next ("Class validation error for validator 'x':") takes that line along."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(exc).__name__}: {text}" if with_type or not text else text


def model_read_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a model folder it cannot read (a bad config.json, tokenizer file or weights
    file): besides the builtins, huggingface_hub's strict-dataclass validation, which transformers 5 configs run
    (e.g. ``num_hidden_layers`` against ``layer_types``) and which is no ValueError. Imported when an error is
    being matched, so a command that loads no model never imports the hub."""
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, TypeError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: its configs raise ValueError
        return errors
    return (*errors, StrictDataclassError)
