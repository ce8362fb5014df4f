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

from rlfactory.data.formats import CONVERTERS, RowError, read_columns
from rlfactory.data.registry import DatasetSpec, get_spec, load_registry
from rlfactory.data.trl import CONVERSATION_COLUMNS, UnsupportedType, from_trl, is_trl_row
from rlfactory.errors import UserError, first_line, read_text

log = logging.getLogger(__name__)

# What each stage needs from an example: sft trains on a conversation, pairwise/unpaired on
# preference data, prompt on prompts (rollouts), text on raw text (continued pre-training).
EXAMPLE_KINDS = ("sft", "pairwise", "unpaired", "prompt", "text")
# columns a format reads the conversation from when the registry names none (see extra_columns)
DEFAULT_CONVERSATION_COLUMNS = {
    "openai": {"messages"},
    "alpaca": {"instruction", "input", "output", "history"},
    "sharegpt": {"conversations"},
    "trl": CONVERSATION_COLUMNS,
}


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


def _iter_text(path: Path) -> Iterator[dict[str, Any]]:
    """A .txt corpus: one document per line, as `datasets`' text loader and LLaMA-Factory read it; blank
    lines separate nothing and carry no text, so they are skipped."""
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield {"text": line.rstrip("\n")}


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
        return str(path), _read_saved(path, spec, name)
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return str(path), _iter_json(path)
    if suffix == ".txt":
        return str(path), _iter_text(path)
    if suffix in (".csv", ".parquet"):
        return str(path), _read_table(path, suffix[1:])
    raise UserError(
        f"dataset '{name}': unsupported file type '{suffix}' ({path}); use json, jsonl, txt, csv or parquet"
    )


def convert_row(row: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
    """The canonical example of one row, with every column that did not become the conversation kept under
    ``columns`` (reward functions and environments read them). openai rows without their `messages` column
    are read as a TRL dataset type."""
    column = spec.columns.messages or "messages"
    if spec.formatting == "openai" and spec.columns.messages is None and column not in row and is_trl_row(row):
        example = from_trl(row, spec)
    else:
        example = CONVERTERS.get(spec.formatting, from_trl)(row, spec)
    example["columns"] = extra_columns(row, spec, example)
    return example


def extra_columns(row: dict[str, Any], spec: DatasetSpec, example: dict[str, Any]) -> dict[str, Any]:
    """The row's columns except those that became the conversation (messages, chosen, rejected).

    Mapped columns such as ``answer`` stay under their own name too: a TRL-style reward reads ``solution``."""
    c = spec.columns
    named = {c.messages, c.prompt, c.query, c.response, c.history, c.chosen, c.rejected} - {None}
    conversation = named | DEFAULT_CONVERSATION_COLUMNS[spec.formatting]
    if example.get("trl_type"):
        conversation |= CONVERSATION_COLUMNS
    return {key: value for key, value in row.items() if key not in conversation}


def for_kind(example: dict[str, Any], kind: str) -> dict[str, Any]:
    """A prompt-completion row read as a prompt (rollouts): the prompt messages, the reference completion kept
    under ``columns["completion"]`` for rewards."""
    start = example.get("train_from")
    if kind != "prompt" or start is None:
        return example
    completion = example["messages"][start:]
    reference = completion[0]["content"] if example.get("plain") else completion
    return {
        **example,
        "messages": example["messages"][:start],
        "columns": {**example["columns"], "completion": reference},
    }


def is_ranking(name: str, folder: Path, specs: dict[str, DatasetSpec]) -> bool:
    """Preference (chosen/rejected) data: registered with ``ranking: true``, or TRL preference rows (read from the
    first row, as TRL's KTO trainer unpairs a preference dataset it is given)."""
    spec = get_spec(name, folder, specs)
    if spec.ranking:
        return True
    if spec.formatting not in ("openai", "trl") or spec.columns.messages is not None:
        return False
    _, rows = _iter_rows(spec, folder, name)
    row = next(iter(rows), None)
    return isinstance(row, dict) and "chosen" in row and "rejected" in row and "completion" not in row


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
    if kind == "text":
        if not isinstance(example.get("text"), str):
            raise RowError(
                "continued pre-training (stage pt) trains on raw text: the row needs a `text` column "
                "(or use a .txt file, one document per line)"
            )
        return
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
        raise RowError(
            "KTO rows need a true/false label (set columns.kto_tag in dataset_info.yaml, or give chosen/rejected "
            "pairs with `ranking: true` on their entry)"
        )


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
        unread = UnreadColumns(read_columns(spec))
        taken = 0
        for number, row in enumerate(rows, start=1):
            if max_samples is not None and taken >= max_samples:
                break
            try:
                if not isinstance(row, dict):
                    raise RowError("a row must be an object")
                example = for_kind(convert_row(row, spec), kind)
                if not example.get("trl_type"):  # a TRL row's columns are read by its type (data/trl.py)
                    unread.add(row)
                if kind == "prompt":
                    response_as_answer(example)
                check_example(example, kind)
            except UnsupportedType as exc:
                raise UserError(f"{source} row {number}: {exc}") from None
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
