"""Stage ``kto``: Kahneman-Tversky optimisation on unpaired desirable / undesirable examples.

Reads top to bottom: checks -> tokenizer -> examples (unpaired, or split from preference pairs) ->
render -> policy -> reference -> output dir -> scores before -> train (shared engine) -> scores after.

Data: a dataset registered as ranking data (``ranking: true``) is used as is: each pair gives one
desirable (chosen) and one undesirable (rejected) example, so no extra key is needed. Other datasets
need a true/false ``label`` (``columns.kto_tag``). Both labels must occur.

Reference point z0 (the KL term): estimated per micro-batch from mismatched pairs, prompt i with the
completion of example i-1 (TRL's rotation; an earlier row when that one has the same prompt), under
the policy and the reference, without gradient. A micro-batch therefore needs at least 2 examples.
Under data parallelism each process uses its own micro-batch (TRL all-reduces z0; the estimate is
noisier, not biased). The loss is the registered ``kto`` entry; the engine divides summed
per-example losses by the examples of the window.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from rlfactory.algos.common import HeadKernels, masked_mean
from rlfactory.algos.preference import PREFERENCE_LOSSES
from rlfactory.config.schema import KTOConfig, RunConfig
from rlfactory.data.packing import ALIGN_COLUMNS
from rlfactory.engine.offline import Batch, StageParts, train
from rlfactory.errors import UserError
from rlfactory.model.reference import ReferencePolicy, build_reference
from rlfactory.render.fit import FitCounts, infer_seqlen
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common, preference_data
from rlfactory.stages.preference_data import (
    finish_counts,
    fit_prompt,
    forward_logps,
    pad_rows,
    reference_logps,
    tally,
)

log = logging.getLogger(__name__)
MARGINS = "eval reward margin (desirable - undesirable; 0 at step 0)"


def split_pairs(pairs: list[dict]) -> list[dict]:
    """Each preference pair -> a desirable (chosen) and an undesirable (rejected) unpaired example."""
    out = []
    for pair in pairs:
        for side, label in (("chosen", True), ("rejected", False)):
            out.append({**pair, "messages": pair["messages"] + pair[side], "label": label, "source": pair["source"]})
    return out


def load_kto_examples(cfg: RunConfig, names: list[str]) -> list[dict]:
    """Unpaired examples: ranking datasets are split (one example per side), others need labels."""
    from rlfactory.data.loader import is_ranking, load_examples
    from rlfactory.data.registry import load_registry
    from rlfactory.stages import dataset_kind

    d = cfg.data
    folder, specs = load_registry(d.dataset_dir)
    examples: list[dict] = []
    pairs: list[dict] = []
    for name in names:
        if dataset_kind("kto", is_ranking(name, folder, specs)) == "pairwise":
            log.info("dataset '%s' is preference data: each pair gives one desirable + one undesirable example", name)
            pairs += load_examples([name], "pairwise", d.dataset_dir, d.max_samples, d.max_bad_rows)
        else:
            examples += load_examples([name], "unpaired", d.dataset_dir, d.max_samples, d.max_bad_rows)
    return examples + split_pairs(pairs)


def check_labels(examples: list[dict], names: list[str], section: KTOConfig) -> None:
    """Both classes must occur; warn when the weighted class balance is outside TRL's advice [1, 4/3]."""
    desirable = sum(1 for e in examples if e["label"])
    undesirable = len(examples) - desirable
    if not desirable or not undesirable:
        present = "desirable (label true)" if desirable else "undesirable (label false)"
        raise UserError(
            f"kto needs both desirable and undesirable examples, but {', '.join(names)} has only {present} ones "
            f"({len(examples)} rows); add examples of the other label"
        )
    ratio = section.desirable_weight * desirable / (section.undesirable_weight * undesirable)
    if not 1.0 <= ratio <= 4 / 3:
        log.warning(
            "%d desirable vs %d undesirable examples: weighted ratio %.2f is outside [1, 4/3] (KTO paper); "
            "adjust kto.desirable_weight / kto.undesirable_weight",
            desirable,
            undesirable,
            ratio,
        )


def fit_unpaired(item: dict[str, Any], cutoff_len: int, truncation: str) -> tuple[dict[str, Any] | None, str]:
    """(the example within ``cutoff_len``, outcome), split as ``preference_data.fit_pair`` splits a pair."""
    prompt, ids = item["prompt_ids"], item["ids"]
    if len(prompt) + len(ids) <= cutoff_len:
        return item, "kept"
    if truncation == "drop":
        return None, "longer than the limit (data.truncation: drop)"
    keep_prompt, keep_completion = infer_seqlen(len(prompt), len(ids), cutoff_len)
    cut = {**item, "prompt_ids": prompt[len(prompt) - keep_prompt :], "ids": ids[:keep_completion]}
    cut["mask"] = item["mask"][:keep_completion]
    if not any(cut["mask"]) or not cut["prompt_ids"]:
        return None, "no trained token left within the limit"
    return cut, "shortened"


def render_unpaired(
    cfg: RunConfig, tokenizer: Any, examples: list[dict], counts: FitCounts | None = None
) -> list[dict[str, Any]]:
    """Prompt = the prompt of a prompt-completion row, else messages up to the last user turn; completion = the
    rest (its tool results are not trained). Rows longer than data.cutoff_len are shortened or dropped, counted."""
    from rlfactory.render.chat import for_row, render_continuation

    counts = counts if counts is not None else FitCounts(f"data.cutoff_len={cfg.data.cutoff_len}")
    items = []
    for example in examples:
        messages = example["messages"]
        split = example.get("train_from") or max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
        with for_row(example):
            prompt, ids, mask = render_continuation(tokenizer, messages[:split], messages[split:], example["tools"])
        item = {"prompt_ids": prompt, "ids": ids, "mask": mask, "label": bool(example["label"])}
        item, outcome = fit_unpaired(item, cfg.data.cutoff_len, cfg.data.truncation)
        tally(counts, outcome)
        if item is not None:
            items.append(item)
    finish_counts(counts, "kto examples", cfg)
    return items


def fit_counts(cfg: RunConfig, tokenizer: Any, examples: list[dict]) -> FitCounts:
    """What data.cutoff_len does to these examples (``rlfactory config check``)."""
    counts = FitCounts(f"data.cutoff_len={cfg.data.cutoff_len}")
    examples = [e for e in examples if e.get("label") is not None] + split_pairs(
        [e for e in examples if e.get("label") is None]  # ranking data: one example per side, as the stage reads it
    )
    render_unpaired(cfg, tokenizer_for(tokenizer, examples), examples, counts)
    return counts


def mismatched(items: list[dict]) -> list[dict]:
    """For row i, the completion of row i-1 (TRL's rotation), or the nearest earlier row with another prompt:
    a pair split into two examples puts the same prompt in neighbouring rows."""
    out = []
    for i, item in enumerate(items):
        others = (items[i - k] for k in range(1, len(items)))
        out.append(next((o for o in others if o["prompt_ids"] != item["prompt_ids"]), items[i - 1]))
    return out


def collate_unpaired(pad_id: int, cutoff_len: int) -> Callable[[list[dict]], Batch]:
    """Rows (prompt_i, completion_i) plus ``kl_`` rows (prompt_i, a completion of another prompt), ``desirable``."""

    def collate(items: list[dict]) -> Batch:
        batch = pad_rows([(it["prompt_ids"], it["ids"], it["mask"]) for it in items], pad_id, ALIGN_COLUMNS, cutoff_len)
        kl_rows = []
        for item, other in zip(items, mismatched(items), strict=True):
            # the completion fits cutoff_len with one prompt token (render_unpaired checked it)
            prompt = fit_prompt(item["prompt_ids"], len(other["ids"]), cutoff_len, "right") or item["prompt_ids"][-1:]
            kl_rows.append((prompt, other["ids"], other["mask"]))
        kl_batch = pad_rows(kl_rows, pad_id, ALIGN_COLUMNS, cutoff_len)
        batch.update({f"kl_{k}": v for k, v in kl_batch.items()})
        batch["desirable"] = torch.tensor([it["label"] for it in items], dtype=torch.bool)
        # (any desirable, any undesirable) as host booleans: the loss picks its logged class means without a sync
        batch["labels_present"] = (any(it["label"] for it in items), not all(it["label"] for it in items))
        return batch

    return collate


def kto_metrics(
    rewards: torch.Tensor,
    logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    present: tuple[bool, bool],
) -> dict[str, torch.Tensor]:
    """TRL's KTO names: kl, rewards/chosen|rejected|margins, logps/chosen|rejected (class means of the batch),
    as 0-d device tensors (the engine reads them at log time, no sync in the step).

    ``present``: whether the batch has (desirable, undesirable) rows, known on the host from the collate. A
    class absent from the batch logs no mean (nor a margin), so the engine averages each over the batches that
    have it; deciding that from ``desirable`` itself would wait for the device.
    """
    metrics = {"kl": kl.detach()}
    for name, rows, has_rows in (("chosen", desirable, present[0]), ("rejected", ~desirable, present[1])):
        if has_rows:
            metrics[f"rewards/{name}"] = masked_mean(rewards.detach(), rows)
            metrics[f"logps/{name}"] = masked_mean(logps.detach(), rows)
    if all(present):
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


def make_loss(
    section: KTOConfig, ref: ReferencePolicy, kernels: HeadKernels = HeadKernels()
) -> Callable[[Any, Batch], tuple[torch.Tensor, dict]]:
    """loss_fn(model, batch) -> (summed per-example loss, TRL's KTO metrics); ``kernels``: the run's LM head."""
    kto = PREFERENCE_LOSSES.get("kto")

    def kto_loss(model: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():  # the reference point is detached: no graph for the mismatched rows
            policy_kl = forward_logps(model, batch, "kl_", kernels)[0]
        policy = forward_logps(model, batch, "", kernels)[0]
        losses, rewards, kl = kto(
            policy,
            reference_logps(ref, batch, "", kernels)[0],
            batch["desirable"],
            policy_kl,
            reference_logps(ref, batch, "kl_", kernels)[0],
            beta=section.beta,
            desirable_weight=section.desirable_weight,
            undesirable_weight=section.undesirable_weight,
        )
        return losses.sum(), kto_metrics(rewards, policy, batch["desirable"], kl, batch["labels_present"])

    return kto_loss


def count_examples(batch: Batch) -> float:
    return float(batch["input_ids"].shape[0])


def run(cfg: RunConfig) -> dict[str, Any]:
    from rlfactory.model.loader import head_kernels, load_model, load_tokenizer

    assert cfg.kto is not None
    resume_from = common.preflight(cfg)
    tokenizer = load_tokenizer(cfg.model)

    examples = load_kto_examples(cfg, cfg.data.dataset)
    check_labels(examples, cfg.data.dataset, cfg.kto)
    train_examples, eval_examples = common.split_eval(examples, cfg.data.eval_split, cfg.seed)
    if cfg.data.eval_dataset:
        eval_examples = load_kto_examples(cfg, cfg.data.eval_dataset)
    renderer = tokenizer_for(tokenizer, train_examples, eval_examples)  # plain text for standard TRL rows
    train_items = render_unpaired(cfg, renderer, train_examples)
    eval_items = render_unpaired(cfg, renderer, eval_examples) if eval_examples else None
    eval_prompts = common.load_eval_prompts(cfg)

    model = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    ref = build_reference(cfg, model)
    common.start_output_dir(cfg, resume_from)

    parts = StageParts(
        train_examples=train_items,
        eval_examples=eval_items,
        collate=collate_unpaired(tokenizer.pad_token_id, cfg.data.cutoff_len),
        loss_fn=make_loss(cfg.kto, ref, head_kernels(cfg.model, cfg.train)),
        count_fn=count_examples,
        before_training=common.score_before(cfg, tokenizer, eval_prompts),
    )
    result = train(cfg, model, tokenizer, parts, resume_from)
    extra = common.score_after(cfg, result, tokenizer, eval_prompts)
    extra |= preference_data.before_after(result.final_dir, "eval_rewards/margins", MARGINS, len(eval_items or []))
    return common.finish(cfg, result, extra)
