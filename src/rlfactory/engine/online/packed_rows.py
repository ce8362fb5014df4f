"""Padding-free micro-batches of rollouts (``rollout.packing``): :class:`PackedRows`, built on the host from the rows'
prompt and response lengths, turns a micro-batch of the padded :class:`RolloutBatch` into packed rows for the
forward passes of ``update`` and back to the (b, R) response layout (the contract is ``data.packing``'s module doc).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rlfactory.data.packing import ALIGN_COLUMNS, BOUNDARY_KEYS, document_boundaries, first_fit, round_up
from rlfactory.rollout.batch import RolloutBatch

Batch = RolloutBatch


# How a packed micro-batch is laid out (``Updater.packing``; None: padded rows, as sampled).
# "row": all samples in ONE row, for attention kernels that skip the masked blocks (flash-attention's varlen, flex).
# "rows": samples first-fit into rows as long as the longest sample (its length rounded up to ALIGN_COLUMNS), for
# sdpa / eager, which compute a row's whole attention and mask it: a row then costs at most one padded sample's
# attention, while the matrix products run on about the real tokens (the rest is the rows' tails).
PackLayout = Literal["row", "rows"] | None


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch as padding-free rows (``rollout.packing``; the contract is ``data.packing``'s module doc): each
    sample's prompt + response back to back, position ids restarting at 0, no attention mask, so the forward costs
    the micro-batch's real tokens (and, with several rows, their tails). Built on the host from the rows' lengths
    (no device sync)."""

    gather: torch.Tensor  # (n x L,) flat indices into input_ids[rows] (b x (P+R)) of each packed position's token
    position_ids: torch.Tensor  # (n, L) restarting at each sample (and at a row's tail)
    keep: torch.Tensor  # (K,) flat positions of the packed rows that predict a response token (K = sum of responses)
    place: torch.Tensor  # (K,) where each of them goes in the (b, width) response layout, flattened
    rows: int  # b
    width: int  # the micro-batch's longest response (>= 1)
    # layout "row": the documents' boundaries in the row, (samples + 1,) int32, and the longest, as transformers'
    # flash-attention path and ``model.attention``'s sdpa_varlen read them (no device sync to find them)
    cu_seqlens: torch.Tensor | None = None
    max_length: int = 0

    @classmethod
    def build(
        cls, prompt: list[int], response: list[int], width_p: int, width_r: int, layout: PackLayout = "row"
    ) -> PackedRows:
        """``prompt`` / ``response``: the rows' lengths; ``width_p`` / ``width_r``: the batch's prompt and response
        columns (prompts are left-padded to ``width_p``, responses right-padded); ``layout``: see ``PackLayout``."""
        from rlfactory.data.packing import document_positions

        lengths = [n_p + n_r for n_p, n_r in zip(prompt, response, strict=True)]
        bins = [list(range(len(lengths)))] if layout != "rows" else first_fit(lengths)
        row_len = max((sum(lengths[i] for i in b) for b in bins), default=0)
        if layout == "rows":
            row_len = round_up(max(row_len, 1), ALIGN_COLUMNS)
        gather, keep, place, positions = [], [], [], []
        width = max(1, *response) if response else 1
        for index, members in enumerate(bins):
            start = index * row_len
            for row in members:
                n_p, n_r = prompt[row], response[row]
                first = row * (width_p + width_r) + width_p - n_p
                gather.append(torch.arange(first, first + n_p + n_r))
                keep.append(torch.arange(start + n_p - 1, start + n_p + n_r - 1))  # position t predicts token t + 1
                place.append(torch.arange(row * width, row * width + n_r))
                start += n_p + n_r
            tail = (index + 1) * row_len - start  # a row's tail: token 0's id, its own positions, never read
            gather.append(torch.zeros(tail, dtype=torch.long))
            positions.append(document_positions([lengths[i] for i in members] + ([tail] if tail else [])))
        cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        position_ids = torch.stack(positions) if positions else torch.zeros((1, 0), dtype=torch.long)
        cu_seqlens = document_boundaries(lengths)["cu_seq_lens_q"] if layout != "rows" and lengths else None
        return cls(
            cat(gather), position_ids, cat(keep), cat(place), len(prompt), width, cu_seqlens, max(lengths, default=0)
        )

    def to(self, device: torch.device | str) -> PackedRows:
        pinned = lambda t: (t.pin_memory() if torch.device(device).type == "cuda" else t).to(device, non_blocking=True)
        return PackedRows(
            pinned(self.gather),
            pinned(self.position_ids),
            pinned(self.keep),
            pinned(self.place),
            self.rows,
            self.width,
            None if self.cu_seqlens is None else pinned(self.cu_seqlens),
            self.max_length,
        )

    def inputs(self, batch: Batch, rows: torch.Tensor) -> dict[str, Any]:
        """The packed rows' model inputs (no attention mask: the position ids separate the samples; one row also
        says where its documents start, for the varlen kernels)."""
        ids = batch.input_ids[rows].reshape(-1)[self.gather].view(self.position_ids.shape)
        inputs: dict[str, Any] = {"input_ids": ids, "position_ids": self.position_ids}
        if self.cu_seqlens is not None:
            boundaries = (self.cu_seqlens, self.cu_seqlens, self.max_length, self.max_length)
            inputs |= dict(zip(BOUNDARY_KEYS, boundaries, strict=True))
        return inputs

    def scatter(self, values: torch.Tensor, batch: Batch) -> torch.Tensor:
        """(K,) per response token -> (b, R) in the batch's response layout, zeros elsewhere (differentiable)."""
        out = values.new_zeros(self.rows * self.width).index_put((self.place,), values)
        return F.pad(out.view(self.rows, self.width), (0, batch.responses.shape[1] - self.width))


def host_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Each row's prompt and response length, read from the device once (one sync per pass, not per micro-batch)."""
    width_p = batch.input_ids.shape[1] - batch.responses.shape[1]
    prompt, response = torch.stack([batch.attention_mask[:, :width_p].sum(-1), batch.response_length.long()]).tolist()
    return prompt, response


def packed_micro_batch(
    batch: Batch, prompt: list[int], response: list[int], rows: list[int], layout: PackLayout = "row"
) -> PackedRows:
    """The micro-batch ``rows`` (host-side indices; ``prompt`` / ``response``: every row's lengths), packed in
    ``layout``, on the batch's device."""
    width_r = batch.responses.shape[1]
    lengths = [prompt[i] for i in rows], [response[i] for i in rows]
    packed = PackedRows.build(*lengths, batch.input_ids.shape[1] - width_r, width_r, layout)
    return packed.to(batch.responses.device)
