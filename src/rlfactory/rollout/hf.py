"""Generation with transformers' ``generate`` (batched, KV cache): token ids in, token ids out.

Sampling settings are always passed explicitly (top_k 0, top_p 1, no repetition penalty unless
asked), so a checkpoint's ``generation_config.json`` (Qwen ships top_k=20, temperature 0.7,
repetition_penalty 1.05) can never silently change the distribution the rollouts come from:
the policy gradient assumes samples from the plain softmax at the configured temperature.
"""

from __future__ import annotations

from typing import Any

import torch

from rlfactory.rollout.base import Completion, SamplingParams


def _sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    # ignore_eos: a fixed length, as vLLM's ignore_eos (benchmarks on random weights)
    fixed = {"min_new_tokens": params.max_tokens} if params.ignore_eos else {}
    if params.temperature <= 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, **fixed}
    return {
        "do_sample": True,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 disables the warper
        "min_p": params.min_p,  # 0 is a no-op, and keeps a checkpoint's min_p out
        # a diverged policy's NaN logits would crash sampling ("probability tensor contains inf, nan"); with them
        # replaced, the step goes on and the loss check (engine.shared.NonFiniteGuard) stops the run with a message
        "remove_invalid_values": True,
        **fixed,
    }


def generate_kwargs(params: SamplingParams, stop_ids: list[int], pad_id: int | None) -> dict[str, Any]:
    """Every ``model.generate`` argument but the inputs: the sampling settings, stops and padding (also what
    ``rlfactory serve``'s HF server generates with, so a served reply samples as a rollout does)."""
    return {
        "max_new_tokens": params.max_tokens,
        "eos_token_id": stop_ids,
        "pad_token_id": pad_id,
        "repetition_penalty": 1.0,
        "use_cache": True,
        **_sampling_kwargs(params),
    }


class HFBackend:
    """Batched ``model.generate`` on the policy itself (so ``sync_weights`` has nothing to do)."""

    syncs_weights = False

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64, generate_kwargs: dict | None = None):
        """``generate_kwargs`` go to every ``model.generate`` call as they are (``rlfactory chat``: a streamer and a
        stopping criterion for Ctrl-C)."""
        from rlfactory.render.chat import stop_ids

        self.model = model
        self.batch_size = batch_size
        self.generate_kwargs = generate_kwargs or {}
        self.stop_ids = stop_ids(tokenizer)  # any of them ends a turn (harmony: <|return|> or <|call|>)
        self.pad_id = tokenizer.pad_token_id

    def sync_weights(self, model: Any) -> None:
        self.model = model

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Left-padded batches; each completion is cut right after its first end-of-turn token."""
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in chunk], device=device)
            attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                **generate_kwargs(params, self.stop_ids, self.pad_id),
                **self.generate_kwargs,
            )
            stops = set(self.stop_ids)
            for row in out[:, width:].tolist():
                end = next((i for i, token in enumerate(row) if token in stops), None)
                if end is not None:
                    completions.append(Completion(row[: end + 1], "stop"))
                else:
                    completions.append(Completion(row[: params.max_tokens], "length"))
        self.model.train(was_training)
        return completions


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
    """Completion token ids for each prompt (greedy by default); see :class:`HFBackend`."""
    backend = HFBackend(model, tokenizer, batch_size)
    params = SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    return [c.token_ids for c in backend.generate(prompts, params)]
