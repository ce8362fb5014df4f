"""The WebUI's workspace: every path the page reads, writes, exports or deletes must resolve inside it.

The workspace root is the folder the WebUI starts in (``--workspace DIR`` to change it; the server then
runs from there, so relative paths in the page mean the same as for the CLI). Paths are resolved with
their symbolic links followed, so a link inside the workspace that points outside is refused too.
Reading (models, adapters, datasets, YAMLs to load) may also use the extra roots given with
``--allow-read DIR``. A model name that is not a local path (a hub id such as ``Qwen/Qwen2.5-0.5B``)
is not a file and passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfactory.errors import UserError


@dataclass(frozen=True)
class Workspace:
    root: Path
    read_roots: tuple[Path, ...] = field(default_factory=tuple)

    def resolve(self, path: str | Path) -> Path:
        """``path`` (relative to the root, ``~`` expanded) with every symbolic link followed."""
        return (self.root / Path(path).expanduser()).resolve()

    def _inside(self, path: str | Path, roots: tuple[Path, ...], what: str, action: str) -> Path:
        if not str(path).strip():
            raise UserError(f"{what}: the path is empty")
        target = self.resolve(path)
        if any(target == root or root in target.parents for root in roots):
            return target
        allowed = ", ".join(str(r) for r in roots)
        extra = "; start the WebUI with --allow-read DIR to read from another folder" if action == "read" else ""
        raise UserError(f"{what} '{path}' is outside the WebUI workspace ({allowed}): refused to {action} it{extra}")

    def writable(self, path: str | Path, what: str) -> Path:
        """``path`` resolved, when it lies inside the workspace root; else UserError."""
        return self._inside(path, (self.root,), what, "write")

    def readable(self, path: str | Path, what: str) -> Path:
        """``path`` resolved, when it lies inside the workspace or an --allow-read root; else UserError."""
        return self._inside(path, (self.root, *self.read_roots), what, "read")

    def readable_model(self, name: str | None, what: str) -> None:
        """A model/adapter given as a local path must be readable; a hub id is not a path and passes."""
        if name and is_local_path(str(name), self.root):
            self.readable(str(name), what)


def is_local_path(name: str, root: Path) -> bool:
    """Whether ``name`` means a file system path rather than a hub id (``org/name``)."""
    text = str(name)
    return text.startswith(("/", ".", "~")) or ".." in Path(text).parts or (root / text).exists()


_CURRENT: list[Workspace] = []


def configure(root: str | None = None, allow_read: list[str] | None = None) -> Workspace:
    """Set the workspace of this WebUI process (UserError for a folder that does not exist)."""
    folder = _existing_dir(root or ".", "--workspace")
    extra = tuple(_existing_dir(d, "--allow-read") for d in allow_read or [])
    _CURRENT[:] = [Workspace(folder, extra)]
    return _CURRENT[0]


def current() -> Workspace:
    """The configured workspace; the working directory when none was configured."""
    return _CURRENT[0] if _CURRENT else Workspace(Path.cwd().resolve())


def _existing_dir(path: str, flag: str) -> Path:
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise UserError(f"{flag} '{path}' is not a directory; give an existing folder")
    return folder


def check_sources(model: str | None, adapters: list[str], dataset_dir: str | None) -> None:
    """The model, its adapters and the dataset folder come from allowed roots (the bundled data/ is used
    when data.dataset_dir is unset, as for the CLI)."""
    ws = current()
    ws.readable_model(model, "model.name_or_path")
    for index, adapter in enumerate(adapters):
        ws.readable_model(adapter, f"model.adapter_paths.{index}")
    if dataset_dir:
        ws.readable(dataset_dir, "data.dataset_dir")


def check_run_paths(config: Any) -> None:
    """A run started from the page writes only inside the workspace and reads from allowed roots."""
    ws = current()
    ws.writable(config.output_dir, "output_dir")
    check_sources(config.model.name_or_path, config.model.adapter_paths, config.data.dataset_dir)
    if config.resume_from_checkpoint not in (None, "auto"):
        ws.writable(config.resume_from_checkpoint, "resume_from_checkpoint")
