"""Prompts + completions -> the padded tensors every online phase reads.

Layout (as verl): ``[left-padded prompt | response | right padding]``, width P + R, where P is the
longest prompt and R the longest response of the batch. Response positions are the same columns
P..P+R-1 in every row, so every per-token tensor of the algorithms is (B, R) and aligned:
``response_mask[i, t]`` is 1 where row i has a policy-produced token at response position t.
Padding has attention 0 and never enters a loss; position ids count only real tokens, so a
left-padded row computes exactly what the unpadded prompt would.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from rlfactory.data.packing import round_up
from rlfactory.rollout.base import Completion


@dataclass
class RolloutBatch:
    """The tensors of one online step, (B, P+R) for the model inputs and (B, R) per response token.

    ``pack_rollouts`` fills the first block; the step's phases fill the rest, each field by one named phase
    (``engine.online.phases``), so a reader can see from the type which phase has run.
    """

    input_ids: torch.Tensor  # (B, P+R)
    attention_mask: torch.Tensor  # (B, P+R)
    position_ids: torch.Tensor  # (B, P+R)
    responses: torch.Tensor  # (B, R) the response columns of input_ids
    response_mask: torch.Tensor  # (B, R) 1 on policy-produced tokens: rewards and advantages live here
    loss_mask: torch.Tensor  # (B, R) response_mask, minus truncated samples under rollout.mask_truncated
    response_length: torch.Tensor  # (B,) float
    truncated: torch.Tensor  # (B,) bool
    sampler_logprobs: torch.Tensor | None = None  # (B, R) from a separate sampler (vLLM); None: the policy sampled
    # phase outputs
    scores: torch.Tensor | None = None  # (B,) sequence rewards (reward phase)
    group: torch.Tensor | None = None  # (B,) prompt group ids (reward phase)
    ref_logprobs: torch.Tensor | None = None  # (B, R) reference policy (ref phase, with a KL term)
    old_logprobs: torch.Tensor | None = None  # (B, R) pi_old (old-logprob phase, > 1 update or in-reward KL)
    values: torch.Tensor | None = None  # (B, R) critic values (values phase, with a critic)
    token_rewards: torch.Tensor | None = None  # (B, R) advantage phase
    advantages: torch.Tensor | None = None  # (B, R) advantage phase
    returns: torch.Tensor | None = None  # (B, R) advantage phase

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: v.to(device) if v is not None else None for k, v in moved.items()})

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def pack_rollouts(
    prompts: list[list[int]],
    completions: list[Completion],
    pad_id: int,
    mask_truncated: bool = False,
    align_columns: int = 1,
) -> RolloutBatch:
    """The batch of B samples: input_ids, attention_mask, position_ids (B, P+R); responses, response_mask,
    loss_mask (B, R); response_length, truncated (B,); and sampler_logprobs (B, R) when every completion came
    with the sampler's log-probs (a separate sampler such as vLLM; its absence means "sampled by the policy").

    ``response_mask`` marks policy tokens (rewards and advantages are computed over it);
    ``loss_mask`` is the same, except that with ``mask_truncated`` samples that hit the length limit
    are all zeros (DAPO's overlong filtering): they still count in group statistics but add nothing
    to the loss. ``align_columns``: R is widened (with padding, out of every mask) until P + R is a multiple of it.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    width_p = max(len(p) for p in prompts)
    width_r = max(1, max(len(c.token_ids) for c in completions))
    width_r = round_up(width_p + width_r, align_columns) - width_p
    batch = len(prompts)
    input_ids = torch.full((batch, width_p + width_r), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    response_mask = torch.zeros((batch, width_r), dtype=torch.float32)
    sampler_logprobs = torch.zeros((batch, width_r), dtype=torch.float32)
    truncated = torch.tensor([c.finish_reason == "length" for c in completions])
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        n_p, n_r = len(prompt), len(completion.token_ids)
        input_ids[row, width_p - n_p : width_p] = torch.tensor(prompt)
        input_ids[row, width_p : width_p + n_r] = torch.tensor(completion.token_ids, dtype=torch.long)
        attention[row, width_p - n_p : width_p + n_r] = 1
        response_mask[row, :n_r] = torch.tensor(completion.policy_mask(), dtype=torch.float32)
        if completion.logprobs is not None:
            sampler_logprobs[row, :n_r] = torch.tensor(completion.logprobs)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        responses=input_ids[:, width_p:],
        response_mask=response_mask,
        loss_mask=response_mask * ~(truncated[:, None] & mask_truncated),
        response_length=torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32),
        truncated=truncated,
        sampler_logprobs=sampler_logprobs if all(c.logprobs is not None for c in completions) else None,
    )


def response_logits(logits: torch.Tensor, response_width: int) -> torch.Tensor:
    """Logits (B, P+R, V) -> the (B, R, V) slice that predicts the response tokens.

    Position t predicts token t+1, so the response token at column P + t is predicted at P + t - 1.
    """
    width = logits.shape[1]
    return logits[:, width - response_width - 1 : width - 1]
