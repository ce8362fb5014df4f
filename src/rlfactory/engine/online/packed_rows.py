"""Padding-free micro-batches of rollouts (``rollout.packing``): :class:`PackedRows`, built on the host from the rows'
prompt and response lengths, turns a micro-batch of the padded :class:`RolloutBatch` into packed rows for the
forward passes of ``update`` and back to the (b, R) response layout (the contract is ``data.packing``'s module doc).
"""

from __future__ import annotations

import itertools
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
# "shared": one row in which samples of one prompt (a group, consecutive rows with equal prompt ids) hold that prompt
# once: a later sample's response attends to the first one's prompt keys (``kv_index``; sdpa_varlen only, see
# ``model.attention``), its positions continue from the prompt's end, and its first token is predicted from the
# prompt's last position. The same numbers, without computing a group's prompt once per sample.
PackLayout = Literal["row", "rows", "shared"] | None


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
    # (K,) flat positions of the packed rows holding each kept position's target token (None: the next position)
    targets: torch.Tensor | None = None
    # layout "shared": the row positions each key document reads, the key documents' boundaries and the longest
    kv_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_length_k: int = 0

    @classmethod
    def build(
        cls,
        prompt: list[int],
        response: list[int],
        width_p: int,
        width_r: int,
        layout: PackLayout = "row",
        prompt_of: list[int] | None = None,
    ) -> PackedRows:
        """``prompt`` / ``response``: the rows' lengths; ``width_p`` / ``width_r``: the batch's prompt and response
        columns (prompts are left-padded to ``width_p``, responses right-padded); ``layout``: see ``PackLayout``;
        ``prompt_of`` (layout "shared"): for each row, the first row with the same prompt."""
        from rlfactory.data.packing import document_positions

        if layout == "shared":
            return cls._shared(prompt, response, width_p, width_r, prompt_of or list(range(len(prompt))))
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

    @classmethod
    def _shared(
        cls, prompt: list[int], response: list[int], width_p: int, width_r: int, prompt_of: list[int]
    ) -> PackedRows:
        """Layout "shared" (see ``PackLayout``): each prompt once, at its first row; the later rows' responses as
        documents of their own whose keys are that prompt's and their own."""
        arange = lambda start, n: torch.arange(start, start + n)  # noqa: E731
        gather, keep, targets, place, positions, kv_index = [], [], [], [], [], []
        q_lengths, k_lengths = [], []
        width = max(1, *response) if response else 1
        hosts: dict[int, int] = {}  # a row's prompt -> where that prompt starts in the row
        start = 0
        for row, (n_p, n_r) in enumerate(zip(prompt, response, strict=True)):
            first = row * (width_p + width_r) + width_p - n_p  # the row's first prompt token in input_ids[rows]
            place.append(arange(row * width, n_r))
            host = hosts.get(prompt_of[row])
            if host is None:  # the prompt's first row: prompt + response, as layout "row" lays it out
                hosts[prompt_of[row]] = start
                gather.append(arange(first, n_p + n_r))
                kv_index.append(arange(start, n_p + n_r))
                keep.append(arange(start + n_p - 1, n_r))  # position t predicts token t + 1
                targets.append(arange(start + n_p, n_r))
                positions.append(arange(0, n_p + n_r))
                q_lengths.append(n_p + n_r)
                k_lengths.append(n_p + n_r)
                start += n_p + n_r
            elif n_r:  # the response alone; its first token is predicted from the shared prompt's last position
                gather.append(arange(first + n_p, n_r))
                kv_index += [arange(host, n_p), arange(start, n_r)]
                keep += [torch.tensor([host + n_p - 1]), arange(start, n_r - 1)]
                targets.append(arange(start, n_r))
                positions.append(arange(n_p, n_r))
                q_lengths.append(n_r)
                k_lengths.append(n_p + n_r)
                start += n_r
        cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # noqa: E731
        bounds = lambda lengths: torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)  # noqa: E731
        return cls(
            cat(gather),
            cat(positions)[None],
            cat(keep),
            cat(place),
            len(prompt),
            width,
            bounds(q_lengths),
            max(q_lengths, default=0),
            targets=cat(targets),
            kv_index=cat(kv_index),
            cu_seqlens_k=bounds(k_lengths),
            max_length_k=max(k_lengths, default=0),
        )

    def to(self, device: torch.device | str) -> PackedRows:
        pinned = lambda t: (t.pin_memory() if torch.device(device).type == "cuda" else t).to(device, non_blocking=True)
        maybe = lambda t: None if t is None else pinned(t)  # noqa: E731
        return PackedRows(
            pinned(self.gather),
            pinned(self.position_ids),
            pinned(self.keep),
            pinned(self.place),
            self.rows,
            self.width,
            maybe(self.cu_seqlens),
            self.max_length,
            maybe(self.targets),
            maybe(self.kv_index),
            maybe(self.cu_seqlens_k),
            self.max_length_k,
        )

    def target_ids(self, inputs: dict[str, Any]) -> torch.Tensor:
        """(1, K) the token each kept position predicts, read from the packed ``input_ids``."""
        where = self.keep + 1 if self.targets is None else self.targets
        return inputs["input_ids"].reshape(-1)[where][None]

    def inputs(self, batch: Batch, rows: torch.Tensor) -> dict[str, Any]:
        """The packed rows' model inputs (no attention mask: the position ids separate the samples; one row also
        says where its documents start, for the varlen kernels)."""
        ids = batch.input_ids[rows].reshape(-1)[self.gather].view(self.position_ids.shape)
        inputs: dict[str, Any] = {"input_ids": ids, "position_ids": self.position_ids}
        if self.kv_index is not None:
            boundaries = (self.cu_seqlens, self.cu_seqlens_k, self.max_length, self.max_length_k)
            inputs |= dict(zip(BOUNDARY_KEYS, boundaries, strict=True)) | {"kv_index": self.kv_index}
        elif self.cu_seqlens is not None:
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


def host_prompt_groups(batch: Batch) -> list[int]:
    """For each row, the first row of its run of consecutive rows with the same prompt (a group's samples are
    consecutive rows), read from the device in one sync: layout "shared"'s ``prompt_of``."""
    width_p = batch.input_ids.shape[1] - batch.responses.shape[1]
    prompts = torch.where(batch.attention_mask[:, :width_p].bool(), batch.input_ids[:, :width_p], -1)
    same = (prompts[1:] == prompts[:-1]).all(-1).tolist()
    prompt_of = [0] * len(prompts)
    for row, same_as_previous in enumerate(same, start=1):
        prompt_of[row] = prompt_of[row - 1] if same_as_previous else row
    return prompt_of


def packed_micro_batch(
    batch: Batch,
    prompt: list[int],
    response: list[int],
    rows: list[int],
    layout: PackLayout = "row",
    prompt_of: list[int] | None = None,
) -> PackedRows:
    """The micro-batch ``rows`` (host-side indices; ``prompt`` / ``response``: every row's lengths; ``prompt_of``:
    every row's prompt group, for layout "shared"), packed in ``layout``, on the batch's device."""
    width_r = batch.responses.shape[1]
    lengths = [prompt[i] for i in rows], [response[i] for i in rows]
    groups = [prompt_of[i] for i in rows] if prompt_of is not None else None
    packed = PackedRows.build(*lengths, batch.input_ids.shape[1] - width_r, width_r, layout, groups)
    return packed.to(batch.responses.device)
