"""``rlfactory export``: a model, an adapter or a run's result as a plain Hugging Face folder (or the adapter alone).

Merged: the adapters are merged into the base (``use.source``: a run dir means its adapter on its base, with the
run's template), and the folder holds safetensors shards, config, generation config, tokenizer and chat template:
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it, vLLM serves it. Adapter only: the adapter's own files plus
the tokenizer and template, for PEFT on the same base. The folder is written under a temporary name beside the
target and renamed at the end, so a failure leaves no half-written export; the WebUI's Export tab calls ``export``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlfactory.errors import UserError, model_read_errors
from rlfactory.use.source import ModelSource, PathCheck, load_source, resolve_source

# what a folder may hold for --overwrite to replace it: an earlier export or another model folder, never anything else
MODEL_MARKERS = ("config.json", "adapter_config.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
DTYPES = ("float32", "bfloat16", "float16")  # a checkpoint dtype model.dtype can name


@dataclass
class ExportResult:
    """What was written where, for the summary."""

    target: Path
    kind: str  # "merged" (full weights) or "adapter"
    source: ModelSource
    files: list[tuple[str, int]] = field(default_factory=list)
    pushed: str | None = None

    def summary(self) -> list[str]:
        total = sum(size for _, size in self.files)
        shards = [name for name, _ in self.files if name.endswith(".safetensors")]
        others = [name for name, _ in self.files if not name.endswith(".safetensors")]
        what = (
            f"merged {' + '.join(self.source.adapters)} into {self.source.base}"
            if self.kind == "merged" and self.source.adapters
            else f"{self.source.base} re-saved"
            if self.kind == "merged"
            else f"adapter {self.source.adapters[-1]} (base {self.source.base})"
        )
        lines = [
            f"exported {what} -> {self.target}",
            f"  {_mib(total)} in {len(self.files)} files: {len(shards)} safetensors ({', '.join(shards)}), "
            + ", ".join(others),
            f"  chat template: {self.source.template or 'the tokenizer' + chr(39) + 's own'}",
        ]
        if self.kind == "merged":
            lines += [
                "load it:",
                f"  AutoModelForCausalLM.from_pretrained('{self.target}')  (its tokenizer and template are there too)",
                f"  rlfactory: model.name_or_path: {self.target}   (vllm serve {self.target} works too)",
            ]
        else:
            lines += [
                "load it:",
                f"  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{self.source.base}'), "
                f"'{self.target}')",
                f"  rlfactory: model.adapter_paths: [{self.target}] with model.name_or_path: {self.source.base}",
            ]
        if self.pushed:
            lines.append(f"pushed to https://huggingface.co/{self.pushed}")
        return lines


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def parse_shard_size(text: str) -> int:
    """``2GB``, ``500MB``, ``5GiB`` or a byte count -> bytes (transformers' own parser), else a clear error."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(text.strip() if isinstance(text, str) else text)
    except (ValueError, TypeError):
        size = 0
    if not isinstance(size, int) or size <= 0:
        raise UserError(f"--max-shard-size '{text}': give a size such as 2GB, 500MB or 5GiB")
    return size


def check_target(target: Path, overwrite: bool, source_paths: list[str]) -> None:
    """Refuse a target that is a file, not empty (without ``overwrite``), not a model folder (even with it: only an
    earlier export is replaced), or that is or holds what is being exported, the working or home directory."""
    from rlfactory.engine.run_dir import project_roots

    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UserError(f"--to '{target}' is a file or a link; give a folder for the export")
    resolved = target.resolve()
    protected = {"the working directory": Path.cwd().resolve(), "the home directory": Path.home().resolve()}
    protected |= {f"the project root {root}": root for root in project_roots()}
    protected |= {f"'{p}', which is being exported": Path(p).expanduser().resolve() for p in source_paths}
    for name, place in protected.items():
        if place == resolved or resolved in place.parents:
            where = "is" if place == resolved else "contains"
            raise UserError(f"--to '{target}' {where} {name}; choose a folder of its own, e.g. exports/my-model")
    if not target.exists() or not any(target.iterdir()):
        return
    if not overwrite:
        raise UserError(f"--to '{target}' is not empty; choose another folder or pass --overwrite to replace it")
    if not any((target / marker).is_file() for marker in MODEL_MARKERS):
        raise UserError(
            f"--to '{target}' is not empty and holds no model (no config.json or adapter_config.json); --overwrite "
            "replaces only an earlier export: choose another folder"
        )


def hub_online() -> None:
    """Before anything is written: a push needs the Hub (HF_HUB_OFFLINE unset, the endpoint answering)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(
            "--push-to-hub: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it (and log in with "
            "`hf auth login`), or export without --push-to-hub and upload the folder later"
        )
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except Exception as exc:  # noqa: BLE001 - any failure of this probe (DNS, refused, TLS, timeout) means offline
        raise UserError(
            f"--push-to-hub: the Hub ({constants.ENDPOINT}) cannot be reached ({type(exc).__name__}); export without "
            "--push-to-hub and upload the folder when online"
        ) from None


def push(target: Path, repo_id: str, kind: str) -> str:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(folder_path=str(target), repo_id=repo_id, commit_message=f"rlfactory export ({kind})")
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--push-to-hub {repo_id}: the upload failed ({first}); the export itself is complete in {target}. Log in "
            "with `hf auth login` (a token with write access) and retry, or upload the folder yourself"
        ) from None
    return repo_id


def checkpoint_dtype(base: str) -> str:
    """The base checkpoint's own dtype, so a bf16 model is exported as bf16 (``model.dtype: auto`` would mean
    float32 on a CPU, doubling the files)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(base)
    except model_read_errors():
        return "auto"
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "").removeprefix("torch.")
    return dtype if dtype in DTYPES else "auto"


def write_merged(source: ModelSource, folder: Path, max_shard_size: int) -> None:
    model, tokenizer = load_source(source, dtype=checkpoint_dtype(source.base))
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(folder))


def write_adapter(source: ModelSource, folder: Path, _max_shard_size: int) -> None:
    """The last adapter's own files (its config pointing at the resolved base) plus the tokenizer and template."""
    from rlfactory.config.schema import ModelConfig
    from rlfactory.model.loader import check_adapter, is_hub_id, load_tokenizer

    if len(source.adapters) > 1:
        raise UserError(
            f"the adapter {source.adapters[-1]} was trained on {source.base} with {', '.join(source.adapters[:-1])} "
            "merged into it: alone it does not reproduce the model; export it merged (without --adapter-only)"
        )
    adapter = Path(source.adapters[0])
    check_adapter(str(adapter))
    for name in ADAPTER_FILES[1:]:
        if (adapter / name).is_file():
            shutil.copy2(adapter / name, folder / name)
    config = json.loads((adapter / "adapter_config.json").read_text())
    local = Path(source.base).expanduser()
    config["base_model_name_or_path"] = (
        str(local.resolve()) if local.is_dir() or not is_hub_id(source.base) else source.base
    )
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = load_tokenizer(ModelConfig(name_or_path=source.tokenizer_from, template=source.template))
    tokenizer.save_pretrained(str(folder))


WRITERS: dict[str, Callable[[ModelSource, Path, int], None]] = {"merged": write_merged, "adapter": write_adapter}


def export(
    path: str,
    to: str,
    base: str = "",
    template: str = "",
    adapter_only: bool = False,
    max_shard_size: str = "2GB",
    overwrite: bool = False,
    push_to_hub: str | None = None,
    check: PathCheck | None = None,
) -> ExportResult:
    """Everything is checked before a model loads; the export is written to ``.<name>.partial-<pid>`` beside the
    target and renamed into place, so an error (or a kill) leaves the target as it was."""
    shard_bytes = parse_shard_size(max_shard_size)
    if not str(to).strip():
        raise UserError("--to: give the folder to export to")
    target = Path(to.strip()).expanduser()
    source = resolve_source(path, base, template, check)
    kind = "adapter" if adapter_only else "merged"
    if adapter_only and not source.adapters:
        raise UserError(f"--adapter-only: '{path}' is a full model, not a LoRA adapter; export it without the flag")
    check_target(target, overwrite, [path, *(p for p in [source.base, *source.adapters] if Path(p).exists())])
    if push_to_hub:
        hub_online()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        WRITERS[kind](source, partial, shard_bytes)
        _replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    files = sorted((f.name, f.stat().st_size) for f in target.iterdir() if f.is_file())
    result = ExportResult(target.resolve(), kind, source, files)
    if push_to_hub:
        result.pushed = push(target, push_to_hub, kind)
    return result


def _replace(partial: Path, target: Path) -> None:
    """Move the finished export into place; an earlier export there (checked by ``check_target``) is removed only
    after the new one is complete."""
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        target.rename(old)
    partial.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def run_cli(args: argparse.Namespace) -> int:
    """``rlfactory export PATH --to DIR``: export, then print the summary."""
    result = export(
        args.path,
        args.to,
        base=args.base or "",
        template=args.template or "",
        adapter_only=args.adapter_only,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        push_to_hub=args.push_to_hub,
    )
    print("\n".join(result.summary()))
    return 0
