"""Read registered datasets, convert rows to canonical examples, validate them for a stage.

Every bad row is reported with its file and row number; up to ``data.max_bad_rows`` are skipped
with a warning, more is an error. An empty result is an error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlfactory.data.formats import CONVERTERS, RowError, read_columns
from rlfactory.data.registry import DatasetSpec, get_spec, load_registry
from rlfactory.errors import UserError

log = logging.getLogger(__name__)

# What each stage needs from an example: sft trains on a conversation, pairwise/unpaired on
# preference data, prompt on prompts (rollouts).
EXAMPLE_KINDS = ("sft", "pairwise", "unpaired", "prompt")


def _iter_json(path: Path) -> Iterator[dict[str, Any]]:
    """JSON list or JSON Lines. Read with the json module rather than `datasets`: Arrow would unify
    message dicts across rows (adding null keys that chat templates then render) and row numbers
    must stay exact for error messages."""
    text = path.read_text(encoding="utf-8")
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
            ds = datasets.load_dataset(
                spec.hf_path, spec.subset, split=spec.split, data_dir=spec.data_dir, revision=spec.revision
            )
        except Exception as exc:  # datasets raises many types; all mean "cannot load this"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"dataset '{name}': cannot load '{spec.hf_path}' (split {spec.split}) through `datasets`: {first}. "
                "Offline, only datasets already in the local Hugging Face cache load: load it once with network "
                "access, or save it as a file and register it with file_name"
            ) from None
        return spec.hf_path, iter(ds)
    path = folder / str(spec.file_name)
    if not path.exists():
        raise UserError(
            f"dataset '{name}': file '{path}' does not exist (its file_name in {folder}/dataset_info.yaml or .json)"
        )
    if path.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(path))
        ds = loaded[spec.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return str(path), iter(ds)
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return str(path), _iter_json(path)
    if suffix in (".csv", ".parquet"):
        import datasets

        ds = datasets.load_dataset(suffix[1:], data_files=str(path), split="train")
        return str(path), iter(ds)
    raise UserError(f"dataset '{name}': unsupported file type '{suffix}' ({path}); use json, jsonl, csv or parquet")


class UnreadColumns:
    """Counts the non-empty columns of a dataset's rows that the entry's mapping never reads, so that none is
    dropped silently (an alpaca ``input`` left out of ``columns``, a misspelt column name)."""

    def __init__(self, read: set[str]) -> None:
        self.read = read
        self.counts: dict[str, int] = {}

    def add(self, row: dict[str, Any]) -> None:
        for column, value in row.items():
            if column not in self.read and value not in (None, "", [], {}):
                self.counts[column] = self.counts.get(column, 0) + 1

    def report(self, name: str) -> None:
        if self.counts:
            shown = ", ".join(f"'{column}' ({n} rows)" for column, n in sorted(self.counts.items()))
            log.warning(
                "dataset '%s': column(s) %s are not mapped in the registry entry, so they are not part of the "
                "conversation; map them under `columns` if they should be",
                name,
                shown,
            )


def response_as_answer(example: dict[str, Any]) -> None:
    """Prompt-only stages (ppo, grpo) on sft-style rows, as LLaMA-Factory's ppo reads them: the final assistant
    turn is not a prompt, so it becomes the row's reference ``answer`` (for reward functions) instead of being
    dropped. A row that already has an answer keeps the error: its response would be lost."""
    messages = example["messages"]
    if len(messages) > 1 and messages[-1]["role"] == "assistant" and example.get("answer") is None:
        if not messages[-1].get("tool_calls") and not example.get("chosen"):
            example["answer"] = messages.pop()["content"]


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
        unread = UnreadColumns(read_columns(spec))
        taken = 0
        for number, row in enumerate(rows, start=1):
            if max_samples is not None and taken >= max_samples:
                break
            try:
                if not isinstance(row, dict):
                    raise RowError("a row must be an object")
                unread.add(row)
                example = convert(row, spec)
                if kind == "prompt":
                    response_as_answer(example)
                check_example(example, kind)
            except RowError as exc:
                bad.append(f"{source} row {number}: {exc}")
                continue
            example["source"] = f"{name}:{number}"
            examples.append(example)
            taken += 1
        unread.report(name)
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
