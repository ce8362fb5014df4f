"""Generation with transformers' ``generate`` (batched, KV cache): token ids in, token ids out.

Sampling settings are always passed explicitly (top_k 0, top_p 1, no repetition penalty unless
asked), so a checkpoint's ``generation_config.json`` (Qwen ships top_k=20, temperature 0.7,
repetition_penalty 1.05) can never silently change the distribution the rollouts come from:
the policy gradient assumes samples from the plain softmax at the configured temperature.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
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
    # Layers compiled in place (train.torch_compile) would compile again for every cache state and length that
    # generation passes them (prefill, each decode length) until dynamo's recompile limit (8 per code object), and
    # from then on the training forward of the same layers runs eager too. Generation on the policy itself
    # therefore runs eager (``torch.compiler.set_stance``: process-wide, so not for a copy that generates in a
    # second thread while the policy trains -- CopyBackend's copy has no compiled layers anyway).
    eager_generation = True

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
        was_training = self.model.training
        self.model.eval()
        completions: list[Completion] = []
        stance = torch.compiler.set_stance("force_eager") if self.eager_generation else contextlib.nullcontext()
        with stance:
            for start in range(0, len(prompts), self.batch_size):
                completions += self._generate_batch(prompts[start : start + self.batch_size], params)
        self.model.train(was_training)
        return completions

    def _generate_batch(self, chunk: list[list[int]], params: SamplingParams, **extra: Any) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in chunk], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            **generate_kwargs(params, self.stop_ids, self.pad_id),
            **self.generate_kwargs,
            **extra,
        )
        stops = set(self.stop_ids)
        completions = []
        for row in out[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in stops), None)
            if end is not None:
                completions.append(Completion(row[: end + 1], "stop"))
            else:
                completions.append(Completion(row[: params.max_tokens], "length"))
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


class PrivateSampling:
    """A logits processor that samples itself, from its own ``torch.Generator``, and keeps each sampled token's
    log-prob; generate then runs greedy (``do_sample=False``) and its argmax takes the token chosen here.

    Why by hand: transformers' ``generate`` samples with ``torch.multinomial`` on torch's one global generator and
    takes no generator of its own. A sampler running in a second thread (``rollout.overlap``) would then share it with
    the update on the main thread, and which draw lands where would depend on timing. It also returns no per-token
    log-probs short of keeping every step's (B, V) scores. Here the warpers are transformers' own, in the order
    ``generate`` applies them (temperature, top-k, top-p, min-p), so the distribution is the one ``do_sample=True``
    samples from; the log-prob kept is that distribution's (as vLLM's ``processed_logprobs``). It must run last:
    generate appends a caller's processors after its own (min_new_tokens, invalid-value removal)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator):
        from transformers.generation.logits_process import (
            InfNanRemoveLogitsProcessor,
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.greedy = params.temperature <= 0
        # a diverged policy's NaN logits: replaced, as generate's remove_invalid_values does (see _sampling_kwargs)
        self.warpers: list[Any] = [InfNanRemoveLogitsProcessor()]
        if not self.greedy:
            self.warpers.append(TemperatureLogitsWarper(params.temperature))
        if not self.greedy and params.top_k:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if not self.greedy and params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))
        if not self.greedy and params.min_p > 0:
            self.warpers.append(MinPLogitsWarper(params.min_p))
        self.generator = generator
        self.logprobs: list[torch.Tensor] = []  # per generated position: (B,) log-prob of the token taken

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        logprobs = scores.float().log_softmax(-1)
        if self.greedy:
            tokens = logprobs.argmax(-1)
        else:
            tokens = torch.multinomial(logprobs.exp(), 1, generator=self.generator)[:, 0]
        self.logprobs.append(logprobs.gather(-1, tokens[:, None])[:, 0])
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter_(-1, tokens[:, None], 0.0)


def copy_for_sampling(model: Any) -> Any:
    """A copy of ``model`` that generates while the original trains: its trained parameters are its own, its frozen
    ones (a LoRA policy's whole base) are the original's tensors, shared, so a LoRA copy costs the adapter only.

    Layers compiled in place (``train.torch_compile``) keep a compiled call bound to the original layer; the copy
    drops it and runs eager, so it never calls the original's weights."""
    import copy

    shared = {id(p): p for p in model.parameters() if not p.requires_grad}
    clone = copy.deepcopy(model, memo=shared)
    for module in clone.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone.eval()


class CopyBackend(HFBackend):
    """``generate`` on a copy of the policy (``copy_for_sampling``) that the loop syncs after each update, so that a
    second thread can generate the next step's rollouts while the policy trains (``rollout.overlap``). It samples
    from its own generator (``PrivateSampling``: seeded, so a run samples the same whatever the threads' timing) and
    returns the sampler's log-prob of every token: what the importance-sampling correction and the sampler/trainer
    mismatch metrics compare with the trainer's."""

    syncs_weights = True
    eager_generation = False  # the copy has no compiled layers, and the policy may be training in the other thread

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64, seed: int = 0):
        super().__init__(copy_for_sampling(model), tokenizer, batch_size)
        device = next(self.model.parameters()).device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def sync_weights(self, model: Any) -> None:
        """The policy's trained parameters into the copy (by name; the frozen ones are shared already)."""
        own = dict(self.model.named_parameters())
        for name, param in model.named_parameters():
            if param.requires_grad:
                own[name].copy_(param)

    def _generate_batch(self, chunk: list[list[int]], params: SamplingParams, **extra: Any) -> list[Completion]:
        from transformers import LogitsProcessorList

        sampling = PrivateSampling(params, self.generator)
        greedy = replace(params, temperature=0)  # generate's argmax takes the token PrivateSampling chose
        completions = super()._generate_batch(chunk, greedy, logits_processor=LogitsProcessorList([sampling]), **extra)
        taken = torch.stack(sampling.logprobs, 1).tolist()  # (b, steps); generate may have run past a stop
        return [replace(c, logprobs=row[: len(c.token_ids)]) for c, row in zip(completions, taken, strict=True)]
