"""Tools declared in YAML (``tools:``) -> callable + JSON schema, checked before any model loads.

An entry names a function: ``path/to/file.py:function``, ``package.module:function`` or a bundled tool
(``calculator``, which offers the schema of the bundled data). Its schema is derived from type hints + docstring by
``transformers.utils.get_json_schema``
(the same function ``apply_chat_template(tools=[fn])`` calls at inference, so the prompt the policy is
trained with is the prompt it is served with), or given explicitly (``json_schema``) and then checked
against the function's signature. Every problem is a UserError naming the entry and the fix.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlfactory.errors import UserError, did_you_mean

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    runs_code: bool = False  # execute in a subprocess with time and memory limits
    timeout_s: float | None = None  # per-call override of agent.tool_timeout_s
    source: str = ""  # the YAML entry, for messages

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}


def resolve_function(ref: str) -> tuple[Callable[..., Any], bool]:
    """(function, runs_code) for a bundled name, ``file.py:function`` or ``module:function``."""
    from rlfactory.tools.builtin import BUILTIN_TOOLS

    if ":" not in ref:
        if ref not in BUILTIN_TOOLS:
            raise UserError(
                f"tools: unknown bundled tool '{ref}'{did_you_mean(ref, BUILTIN_TOOLS)}; bundled: "
                f"{', '.join(BUILTIN_TOOLS)}; or give `path/to/file.py:function` / `package.module:function`"
            )
        return BUILTIN_TOOLS[ref]
    target, _, name = ref.rpartition(":")
    if target.endswith(".py"):
        from rlfactory.plugins import load_user_function

        return load_user_function(ref, what="tools"), False
    try:
        module = importlib.import_module(target)
    except Exception as exc:  # the user's module: any import error is theirs to fix
        raise UserError(
            f"tools: '{ref}': module '{target}' does not import ({type(exc).__name__}: {exc}); "
            "check the module path and that its package is installed"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"tools: '{ref}': module '{target}' has no function '{name}'")
    return fn, False


def normalize_schema(schema: dict[str, Any], where: str) -> dict[str, Any]:
    """Accept the OpenAI ``{type: function, function: {...}}`` form or the bare ``{name, parameters}`` one."""
    fn = schema.get("function", schema) if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise UserError(
            f"{where}: a tool schema needs a string `name` (OpenAI form: {{type: function, function: ...}})"
        )
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise UserError(f"{where}: `parameters` of tool '{fn['name']}' must be a JSON schema of type object")
    return {"type": "function", "function": fn}


def derive_schema(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """The schema transformers derives for ``fn`` (type hints + Google-style docstring)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers raises several types for missing hints / docstrings
        raise UserError(
            f"{where}: cannot derive a JSON schema from '{getattr(fn, '__name__', fn)}' ({exc}); give every "
            "argument a type hint and describe it in a Google-style docstring (Args: section), or set "
            "`json_schema` explicitly"
        ) from None


def check_schema_matches(fn: Callable[..., Any], schema: dict[str, Any], where: str) -> None:
    """An explicit schema must describe the function: same argument names, required ones required, types agree."""
    signature = inspect.signature(fn)
    params = schema["function"].get("parameters") or {}
    props: dict[str, Any] = params.get("properties", {})
    required = set(params.get("required", []))
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    named = {n: p for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    problems = [
        f"argument '{n}' is not a parameter of the function" for n in props if n not in named and not takes_kwargs
    ]
    problems += [f"required argument '{n}' is not in the function" for n in required if n not in props]
    for name, param in named.items():
        if param.default is param.empty and name not in required:
            problems.append(f"the function requires '{name}' but the schema does not list it as required")
    hints = typing.get_type_hints(fn) if hasattr(fn, "__annotations__") else {}
    for name, prop in props.items():
        want = _JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name))
        if want and isinstance(prop, dict) and prop.get("type") not in (None, want):
            problems.append(f"argument '{name}' is {want} in the function but {prop.get('type')} in the schema")
    if problems:
        raise UserError(f"{where}: the schema does not match the function: {'; '.join(problems)}")


def load_tool(entry: Any, index: int) -> Tool:
    """One ``tools:`` entry (a ``ToolSpec``) -> a checked Tool."""
    from rlfactory.tools.builtin import BUILTIN_SCHEMAS

    where = f"tools[{index}] ({entry.function})"
    fn, runs_code = resolve_function(entry.function)
    if entry.json_schema is not None:
        schema = normalize_schema(entry.json_schema, where)
        check_schema_matches(fn, schema, where)
    elif entry.function in BUILTIN_SCHEMAS:  # a bundled tool's own schema (the one its bundled data carry)
        schema = BUILTIN_SCHEMAS[entry.function]
    else:
        schema = derive_schema(fn, where)
    if entry.name:
        schema = {"type": "function", "function": {**schema["function"], "name": entry.name}}
    runs_code = runs_code if entry.runs_code is None else entry.runs_code
    return Tool(schema["function"]["name"], fn, schema, runs_code, entry.timeout_s, entry.function)


def load_tools(entries: list[Any]) -> dict[str, Tool]:
    """All declared tools by the name the model calls them; duplicate names are an error."""
    tools: dict[str, Tool] = {}
    for index, entry in enumerate(entries):
        tool = load_tool(entry, index)
        if tool.name in tools:
            raise UserError(f"tools[{index}]: a tool named '{tool.name}' is declared twice; set `name` on one")
        tools[tool.name] = tool
    return tools


def check_example_tools(examples: list[dict[str, Any]], tools: dict[str, Tool]) -> None:
    """Rows that carry their own ``tools`` may only offer tools the run can execute."""
    for example in examples:
        for index, schema in enumerate(example.get("tools") or []):
            where = f"{example.get('source', 'a row')}: tools[{index}]"
            name = normalize_schema(schema, where)["function"]["name"]
            if name not in tools:
                raise UserError(
                    f"{where} offers tool '{name}', which the run does not declare (declared: "
                    f"{', '.join(tools) or 'none'}); add it under `tools:` in the YAML or remove it from the row"
                )


def check_arguments(arguments: Any, parameters: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit a JSON-schema object (top-level keys, required, types, enums), else None.

    >>> params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    >>> check_arguments({"x": 1}, params) is None, check_arguments({}, params), check_arguments({"x": "1"}, params)
    (True, "missing required argument 'x'", "argument 'x' must be integer, got str")
    """
    if not isinstance(arguments, dict):
        return f"arguments must be an object, got {type(arguments).__name__}"
    props = parameters.get("properties", {})
    for name in parameters.get("required", []):
        if name not in arguments:
            return f"missing required argument '{name}'"
    for name, value in arguments.items():
        if name not in props:
            if parameters.get("additionalProperties", False) is False:
                return f"unknown argument '{name}' (expected: {', '.join(props) or 'none'})"
            continue
        prop = props[name] if isinstance(props[name], dict) else {}
        types = prop.get("type")
        types = [types] if isinstance(types, str) else types or []
        ok = not types or any(
            isinstance(value, _PY_TYPES.get(t, object)) and not (t in ("integer", "number") and isinstance(value, bool))
            for t in types
        )
        if not ok:
            return f"argument '{name}' must be {' or '.join(types)}, got {type(value).__name__}"
        if "enum" in prop and value not in prop["enum"]:
            return f"argument '{name}' must be one of {prop['enum']}"
    return None
