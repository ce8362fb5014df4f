"""Generation with transformers' ``generate`` (batched, KV cache): token ids in, token ids out."""

from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def generate_ids(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 32,
) -> list[list[int]]:
    """Completion token ids for each prompt (left-padded batches; cut after the end-of-turn token)."""
    from rlfactory.render.chat import end_of_turn

    stop_id = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))
    pad_id = tokenizer.pad_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    completions: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k or None}
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_id,
            pad_token_id=pad_id,
            **(sampling if temperature > 0 else {"do_sample": False}),
        )
        for row in out[:, width:].tolist():
            completions.append(row[: row.index(stop_id) + 1] if stop_id in row else row)
    model.train(was_training)
    return completions
