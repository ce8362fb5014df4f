"""Fitting rendered rows into a token budget (``data.cutoff_len``), and counting what that changed.

``infer_seqlen`` splits a budget between a source (prompt) and a target (response) as LLaMA-Factory does
(``data/processor/processor_utils.py``): a short target is kept whole and the source cut; a short source is kept
whole and the target cut; when both are long, each keeps a share proportional to its length. Every stage
shortens rows with it (or drops them with ``data.truncation: drop``) and records the outcome in a ``FitCounts``,
which the stage logs and ``rlfactory config check`` prints, so nothing is shortened or dropped silently.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """(source, target) lengths that fit ``cutoff_len``, split the way LLaMA-Factory splits them.

    >>> infer_seqlen(10, 20, 100)   # fits: unchanged
    (10, 20)
    >>> infer_seqlen(300, 20, 100)  # short target kept whole, source cut
    (80, 20)
    >>> infer_seqlen(20, 300, 100)  # short source kept whole, target cut
    (20, 80)
    >>> infer_seqlen(100, 300, 100) # both long: shares in proportion (25 / 75)
    (25, 75)
    """
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


@dataclass
class FitCounts:
    """How many rows a stage kept whole, shortened, or dropped (by reason), against which limit."""

    limit: str  # e.g. "data.cutoff_len=1024"
    kept: int = 0
    shortened: int = 0
    dropped: Counter = field(default_factory=Counter)

    def drop(self, reason: str) -> None:
        self.dropped[reason] += 1

    @property
    def total(self) -> int:
        return self.kept + self.shortened + sum(self.dropped.values())

    def summary(self) -> str:
        """One line: 'after data.cutoff_len=64: 290 of 300 kept (12 shortened), 10 dropped (reason)'."""
        used = self.kept + self.shortened
        line = f"after {self.limit}: {used} of {self.total} kept ({self.shortened} shortened)"
        for reason, n in sorted(self.dropped.items()):
            line += f", {n} dropped ({reason})"
        return line

    def report(self, what: str) -> None:
        """Log the summary when anything was shortened or dropped."""
        if self.shortened or self.dropped:
            log.warning("%s %s", what, self.summary())


def _trained(segments: list, train_on: str, train_from: int) -> list[bool]:
    """Which segments carry loss: ``all`` tokens, every assistant turn, or only the last; never a turn before
    ``train_from`` (the prompt of a prompt-completion row)."""
    turns = [i for i, s in enumerate(segments) if s.trainable and s.message_index >= train_from]
    if train_on == "all":
        return [True] * len(segments)
    chosen = set(turns[-1:] if train_on == "last_assistant" else turns)
    return [i in chosen for i in range(len(segments))]


def _pairs(segments: list) -> list[tuple[list[int], list[int], bool]]:
    """(source ids, target ids, target trained?) per assistant turn; trailing glue is a source without a target."""
    pairs, source = [], []
    for segment in segments:
        if segment.trainable:
            pairs.append((source, list(segment.ids), True))
            source = []
        else:
            source = source + list(segment.ids)
    if source:
        pairs.append((source, [], False))
    return pairs


def sft_item(
    segments: list, train_on: str, cutoff_len: int | None, truncation: str, train_from: int = 0
) -> tuple[dict[str, list[int]] | None, str]:
    """(input_ids + labels, outcome) of a rendered conversation; outcome is ``kept``, ``shortened`` or why
    it was dropped (the item is then None).

    Too long with ``truncation: right``: each turn in order gets what is left of the budget, split between its
    prompt (``source``) and its response (``target``) by ``infer_seqlen``; the prompt keeps its end (next to the
    response), the response its start; turns past the budget are left out.
    """
    flags = _trained(segments, train_on, train_from)
    total = sum(len(s.ids) for s in segments)
    fits = cutoff_len is None or total <= cutoff_len
    if not fits and truncation == "drop":
        return None, "longer than the limit (data.truncation: drop)"
    input_ids: list[int] = []
    labels: list[int] = []
    if fits:
        for segment, trained in zip(segments, flags, strict=True):
            input_ids += segment.ids
            labels += segment.ids if trained else [-100] * len(segment.ids)
    else:
        assert cutoff_len is not None
        trained_iter = iter(f for s, f in zip(segments, flags, strict=True) if s.trainable)
        glue_trained = train_on == "all"
        for source, target, has_target in _pairs(segments):
            room = cutoff_len - len(input_ids)
            if room <= 0:
                break
            keep_source, keep_target = infer_seqlen(len(source), len(target), room)
            source, target = source[len(source) - keep_source :], target[:keep_target]
            target_trained = next(trained_iter) if has_target else False
            input_ids += source + target
            labels += (source if glue_trained else [-100] * len(source)) + (
                target if target_trained else [-100] * len(target)
            )
    if all(label == -100 for label in labels[1:]):
        return None, "no trained token left within the limit"
    return {"input_ids": input_ids, "labels": labels}, "kept" if fits else "shortened"
