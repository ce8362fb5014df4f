"""Preference data shared by stages rm, dpo, kto and orpo: render pairs, truncate, collate, log-probs.

A pair is rendered with ``render_continuation`` once per side; both sides must give the same prompt ids,
so chosen and rejected differ only in their response tokens. A micro-batch of B pairs becomes ONE
padded batch of 2B rows ``[chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}]`` so both sides go
through a single forward (half the kernel launches, and the same padding for both). ``loss_mask``
marks the response tokens the policy produced: prompt, template glue after the turn and padding are
never counted. The summary's before -> after numbers are read from the engine's step-0 and final evals,
so no extra pass over the eval set is made.

``data.share_prompt`` (with ``model.attn_implementation`` sdpa_varlen) lays a micro-batch out as ONE row instead:
each pair's prompt once, then its chosen and its rejected response (:func:`collate_shared_pairs`), the prompt's keys
and values read by both responses. The same numbers, and the prompt's tokens are computed once instead of twice.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlfactory.algos.common import HeadKernels, masked_sum, token_logprobs
from rlfactory.config.schema import RunConfig
from rlfactory.data.packing import BOUNDARY_KEYS, padded_width
from rlfactory.engine.offline import Batch
from rlfactory.errors import UserError
from rlfactory.model.reference import ReferencePolicy
from rlfactory.render.chat import for_row, render_continuation
from rlfactory.render.fit import FitCounts, infer_seqlen
from rlfactory.render.plain import tokenizer_for
from rlfactory.stages import common

log = logging.getLogger(__name__)

Row = tuple[list[int], list[int], list[bool]]  # (prompt ids, response ids, response mask)


def load_train_eval(cfg: RunConfig, kind: str) -> tuple[list[dict], list[dict]]:
    """Training examples and held-out ones (``data.eval_dataset``, else a seeded ``data.eval_split``)."""
    from rlfactory.data.loader import load_examples

    d = cfg.data
    examples = load_examples(d.dataset, kind, d.dataset_dir, d.max_samples, d.max_bad_rows)
    train, held = common.split_eval(examples, d.eval_split, cfg.seed)
    if d.eval_dataset:
        held = load_examples(d.eval_dataset, kind, d.dataset_dir, d.max_samples, d.max_bad_rows)
    return train, held


def fit_prompt(prompt: list[int], longest_response: int, cutoff_len: int, truncation: str) -> list[int] | None:
    """The prompt, cut from the LEFT so a whole response of ``longest_response`` tokens fits in ``cutoff_len``
    (KTO's mismatched rows pair a prompt with another row's completion); None means drop. At least one prompt token
    must stay: it predicts the first response token.
    """
    room = cutoff_len - longest_response
    if len(prompt) <= room:
        return prompt
    if truncation == "drop" or room < 1:
        return None
    return prompt[len(prompt) - room :]


def render_pair(tokenizer: Any, example: dict) -> dict[str, list]:
    """prompt_ids plus ids and masks of both responses (plus ``margin`` when the row has one)."""
    with for_row(example):
        prompt, chosen, chosen_mask = render_continuation(
            tokenizer, example["messages"], example["chosen"], example["tools"]
        )
        prompt_r, rejected, rejected_mask = render_continuation(
            tokenizer, example["messages"], example["rejected"], example["tools"]
        )
    if prompt != prompt_r:  # cannot happen with a prefix-stable template; guard the single-forward layout
        raise UserError(f"{example.get('source')}: chosen and rejected render different prompts")
    item: dict[str, Any] = {"prompt_ids": prompt, "chosen_ids": chosen, "chosen_mask": chosen_mask}
    item.update(rejected_ids=rejected, rejected_mask=rejected_mask, margin=example.get("margin"))
    return item


def fit_pair(item: dict[str, Any], cutoff_len: int, truncation: str) -> tuple[dict[str, Any] | None, str]:
    """(the pair within ``cutoff_len``, outcome): ``kept``, ``shortened`` or why it was dropped.

    Too long with ``truncation: right``: the prompt and the longer response split the budget as LLaMA-Factory
    splits them (``render.fit.infer_seqlen``); the prompt keeps its end, both responses keep their start, cut to
    the same length. Where that cut makes the two sides identical (pairs often differ only near their end), the
    responses get all the room but what the prompt needs (at least one token). A pair still identical, or left
    without a trained token, is dropped.
    """
    prompt, chosen, rejected = item["prompt_ids"], item["chosen_ids"], item["rejected_ids"]
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= cutoff_len:
        return item, "kept"
    if truncation == "drop":
        return None, "longer than the limit (data.truncation: drop)"
    cut = _cut_pair(item, *infer_seqlen(len(prompt), longest, cutoff_len))
    if cut["chosen_ids"] == cut["rejected_ids"]:  # they differ late: give the responses all the room the prompt spares
        keep_response = min(longest, cutoff_len - 1)
        cut = _cut_pair(item, min(len(prompt), cutoff_len - keep_response), keep_response)
    if cut["chosen_ids"] == cut["rejected_ids"]:
        return None, "chosen and rejected identical within the limit"
    if not (any(cut["chosen_mask"]) and any(cut["rejected_mask"])) or not cut["prompt_ids"]:
        return None, "no trained token left within the limit"
    return cut, "shortened"


def _cut_pair(item: dict[str, Any], keep_prompt: int, keep_response: int) -> dict[str, Any]:
    """The pair with the prompt's last ``keep_prompt`` tokens and each response's first ``keep_response``."""
    cut = {**item, "prompt_ids": item["prompt_ids"][len(item["prompt_ids"]) - keep_prompt :]}
    for side in ("chosen", "rejected"):
        cut[f"{side}_ids"] = item[f"{side}_ids"][:keep_response]
        cut[f"{side}_mask"] = item[f"{side}_mask"][:keep_response]
    return cut


def tally(counts: FitCounts, outcome: str) -> None:
    """Add one row's outcome (from ``fit_pair`` or the kto equivalent) to ``counts``."""
    if outcome == "kept":
        counts.kept += 1
    elif outcome == "shortened":
        counts.shortened += 1
    else:
        counts.drop(outcome)


def finish_counts(counts: FitCounts, what: str, cfg: RunConfig) -> None:
    """Log what the limit changed; no example left is an error."""
    counts.report(what)
    if counts.total and counts.kept + counts.shortened == 0:
        raise UserError(f"no example fits data.cutoff_len={cfg.data.cutoff_len}; raise it")


def render_pairs(
    cfg: RunConfig, tokenizer: Any, examples: list[dict], counts: FitCounts | None = None
) -> list[dict[str, Any]]:
    """Render every pair and fit it into data.cutoff_len; every shortened or dropped pair is counted."""
    counts = counts if counts is not None else FitCounts(f"data.cutoff_len={cfg.data.cutoff_len}")
    items = []
    for example in examples:
        item, outcome = fit_pair(render_pair(tokenizer, example), cfg.data.cutoff_len, cfg.data.truncation)
        tally(counts, outcome)
        if item is not None:
            items.append(item)
    finish_counts(counts, "preference pairs", cfg)
    return items


def fit_counts(cfg: RunConfig, tokenizer: Any, examples: list[dict]) -> FitCounts:
    """What data.cutoff_len does to these pairs (``rlfactory config check``)."""
    counts = FitCounts(f"data.cutoff_len={cfg.data.cutoff_len}")
    render_pairs(cfg, tokenizer_for(tokenizer, examples), examples, counts)
    return counts


def pad_rows(rows: list[Row], pad_id: int, align: int = 1, cap: int | None = None) -> Batch:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` (True on trained response tokens), and
    ``logp_rows``: the flat (rows x width) indices of the positions whose next token is trained.

    Without padding the mask is left out, as in sft: sdpa then runs its causal kernel instead of a masked one. A
    padded batch is rounded up to ``align`` columns, up to ``cap`` (:func:`rlfactory.data.packing.padded_width`).
    """
    width = padded_width([len(prompt) + len(response) for prompt, response, _ in rows], align, cap)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for row, (prompt, response, mask) in enumerate(rows):
        n, m = len(prompt), len(response)
        ids[row, : n + m] = torch.tensor(prompt + response, dtype=torch.long)
        attention[row, : n + m] = 1
        loss_mask[row, n : n + m] = torch.tensor(mask, dtype=torch.bool)
    # the positions whose next token is trained, found here on the host (``forward_logps``: no GPU wait)
    logp_rows = loss_mask[:, 1:].nonzero()
    logp_rows = logp_rows[:, 0] * width + logp_rows[:, 1]
    batch = {"input_ids": ids, "loss_mask": loss_mask, "logp_rows": logp_rows}
    if not bool(attention.all()):  # no padding: without a mask, sdpa takes its fast causal (flash) path
        batch["attention_mask"] = attention
    return batch


def collate_pairs(pad_id: int, align: int = 1, cap: int | None = None) -> Callable[[list[dict]], Batch]:
    """B pairs -> one batch of 2B rows, chosen first; carries ``margin`` and precomputed ``ref_*`` if present.
    ``align``, ``cap``: see :func:`pad_rows`."""

    def collate(items: list[dict]) -> Batch:
        chosen = [(it["prompt_ids"], it["chosen_ids"], it["chosen_mask"]) for it in items]
        rejected = [(it["prompt_ids"], it["rejected_ids"], it["rejected_mask"]) for it in items]
        batch = pad_rows(chosen + rejected, pad_id, align, cap)
        batch["margin"] = torch.tensor([float(it.get("margin") or 0.0) for it in items])
        if "ref_chosen_logps" in items[0]:
            batch["ref_logps"] = torch.tensor(
                [it["ref_chosen_logps"] for it in items] + [it["ref_rejected_logps"] for it in items]
            )
        return batch

    return collate


def collate_shared_pairs(items: list[dict], pad_id: int | None = None) -> Batch:
    """B pairs -> ONE row ``[prompt_0, chosen_0, rejected_0, prompt_1, ...]`` for ``data.share_prompt``.

    Two attention documents per pair: prompt + chosen (keys = queries), and the rejected response, whose keys are
    the prompt's and its own (``kv_index``: the row positions each key document reads, in order; see
    ``model.attention``). The rejected response's positions continue from the prompt's end, so every token sees what
    it would see in a row of its own. The trained positions and their targets are listed here on the host:
    ``logp_rows`` (the position predicting each trained token; a rejected response's first token is predicted from
    the prompt's last position, as the chosen one's is), ``logp_targets``, ``logp_sides`` (0..B-1 chosen, B..2B-1
    rejected, the padded layout's row order) and ``logp_counts``; ``score_rows`` (rm): each side's last token that
    is not ``pad_id``, where transformers' classifiers pool a padded row (a response may end in a token equal to the
    pad id, e.g. eos used as pad), so training scores what inference scores.
    """
    ids: list[int] = []
    positions: list[int] = []
    kv_index: list[int] = []
    q_lengths: list[int] = []
    k_lengths: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    sides: list[int] = []
    score_rows = [0] * (2 * len(items))
    pairs = len(items)
    for pair, item in enumerate(items):
        start = len(ids)
        prompt, chosen, rejected = item["prompt_ids"], item["chosen_ids"], item["rejected_ids"]
        p, c, r = len(prompt), len(chosen), len(rejected)
        ids += prompt + chosen + rejected
        positions += list(range(p + c)) + list(range(p, p + r))
        kv_index += list(range(start, start + p + c)) + list(range(start, start + p))
        kv_index += list(range(start + p + c, start + p + c + r))
        q_lengths += [p + c, r]
        k_lengths += [p + c, p + r]
        both_sides = (
            (pair, start + p, chosen, item["chosen_mask"]),
            (pairs + pair, start + p + c, rejected, item["rejected_mask"]),
        )
        for side, first, response, mask in both_sides:
            for j, (token, trained) in enumerate(zip(response, mask, strict=True)):
                if trained:
                    rows.append(start + p - 1 if j == 0 else first + j - 1)
                    targets.append(token)
                    sides.append(side)
            score_rows[side] = _last_non_pad(
                prompt + response, [*range(start, start + p), *range(first, first + len(response))], pad_id
            )
    q_bounds = list(itertools.accumulate(q_lengths, initial=0))
    k_bounds = list(itertools.accumulate(k_lengths, initial=0))
    batch = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "kv_index": torch.tensor(kv_index, dtype=torch.long),
        "cu_seq_lens_q": torch.tensor(q_bounds, dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor(k_bounds, dtype=torch.int32),
        "max_length_q": max(q_lengths),
        "max_length_k": max(k_lengths),
        "logp_rows": torch.tensor(rows, dtype=torch.long),
        "logp_targets": torch.tensor(targets, dtype=torch.long),
        "logp_sides": torch.tensor(sides, dtype=torch.long),
        "logp_counts": torch.bincount(torch.tensor(sides, dtype=torch.long), minlength=2 * pairs).float(),
        "score_rows": torch.tensor(score_rows, dtype=torch.long),
        "margin": torch.tensor([float(it.get("margin") or 0.0) for it in items]),
    }
    if "ref_chosen_logps" in items[0]:
        batch["ref_logps"] = torch.tensor(
            [it["ref_chosen_logps"] for it in items] + [it["ref_rejected_logps"] for it in items]
        )
    return batch


def _last_non_pad(tokens: list[int], places: list[int], pad_id: int | None) -> int:
    """The row position of the last of ``tokens`` (at ``places``) that is not ``pad_id``; the first position when all
    are (transformers' pooling: the argmax of an all-zero mask)."""
    last = next((i for i in range(len(tokens) - 1, -1, -1) if tokens[i] != pad_id), 0)
    return places[last]


SHARED_INPUTS = ("input_ids", "position_ids", "kv_index", *BOUNDARY_KEYS)  # the model's inputs of a shared row


def pair_collate(cfg: RunConfig, pad_id: int, align: int = 1) -> Callable[[list[dict]], Batch]:
    """The run's pair layout: one shared-prompt row (``data.share_prompt``), else 2B padded rows."""
    if cfg.data.share_prompt:
        from rlfactory.model.attention import NAME, resolved_attention

        attention = resolved_attention(cfg.model)
        if attention != NAME:
            raise UserError(
                f"data.share_prompt needs model.attn_implementation {NAME} (this run resolves to {attention}): "
                f"set model.attn_implementation: {NAME}, or remove data.share_prompt"
            )
        return functools.partial(collate_shared_pairs, pad_id=pad_id)
    return collate_pairs(pad_id, align, cfg.data.cutoff_len)


def count_pairs(batch: Batch) -> float:
    """Pairs in a batch of either layout (the loss's unit for rm, dpo and orpo)."""
    return float(batch["margin"].shape[0])


def sequence_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (summed, length-averaged) log-probs of the masked tokens; logits (N, T, V) -> (N,), (N,).

    Position t predicts token t+1, so targets are the ids shifted left and the mask is shifted with them;
    the full logits are passed (no sliced copy) and the last position is masked out. ``token_logprobs``
    never materialises a (N, T, V) float32 log-softmax.
    """
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    mask = torch.zeros_like(loss_mask)
    mask[:, :-1] = loss_mask[:, 1:]
    sums = masked_sum(token_logprobs(logits, targets), mask, dim=-1)
    return sums, sums / mask.sum(-1).clamp(min=1)


def forward_logps(
    model: Any, batch: Batch, prefix: str = "", kernels: HeadKernels = HeadKernels()
) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal-LM forward over the rows ``{prefix}input_ids``; returns (summed, averaged) response logps.

    Only the response positions go through the LM head (``model.lm_head.next_token_logps``, with the run's
    ``kernels``), so the (2B, T, V) logits never exist. ``attention_mask`` may be absent (no padding: sdpa's
    causal path).
    """
    from rlfactory.model.lm_head import logps_at, next_token_logps

    if f"{prefix}kv_index" in batch:  # one shared-prompt row: the trained positions were listed by the collate
        inputs = {key: batch[f"{prefix}{key}"] for key in SHARED_INPUTS}
        picked = logps_at(model, inputs, batch[f"{prefix}logp_rows"], batch[f"{prefix}logp_targets"], kernels)
        counts = batch[f"{prefix}logp_counts"]
        sums = picked.new_zeros(counts.shape[0]).index_add(0, batch[f"{prefix}logp_sides"], picked)
        return sums, sums / counts.clamp(min=1)
    inputs = {"input_ids": batch[f"{prefix}input_ids"]}
    if f"{prefix}attention_mask" in batch:
        inputs["attention_mask"] = batch[f"{prefix}attention_mask"]
    mask = torch.zeros_like(batch[f"{prefix}loss_mask"])
    mask[:, :-1] = batch[f"{prefix}loss_mask"][:, 1:]  # position t predicts token t+1
    sums = next_token_logps(model, inputs, mask, kernels, rows=batch.get(f"{prefix}logp_rows")).sum(-1)
    return sums, sums / mask.sum(-1).clamp(min=1)


def reference_logps(
    ref: ReferencePolicy, batch: Batch, prefix: str = "", kernels: HeadKernels = HeadKernels()
) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward_logps`` of the rows ``{prefix}input_ids`` on the reference's weights, without gradient."""
    with ref.weights(batch[f"{prefix}input_ids"].device) as model:
        return forward_logps(model, batch, prefix, kernels)


def run_device() -> torch.device:
    """This process's device, where Accelerate will place the policy (passes before training run there too)."""
    from rlfactory.engine.shared import process_state

    return process_state().device


PAIR_ACCURACY = "eval preference accuracy (policy logp chosen > rejected)"


def logp_accuracy(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs whose chosen response has the higher policy log-prob, logged as ``logps/accuracies``.

    Unlike the implicit-reward accuracy (0 at step 0, when policy == reference), it means something before
    training, so the step-0 and final evals show what training changed.
    """
    return (chosen_logps.detach() > rejected_logps.detach()).float().mean()  # 0-d: the engine reads it at log time


def before_after(out: str | Path, metric: str, label: str, n: int) -> dict[str, dict]:
    """``{label: {before, after, n}}`` from the step-0 and the last eval records of trainer_log.jsonl."""
    from rlfactory.engine.run_dir import read_log

    records = [r for r in read_log(out) if metric in r]
    if not records:
        return {}
    from rlfactory.engine.shared import before_after as entry

    before = records[0][metric] if records[0]["step"] == 0 else None
    return {label: entry(before, records[-1][metric], n)}
