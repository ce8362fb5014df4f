"""Read registered datasets, convert rows to canonical examples, validate them for a stage.

Every bad row is reported with its file and row number; up to ``data.max_bad_rows`` are skipped
with a warning, more is an error. An empty result is an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlfactory.data.formats import CONVERTERS, RowError
from rlfactory.data.registry import DatasetSpec, get_spec, load_registry
from rlfactory.errors import UserError, first_line, read_text

log = logging.getLogger(__name__)

# What each stage needs from an example: sft trains on a conversation, pairwise/unpaired on
# preference data, prompt on prompts (rollouts).
EXAMPLE_KINDS = ("sft", "pairwise", "unpaired", "prompt")


def _iter_json(path: Path) -> Iterator[dict[str, Any]]:
    """JSON list or JSON Lines. Read with the json module rather than `datasets`: Arrow would unify
    message dicts across rows (adding null keys that chat templates then render) and row numbers
    must stay exact for error messages."""
    text = read_text(path)
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        yield from rows
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: line {number} is not valid JSON ({exc.msg}); fix or remove it") from None


def _iter_rows(spec: DatasetSpec, folder: Path, name: str) -> tuple[str, Iterator[dict[str, Any]]]:
    """(source label, rows) for a registry entry."""
    if spec.hf_path:
        import datasets

        try:
            ds = datasets.load_dataset(spec.hf_path, spec.subset, split=spec.split)
        except Exception as exc:  # datasets raises many types; all mean "cannot load this"
            raise UserError(f"dataset '{name}': cannot load hf_path '{spec.hf_path}': {exc}") from None
        return spec.hf_path, iter(ds)
    path = folder / str(spec.file_name)
    if not path.exists():
        raise UserError(f"dataset '{name}': file '{path}' does not exist (file_name in {folder}/dataset_info.yaml)")
    if path.is_dir():
        return str(path), _read_saved(path, spec, name)
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return str(path), _iter_json(path)
    if suffix in (".csv", ".parquet"):
        return str(path), _read_table(path, suffix[1:])
    raise UserError(f"dataset '{name}': unsupported file type '{suffix}' ({path}); use json, jsonl, csv or parquet")


def _read_saved(path: Path, spec: DatasetSpec, name: str) -> Iterator[dict[str, Any]]:
    """A folder written by ``datasets``' ``save_to_disk`` (a plain folder of files is not one)."""
    import datasets

    if not any((path / marker).is_file() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise UserError(
            f"dataset '{name}': '{path}' is a directory, not a file or a `datasets` save_to_disk folder; set file_name "
            "to the data file inside it"
        )
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets and Arrow raise many types; all mean "this folder cannot be read"
        raise UserError(
            f"dataset '{name}': cannot read the saved dataset '{path}': {first_line(exc, with_type=True)}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise UserError(f"dataset '{name}': '{path}' has no split '{spec.split}'; splits: {', '.join(loaded)}")
        return iter(loaded[spec.split])
    return iter(loaded)


def _read_table(path: Path, kind: str) -> Iterator[dict[str, Any]]:
    """A csv or parquet file through ``datasets``. It parses the whole file here, so a ragged CSV, a non-UTF-8 CSV or
    a corrupt parquet is one error naming the file, before any row is used."""
    import datasets

    if kind == "csv":
        read_text(path)  # the CSV reader's own decoding error names neither the file nor the line
    try:
        with _quiet("datasets"):  # it logs the parse error with a traceback before raising it
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # DatasetGenerationError, ArrowInvalid, ParserError ...: the file cannot be parsed
        cause = exc.__cause__ or exc
        raise UserError(
            f"{path}: cannot be read as {kind.upper()}: {first_line(cause, with_type=True)}; "
            + (
                "check that every row has as many fields as the header"
                if kind == "csv"
                else "the file is corrupt or not parquet: write it again (e.g. pandas.DataFrame.to_parquet)"
            )
        ) from None
    return iter(ds)


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Silence a library's logger for a call whose errors become our own message."""
    log_ = logging.getLogger(logger)
    level = log_.level
    log_.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log_.setLevel(level)


def check_example(example: dict[str, Any], kind: str) -> None:
    """Raise RowError if the example cannot serve a stage of this kind."""
    messages = example["messages"]
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        raise RowError("a system message may only come first")
    body = roles[1:] if roles[:1] == ["system"] else roles
    if not body or body[0] != "user":
        raise RowError("the conversation must start with a user message (after an optional system message)")
    if kind in ("sft", "unpaired") and body[-1] != "assistant":
        raise RowError("the last message must be an assistant message (it is what gets trained)")
    if kind in ("pairwise", "prompt") and body[-1] == "assistant":
        raise RowError("the conversation must end before the response (chosen/rejected or generated)")
    if kind == "pairwise":
        for side in ("chosen", "rejected"):
            turns = example.get(side)
            if not turns:
                raise RowError(f"'{side}' is missing or empty")
            if turns[0]["role"] != "assistant":
                raise RowError(f"'{side}' must start with an assistant message")
            if not any(m["content"].strip() or m.get("tool_calls") for m in turns if m["role"] == "assistant"):
                raise RowError(f"'{side}' has no assistant content")
        if example["chosen"] == example["rejected"]:
            raise RowError("'chosen' and 'rejected' are identical; a preference pair must differ")
    if kind == "unpaired" and example.get("label") is None:
        raise RowError("KTO rows need a true/false label (set columns.kto_tag in dataset_info.yaml)")


def load_examples(
    names: list[str],
    kind: str,
    dataset_dir: str | None = None,
    max_samples: int | None = None,
    max_bad_rows: int = 0,
) -> list[dict[str, Any]]:
    """Load, convert and validate the named datasets for a stage of ``kind``."""
    if kind not in EXAMPLE_KINDS:
        raise ValueError(f"unknown example kind {kind}")
    folder, specs = load_registry(dataset_dir)
    examples: list[dict[str, Any]] = []
    bad: list[str] = []
    for name in names:
        spec = get_spec(name, folder, specs)
        source, rows = _iter_rows(spec, folder, name)
        convert = CONVERTERS[spec.formatting]
        taken = 0
        for number, row in enumerate(rows, start=1):
            if max_samples is not None and taken >= max_samples:
                break
            try:
                if not isinstance(row, dict):
                    raise RowError("a row must be an object")
                example = convert(row, spec)
                check_example(example, kind)
            except RowError as exc:
                bad.append(f"{source} row {number}: {exc}")
                continue
            example["source"] = f"{name}:{number}"
            examples.append(example)
            taken += 1
    if len(bad) > max_bad_rows:
        shown = "\n  ".join(bad[:5]) + (f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise UserError(
            f"{len(bad)} malformed row(s) (data.max_bad_rows is {max_bad_rows}):\n  {shown}\n"
            "fix the rows, fix the column mapping in dataset_info.yaml, or raise data.max_bad_rows to skip them"
        )
    for line in bad:
        log.warning("skipped %s", line)
    if not examples:
        raise UserError(f"dataset(s) {', '.join(names)} gave no usable {kind} examples")
    return examples
