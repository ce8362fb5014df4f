"""TRL's dataset types -> the canonical example, without preprocessing.

TRL names a dataset type by its columns (https://huggingface.co/docs/trl/dataset_formats), each *standard*
(strings) or *conversational* (lists of ``{role, content}`` messages):

    language modeling      text                       | messages
    prompt-only            prompt
    prompt-completion      prompt, completion
    preference             prompt, chosen, rejected   | chosen, rejected (implicit prompt: a shared prefix)
    unpaired preference    prompt, completion, label
    stepwise supervision   prompt, completions, labels (refused: it trains process reward models)

Conversational rows become ``messages`` (+ ``chosen``/``rejected``) as they are. Standard rows are plain text
that TRL tokenizes without a chat template, so they are marked ``plain``: the stage renders them with the
plain-text template of ``render.plain`` (prompt text, then the completion and the eos token), which gives
TRL's ids. A prompt-completion row trains its completion only (TRL's ``completion_only_loss``):
``train_from`` is the index of the first completion message. The implicit prompt of a preference row is
found with TRL's own ``extract_prompt``; conversational detection is TRL's ``is_conversational``.
"""

from __future__ import annotations

import json
from typing import Any

from rlfactory.data.formats import RowError, _common, _label, normalize_message
from rlfactory.data.registry import DatasetSpec

# the columns that name a TRL dataset type; any of them in a row means "this is a TRL row"
TRL_KEYS = ("text", "messages", "prompt", "completion", "chosen", "rejected", "completions")


class UnsupportedType(RowError):
    """A dataset type rlfactory does not train on: the whole dataset is refused, not the row skipped."""


def is_trl_row(row: dict[str, Any]) -> bool:
    return any(key in row for key in TRL_KEYS)


def _conversational(key: str, value: Any) -> bool:
    from trl.data_utils import is_conversational

    return bool(value) and is_conversational({key: value})


def _decoded(key: str, value: Any) -> Any:
    """A conversation stored as a JSON string (csv, some parquet exports) is decoded; any other string is text."""
    if isinstance(value, str) and value.lstrip()[:1] == "[":
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        return decoded if _conversational(key, decoded) else value
    return value


def _messages(key: str, value: Any, role: str) -> tuple[list[dict[str, Any]], bool]:
    """(messages, plain) of one TRL column: a string becomes one ``role`` message of plain text."""
    value = _decoded(key, value)
    if isinstance(value, str):
        return [{"role": role, "content": value}], True
    if not isinstance(value, list) or not _conversational(key, value):
        raise RowError(f"column '{key}' must be a string or a list of {{role, content}} messages")
    return [normalize_message(m, f"{key}[{i}]") for i, m in enumerate(value)], False


def trl_type(row: dict[str, Any]) -> str:
    """The TRL dataset type a row's columns name (the order matters: `prompt` alone is prompt-only)."""
    keys = set(row)
    if "completions" in keys:
        raise UnsupportedType(
            "stepwise supervision rows (prompt/completions/labels) train process reward models, which rlfactory "
            "does not train; give one `completion` per row (prompt-completion) or chosen/rejected pairs"
        )
    for name, needs in TYPES:
        if needs <= keys:
            return name
    raise RowError(f"no TRL dataset type fits the columns {', '.join(sorted(keys))}")


TYPES = (  # (type, the columns it needs), most specific first
    ("unpaired", {"prompt", "completion", "label"}),
    ("preference", {"prompt", "chosen", "rejected"}),
    ("implicit_preference", {"chosen", "rejected"}),
    ("prompt_completion", {"prompt", "completion"}),
    ("prompt_only", {"prompt"}),
    ("language_modeling", {"messages"}),
    ("language_modeling_text", {"text"}),
)
# columns that hold the conversation itself: the rest of a row is handed to rewards and tools as `columns`
CONVERSATION_COLUMNS = {"text", "messages", "prompt", "completion", "chosen", "rejected"}


def _implicit(row: dict[str, Any]) -> dict[str, Any]:
    """chosen/rejected holding whole conversations (or texts) that share their prompt: TRL's extract_prompt."""
    from trl.data_utils import extract_prompt

    if type(row["chosen"]) is not type(row["rejected"]):
        raise RowError("'chosen' and 'rejected' must both be strings or both be lists of messages")
    split = extract_prompt({"chosen": row["chosen"], "rejected": row["rejected"]})
    if not split["prompt"]:
        raise RowError("'chosen' and 'rejected' share no prompt: add a `prompt` column (explicit prompt)")
    return split


def from_trl(row: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
    """A row of any TRL dataset type -> the canonical example (see the module doc)."""
    kind = trl_type(row)
    example: dict[str, Any]
    if kind == "language_modeling_text":
        if not isinstance(row["text"], str):
            raise RowError("column 'text' must be a string")
        example = {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": row["text"]}]}
        example.update(plain=True, text=row["text"])
    elif kind == "language_modeling":
        messages, plain = _messages("messages", row["messages"], "assistant")
        if plain:
            raise RowError("column 'messages' must be a list of {role, content} messages")
        example = {"messages": messages}
    else:
        source = _implicit(row) if kind == "implicit_preference" else row
        messages, plain = _messages("prompt", source["prompt"], "user")
        example = {"messages": messages}
        if kind in ("prompt_completion", "unpaired"):
            completion, plain_c = _messages("completion", row["completion"], "assistant")
            if plain != plain_c:
                raise RowError("'prompt' and 'completion' must both be strings or both be lists of messages")
            example.update(messages=messages + completion, train_from=len(messages))
        for side in ("chosen", "rejected") if "preference" in kind else ():
            turns, plain_side = _messages(side, source[side], "assistant")
            if plain != plain_side:
                raise RowError(f"'prompt' and '{side}' must both be strings or both be lists of messages")
            example[side] = turns
        if plain:
            example["plain"] = True
    return _with_common(row, spec, example, kind)


def _with_common(row: dict[str, Any], spec: DatasetSpec, example: dict[str, Any], kind: str) -> dict:
    """system, tools, answer, margin as every format reads them; the label of unpaired rows."""
    tools_column = spec.columns.tools or ("tools" if "tools" in row else None)
    spec = spec.model_copy(
        update={"ranking": False, "columns": spec.columns.model_copy(update={"tools": tools_column})}
    )
    messages = example.pop("messages")
    base = _common(row, spec, messages, None)
    if "train_from" in example:  # a system column put a message in front
        example["train_from"] += len(base["messages"]) - len(messages)
    if kind == "unpaired":
        base["label"] = _label(row["label"], "label")
    return {**base, **example, "messages": base["messages"], "trl_type": kind}
