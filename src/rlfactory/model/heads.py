"""Reward-model head: a sequence-classification model with one output (the ``score`` head) on a base LM.

Stage ``rm`` trains it; ppo/grpo use :func:`load_reward_model` and :func:`score_ids` as a reward source.
The reward of a sequence is the score at its last non-pad token, which is how transformers'
``*ForSequenceClassification`` pools (right or left padding), so training and inference agree.
The saved directory is a plain transformers checkpoint: ``AutoModelForSequenceClassification.from_pretrained``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rlfactory.config.schema import RunConfig
from rlfactory.errors import UserError, first_line, model_read_errors
from rlfactory.model.loader import (
    apply_freeze,
    check_model_exists,
    merge_adapter,
    peft_lora_config,
    resolve_dtype,
    wrap_lora,
)

log = logging.getLogger(__name__)

SCORE_HEAD = "score"  # name of the head in transformers' *ForSequenceClassification


def load_reward_model_for_training(cfg: RunConfig, pad_token_id: int) -> Any:
    """Base LM + a fresh 1-output score head, with LoRA (head trained in full), freeze or full fine-tuning."""
    from transformers import AutoModelForSequenceClassification

    from rlfactory.model.attention import attention_implementation, resolved_attention

    path = str(cfg.model.name_or_path)
    check_model_exists(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path,
            num_labels=1,
            pad_token_id=pad_token_id,
            dtype=resolve_dtype(cfg.model.dtype),
            attn_implementation=attention_implementation(resolved_attention(cfg.model)),
            trust_remote_code=cfg.model.trust_remote_code,
        )
    except model_read_errors() as exc:
        raise UserError(f"cannot load '{path}' as a reward model: {first_line(exc)}") from None
    model.config.pad_token_id = pad_token_id  # pooling finds the last non-pad token with it
    for adapter in cfg.model.adapter_paths:
        model = merge_adapter(model, adapter)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.model.finetuning == "lora":
        return _apply_lora(model, cfg)
    if cfg.model.finetuning == "freeze":
        extra = [*cfg.freeze.extra_modules, SCORE_HEAD]
        apply_freeze(model, cfg.freeze.model_copy(update={"extra_modules": extra}))
    return model


def _apply_lora(model: Any, cfg: RunConfig) -> Any:
    """LoRA of task SEQ_CLS: PEFT then trains and saves the new ``score`` head in full (modules_to_save)."""
    if cfg.model.gradient_checkpointing:
        model.enable_input_require_grads()
    modules = sorted({*cfg.lora.modules_to_save, SCORE_HEAD})
    return wrap_lora(model, peft_lora_config(cfg.lora, "SEQ_CLS", modules), cfg.lora)


def merge_reward_model(model: Any) -> Any:
    """The model with a LoRA adapter merged into its weights (the score head included); others unchanged."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def save_reward_model(model: Any, tokenizer: Any, output_dir: str | Path) -> None:
    """Save a plain directory (merge LoRA first), removing adapter files the engine may have written there:
    transformers would otherwise load the directory as an adapter on top of its base model."""
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        Path(output_dir, name).unlink(missing_ok=True)
    model.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))


def load_reward_model(path: str | Path, device: str | torch.device | None = None, dtype: str = "auto") -> tuple:
    """(model, tokenizer) of a reward model saved by stage rm, in eval mode on ``device``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_model_exists(str(path))
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=resolve_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except model_read_errors() as exc:
        raise UserError(f"cannot load reward model '{path}': {first_line(exc)}") from None
    if model.config.num_labels != 1:
        raise UserError(f"'{path}' is not a reward model: it has {model.config.num_labels} outputs, not 1")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")), tokenizer


@torch.no_grad()
def score_ids(model: Any, sequences: list[list[int]], pad_id: int, batch_size: int = 16) -> torch.Tensor:
    """Rewards (N,) float32 on CPU for token-id sequences (e.g. prompt + response of a rollout)."""
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(chunk):
            ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq, dtype=torch.long), 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        scores.append(logits[:, 0].float().cpu())
    return torch.cat(scores) if scores else torch.zeros(0)


def score_texts(model: Any, tokenizer: Any, texts: list[str], batch_size: int = 16) -> list[float]:
    """Rewards of already rendered texts (as the chat template writes a conversation, no special tokens added)."""
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return score_ids(model, sequences, tokenizer.pad_token_id, batch_size).tolist()


def score_conversations(model: Any, tokenizer: Any, conversations: list[list[dict]], tools: list | None = None) -> list:
    """Rewards of message lists, rendered with the same segments as training (``render.chat``)."""
    from rlfactory.render.chat import render_segments

    sequences = [[t for seg in render_segments(tokenizer, conv, tools) for t in seg.ids] for conv in conversations]
    return score_ids(model, sequences, tokenizer.pad_token_id).tolist()
