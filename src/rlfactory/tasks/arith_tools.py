"""The bundled arithmetic task with the ``calculator`` tool: the schema the tiny model saw in pretraining, and
conversations that solve a problem by calling the tool (SFT rows, preference pairs, RL prompts).

The schema is the OpenAI form of ``rlfactory.tools.builtin.calculator`` as ``scripts/make_tiny_model.py``
renders it (no argument descriptions); it is stored in each row's ``tools`` column, so the rendered prompt is
exactly what the model was trained on. Runs declare the executable tool with ``tools: [calculator]``.
"""

from __future__ import annotations

from typing import Any

from rlfactory.tools.builtin import CALCULATOR_SCHEMA  # noqa: F401 -- the rows' `tools` column (re-exported)


def expression(problem: dict[str, str]) -> str:
    """The arithmetic of a problem's solution: ``"12 + 7 = 19. The answer is 19."`` -> ``"12 + 7"``."""
    return problem["solution"].split(" = ")[0]


def tool_turns(problem: dict[str, str]) -> list[dict[str, Any]]:
    """assistant call -> tool result -> assistant answer (OpenAI messages)."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression(problem)}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": problem["answer"]},
        {"role": "assistant", "content": problem["solution"]},
    ]
