"""``model.reference.ReferencePolicy``: the one reference of dpo/kto and the RL stages.

The adapter-disabled LoRA policy must score exactly as the base model it was built on; a frozen copy moves to
the batch's device on first use; neither builds a graph; the adapter is back on after the block.
"""

from __future__ import annotations

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL

from rlfactory.config.loader import validate_config
from rlfactory.config.schema import LoraConfig, ModelConfig
from rlfactory.data.loader import load_examples
from rlfactory.model import reference
from rlfactory.model.loader import apply_lora, load_tokenizer
from rlfactory.model.reference import ReferencePolicy, build_reference
from rlfactory.stages import preference_data


def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()


def _cfg(finetuning: str = "lora") -> object:
    return validate_config(
        {"stage": "dpo", "model": {"name_or_path": str(TINY_MODEL), "finetuning": finetuning},
         "data": {"dataset": "arith_pref"}},
        "test",
    )


@pytest.fixture(scope="module")
def batch():
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    pairs = load_examples(["arith_pref_test"], "pairwise", str(DATA_DIR), max_samples=3)
    return preference_data.collate_pairs(tokenizer.pad_token_id)(preference_data.render_pairs(_cfg(), tokenizer, pairs))


@pytest.fixture(scope="module")
def lora_policy():
    """A LoRA policy whose adapter changes the outputs (B is zero at init, so it is filled here)."""
    policy = apply_lora(_base(), LoraConfig(r=4, alpha=8, dropout=0.0), gradient_checkpointing=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return policy


def test_adapter_disabled_scores_exactly_as_the_base_model(lora_policy, batch):
    ref = build_reference(_cfg(), lora_policy)
    assert not ref.is_copy and ref.policy is lora_policy
    with torch.no_grad():
        base_sums, base_means = preference_data.forward_logps(_base(), batch)  # a fresh base model
        adapted_before = preference_data.forward_logps(lora_policy, batch)[0]
    with ref.weights(torch.device("cpu")) as model:
        assert model is lora_policy and not torch.is_grad_enabled()
        sums, means = preference_data.forward_logps(model, batch)
    assert torch.equal(sums, base_sums) and torch.equal(means, base_means)
    assert not sums.requires_grad
    assert (adapted_before - base_sums).abs().max() > 1e-3  # the adapter matters: the check above is not vacuous
    adapted_after = preference_data.forward_logps(lora_policy, batch)[0]  # adapter back on, gradients back
    torch.testing.assert_close(adapted_after, adapted_before, rtol=0, atol=0)
    assert adapted_after.requires_grad


def test_reference_logps_equal_the_copy_run_by_hand(lora_policy, batch):
    """The stages' helper runs the forward on the reference weights, for a row prefix, without a graph."""
    copy = _base()
    got = preference_data.reference_logps(ReferencePolicy(lora_policy, copy), batch)
    with torch.no_grad():
        want = preference_data.forward_logps(copy, batch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not got[0].requires_grad


def test_a_frozen_copy_moves_to_the_device_on_first_use(lora_policy):
    copy = _base()
    ref = ReferencePolicy(lora_policy, copy)
    assert ref.is_copy
    with ref.weights("meta") as model:  # a device other than the host's, without an accelerator
        assert model is copy and not torch.is_grad_enabled()
    assert {p.device.type for p in copy.parameters()} == {"meta"}
    assert {p.device.type for p in lora_policy.parameters()} == {"cpu"}  # the policy stays where it is


def test_full_fine_tuning_loads_a_frozen_copy_and_lora_needs_none(monkeypatch, lora_policy):
    loaded: list[object] = []
    load = reference.load_frozen_copy
    monkeypatch.setattr(reference, "load_frozen_copy", lambda cfg, path=None: loaded.append(path) or load(cfg, path))
    full = build_reference(_cfg("full"), _base())
    assert full.is_copy and loaded == [None]
    assert not full.copy.training and not any(p.requires_grad for p in full.copy.parameters())
    named = build_reference(_cfg(), lora_policy, ref_path=str(TINY_MODEL))  # another model named: a copy
    assert named.is_copy and loaded == [None, str(TINY_MODEL)]
    assert not build_reference(_cfg(), lora_policy).is_copy and len(loaded) == 2
    with pytest.raises(ValueError, match="PEFT"):
        ReferencePolicy(_base())  # a full model cannot disable an adapter: it needs a copy
