"""Stage ``grpo``: critic-free online RL with groups of samples per prompt.

Reads top to bottom: checks (names, reward sources, dataset columns) -> tokenizer -> prompts ->
policy -> output dir -> the online loop (``stages/online.py``) -> summary with held-out
accuracy before and after.

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples ``rollout.num_samples``
completions per prompt and uses the group as the baseline (``algorithm.adv_estimator: grpo``;
rloo and reinforce_plus_plus(_baseline) also run here). The common variants are settings, not
code: Dr.GRPO = ``grpo_scale: none`` + ``loss_agg: seq-mean-token-sum-norm``; DAPO =
``clip_high: 0.28`` + ``rollout.dynamic_sampling`` + ``loss_agg: token-mean`` + the
``length_penalty`` reward (soft overlong punishment) or ``rollout.mask_truncated``; GSPO =
``policy_loss: gspo`` + ``loss_agg: seq-mean-token-mean``; several updates per batch
(TRL's num_iterations) = ``algorithm.ppo_epochs``.
"""

from __future__ import annotations

from typing import Any

from rlfactory.config.schema import RunConfig
from rlfactory.stages import common


def check(cfg: RunConfig) -> list[str]:
    """Everything that can fail before a model loads (``rlfactory config check`` can call this)."""
    from rlfactory.stages.online_setup import load_prompt_sets

    train, evals, components = load_prompt_sets(cfg)
    return [
        f"[{cfg.name or cfg.stage}] {len(train)} prompts, {len(evals)} eval prompts, rewards: "
        f"{', '.join(c.name for c in components) or 'reward model'}"
    ]


def run(cfg: RunConfig) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.stages.online import train
    from rlfactory.stages.online_setup import check_backend, load_prompt_sets, render_prompts

    resume_from = common.preflight(cfg)
    check_backend(cfg)  # here, not in check(): `config check` validates a config, not this environment
    set_seed(cfg.seed)  # before any model is built: LoRA and value-head initialisation are random
    prompts, eval_prompts, _ = load_prompt_sets(cfg)
    tokenizer = load_tokenizer(cfg.model)
    prompts = render_prompts(cfg, tokenizer, prompts)
    eval_prompts = render_prompts(cfg, tokenizer, eval_prompts) if eval_prompts else []

    policy = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    common.start_output_dir(cfg, resume_from)

    result, extra = train(cfg, policy, tokenizer, prompts, eval_prompts, resume_from=resume_from)
    return common.finish(cfg, result, extra)
