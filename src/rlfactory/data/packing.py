"""Padding-free rows: sequences back to back in one row, position ids restarting at 0 at each.

The one packing contract of every stage (sft's ``data.packing``, the online stages' ``rollout.packing``): the row
goes to the model with ``position_ids`` and WITHOUT an attention mask. transformers then finds the documents from
the position ids (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal mask for
sdpa / eager / flex attention, or passes them to flash-attention as varlen sequences, so a document never attends to
another and computes exactly what it computes alone, at the cost of its own tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def document_positions(lengths: Sequence[int]) -> torch.Tensor:
    """(sum(lengths),) int64: ``0 .. n-1`` for each document of length n, in order."""
    if not lengths:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])


def pack_sequences(sequences: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``position_ids`` (1, N): ``sequences`` packed into one row (no attention mask: see above)."""
    ids = [token for sequence in sequences for token in sequence]
    positions = document_positions([len(sequence) for sequence in sequences])
    return {"input_ids": torch.tensor([ids], dtype=torch.long), "position_ids": positions[None]}
