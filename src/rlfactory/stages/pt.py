"""Stage ``pt``: continued pre-training on raw text, every token trained.

Reads top to bottom: checks -> tokenizer -> documents (``.txt`` lines or a ``text`` column) -> blocks -> model ->
output dir -> score before -> train (shared engine, sft's loss) -> score after -> summary.

Blocks: each document is tokenized as ``[bos] text eos`` (bos only where the tokenizer has one), the documents are
concatenated in order and cut into blocks of ``data.cutoff_len`` tokens, as LLaMA-Factory's pt stage and TRL's
wrapped packing do: a document may span two blocks and attends to the documents before it in its block. Unlike
LLaMA-Factory, which drops the tail that does not fill a block, the last block is kept (shorter, padded): no text is
lost. The held-out documents (``data.eval_split`` / ``data.eval_dataset``) are packed on their own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from rlfactory.config.schema import RunConfig
from rlfactory.data.packing import ALIGN_COLUMNS
from rlfactory.engine.offline import StageParts, train
from rlfactory.errors import UserError
from rlfactory.stages import common
from rlfactory.stages.sft import collate_padded, count_tokens, nll_sum


@dataclass
class PackCounts:
    """What packing made of the documents (logged, and printed by ``rlfactory config check``)."""

    documents: int
    tokens: int
    block_len: int

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.block_len)

    def summary(self) -> str:
        last = self.tokens - (self.blocks - 1) * self.block_len
        return (
            f"{self.documents} documents, {self.tokens} tokens packed into {self.blocks} blocks of data.cutoff_len="
            f"{self.block_len} (last block {last} tokens; nothing dropped)"
        )


def document_ids(tokenizer: Any, text: str) -> list[int]:
    """``[bos] text eos``: the eos token separates documents, so the model learns where one ends."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def pack_blocks(tokenizer: Any, examples: list[dict], block_len: int) -> tuple[list[dict[str, list[int]]], PackCounts]:
    """Documents -> blocks of ``block_len`` tokens (the last may be shorter), labels = ids (every token trained)."""
    if tokenizer.eos_token_id is None:
        raise UserError("stage pt ends every document with the eos token; this tokenizer has none")
    stream = [token for example in examples for token in document_ids(tokenizer, example["text"])]
    blocks = [stream[i : i + block_len] for i in range(0, len(stream), block_len)]
    if blocks and len(blocks[-1]) < 2:  # one token predicts nothing: it joins the block before
        blocks = blocks[:-2] + [blocks[-2] + blocks[-1]] if len(blocks) > 1 else []
    counts = PackCounts(len(examples), len(stream), block_len)
    return [{"input_ids": block, "labels": list(block)} for block in blocks], counts


def fit_counts(cfg: RunConfig, tokenizer: Any, examples: list[dict]) -> PackCounts:
    """What packing makes of these documents (``rlfactory config check``)."""
    return pack_blocks(tokenizer, examples, cfg.data.cutoff_len)[1]


def run(cfg: RunConfig) -> dict[str, Any]:
    import logging

    from rlfactory.data.loader import load_examples
    from rlfactory.model.loader import head_kernels, load_model, load_tokenizer

    d = cfg.data
    resume_from = common.preflight(cfg)
    tokenizer = load_tokenizer(cfg.model)
    documents = load_examples(d.dataset, "text", d.dataset_dir, d.max_samples, d.max_bad_rows)
    train_docs, eval_docs = common.split_eval(documents, d.eval_split, cfg.seed)
    if d.eval_dataset:
        eval_docs = load_examples(d.eval_dataset, "text", d.dataset_dir, d.max_samples, d.max_bad_rows)
    train_items, counts = pack_blocks(tokenizer, train_docs, d.cutoff_len)
    logging.getLogger(__name__).info("pt data: %s", counts.summary())
    eval_items = pack_blocks(tokenizer, eval_docs, d.cutoff_len)[0] if eval_docs else None
    if not train_items:
        raise UserError(f"dataset(s) {', '.join(d.dataset)} hold no text to train on")
    eval_prompts = common.load_eval_prompts(cfg)  # evaluation.dataset: generation scored before and after

    model = load_model(cfg.model, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    common.start_output_dir(cfg, resume_from)
    parts = StageParts(
        train_examples=train_items,
        eval_examples=eval_items or None,
        collate=collate_padded(tokenizer.pad_token_id, ALIGN_COLUMNS, d.cutoff_len),
        loss_fn=functools.partial(nll_sum, kernels=head_kernels(cfg.model, cfg.train)),
        count_fn=count_tokens,
        before_training=common.score_before(cfg, tokenizer, eval_prompts),
    )
    result = train(cfg, model, tokenizer, parts, resume_from)
    return common.finish(cfg, result, common.score_after(cfg, result, tokenizer, eval_prompts))
