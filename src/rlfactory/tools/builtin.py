"""Bundled tools, by name (``tools: [calculator]`` in a run YAML).

Each is a plain typed function with a Google-style docstring, so its JSON schema can be derived exactly as
``transformers.utils.get_json_schema`` (what ``apply_chat_template(tools=[fn])`` uses at inference) does; the
calculator offers the shorter schema of the bundled data instead (``BUILTIN_SCHEMAS``).
``python`` runs code: it is flagged ``runs_code`` and always executes in a subprocess with limits.
"""

from __future__ import annotations

import ast
import contextlib
import io
import operator
from collections.abc import Callable
from typing import Any

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 100  # 9 ** 10 ** 10 would hang the worker: refuse large powers


def _evaluate(node: ast.AST) -> int | float:
    """Numbers and + - * / // % ** only; anything else (names, calls, attributes) is refused."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "12 + 7".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def python(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: A Python program; use print() to show results.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})  # noqa: S102 - runs in a sandboxed subprocess
    return out.getvalue()


# name -> (function, runs_code)
BUILTIN_TOOLS: dict[str, tuple[Callable[..., Any], bool]] = {
    "calculator": (calculator, False),
    "python": (python, True),
}

# The calculator as the bundled model and data describe it (no argument description): what `tools: [calculator]`
# offers when no `json_schema` is given, so chat, eval and serve prompt the bundled model exactly as it was trained.
# Offered the docstring's longer schema instead, the tool-trained bundled model solved 0 of 100 held-out problems
# in `rlfactory chat` (it still called the tool, but copied the numbers wrong); with this one, 89.
CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
BUILTIN_SCHEMAS: dict[str, dict[str, Any]] = {"calculator": CALCULATOR_SCHEMA}
