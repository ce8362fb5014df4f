"""Stage ``dpo``: direct preference optimisation with a loss chosen by name (sigmoid, ipo, hinge, robust, simpo).

Reads top to bottom: loss check -> tokenizer -> pairs (render, truncate) -> policy -> reference ->
output dir -> scores before -> train (shared engine) -> scores after -> summary.

Each micro-batch of B pairs is one forward of 2B rows (chosen; rejected). The loss entry comes from
``PREFERENCE_LOSSES`` and declares what it needs: ``reference_free`` entries (simpo) never touch a
reference; ``length_normalised`` entries (ipo, simpo) get length-averaged log-probs, the others sums.
``dpo.sft_weight`` > 0 adds RPO's NLL on the chosen response (Pang et al. 2024,
https://arxiv.org/abs/2404.19733), per sequence averaged over its tokens. The engine divides the summed
per-pair losses by the pairs in the accumulation window, so the loss is a mean over pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from rlfactory.algos.common import HeadKernels
from rlfactory.algos.preference import PREFERENCE_LOSSES, preference_metrics
from rlfactory.config.schema import DPOConfig, RunConfig
from rlfactory.data.packing import ALIGN_COLUMNS
from rlfactory.engine.offline import Batch, StageParts, train
from rlfactory.errors import UserError, did_you_mean
from rlfactory.model import reference
from rlfactory.model.reference import ReferencePolicy
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common, preference_data
from rlfactory.stages.preference_data import PAIR_ACCURACY, count_pairs, forward_logps, pair_collate

fit_counts = preference_data.fit_counts  # `rlfactory config check`: what data.cutoff_len does to the pairs

log = logging.getLogger(__name__)


def dpo_loss_types() -> list[str]:
    """Paired losses that are a DPO objective on their own (orpo and kto have stages of their own)."""
    return [n for n in PREFERENCE_LOSSES.names() if not PREFERENCE_LOSSES.traits(n).get("own_stage")]


def check(cfg: RunConfig) -> list[str]:
    """What dpo adds to the shared checks (``config check`` and the start of ``run``): the loss name and the path of a
    separate reference model."""
    from rlfactory.model.loader import check_model_exists

    assert cfg.dpo is not None
    check_loss_type(cfg.dpo.loss_type)
    if cfg.dpo.ref_model:
        check_model_exists(cfg.dpo.ref_model, "dpo.ref_model")
    return []


def check_loss_type(name: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The registered loss and its traits; a clear error for unknown names and other stages' objectives."""
    valid = dpo_loss_types()
    if name in PREFERENCE_LOSSES and name not in valid:
        stage = PREFERENCE_LOSSES.traits(name)["own_stage"]
        raise UserError(
            f"dpo.loss_type '{name}' is the objective of stage {stage}: set `stage: {stage}` (with a `{stage}:` "
            f"section) instead; dpo loss types: {', '.join(valid)}"
        )
    if name == "kto_pair":  # TRL's and LLaMA-Factory's paired KTO
        raise UserError(
            "dpo.loss_type 'kto_pair' (paired KTO) is not supported: use `stage: kto`, which also takes ranking data "
            f"(each pair gives one desirable and one undesirable example); dpo loss types: {', '.join(valid)}"
        )
    if name not in valid:
        raise UserError(f"unknown dpo.loss_type '{name}'{did_you_mean(name, valid)}; valid names: {', '.join(valid)}")
    return PREFERENCE_LOSSES.get(name), PREFERENCE_LOSSES.traits(name)


def reference_logps(
    batch: Batch, ref: ReferencePolicy | None, length_normalised: bool, kernels: HeadKernels = HeadKernels()
) -> torch.Tensor | None:
    """(2B,) reference log-probs: precomputed in the batch, computed now, or None (reference-free loss)."""
    if "ref_logps" in batch:
        return batch["ref_logps"]
    if ref is None:
        return None
    sums, means = preference_data.reference_logps(ref, batch, "", kernels)
    return means if length_normalised else sums


def make_loss(
    section: DPOConfig,
    loss: Callable[..., Any],
    traits: dict,
    ref: ReferencePolicy | None,
    kernels: HeadKernels = HeadKernels(),
) -> Callable:
    """loss_fn(model, batch) -> (summed per-pair loss, metrics under TRL's names); ``kernels``: the run's LM head."""
    length_normalised = traits["length_normalised"]

    def dpo_loss(model: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        sums, means = forward_logps(model, batch, "", kernels)
        policy_chosen, policy_rejected = (means if length_normalised else sums).chunk(2)
        ref_logps = reference_logps(batch, ref, length_normalised, kernels)
        ref_chosen, ref_rejected = ref_logps.chunk(2) if ref_logps is not None else (None, None)
        losses, chosen_rewards, rejected_rewards = loss(
            policy_chosen,
            policy_rejected,
            ref_chosen,
            ref_rejected,
            beta=section.beta,
            label_smoothing=section.label_smoothing,
            gamma=section.simpo_gamma,
        )
        metrics = preference_metrics(chosen_rewards, rejected_rewards, *sums.chunk(2))
        metrics["logps/accuracies"] = preference_data.logp_accuracy(*sums.chunk(2))
        if section.sft_weight:
            nll = -means.chunk(2)[0]  # per-sequence mean token NLL of the chosen response
            losses = losses + section.sft_weight * nll
            metrics["nll_loss"] = nll.detach().mean()
        return losses.sum(), metrics

    return dpo_loss


def precompute_pairs(
    ref_path: str | None,
    cfg: RunConfig,
    policy: Any,
    item_sets: list[list[dict]],
    *,
    collate: Callable[[list[dict]], Batch],
    batch_size: int,
    length_normalised: bool,
    kernels: HeadKernels = HeadKernels(),
) -> None:
    """``dpo.precompute_ref_logps``: store ``ref_chosen_logps`` / ``ref_rejected_logps`` (summed, or averaged
    when ``length_normalised``) in every pair item, in one pass before training.

    The policy at step 0 is the reference, so it is used directly (LoRA: its adapter disabled; full/freeze:
    its own weights, no copy) unless ``ref_path`` names another model, which is loaded, used once and freed.
    """
    device = preference_data.run_device()
    copy = reference.load_frozen_copy(cfg, ref_path) if ref_path else None
    if copy is None and not reference.is_peft(policy):
        copy = policy  # full/freeze at step 0: the starting weights ARE the reference
    with ReferencePolicy(policy, copy).weights(device) as model:
        was_training = model.training
        model.eval()
        for items in item_sets:
            for start in range(0, len(items), batch_size):
                chunk = items[start : start + batch_size]
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(chunk).items()}
                _store_ref_logps(chunk, forward_logps(model, batch, "", kernels), length_normalised)
        model.train(was_training)
    if ref_path:
        del copy, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    log.info("reference log-probs precomputed for %d pair(s)", sum(len(items) for items in item_sets))


def _store_ref_logps(chunk: list[dict], logps: tuple[torch.Tensor, torch.Tensor], length_normalised: bool) -> None:
    """Write one batch's (summed, averaged) reference log-probs into its pair items, chosen rows first."""
    sums, means = logps
    chosen, rejected = (means if length_normalised else sums).float().cpu().chunk(2)
    for item, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True):
        item.update(ref_chosen_logps=c, ref_rejected_logps=r)


def setup_reference(
    cfg: RunConfig, model: Any, traits: dict, item_sets: list[list[dict]], pad_id: int, kernels: HeadKernels
) -> ReferencePolicy | None:
    """The reference (``model.reference``); None when reference-free or precomputed."""
    section = cfg.dpo
    assert section is not None
    if traits["reference_free"]:
        if section.precompute_ref_logps:
            log.info("dpo.loss_type '%s' is reference-free: nothing to precompute", section.loss_type)
        return None
    if section.precompute_ref_logps:
        precompute_pairs(
            section.ref_model,
            cfg,
            model,
            item_sets,
            collate=pair_collate(cfg, pad_id),
            batch_size=cfg.train.per_device_batch_size,
            length_normalised=traits["length_normalised"],
            kernels=kernels,
        )
        return None
    return reference.build_reference(cfg, model, section.ref_model)


def run(cfg: RunConfig) -> dict[str, Any]:
    from rlfactory.model.loader import head_kernels, load_model, load_tokenizer

    assert cfg.dpo is not None
    loss, traits = check_loss_type(cfg.dpo.loss_type)
    check(cfg)
    resume_from = common.preflight(cfg)
    tokenizer = load_tokenizer(cfg.model)

    train_examples, eval_examples = preference_data.load_train_eval(cfg, "pairwise")
    renderer = tokenizer_for(tokenizer, train_examples, eval_examples)  # plain text for standard TRL rows
    train_items = preference_data.render_pairs(cfg, renderer, train_examples)
    eval_items = preference_data.render_pairs(cfg, renderer, eval_examples) if eval_examples else None
    eval_prompts = common.load_eval_prompts(cfg)

    model = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    item_sets = [train_items] + ([eval_items] if eval_items else [])
    kernels = head_kernels(cfg.model, cfg.train)
    ref = setup_reference(cfg, model, traits, item_sets, tokenizer.pad_token_id, kernels)
    common.start_output_dir(cfg, resume_from)

    parts = StageParts(
        train_examples=train_items,
        eval_examples=eval_items,
        collate=pair_collate(cfg, tokenizer.pad_token_id, ALIGN_COLUMNS),
        loss_fn=make_loss(cfg.dpo, loss, traits, ref, kernels),
        count_fn=count_pairs,
        before_training=common.score_before(cfg, tokenizer, eval_prompts),
    )
    result = train(cfg, model, tokenizer, parts, resume_from)
    extra = common.score_after(cfg, result, tokenizer, eval_prompts)
    extra |= preference_data.before_after(
        result.final_dir, "eval_logps/accuracies", PAIR_ACCURACY, len(eval_items or [])
    )
    return common.finish(cfg, result, extra)
