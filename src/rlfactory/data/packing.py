"""Padding-free rows: sequences back to back in one row, position ids restarting at 0 at each.

The one packing contract of every stage (sft's ``data.packing``, the online stages' ``rollout.packing``): the row
goes to the model with ``position_ids`` and WITHOUT an attention mask. transformers then finds the documents from
the position ids (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask for
sdpa / eager / flex attention, or passes them to flash-attention as varlen sequences, so a document never attends to
another and computes exactly what it computes alone, at the cost of its own tokens only. A row that is a whole
micro-batch also carries its documents' boundaries (``document_boundaries``): flash-attention and ``sdpa_varlen``
(``model.attention``) take them as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Padded batches are made a multiple of this many columns wide (the offline collates, when they pad at all; the
# online loop's rollout batches and the micro-batches its passes cut). sdpa's masked CUDA kernel needs the mask's
# rows at an aligned stride and pads them otherwise; under train.torch_compile, inductor guards on which of the two
# the first compile saw (its sdpa lowering, pytorch/pytorch#163083), so a later step whose width fell the other way
# compiled the layers once more (the likely cause of a 16 s update in the fifth step of a 7B grpo run on 4 GPUs,
# docs/BENCHMARKS.md). Costs at most 7 padding columns.
ALIGN_COLUMNS = 8

# attention kernels that skip the masked blocks of a packed row (flash-attention's varlen, flex's block mask): a
# micro-batch packs into ONE row there. sdpa and eager compute a row's whole attention and mask it afterwards, so
# one long row costs its length squared (the bundled model on CPU: 0.15-0.30x a padded update's speed); for them
# the samples go into rows no longer than the longest sample (``first_fit``): 1.24-1.39x padded's speed there at
# lengths 32..1024 and 16..256, 1.00x at nearly equal lengths (bench/packed_update.py)
SPARSE_ATTENTION = ("flash_attention_2", "flex_attention", "sdpa_varlen")  # sdpa_varlen: with the boundaries


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def padded_width(lengths: Sequence[int], align: int = 1, cap: int | None = None) -> int:
    """The width of a right-padded batch of rows ``lengths`` long: the longest, rounded up to a multiple of
    ``align`` when the batch is padded anyway (a batch of equal rows stays unpadded: without a mask, sdpa takes its
    causal kernel), never past ``cap`` (``data.cutoff_len``: a model with learned positions has no position past
    it)."""
    longest = max(lengths)
    if align <= 1 or all(n == longest for n in lengths):
        return longest
    aligned = round_up(longest, align)
    return aligned if cap is None else max(longest, min(aligned, cap))


@dataclass(frozen=True)
class MicroBatching:
    """How a pass cuts its rows into micro-batches: at most ``samples`` rows (``train.per_device_batch_size``) and,
    with ``tokens`` (``rollout.micro_batch_tokens``), at most that many prompt + response tokens, so that a
    micro-batch's activations are bounded whatever the response lengths (verl's dynamic batch size); a sample
    longer than ``tokens`` runs alone."""

    samples: int
    tokens: int | None = None

    def spans(self, lengths: list[int]) -> list[tuple[int, int]]:
        """[start, end) of consecutive micro-batches over rows of these token counts, in order."""
        spans, start, total = [], 0, 0
        for i, n in enumerate(lengths):
            full = i - start == self.samples or (self.tokens is not None and total + n > self.tokens)
            if i > start and full:
                spans.append((start, i))
                start, total = i, 0
            total += n
        return spans + [(start, len(lengths))] if lengths else spans


def first_fit(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of ``lengths`` in bins no longer than the longest, first fit in decreasing order (each bin's members in
    their original order). Written here: a few lines, on the host, once per micro-batch."""
    capacity, bins, room = max(lengths, default=0), [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return [sorted(b) for b in bins]


def document_positions(lengths: Sequence[int]) -> torch.Tensor:
    """(sum(lengths),) int64: ``0 .. n-1`` for each document of length n, in order."""
    if not lengths:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])


# a packed row's documents as transformers' flash-attention path reads them from the forward's kwargs
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def document_boundaries(lengths: Sequence[int]) -> dict[str, Any]:
    """``BOUNDARY_KEYS`` of one row of documents ``lengths`` long: where each starts ((n + 1,) int32, made on the
    host: the kernels need not find them from the position ids on the device) and the longest."""
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    longest = max(lengths, default=0)
    return dict(zip(BOUNDARY_KEYS, (starts, starts, longest, longest), strict=True))


def pack_sequences(sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """``input_ids`` and ``position_ids`` (1, N): ``sequences`` packed into one row (no attention mask: see above),
    with the documents' boundaries (``document_boundaries``)."""
    ids = [token for sequence in sequences for token in sequence]
    lengths = [len(sequence) for sequence in sequences]
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": document_positions(lengths)[None],
        **document_boundaries(lengths),
    }
