"""``model.adapters``: PEFT's adapter switches without a walk over the model on every use.

The switches must do what PEFT's own context managers do (the same outputs as ``disable_adapter()``, modules_to_save
included; the same flags as ``disable_input_dtype_casting``), restore each layer's own state, nest, and find the
layers only once per model (the walk is what made them slow: about 60 ms of host time per dpo micro-batch on an H200).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM, Qwen2Config

from rlfactory.model.adapters import adapter_layers, adapters_off, input_casting_off


def _policy(**lora: object):
    """A 2-layer Qwen2 in float64 with LoRA on every linear layer, its B matrices filled (zero at init)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
            if "modules_to_save" in name:
                param.add_(0.1)  # the trained copy differs from the original head
    return policy


IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("lora", [{}, {"modules_to_save": ["lm_head"]}], ids=["lora", "lora+modules_to_save"])
def test_adapters_off_scores_exactly_as_peft_disable_adapter(lora):
    policy = _policy(**lora)
    adapted = _logits(policy)
    with policy.disable_adapter():
        peft_base = _logits(policy)
    with adapters_off(policy):
        ours = _logits(policy)
    assert not torch.equal(adapted, peft_base)  # the adapter (and the trained head) change the outputs
    assert torch.equal(ours, peft_base)
    assert torch.equal(_logits(policy), adapted)  # on again after the block
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)


def test_adapters_off_nests_and_restores_each_layers_own_state():
    policy = _policy()
    layers = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
    layers[0]._disable_adapters = True  # a layer the user switched off stays off
    with adapters_off(policy):
        with adapters_off(policy):
            assert all(layer.disable_adapters for layer in layers)
        assert all(layer.disable_adapters for layer in layers)
    assert layers[0].disable_adapters and not any(layer.disable_adapters for layer in layers[1:])
    with pytest.raises(RuntimeError), adapters_off(policy):
        raise RuntimeError("a failed forward")
    assert not any(layer.disable_adapters for layer in layers[1:])  # restored after an error too


def test_input_casting_off_sets_the_flags_peft_sets():
    policy = _policy()
    layers = [m for m in policy.modules() if isinstance(m, BaseTunerLayer)]
    with disable_input_dtype_casting(policy):
        peft_flags = [layer.cast_input_dtype_enabled for layer in layers]
    with input_casting_off(policy):
        ours = [layer.cast_input_dtype_enabled for layer in layers]
    assert ours == peft_flags == [False] * len(layers)
    assert all(layer.cast_input_dtype_enabled for layer in layers)


def test_the_layers_are_found_once_per_model(monkeypatch):
    policy = _policy()
    found = adapter_layers(policy)
    assert len(found) == 2 * 7  # q k v o gate up down in each of the 2 layers

    def walk(*_a, **_k):
        raise AssertionError("walked the model again")

    monkeypatch.setattr(type(policy), "modules", walk)
    with adapters_off(policy), input_casting_off(policy):
        pass
    assert adapter_layers(policy) is found


def test_a_warm_micro_batch_walks_no_module_tree(monkeypatch):
    """A dpo LoRA micro-batch as the engine runs it under bf16 autocast -- the reference's forward in
    ``ReferencePolicy.weights``, the policy's forward in ``autocast_forward``, its backward through
    ``engine.shared.backward`` -- walks none of the model's module trees once warm. Each walk was host time in which
    the GPU waited: PEFT's switches walked on every entry and exit, Accelerate's ``unwrap_model`` once per use."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from rlfactory.engine.shared import autocast_forward, backward
    from rlfactory.model.reference import ReferencePolicy

    policy = _policy().float()
    reference = ReferencePolicy(policy)
    size = len(list(policy.modules()))
    walks: list[str] = []
    named_modules = torch.nn.Module.named_modules

    def counted(self, *args, **kwargs):
        yielded = 0
        try:
            for item in named_modules(self, *args, **kwargs):
                yielded += 1
                yield item
        finally:
            if yielded > size // 2:  # a whole tree (a lazy next(model.parameters()) takes one module)
                walks.append(type(self).__name__)

    def micro_batch() -> None:
        with reference.weights("cpu") as model:
            model(input_ids=IDS)
        with autocast_forward(accelerator, policy):
            loss = policy(input_ids=IDS).logits.float().sum()
        backward(accelerator, policy, loss)

    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: bf16 only for this test
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    try:
        micro_batch()  # warm: the adapter layers are found here
        monkeypatch.setattr(torch.nn.Module, "named_modules", counted)
        micro_batch()
        micro_batch()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert walks == []
