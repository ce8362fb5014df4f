"""Example environment: a simulated user who checks the answer and asks for another try when it is wrong.

Shows state across turns (attempts left) and environment messages (``user`` turns, masked from the loss
like tool results). Tool calls in a turn are still executed (the calculator helps), so it composes with
``tools:``. Reward parts: ``solved`` (1 when a final answer was right) and ``attempts`` (wrong answers given).
"""

from __future__ import annotations

from typing import Any

from rlfactory.envs.base import ENVIRONMENTS, StepResult, ToolEnv
from rlfactory.tasks.arith import is_correct
from rlfactory.tools.parsers import ToolCall


@ENVIRONMENTS.register("arith_feedback")
class ArithFeedbackEnv(ToolEnv):
    def __init__(self, tools: dict, limits: Any, max_attempts: int = 2, retry_message: str | None = None):
        super().__init__(tools, limits)
        self.max_attempts = max_attempts
        self.retry_message = retry_message or "That is not right. Check your arithmetic and try again."

    def reset(self, row: dict[str, Any]) -> None:
        super().reset(row)
        self.wrong = 0

    async def step(self, message: dict[str, Any], calls: list[ToolCall]) -> StepResult:
        if calls:
            return await super().step(message, calls)
        if is_correct(message["content"], str(self.row.get("answer"))):
            return StepResult([], True, {"solved": 1.0, "attempts": float(self.wrong)})
        self.wrong += 1
        if self.wrong >= self.max_attempts:
            return StepResult([], True, {"solved": 0.0, "attempts": float(self.wrong)})
        return StepResult([{"role": "user", "content": self.retry_message}], False)
