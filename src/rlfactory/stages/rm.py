"""Stage ``rm``: a Bradley-Terry reward model on preference pairs.

Reads top to bottom: tokenizer -> pairs (render, truncate) -> reward model (base LM + score head) ->
output dir -> train (shared engine) -> merge LoRA and save a plain directory -> summary.

The model is ``AutoModelForSequenceClassification`` with one output; the reward of a rendered
conversation is the score at its last non-pad token (see ``model.heads``). Chosen and rejected go
through one forward of 2B rows. The result loads with ``AutoModelForSequenceClassification.from_pretrained``
and with ``rlfactory.model.heads.load_reward_model`` (the reward source of ppo/grpo).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rlfactory.config.schema import RMConfig, RunConfig
from rlfactory.data.packing import ALIGN_COLUMNS
from rlfactory.engine.offline import Batch, StageParts, train
from rlfactory.errors import UserError
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common, preference_data
from rlfactory.stages.preference_data import SHARED_INPUTS, count_pairs, pair_collate

fit_counts = preference_data.fit_counts  # `rlfactory config check`: what data.cutoff_len does to the pairs

HELDOUT = "eval pair accuracy (reward chosen > rejected; step 0: untrained head)"


def bradley_terry(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0, center_coef: float | None = None
) -> torch.Tensor:
    """Per-pair loss ``-log sigmoid(r_c - r_r - margin) + coef * (r_c + r_r)^2``; all (B,) -> (B,).

    Bradley-Terry (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155, Eq. 1); the margin is Llama 2's
    (https://arxiv.org/abs/2307.09288, Eq. 2); the centering term (Eisenstein et al. 2023,
    https://arxiv.org/abs/2312.09244) keeps rewards near zero, as TRL's ``center_rewards_coefficient``.
    The mean over pairs equals TRL's ``RewardTrainer.compute_loss``.
    """
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return losses


def check_margins(section: RMConfig, examples: list[dict]) -> None:
    """``rm.margin_column`` needs a margin on every row: say which row lacks it."""
    if not section.margin_column:
        return
    missing = next((e for e in examples if e.get("margin") is None), None)
    if missing is not None:
        raise UserError(
            f"rm.margin_column is true but {missing['source']} has no margin; map `columns.margin` in "
            "dataset_info.yaml or set rm.margin_column: false"
        )


def pair_rewards(model: Any, batch: Batch) -> torch.Tensor:
    """(2B,) float32 rewards, chosen first: the classifier's pooled score of each padded row, or, for one
    shared-prompt row (``data.share_prompt``), the score head's output at the collate's ``score_rows`` (each side's
    last token that is not pad; the classifier's own pooling would take the row's last token only)."""
    if "kv_index" not in batch:
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        return out.logits[:, 0].float()
    from rlfactory.model.heads import SCORE_HEAD
    from rlfactory.model.lm_head import unwrapped

    scores: list[torch.Tensor] = []
    handle = getattr(unwrapped(model), SCORE_HEAD).register_forward_hook(lambda _m, _a, out: scores.append(out))
    try:
        model(**{key: batch[key] for key in SHARED_INPUTS}, use_cache=False)
    finally:
        handle.remove()
    return scores[-1].flatten(0, 1).index_select(0, batch["score_rows"])[:, 0].float()


def make_loss(section: RMConfig) -> Callable[[Any, Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """loss_fn(model, batch) -> (summed per-pair loss, metrics: accuracy and rewards/*)."""

    def reward_loss(model: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        chosen, rejected = pair_rewards(model, batch).chunk(2)
        margin = batch["margin"] if section.margin_column else 0.0
        losses = bradley_terry(chosen, rejected, margin, section.center_rewards_coefficient)
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            "accuracy": (chosen > rejected).float().mean(),  # 0-d tensors: read at log time, no sync here
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margins": (chosen - rejected).mean(),
        }
        return losses.sum(), metrics

    return reward_loss


def run(cfg: RunConfig) -> dict[str, Any]:
    from rlfactory.engine.shared import process_state
    from rlfactory.model.heads import load_reward_model_for_training, merge_reward_model, save_reward_model
    from rlfactory.model.loader import load_tokenizer

    assert cfg.rm is not None
    resume_from = common.preflight(cfg)
    tokenizer = load_tokenizer(cfg.model)

    train_examples, eval_examples = preference_data.load_train_eval(cfg, "pairwise")
    check_margins(cfg.rm, train_examples + eval_examples)
    renderer = tokenizer_for(tokenizer, train_examples, eval_examples)  # plain text for standard TRL rows
    train_items = preference_data.render_pairs(cfg, renderer, train_examples)
    eval_items = preference_data.render_pairs(cfg, renderer, eval_examples) if eval_examples else None

    model = load_reward_model_for_training(cfg, tokenizer.pad_token_id)
    common.start_output_dir(cfg, resume_from)

    parts = StageParts(
        train_examples=train_items,
        eval_examples=eval_items,
        collate=pair_collate(cfg, tokenizer.pad_token_id, ALIGN_COLUMNS),
        loss_fn=make_loss(cfg.rm),
        count_fn=count_pairs,
    )
    result = train(cfg, model, tokenizer, parts, resume_from)
    merged = merge_reward_model(result.model)
    if process_state().is_main_process:
        save_reward_model(merged, tokenizer, result.final_dir)
    result = dataclasses.replace(result, model=merged, saved_as="full")
    extra = preference_data.before_after(result.final_dir, "eval_accuracy", HELDOUT, len(eval_items or []))
    return common.finish(cfg, result, extra)
