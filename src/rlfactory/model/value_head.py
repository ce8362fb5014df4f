"""The PPO critic: a separate value model = a causal LM's trunk + a scalar head per token.

Why separate (not a head on the policy's trunk): the critic gets its own optimizer, learning rate
and warmup, its loss never scales the policy gradient (no ``vf_coef`` to tune), and the policy
stays a plain causal LM that saves, merges and exports like every other stage's output. The cost is
a second trunk in memory; with LoRA only its adapter and head are trained.

The trunk is the decoder of ``AutoModelForCausalLM`` (``get_decoder()``), loaded through the same
loader as the policy (adapters merged, LoRA / full / freeze applied), so the LM head is never run:
values come from the final hidden states (B, T, H) through ``value_head`` (H -> 1).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfactory.config.schema import RunConfig

log = logging.getLogger(__name__)

HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """values = head(decoder(input_ids)) -> (B, T) float32. ``lm`` is the (possibly PEFT) causal LM."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size if hasattr(lm.config, "hidden_size") else lm.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)  # V = 0 at the start: no random early baseline
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, **attention: Any
    ) -> torch.Tensor:
        """``attention``: a packed row's document boundaries for the varlen kernels (``PackedRows.inputs``)."""
        decoder = self.lm.get_decoder()
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **attention
        ).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


def load_value_model(cfg: RunConfig) -> ValueModel:
    """The critic from ``critic.model_path`` (default: the policy's starting model), fine-tuned like the policy."""
    from rlfactory.model.loader import load_model

    assert cfg.critic is not None
    model_cfg = cfg.model
    if cfg.critic.model_path:
        model_cfg = model_cfg.model_copy(update={"name_or_path": cfg.critic.model_path, "adapter_paths": []})
    lm = load_model(model_cfg, cfg.lora, cfg.freeze, torch_compile=cfg.train.torch_compile)
    critic = ValueModel(lm)  # the head stays float32 whatever the trunk's dtype
    log.info("critic: value model on %s", model_cfg.name_or_path)
    return critic


def save_value_model(critic: ValueModel, output_dir: str | Path) -> None:
    """``<output_dir>``: the trunk as a normal HF dir (adapter or full) plus ``value_head.safetensors``."""
    from safetensors.torch import save_file

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    critic.lm.save_pretrained(str(output_dir), safe_serialization=True)
    save_file(
        {k: v.detach().contiguous() for k, v in critic.value_head.state_dict().items()},
        str(Path(output_dir) / HEAD_FILE),
    )
