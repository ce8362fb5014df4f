"""Stage ``sft``: supervised fine-tuning with loss on assistant tokens.

Reads top to bottom: checks -> tokenizer -> data (render + masks) -> model -> output dir ->
score before -> train (shared engine) -> score after -> summary.

Batching: padded micro-batches, or with ``data.packing`` one padding-free row per micro-batch
whose position ids restart at every document; transformers then builds a block-diagonal
attention mask from the position ids, so packed documents never attend to each other.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from rlfactory.algos.common import HeadKernels
from rlfactory.config.schema import RunConfig
from rlfactory.data.packing import (
    ALIGN_COLUMNS,
    BOUNDARY_KEYS,
    SPARSE_ATTENTION,
    first_fit,
    pack_sequences,
    padded_width,
)
from rlfactory.engine.offline import Batch, StageParts, train
from rlfactory.errors import UserError
from rlfactory.model.attention import resolved_attention
from rlfactory.render.chat import IGNORE_INDEX
from rlfactory.render.fit import FitCounts
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common

log = logging.getLogger(__name__)


def render_examples(
    cfg: RunConfig, tokenizer: Any, examples: list[dict], counts: FitCounts | None = None
) -> list[dict[str, list[int]]]:
    """Canonical examples -> input_ids/labels; rows longer than data.cutoff_len are shortened (or dropped), each
    counted in ``counts`` and logged.

    A template that rewrites history (Qwen3, Mistral) gives a conversation one sequence per rewritten turn
    (``render.chat`` module doc); that is said once, with the counts."""
    from rlfactory.render.chat import for_row, render_sft_outcomes

    counts = counts if counts is not None else FitCounts(f"data.cutoff_len={cfg.data.cutoff_len}")
    d, rendered, split, sequences = cfg.data, [], 0, 0
    for example in examples:
        with for_row(example):
            outcomes = render_sft_outcomes(
                tokenizer,
                example["messages"],
                example.get("tools"),
                d.train_on,
                d.cutoff_len,
                d.truncation,
                example.get("train_from", 0),
            )
        split += len(outcomes) > 1
        sequences += len(outcomes)
        for item, outcome in outcomes:
            if item is None:
                counts.drop(outcome)
                continue
            counts.shortened += outcome == "shortened"
            counts.kept += outcome == "kept"
            rendered.append(item)
    if split:
        log.info(
            "the chat template rewrites earlier turns: %d conversation(s) trained as one sequence per rewritten "
            "turn (%d sequences in all)",
            split,
            sequences,
        )
    counts.report("sft examples")
    if not rendered:
        raise UserError(f"no example fits data.cutoff_len={cfg.data.cutoff_len}; raise it")
    return rendered


def fit_counts(cfg: RunConfig, tokenizer: Any, examples: list[dict]) -> FitCounts:
    """What data.cutoff_len does to these examples (``rlfactory config check``)."""
    counts = FitCounts(f"data.cutoff_len={cfg.data.cutoff_len}")
    render_examples(cfg, tokenizer_for(tokenizer, examples), examples, counts)
    return counts


def collate_padded(pad_id: int, align: int = 1, cap: int | None = None):
    """Right-padded rows; a padded batch is ``align`` columns wide at most past its longest row (see
    :func:`rlfactory.data.packing.padded_width`; the stages pass ALIGN_COLUMNS and data.cutoff_len)."""

    def collate(items: list[dict[str, list[int]]]) -> Batch:
        width = padded_width([len(item["input_ids"]) for item in items], align, cap)
        ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            ids[row, :n] = torch.tensor(item["input_ids"])
            labels[row, :n] = torch.tensor(item["labels"])
            mask[row, :n] = 1
        batch = {"input_ids": ids, "labels": labels, "target_rows": target_rows(labels)}
        if not bool(mask.all()):  # no padding: without a mask, sdpa takes its fast causal (flash) path
            batch["attention_mask"] = mask
        return batch

    return collate


def collate_packed(items: list[dict[str, list[int]]]) -> Batch:
    """One row: documents back to back, position ids restarting at 0, first token of each doc unlabeled."""
    # the first token of each document is unlabelled: never predict a document from the previous one
    labels_row = pack_sequences([[IGNORE_INDEX, *item["labels"][1:]] for item in items])["input_ids"]
    packed = pack_sequences([item["input_ids"] for item in items])
    return {**packed, "labels": labels_row, "target_rows": target_rows(labels_row)}


def packed_collate(cfg: RunConfig, pad_id: int):
    """data.packing's layout: one row per micro-batch where the attention kernel skips masked blocks (flash, flex),
    rows no longer than the longest document for sdpa / eager."""
    if resolved_attention(cfg.model) in SPARSE_ATTENTION:
        return collate_packed
    return collate_packed_rows(pad_id, ALIGN_COLUMNS, cfg.data.cutoff_len)


def collate_packed_rows(pad_id: int, align: int = 1, cap: int | None = None):
    """Documents first-fit into rows no longer than the longest (then padded as :func:`collate_padded` pads), each
    row packed as :func:`collate_packed` packs: for sdpa / eager, which compute a row's whole attention (one row of a
    whole micro-batch would cost its length squared); a row's tail is a document of its own, never trained."""

    def collate(items: list[dict[str, list[int]]]) -> Batch:
        bins = first_fit([len(item["input_ids"]) for item in items])
        rows = [collate_packed([items[i] for i in members]) for members in bins]
        width = padded_width([row["input_ids"].shape[1] for row in rows], align, cap)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(width).repeat(len(rows), 1)
        for r, row in enumerate(rows):
            n = row["input_ids"].shape[1]
            ids[r, :n], labels[r, :n], positions[r, :n] = row["input_ids"][0], row["labels"][0], row["position_ids"][0]
            positions[r, n:] -= n  # the tail's own positions, from 0
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "target_rows": target_rows(labels)}

    return collate


def target_rows(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices (over N x T) of the positions whose next token is trained, found here on the host.

    Computed in the collate so the loss selects those rows with ``index_select`` on the device; a boolean
    index there (``hidden[mask]``) would make the host wait for the whole forward before launching the head
    and the backward.
    """
    row, column = (labels[:, 1:] != IGNORE_INDEX).nonzero().unbind(1)
    return row * labels.shape[1] + column


def nll_sum(
    model: Any, batch: Batch, kernels: HeadKernels = HeadKernels()
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed next-token NLL over labelled tokens (the engine divides by the window's token count).

    The LM head runs on labelled positions only, in chunks, never building the (T, V) logits
    (``model.lm_head.nll_sum``), with the run's ``kernels``.
    """
    from rlfactory.model.lm_head import nll_sum as head_nll_sum

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", *BOUNDARY_KEYS) if k in batch}
    loss_sum = head_nll_sum(model, inputs, batch["labels"], batch.get("target_rows"), kernels)
    n_tokens = count_tokens(batch).clamp(min=1)
    return loss_sum, {"nll_per_token": loss_sum.detach() / n_tokens}


def count_tokens(batch: Batch) -> torch.Tensor:
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def run(cfg: RunConfig) -> dict[str, Any]:
    from rlfactory.data.loader import load_examples
    from rlfactory.model.loader import head_kernels, load_model, load_tokenizer

    resume_from = common.preflight(cfg)
    tokenizer = load_tokenizer(cfg.model)

    examples = load_examples(cfg.data.dataset, "sft", cfg.data.dataset_dir, cfg.data.max_samples, cfg.data.max_bad_rows)
    train_examples, eval_examples = common.split_eval(examples, cfg.data.eval_split, cfg.seed)
    if cfg.data.eval_dataset:
        eval_examples = load_examples(
            cfg.data.eval_dataset, "sft", cfg.data.dataset_dir, cfg.data.max_samples, cfg.data.max_bad_rows
        )
    renderer = tokenizer_for(tokenizer, train_examples, eval_examples)  # plain text for standard TRL rows
    train_items = render_examples(cfg, renderer, train_examples)
    eval_items = render_examples(cfg, renderer, eval_examples) if eval_examples else None
    eval_prompts = common.load_eval_prompts(cfg)

    model = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    common.start_output_dir(cfg, resume_from)

    padded = collate_padded(tokenizer.pad_token_id, ALIGN_COLUMNS, cfg.data.cutoff_len)
    parts = StageParts(
        train_examples=train_items,
        eval_examples=eval_items,
        collate=packed_collate(cfg, tokenizer.pad_token_id) if cfg.data.packing else padded,
        loss_fn=functools.partial(nll_sum, kernels=head_kernels(cfg.model, cfg.train)),
        count_fn=count_tokens,
        before_training=common.score_before(cfg, tokenizer, eval_prompts),
    )
    result = train(cfg, model, tokenizer, parts, resume_from)
    return common.finish(cfg, result, common.score_after(cfg, result, tokenizer, eval_prompts))
