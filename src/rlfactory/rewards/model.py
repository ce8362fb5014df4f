"""A reward model (sequence classifier trained by stage rm) as a reward component.

The reward model may have its own tokenizer, so it cannot score the policy's token ids: each
sample is re-rendered with the reward model's tokenizer through the rendering path stage rm trains
on (prompt messages + the completion as an assistant turn), and scored at its last token
(``rlfactory.model.heads``).
"""

from __future__ import annotations

import logging
from typing import Any

from rlfactory.rewards.stack import Sample

log = logging.getLogger(__name__)


class RewardModelScorer:
    """Callable ``list[Sample] -> list[float]`` around a reward-model directory."""

    def __init__(self, path: str, device: Any, batch_size: int = 32):
        from rlfactory.model.heads import load_reward_model

        self.model, self.tokenizer = load_reward_model(path, device)
        self.model.requires_grad_(False)
        self.batch_size = batch_size
        log.info("reward model: %s", path)

    def __call__(self, samples: list[Sample]) -> list[float]:
        from rlfactory.model.heads import score_conversations

        scores: list[float] = [0.0] * len(samples)
        by_tools: dict[str, list[int]] = {}  # one rendering call per distinct tool list
        for i, sample in enumerate(samples):
            by_tools.setdefault(repr(sample.example.get("tools")), []).append(i)
        for rows in by_tools.values():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                conversations = [
                    samples[i].example["messages"] + [{"role": "assistant", "content": samples[i].completion}]
                    for i in chunk
                ]
                tools = samples[chunk[0]].example.get("tools")
                chunk_scores = score_conversations(self.model, self.tokenizer, conversations, tools)
                for i, score in zip(chunk, chunk_scores, strict=True):
                    scores[i] = float(score)
        return scores
