"""Stage ``orpo``: odds-ratio preference optimisation, SFT and preference in one reference-free loss.

Reads top to bottom: tokenizer -> pairs (render, truncate) -> model -> output dir -> scores before ->
train (shared engine) -> scores after -> summary.

Per pair (Hong et al. 2024, https://arxiv.org/abs/2403.07691, Eq. 6):
``loss = NLL(chosen) + beta * -log sigmoid(log odds(chosen) - log odds(rejected))``, where NLL is the
chosen response's mean token NLL (the paper's per-example L_SFT; TRL averages tokens over the whole
batch, which is the same when responses have equal length) and the odds use length-averaged
log-probs (the registered ``orpo`` entry). No reference model. One forward of 2B rows per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlfactory.algos.common import HeadKernels
from rlfactory.algos.preference import PREFERENCE_LOSSES, preference_metrics
from rlfactory.config.schema import ORPOConfig, RunConfig
from rlfactory.data.packing import ALIGN_COLUMNS
from rlfactory.engine.offline import Batch, StageParts, train
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common, preference_data
from rlfactory.stages.preference_data import PAIR_ACCURACY, count_pairs, forward_logps, pair_collate

fit_counts = preference_data.fit_counts  # `rlfactory config check`: what data.cutoff_len does to the pairs


def make_loss(
    section: ORPOConfig, kernels: HeadKernels = HeadKernels()
) -> Callable[[Any, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """loss_fn(model, batch) -> (summed per-pair loss, TRL's ORPO metrics as 0-d device tensors: the engine
    reads them at log time); ``kernels``: the run's LM head."""
    odds_ratio = PREFERENCE_LOSSES.get("orpo")

    def orpo_loss(model: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sums, means = forward_logps(model, batch, "", kernels)
        chosen, rejected = means.chunk(2)
        or_losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds = odds_ratio(
            chosen, rejected, beta=section.beta
        )
        nll = -chosen
        metrics = preference_metrics(chosen_rewards, rejected_rewards, chosen, rejected)
        metrics.update(
            nll_loss=nll.detach().mean(),
            log_odds_ratio=log_odds_ratio.detach().mean(),
            log_odds_chosen=log_odds.detach().mean(),
        )
        metrics["logps/accuracies"] = preference_data.logp_accuracy(*sums.chunk(2))
        return (nll + or_losses).sum(), metrics

    return orpo_loss


def run(cfg: RunConfig) -> dict[str, Any]:
    from rlfactory.model.loader import head_kernels, load_model, load_tokenizer

    assert cfg.orpo is not None
    resume_from = common.preflight(cfg)
    tokenizer = load_tokenizer(cfg.model)

    train_examples, eval_examples = preference_data.load_train_eval(cfg, "pairwise")
    renderer = tokenizer_for(tokenizer, train_examples, eval_examples)  # plain text for standard TRL rows
    train_items = preference_data.render_pairs(cfg, renderer, train_examples)
    eval_items = preference_data.render_pairs(cfg, renderer, eval_examples) if eval_examples else None
    eval_prompts = common.load_eval_prompts(cfg)

    model = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    common.start_output_dir(cfg, resume_from)

    parts = StageParts(
        train_examples=train_items,
        eval_examples=eval_items,
        collate=pair_collate(cfg, tokenizer.pad_token_id, ALIGN_COLUMNS),
        loss_fn=make_loss(cfg.orpo, head_kernels(cfg.model, cfg.train)),
        count_fn=count_pairs,
        before_training=common.score_before(cfg, tokenizer, eval_prompts),
    )
    result = train(cfg, model, tokenizer, parts, resume_from)
    extra = common.score_after(cfg, result, tokenizer, eval_prompts)
    extra |= preference_data.before_after(
        result.final_dir, "eval_logps/accuracies", PAIR_ACCURACY, len(eval_items or [])
    )
    return common.finish(cfg, result, extra)
