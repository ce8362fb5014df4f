"""Reward parts of multi-turn tool-calling rollouts, registered with the other reward functions
(``rewards.builtin`` imports this module, so its ``REWARD_FUNCTIONS`` holds them).

Each reads the episode the agent loop recorded in ``example["agent"]`` (``turns`` with their parsed
``calls`` — ``error_kind`` malformed / unknown_tool / bad_arguments, ``tool_error`` when a valid call
raised or timed out — ``finish`` and the environment's ``reward_parts``) and returns 0.0 for single-turn
samples. Outcome rewards (answer_match, math_match, ...) read ``completion``, which is the last assistant
turn. Weight each in ``reward.functions``; each is logged as ``reward/<name>/mean``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlfactory.rewards.registry import REWARD_FUNCTIONS


def _calls(example: dict[str, Any]) -> list[dict[str, Any]]:
    return [call for turn in example.get("agent", {}).get("turns", []) for call in turn["calls"]]


@REWARD_FUNCTIONS.register("tool_call_validity")
def tool_call_validity(
    prompt: str, completion: str, answer: str | None, example: dict[str, Any], no_call_score: float = 0.0
) -> float:
    """Fraction of the episode's calls that parse, name a declared tool and fit its schema.

    >>> ex = {"agent": {"turns": [{"calls": [{"error_kind": None}, {"error_kind": "malformed"}]}]}}
    >>> tool_call_validity("", "", None, ex), tool_call_validity("", "", None, {"agent": {"turns": []}})
    (0.5, 0.0)
    """
    calls = _calls(example)
    return sum(c["error_kind"] is None for c in calls) / len(calls) if calls else no_call_score


@REWARD_FUNCTIONS.register("tool_errors")
def tool_errors(prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> float:
    """Minus the fraction of calls that failed for any reason (invalid, raised, timed out); 0 without calls.

    >>> ex = {"agent": {"turns": [{"calls": [{"error_kind": None, "tool_error": "boom"}, {"error_kind": None}]}]}}
    >>> tool_errors("", "", None, ex)
    -0.5
    """
    calls = _calls(example)
    failed = sum(c["error_kind"] is not None or c.get("tool_error") is not None for c in calls)
    return -failed / len(calls) if calls else 0.0


@REWARD_FUNCTIONS.register("tool_format")
def tool_format(prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> float:
    """1.0 when the episode ended with a final answer (not cut by length or max_turns) and no call was malformed.

    >>> tool_format("", "", None, {"agent": {"finish": "answer", "turns": [{"calls": []}]}})
    1.0
    """
    agent = example.get("agent", {})
    malformed = any(c["error_kind"] == "malformed" for c in _calls(example))
    return float(agent.get("finish") == "answer" and not malformed)


@REWARD_FUNCTIONS.register("turn_penalty")
def turn_penalty(
    prompt: str,
    completion: str,
    answer: str | None,
    example: dict[str, Any],
    free_turns: int = 2,
    per_turn: float = 0.1,
) -> float:
    """Efficiency: minus ``per_turn`` for every assistant turn beyond ``free_turns``.

    >>> turn_penalty("", "", None, {"agent": {"turns": [{}, {}, {}, {}]}})
    -0.2
    """
    turns = len(example.get("agent", {}).get("turns", []))
    return -per_turn * max(0, turns - free_turns) or 0.0


@REWARD_FUNCTIONS.register("tool_safety")
def tool_safety(
    prompt: str,
    completion: str,
    answer: str | None,
    example: dict[str, Any],
    forbidden_tools: list[str] | None = None,
    forbidden_patterns: dict[str, list[str]] | None = None,
) -> float:
    """Safety-rule hook: -1.0 per call to a forbidden tool or whose arguments match a forbidden regex.

    ``forbidden_patterns`` maps a tool name (or ``"*"``) to regexes searched in the JSON of the arguments.
    For richer rules write a reward function reading ``example["agent"]["turns"]``.

    >>> ex = {"agent": {"turns": [{"calls": [{"name": "python", "arguments": {"code": "import os"}}]}]}}
    >>> tool_safety("", "", None, ex, forbidden_patterns={"python": [r"\\bimport os\\b"]})
    -1.0
    """
    forbidden_tools = forbidden_tools or []
    patterns = forbidden_patterns or {}
    violations = 0
    for call in _calls(example):
        args = json.dumps(call.get("arguments") or {})
        rules = patterns.get(call.get("name") or "", []) + patterns.get("*", [])
        violations += call.get("name") in forbidden_tools or any(re.search(rule, args) for rule in rules)
    return -float(violations)


@REWARD_FUNCTIONS.register("env_reward")
def env_reward(prompt: str, completion: str, answer: str | None, example: dict[str, Any]) -> dict[str, float]:
    """The environment's reward parts summed over the episode (each key logged as ``reward/env_reward/<key>``).

    >>> env_reward("", "", None, {"agent": {"reward_parts": {"solved": 1.0}}})
    {'solved': 1.0}
    """
    return dict(example.get("agent", {}).get("reward_parts", {}))
