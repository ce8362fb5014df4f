"""The environment interface of the agent loop (``rollout/agent.py``), and the default tool environment.

One instance per conversation. ``reset(row)`` gets the canonical example (messages, tools, answer, ..., and every
other dataset column under ``row["columns"]``, e.g. a code task's ``test_cases``);
``step(message, calls)`` gets each assistant turn as a message (``role``, ``content``, ``tool_calls`` of the
valid calls) plus every parsed call (invalid ones included) and returns a :class:`StepResult`: the
observation messages to append (``tool`` and/or ``user`` messages), whether the episode is over, and reward
parts (summed over the episode and exposed to rewards as ``example["agent"]["reward_parts"]``; the
``env_reward`` reward function logs and weights them). ``step`` may be ``async def``: the loop steps every
live conversation concurrently. Environments are chosen by name (``agent.env``) or
``path/to/file.py:Class`` (:mod:`rlfactory.envs.factory`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rlfactory.plugins import Registry
from rlfactory.tools.execute import ExecLimits, ToolResult, run_calls_async
from rlfactory.tools.parsers import ToolCall
from rlfactory.tools.spec import Tool

ENVIRONMENTS = Registry("environment")


@dataclass
class StepResult:
    observation: list[dict[str, Any]]  # messages appended after the assistant turn ([] when done)
    done: bool
    reward_parts: dict[str, float] = field(default_factory=dict)
    tool_results: list[ToolResult] = field(default_factory=list)  # one per call, for metrics and traces


class Env(ABC):
    """Base class: override ``step`` (sync or async) and, for state, ``reset``."""

    def __init__(self, tools: dict[str, Tool], limits: ExecLimits, **kwargs: Any):
        self.tools, self.limits = tools, limits

    def reset(self, row: dict[str, Any]) -> None:
        self.row = row

    @abstractmethod
    async def step(self, message: dict[str, Any], calls: list[ToolCall]) -> StepResult:
        """The environment's answer to one assistant turn (its text and parsed calls)."""


@ENVIRONMENTS.register("tools")
class ToolEnv(Env):
    """Run the turn's tool calls; a turn without calls is the final answer. Invalid calls get an error result
    (the model reads what was wrong) and the episode goes on."""

    async def step(self, message: dict[str, Any], calls: list[ToolCall]) -> StepResult:
        if not calls:
            return StepResult([], True)
        [results] = await run_calls_async([calls], self.tools, self.limits)
        observation = [
            {"role": "tool", "name": call.name or "unknown", "content": result.content}
            for call, result in zip(calls, results, strict=True)
        ]
        return StepResult(observation, False, {}, results)
