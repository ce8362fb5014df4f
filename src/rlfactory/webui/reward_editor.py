"""The reward editor of the Train tab (ppo, grpo): build ``reward.functions``, see the ``reward:`` YAML, test it.

The editor writes into the form's own ``reward.functions`` field (one source of truth: what Start runs is what the
field holds). A built-in reward is picked from the registry (``REWARD_FUNCTIONS``); a function from a Python file is
loaded and its signature checked exactly as ``rlfactory train`` does (``rewards.stack.build_components``), so a bad
file, a missing function or a wrong signature is refused when it is added, with the CLI's message.

"Test rewards" samples a few completions of the first training prompts from the run's starting model, as its rollouts
would (the rollout's temperature, top_p, response budget, tools and agent loop), and scores them with the run's reward
stack: the one evaluation path (``use.evaluate.evaluate_job`` over ``engine.evaluate``) with the stack handed in, after
the stage's own checks of prompts and rewards (``stages.rl.load_prompt_sets``). Nothing is trained or written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlfactory.errors import UserError
from rlfactory.webui import workspace

FIELD = "reward.functions"
ONLINE_STAGES = ("ppo", "grpo")


def builtin_rewards() -> list[tuple[str, str]]:
    """(label, name) of every registered reward: the name and the first line of its docstring."""
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    def doc(name: str) -> str:
        text = (REWARD_FUNCTIONS.get(name).__doc__ or "").strip().splitlines()
        return f"{name}: {text[0]}" if text else name

    return [(doc(name), name) for name in REWARD_FUNCTIONS.names()]


def parse_functions(text: str) -> dict[str, float]:
    """The form's reward.functions text -> {function: weight}, read as the schema reads it (a name or a list of
    names weighs 1.0)."""
    from pydantic import ValidationError

    from rlfactory.config.online_schema import RewardConfig

    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = yaml.safe_load(text)
        return dict(RewardConfig(functions=value).functions)
    except yaml.YAMLError as exc:
        raise UserError(f"{FIELD}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except ValidationError as exc:
        raise UserError(f"{FIELD}: {exc.errors()[0]['msg']} (expected {{name: weight, ...}})") from None


def functions_text(functions: dict[str, float]) -> str:
    """{function: weight} as the form's field shows it (one flow-style YAML line)."""
    return yaml.safe_dump(functions, default_flow_style=True, sort_keys=False).strip() if functions else ""


def _weight(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"weight: '{value}' is not a number") from None


def add_builtin(text: str, name: str, weight: Any) -> str:
    """The field's text with a registered reward added (or its weight replaced)."""
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS

    if not name:
        raise UserError("built-in reward: pick one from the list")
    REWARD_FUNCTIONS.get(name)  # an unknown name: the valid ones
    return functions_text({**parse_functions(text), name: _weight(weight)})


def add_from_file(text: str, file: str, function: str, weight: Any) -> str:
    """The field's text with ``file.py:function`` added, after loading it and checking its signature as a run
    does (``build_components``); UserError otherwise."""
    from rlfactory.config.online_schema import RewardConfig
    from rlfactory.rewards.stack import build_components

    file, function = (file or "").strip(), (function or "").strip()
    if not file.endswith(".py"):
        raise UserError(f"reward file: '{file}' is not a Python file; give path/to/file.py")
    if not function.isidentifier():
        raise UserError(f"reward function: '{function}' is not a function name; give the name of a def in {file}")
    workspace.current().readable(file, "reward file")
    spec = f"{file}:{function}"
    build_components(RewardConfig(functions={spec: _weight(weight)}))
    return functions_text({**parse_functions(text), spec: _weight(weight)})


def reward_yaml(raw: dict[str, Any]) -> str:
    """The ``reward:`` section of the run YAML the form makes (what Start would run)."""
    section = raw.get("reward")
    if not section:
        return "# no reward yet: add a built-in reward or a function from a file\n"
    return yaml.safe_dump({"reward": section}, sort_keys=False, default_flow_style=False, allow_unicode=True)


def _check_files(config: Any) -> None:
    """The model, data and reward files come from the workspace's allowed roots."""
    from rlfactory.rewards.stack import is_user_function

    model = config.model
    workspace.check_sources(model.name_or_path, model.adapter_paths, config.data.dataset_dir)
    for spec in config.reward.functions:
        if is_user_function(spec):
            workspace.current().readable(spec.rpartition(":")[0], FIELD)
    if config.reward.reward_model:
        workspace.current().readable(config.reward.reward_model, "reward.reward_model")


def sample_job(config: Any, prompts: int, samples: int) -> Any:
    """An ``EvalJob`` sampling as the run's rollouts do, from the model the run starts from."""
    from rlfactory.rollout.agent import agent_enabled
    from rlfactory.use.evaluate import EvalJob, run_source

    ro, ev = config.rollout, config.evaluation
    agent = config.agent.model_dump() if agent_enabled(config) and config.agent is not None else {}
    return EvalJob(
        path="the form's model",
        source=run_source(config, "model"),
        dataset=config.data.dataset[0],
        dataset_dir=config.data.dataset_dir,
        metric=ev.metric,
        samples=samples,
        temperature=ro.temperature,
        top_p=ro.top_p,
        max_samples=prompts,
        max_new_tokens=ro.max_response_len,
        batch_size=ro.generation_batch_size,
        backend="hf",  # in the WebUI's process, on the model it loads
        threshold=1.0,
        seed=config.seed,
        out=Path("."),  # nothing is written
        tools=list(config.tools) if agent else [],
        max_turns=agent.get("max_turns", ev.max_turns),
        parser=agent.get("parser", ev.parser),
        agent=agent,
    )


def try_rewards(raw: dict[str, Any], prompts: int, samples: int) -> tuple[list[str], list[list[Any]], str]:
    """Sample and score (module doc): (headers, rows, a summary line). Raises UserError."""
    from rlfactory.config.loader import validate_config
    from rlfactory.rewards.stack import RewardStack
    from rlfactory.stages.rl import load_prompt_sets
    from rlfactory.use.evaluate import evaluate_job

    if raw.get("stage") not in ONLINE_STAGES:
        raise UserError(f"stage: rewards are tested for {' and '.join(ONLINE_STAGES)}, not '{raw.get('stage')}'")
    if prompts < 1 or samples < 1:
        raise UserError("test rewards: give at least 1 prompt and 1 sample per prompt")
    config = validate_config(raw, "WebUI form")
    _check_files(config)
    train, _, _ = load_prompt_sets(config)  # the stage's own checks: answers, TRL columns, tools, reward files
    job = sample_job(config, prompts, samples)
    stack = RewardStack(config.reward, config.rollout.max_response_len, _reward_model(config))
    try:
        _, rows = evaluate_job(job, train[:prompts], rewards=stack)
    finally:
        stack.close()
    return _table(rows, stack.names, config.reward.functions)


def _reward_model(config: Any) -> Any:
    if not config.reward.reward_model:
        return None
    from rlfactory.rewards.model import RewardModelScorer

    return RewardModelScorer(config.reward.reward_model, "cpu", config.reward.reward_model_batch_size)


def _table(rows: list[dict[str, Any]], names: list[str], weights: dict[str, float]) -> tuple[list[str], list, str]:
    """One row per sample: prompt, completion, answer, each reward part (raw), the weighted total."""
    from rlfactory.webui.monitor import prompt_text

    parts = list(dict.fromkeys(name for row in rows for name in row.get("rewards", {}))) or names
    headers = ["problem", "prompt", "completion", "answer", *parts, "total"]
    table = [
        [row["problem"], prompt_text(row["prompt"]), row["completion"], row.get("answer")]
        + [round(row.get("rewards", {}).get(p, 0.0), 4) for p in parts]
        + [round(row.get("reward", 0.0), 4)]
        for row in rows
    ]
    means = ", ".join(f"{p} {sum(r['rewards'].get(p, 0.0) for r in rows) / len(rows):.3f}" for p in parts)
    weighted = ", ".join(f"{name} x{weight:g}" for name, weight in weights.items())
    return headers, table, f"{len(rows)} sample(s) scored by {weighted}; means: {means}"
