"""Reading a user's YAML file: UTF-8 only, syntax errors with line and column, duplicate keys refused.

PyYAML keeps the last of two equal keys without a word (``stage: sft`` then ``stage: dpo`` trains dpo), and the
error that follows, if any, names the wrong key. Duplicates are found on the composed node tree (which keeps every
key and its line), before anything is constructed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from rlfactory.errors import UserError, read_text


def syntax_error(exc: yaml.YAMLError, source: str) -> UserError:
    """``source: YAML syntax error at line L, column C: problem``."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return UserError(f"{source}: YAML syntax error{where}: {problem}")


def _check_duplicates(node: yaml.Node, source: str, path: tuple[str, ...] = ()) -> None:
    """Raise on a mapping that holds the same key twice, naming the dotted key and both lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<":
                line = key_node.start_mark.line + 1
                if key in seen:
                    dotted = ".".join((*path, key))
                    raise UserError(
                        f"{source}: duplicate key '{dotted}' at line {seen[key]} and line {line}; "
                        "YAML would keep only the last one: remove one of them"
                    )
                seen[key] = line
            _check_duplicates(value_node, source, (*path, key or "?"))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_duplicates(item, source, (*path, str(index)))


def parse_yaml(text: str, source: str) -> Any:
    """Safe-load one YAML document; syntax errors and duplicate keys become a UserError naming ``source``."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicates(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise syntax_error(exc, source) from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | os.PathLike[str], what: str = "file") -> Any:
    """A YAML file's content (None when empty), with the errors above; ``what`` names the file in messages."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} '{path}' is a directory, not a YAML file")
    if not path.is_file():
        raise UserError(f"{what} '{path}' does not exist")
    return parse_yaml(read_text(path), str(path))
