"""LLaMA-Factory's ``dataset_info.json`` entries -> our registry entries, with LLaMA-Factory's defaults.

What differs from our ``dataset_info.yaml``: ``formatting`` is alpaca unless stated; the source is ``file_name``,
``hf_hub_url``, ``ms_hub_url`` / ``om_hub_url`` (ModelScope / Modelers) or ``script_url``; ``folder`` and
``revision`` address a hub repository; ``columns`` may name media (``images``, ``videos``, ``audios``). Alpaca's
``instruction`` / ``input`` / ``output`` and sharegpt's ``conversations`` are the converters' defaults, as in
LLaMA-Factory, so a column the entry leaves out is still read when the rows have it (LLaMA-Factory would drop
``input`` when ``columns`` lists only prompt and response; rlfactory keeps it rather than lose it).

An entry we cannot use gives a message naming the entry and the fix (the registry keeps it as an ``UnusableEntry``,
raised only when a run names it); the rest of the file stays usable. Column and tag names are checked by the
registry's own schema. Imports nothing of the registry, which calls this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlfactory.errors import did_you_mean

MEDIA_COLUMNS = ("images", "videos", "audios")
# keys of an entry that change nothing here (file_sha1: LLaMA-Factory's cache check)
_NO_EFFECT = ("file_sha1",)
_KNOWN = (
    "file_name", "hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "formatting", "ranking", "subset",
    "split", "folder", "revision", "num_samples", "columns", "tags", *_NO_EFFECT,
)  # fmt: skip


def _source(name: str, entry: dict[str, Any], folder: Path) -> dict[str, Any] | str:
    """Where the rows come from, in our keys; a string is the reason the entry cannot be used."""
    if entry.get("hf_hub_url"):
        return {"hf_path": entry["hf_hub_url"], "data_dir": entry.get("folder"), "revision": entry.get("revision")}
    for key, hub in (("ms_hub_url", "ModelScope"), ("om_hub_url", "Modelers")):
        if entry.get(key):
            return (
                f"dataset '{name}' is on {hub} only ({key}: {entry[key]}); rlfactory loads the Hugging Face hub and "
                "local files: download it and register the file with file_name, or add its hf_hub_url"
            )
    if entry.get("script_url"):  # a folder next to dataset_info.json, or a hub repository
        local = folder / str(entry["script_url"])
        return {"hf_path": str(local) if local.exists() else entry["script_url"], "data_dir": entry.get("folder")}
    if entry.get("file_name"):
        return {"file_name": entry["file_name"]}
    return f"dataset '{name}' needs file_name, hf_hub_url or script_url"


def llamafactory_entry(name: str, entry: Any, path: Path) -> dict[str, Any] | str:
    """One entry of LLaMA-Factory's dataset_info.json as one of ours, or the message why it cannot be used."""
    where = f"{path}: dataset '{name}'"
    if not isinstance(entry, dict):
        return f"{where}: an entry must be a mapping (file_name, formatting, columns, ...)"
    unknown = [key for key in entry if key not in _KNOWN]
    if unknown:
        return f"{where}: unknown key '{unknown[0]}'{did_you_mean(unknown[0], _KNOWN)}"
    source = _source(name, entry, path.parent)
    if isinstance(source, str):
        return f"{path}: {source}"
    if entry.get("num_samples") is not None:
        return (
            f"{where}: num_samples (LLaMA-Factory's random subsample) is not supported; remove it and use "
            "data.max_samples"
        )
    for key in ("columns", "tags"):
        if not isinstance(entry.get(key) or {}, dict):
            return f"{where}: `{key}` must be a mapping"
    columns = dict(entry.get("columns") or {})
    media = {key: columns.pop(key) for key in MEDIA_COLUMNS if columns.get(key)}
    if media:
        shown = ", ".join(f"{key}: {value}" for key, value in media.items())
        return f"{where} has media columns ({shown}): rlfactory trains text-only models; use a text dataset"
    out: dict[str, Any] = {k: v for k, v in source.items() if v is not None}
    out["formatting"] = entry.get("formatting", "alpaca")
    out["ranking"] = bool(entry.get("ranking", False))
    out["split"] = entry.get("split", "train")
    if entry.get("subset"):
        out["subset"] = entry["subset"]
    out["columns"] = {k: v for k, v in columns.items() if v is not None}
    out["tags"] = {k: v for k, v in (entry.get("tags") or {}).items() if v is not None}
    return out
