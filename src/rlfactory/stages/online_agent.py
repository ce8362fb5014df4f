"""Multi-turn tool-calling in the online stages (ppo, grpo): config -> agent loop, samples, metrics.

The agent loop (``rollout/agent.py``) replaces the single-turn ``backend.generate`` call when ``tools`` are
declared or ``agent.env`` is set. Its output is the same ``Completion`` (one token sequence per sample, mask
1 only on sampled tokens), so packing, advantages and the policy loss are unchanged: the loss already reads
``loss_mask`` (tested). Rewards see the last assistant turn as the completion and the episode as
``example["agent"]``.
"""

from __future__ import annotations

from typing import Any

from rlfactory.config.schema import RunConfig
from rlfactory.rollout.agent import AgentLoop, AgentResult, AgentSettings
from rlfactory.rollout.base import Completion, SamplingParams


def enabled(cfg: RunConfig) -> bool:
    return bool(cfg.tools) or bool(cfg.agent is not None and cfg.agent.env)


def prepare_examples(cfg: RunConfig, examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Load and check the declared tools (before any model loads); rows without ``tools`` get their schemas,
    rows with their own may only offer declared tools. Returns the tools by name."""
    from rlfactory.tools.spec import check_example_tools, load_tools

    tools = load_tools(cfg.tools)
    check_example_tools(examples, tools)
    schemas = [tool.schema for tool in tools.values()]
    for example in examples:
        if not example.get("tools") and schemas:
            example["tools"] = schemas
    if cfg.agent is not None:
        from rlfactory.tools.parsers import TOOL_PARSERS

        TOOL_PARSERS.get(cfg.agent.parser)
    return tools


def build_agent(cfg: RunConfig, backend: Any, tokenizer: Any) -> AgentLoop | None:
    """The agent loop of this run, or None for single-turn rollouts."""
    from rlfactory.envs.factory import build_env_factory
    from rlfactory.tools.execute import ExecLimits
    from rlfactory.tools.spec import load_tools

    if not enabled(cfg):
        return None
    ag = cfg.agent
    assert ag is not None
    tools = load_tools(cfg.tools)
    limits = ExecLimits(ag.tool_timeout_s, ag.max_concurrency, ag.tool_memory_mb, ag.max_tool_response_chars)
    factory = build_env_factory(ag.env or "tools", tools, limits, ag.env_args)
    settings = AgentSettings(ag.max_turns, ag.parser, ag.max_tokens_per_turn)
    return AgentLoop(backend, tokenizer, tools, settings, factory)


def generate(
    agent: AgentLoop | None, backend: Any, examples: list[dict], params: SamplingParams
) -> tuple[list[Completion], list[str | None], list[dict]]:
    """(completions, final texts or None for single-turn, examples as rewards see them)."""
    if agent is None:
        prompts = [ex["prompt_ids"] for ex in examples]
        return backend.generate(prompts, params), [None] * len(examples), examples
    results: list[AgentResult] = agent.run(examples, params)
    return (
        [r.completion for r in results],
        [r.final_text for r in results],
        [{**ex, "agent": r.summary()} for ex, r in zip(examples, results, strict=True)],
    )


def metrics(examples: list[dict], prefix: str = "") -> dict[str, float]:
    """num_turns/{mean,max}, tool_calls/mean, tool_errors/rate, invalid_calls/rate, tool_calls/<tool> (counts),
    finish/<reason> (fractions) over the samples of a step; {} for single-turn samples."""
    episodes = [ex["agent"] for ex in examples if "agent" in ex]
    if not episodes:
        return {}
    turns = [len(ep["turns"]) for ep in episodes]
    calls = [call for ep in episodes for turn in ep["turns"] for call in turn["calls"]]
    executed = [c for c in calls if c["error_kind"] is None]
    out = {
        "num_turns/mean": sum(turns) / len(turns),
        "num_turns/max": float(max(turns)),
        "tool_calls/mean": len(calls) / len(episodes),
        "tool_errors/rate": sum(c.get("tool_error") is not None for c in executed) / max(len(executed), 1),
        "invalid_calls/rate": (len(calls) - len(executed)) / max(len(calls), 1),
    }
    for call in executed:
        key = f"tool_calls/{call['name']}"
        out[key] = out.get(key, 0.0) + 1.0
    for ep in episodes:
        key = f"finish/{ep['finish']}"
        out[key] = out.get(key, 0.0) + 1.0 / len(episodes)
    return {f"{prefix}{k}": v for k, v in out.items()}


def trace_fields(example: dict) -> dict[str, Any]:
    """Extra fields of a rollout trace line: how the episode ended and every turn (text, calls, results)."""
    if "agent" not in example:
        return {}
    return {"finish": example["agent"]["finish"], "turns": example["agent"]["turns"]}
