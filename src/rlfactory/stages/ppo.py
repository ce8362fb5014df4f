"""Stage ``ppo``: online RL with a learned critic (value model) and GAE.

Reads top to bottom: checks (names, reward sources, dataset columns) -> tokenizer -> prompts ->
policy -> critic -> output dir -> the online loop (``stages/online.py``) -> summary.

PPO for language models (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155; Schulman et al.
2017, https://arxiv.org/abs/1707.06347): the critic (``model/value_head.py``: a separate trunk +
scalar head, trained with the clipped value loss, ``algorithm.value_clip``) gives per-token values,
GAE (``algorithm.gamma``, ``algorithm.lam``) turns the sequence reward (and the per-token KL
penalty, ``algorithm.kl_in_reward_coef`` with a fixed or adaptive controller) into advantages, and
the policy takes ``algorithm.ppo_epochs`` x ``num_mini_batches`` clipped steps per rollout batch.
``critic.warmup_steps`` trains the critic alone first. One sample per prompt is enough
(``rollout.num_samples: 1``), as the critic is the baseline.
"""

from __future__ import annotations

from typing import Any

from rlfactory.config.schema import RunConfig
from rlfactory.stages import common
from rlfactory.stages.grpo import check  # the same checks; the estimator must need values here

__all__ = ["check", "run"]


def run(cfg: RunConfig) -> dict[str, Any]:
    from accelerate.utils import set_seed

    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.model.value_head import load_value_model
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
    critic = load_value_model(cfg)
    common.start_output_dir(cfg, resume_from)

    result, extra = train(cfg, policy, tokenizer, prompts, eval_prompts, critic=critic, resume_from=resume_from)
    return common.finish(cfg, result, extra)
