"""The model picker's list: local model folders (data/models/*, the workspace, its finished full-model runs) and the
models in the Hugging Face cache (``huggingface_hub.scan_cache_dir``), each with its chat template: which one the
tokenizer ships, or, for a tokenizer without one, the named template to fill into ``model.template``.

Read from the files only (config.json, tokenizer_config.json, chat_template.jinja): listing loads no tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUNDLED_DIR = "data/models"
LOCAL_PATTERNS = ("*/config.json", "*/*/config.json", "*/*/*/config.json")  # the workspace, three levels down
MAX_LOCAL = 200
# a tokenizer without a chat template: the named template its model family's chat models use
FAMILY_TEMPLATES = {"qwen2": "chatml", "qwen3": "chatml", "qwen2_moe": "chatml", "qwen3_moe": "chatml"}
FAMILY_TEMPLATES |= {"llama": "llama3", "gemma": "gemma_tools", "gemma2": "gemma_tools", "gemma3_text": "gemma_tools"}
# what a template's text shows of its format, for one that is neither named nor TRL's
MARKERS = (
    ("<|im_start|>", "ChatML"),
    ("<|start_header_id|>", "Llama 3"),
    ("<start_of_turn>", "Gemma"),
    ("<|channel|>", "harmony (GPT-OSS)"),
    ("[INST]", "[INST] (Mistral / Llama 2)"),
)


@dataclass(frozen=True)
class ModelChoice:
    name: str  # what model.name_or_path gets: a path as the page shows it, or a hub id
    where: str  # "local" or "hub cache"
    template: str  # the tokenizer's own template as recognised, "" when it has none
    fill_template: str  # what model.template gets: "" (the tokenizer's own) or a named template

    @property
    def label(self) -> str:
        """The dropdown entry: name, where, template."""
        if self.template:
            template = f"own chat template: {self.template}"
        elif self.fill_template:
            template = f"no chat template: uses {self.fill_template}"
        else:
            template = "no chat template: set model.template"
        return f"{self.name} · {self.where} · {template}"


def chat_template_text(folder: Path) -> str | None:
    """The tokenizer's own chat template (chat_template.jinja, or tokenizer_config.json's ``chat_template``: a string
    or a list of named ones, of which ``default``), or None."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace")
    config = _json(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None:
        template = _json(folder / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def template_label(text: str) -> str:
    """Which template ``text`` is: one of ours or TRL's by name (same text), else its format by its markers."""
    from rlfactory.render.templates import TEMPLATES, trl_templates

    for name, named in TEMPLATES.items():
        if named.jinja.strip() == text.strip():
            return name
    for name, path in trl_templates().items():
        if path.read_text(encoding="utf-8").strip() == text.strip():
            return f"{name} (as TRL ships it)"
    kind = next((label for marker, label in MARKERS if marker in text), "its own format")
    return f"{kind}{', with tools' if 'tools' in text else ''}"


def describe(name: str, folder: Path, where: str) -> ModelChoice:
    template = chat_template_text(folder)
    if template:
        return ModelChoice(name, where, template_label(template), "")
    family = str(_json(folder / "config.json").get("model_type", ""))
    return ModelChoice(name, where, "", FAMILY_TEMPLATES.get(family, ""))


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_model_dir(folder: Path, shown: str) -> bool:
    """A Hugging Face model folder (config.json naming a model type) that is not a checkpoint, a hidden folder or
    inside the hub cache (listed by repo id instead); judged by ``shown``, the path it is listed as."""
    hidden = any(part.startswith((".", "checkpoint-", "models--")) for part in Path(shown).parts)  # models--: cache
    return not hidden and bool(_json(folder / "config.json").get("model_type"))


def local_models(root: Path, extra: Iterable[Path] = ()) -> list[ModelChoice]:
    """Model folders under data/models first, then the rest of ``root`` (three levels down) and the ``extra`` roots;
    names relative to ``root`` where inside it."""
    folders: list[Path] = sorted(p.parent for p in (root / BUNDLED_DIR).glob("*/config.json"))
    for base in (root, *extra):
        for pattern in LOCAL_PATTERNS:
            folders += sorted(p.parent for p in base.glob(pattern))
    seen, choices = set(), []
    for folder in folders:
        key = folder.resolve()
        name = str(folder.relative_to(root)) if folder.is_relative_to(root) else str(folder)
        if key in seen or not _is_model_dir(folder, name):
            continue
        seen.add(key)
        choices.append(describe(name, folder, "local"))
        if len(choices) >= MAX_LOCAL:
            break
    return choices


def cached_models() -> list[ModelChoice]:
    """The models in the Hugging Face cache (its ``main`` revision, else the newest), by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir().repos
    except (CacheNotFound, OSError):
        return []
    choices = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        revisions = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        if repo.repo_type != "model" or not revisions:
            continue
        folder = Path(revisions[0].snapshot_path)
        if (folder / "config.json").is_file():
            choices.append(describe(repo.repo_id, folder, "hub cache"))
    return choices


def all_models(root: Path, extra: Iterable[Path] = ()) -> list[ModelChoice]:
    return [*local_models(root, extra), *cached_models()]
