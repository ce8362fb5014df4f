"""DoRA, rsLoRA, PiSSA/OLoRA and QLoRA through `lora:` and `model.quantization`: the peft/transformers configs they
build, what each refuses, PiSSA's start and its saved (converted) adapter, a DoRA run that learns, and QLoRA's
clear refusal on a machine without CUDA or bitsandbytes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from tests.conftest import ROOT, TINY_MODEL, expect_train_error, run_cli, write_yaml

from rlfactory.config.schema import FreezeConfig, LoraConfig, ModelConfig, PipelineConfig, QuantizationConfig, RunConfig
from rlfactory.errors import UserError
from rlfactory.model.loader import bnb_loading, check_adapter, load_model, peft_lora_config, save_model

IDS = torch.tensor([[5, 17, 300, 42, 7, 99, 12, 250, 3]])
BASE_RUN = {"model": {"name_or_path": "m"}, "data": {"dataset": ["d"]}}
GRPO = {**BASE_RUN, "stage": "grpo", "reward": {"functions": ["answer_match"]}}


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({}, {"use_dora": False, "use_rslora": False, "init_lora_weights": True}),
        ({"use_dora": True, "use_rslora": True}, {"use_dora": True, "use_rslora": True, "init_lora_weights": True}),
        ({"init_lora_weights": "false"}, {"init_lora_weights": False}),
        ({"init_lora_weights": "Gaussian"}, {"init_lora_weights": "gaussian"}),
        ({"init_lora_weights": "pissa_niter_16"}, {"init_lora_weights": "pissa_niter_16"}),
        ({"init_lora_weights": "olora"}, {"init_lora_weights": "olora"}),
        ({"init_lora_weights": "orthogonal", "r": 8}, {"init_lora_weights": "orthogonal"}),
    ],
)
def test_lora_keys_build_the_peft_config(keys, expected):
    peft_config = peft_lora_config(LoraConfig(**keys))
    assert {k: getattr(peft_config, k) for k in expected} == expected
    assert peft_config.task_type == "CAUSAL_LM" and peft_config.r == keys.get("r", 8)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"init_lora_weights": "eva"}, "'eva' is not supported: EVA initialises from activations"),
        ({"init_lora_weights": "loftq"}, "'loftq' is not supported"),
        ({"init_lora_weights": "pisa"}, "'pisa' is not an initialisation; use true, false, gaussian"),
        ({"init_lora_weights": "pissa_niter_x"}, "or pissa_niter_N (N >= 0)"),
        ({"init_lora_weights": "orthogonal", "r": 5}, "orthogonal needs an even r (r is 5)"),
        ({"init_lora_weights": "pissa", "use_dora": True}, "use_dora with init_lora_weights: pissa"),
    ],
)
def test_lora_values_are_refused_with_the_fix(keys, message):
    with pytest.raises(ValidationError) as info:
        LoraConfig(**keys)
    assert message in str(info.value)


def _vllm(lora: dict, sync: str, **model) -> dict:
    return {**GRPO, "model": {"name_or_path": "m", **model}, "lora": lora,
            "rollout": {"backend": "vllm", "lora_sync": sync}}


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_vllm({"use_dora": True}, "adapter"), "lora_sync: adapter cannot serve lora.use_dora (vLLM serves no DoRA"),
        (_vllm({"init_lora_weights": "pissa"}, "adapter"), "belongs to the residual base"),
        (_vllm({}, "merged", quantization={"bits": 4}), "rollout.lora_sync: merged with model.quantization"),
        (_vllm({"use_dora": True}, "adapter", quantization={"bits": 4}), "syncs the adapter alone, which lora.use_"),
        ({**BASE_RUN, "stage": "sft", "model": {"name_or_path": "m", "finetuning": "full", "quantization": {}}},
         "cannot be trained with finetuning: full"),
        ({**BASE_RUN, "stage": "sft", "model": {"name_or_path": "m", "quantization": {}, "adapter_paths": ["a"]}},
         "merge first (`rlfactory export ADAPTER --to DIR`)"),
        ({**BASE_RUN, "stage": "rm", "model": {"name_or_path": "m", "quantization": {}}},
         "model.quantization is not supported for stage rm yet"),
        ({**BASE_RUN, "stage": "sft", "model": {"name_or_path": "m", "quantization": {"bits": 8, "quant_type": "fp4"}}},
         "quant_type: for bits: 4 only"),
        ({**BASE_RUN, "stage": "sft", "lora": {"init_lora_weights": "olora"}, "distributed": {"strategy": "fsdp2"}},
         "converting the adapter back to the original base at save needs it whole"),
        ({**BASE_RUN, "stage": "sft", "model": {"name_or_path": "m", "quantization": {}},
          "distributed": {"strategy": "zero3"}}, "bitsandbytes weights are not sharded here"),
        ({**BASE_RUN, "stage": "sft", "model": {"name_or_path": "m", "quantization": {}},
          "lora": {"init_lora_weights": "pissa_niter_4"}}, "pissa_niter_4 with model.quantization: the initialis"),
    ],
)
def test_combinations_that_cannot_work_are_refused(cfg, message):
    with pytest.raises(ValidationError) as info:
        RunConfig(**cfg)
    assert message in str(info.value)


def test_combinations_that_work_validate():
    assert RunConfig(**_vllm({"use_dora": True}, "merged")).lora.use_dora
    assert RunConfig(**_vllm({"init_lora_weights": "olora"}, "merged")).lora.changes_base()
    run = RunConfig(**_vllm({"use_rslora": True}, "adapter", quantization={"bits": 4}))
    assert run.model.quantization == QuantizationConfig(bits=4, quant_type="nf4", double_quant=True)
    for stage in ("sft", "dpo", "kto", "orpo"):
        RunConfig(**{**BASE_RUN, "stage": stage, "model": {"name_or_path": "m", "quantization": {"bits": 8}},
                     **({"train": {"per_device_batch_size": 2}} if stage == "kto" else {})})
    with pytest.raises(ValidationError, match="saves an adapter, which would be merged into the quantized base"):
        PipelineConfig(stages=[{**BASE_RUN, "stage": "sft", "name": "a"},
                               {**BASE_RUN, "stage": "dpo", "model": {"from_stage": "a", "quantization": {}}}])


def test_quantization_builds_transformers_bitsandbytes_config():
    four = bnb_loading(QuantizationConfig(bits=4, quant_type="fp4", double_quant=False, compute_dtype="float16"))
    q = four["quantization_config"]
    assert q.load_in_4bit and not q.load_in_8bit and q.bnb_4bit_quant_type == "fp4"
    assert q.bnb_4bit_use_double_quant is False and q.bnb_4bit_compute_dtype == torch.float16
    assert four["dtype"] == torch.float16 and four["device_map"] == {"": 0}
    eight = bnb_loading(QuantizationConfig(bits=8))
    assert eight["quantization_config"].load_in_8bit and "dtype" not in eight


def test_pissa_starts_at_the_base_and_saves_a_plain_lora_of_the_trained_model(tmp_path):
    from rlfactory.model.reference import build_reference
    from rlfactory.use.export import export

    base = load_model(ModelConfig(name_or_path=str(TINY_MODEL)), LoraConfig(), FreezeConfig(), trainable=False)
    with torch.no_grad():
        base_logits = base(IDS).logits
        lora = LoraConfig(r=4, init_lora_weights="pissa_niter_4")
        model = load_model(ModelConfig(name_or_path=str(TINY_MODEL)), lora, FreezeConfig())
        assert torch.allclose(model(IDS).logits, base_logits, atol=1e-4)  # the residual is folded into the base
        with model.disable_adapter():  # ... so without the adapter it is not the model: the reference is a copy
            assert (model(IDS).logits - base_logits).abs().max() > 1
        run = RunConfig(**{**BASE_RUN, "stage": "dpo", "model": {"name_or_path": str(TINY_MODEL)}, "lora": lora})
        reference = build_reference(run, model)
        assert reference.is_copy
        with reference.weights() as ref_model:
            assert torch.allclose(ref_model(IDS).logits, base_logits, atol=1e-5)
        for param in model.parameters():  # a stand-in for training: every adapter weight moves
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
        trained = model(IDS).logits
        assert (trained - base_logits).abs().max() > 0.1
        tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(str(TINY_MODEL))
        save_model(model, tokenizer, tmp_path / "adapter", state_dict=model.state_dict())  # the engine's call
        saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert saved["r"] == 8 and saved["init_lora_weights"] is True  # converted: rank 2r, on the original base
        reloaded = load_model(ModelConfig(name_or_path=str(TINY_MODEL), adapter_paths=[str(tmp_path / "adapter")]),
                              LoraConfig(), FreezeConfig(), trainable=False)
        assert torch.allclose(reloaded(IDS).logits, trained, atol=1e-4)
    export(str(tmp_path / "adapter"), str(tmp_path / "merged"), base=str(TINY_MODEL))
    merged = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        assert torch.allclose(merged(IDS).logits, trained, atol=1e-4)


def test_an_unconverted_pissa_adapter_is_refused(tmp_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL))
    get_peft_model(model, PeftLoraConfig(r=2, init_lora_weights="pissa_niter_1")).save_pretrained(str(tmp_path))
    with pytest.raises(UserError, match="a pissa_niter_1 adapter saved without conversion: it fits only the residual"):
        check_adapter(str(tmp_path))


@pytest.mark.slow
def test_dora_rslora_sft_learns_and_exports_what_it_learned(tmp_path, sft_config):
    """16 examples seen 6 times: the training loss falls well below its start (DoRA's magnitudes and directions
    train), and the merged export generates what base + DoRA adapter generates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = {**sft_config, "lora": {"r": 4, "alpha": 8, "use_dora": True, "use_rslora": True},
           "data": {**sft_config["data"], "max_samples": 16},
           "train": {"max_steps": 12, "per_device_batch_size": 8, "learning_rate": 1e-2},
           "logging": {**sft_config["logging"], "logging_steps": 1}}
    result = run_cli("train", str(write_yaml(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    out = Path(cfg["output_dir"])
    losses = [json.loads(line)["loss"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 12 and sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["use_dora"] is True and adapter_cfg["use_rslora"] is True

    from rlfactory.use.export import export

    export(str(out), str(tmp_path / "merged"))
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    with torch.no_grad():
        dora = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(TINY_MODEL)), str(out))(IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))(IDS).logits
    assert tokenizer is not None and torch.allclose(merged, dora, atol=1e-4)


@pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None, reason="QLoRA can run here"
)
def test_qlora_without_cuda_or_bitsandbytes_is_one_clear_error(tmp_path, sft_config):
    cfg = {**sft_config, "model": {**sft_config["model"], "quantization": {"bits": 4}}}
    expect_train_error(tmp_path, cfg, "QLoRA needs a CUDA GPU and bitsandbytes: pip install bitsandbytes")
    check = run_cli("config", "check", "examples/sft/qwen2.5_7b_qlora.yaml", f"output_dir={tmp_path / 'o'}")
    assert check.returncode == 0, check.stderr
    assert "[sft] warning: on this machine, model.quantization: QLoRA needs a CUDA GPU and bitsandbytes" in check.stdout
    assert (ROOT / "examples/sft/qwen2.5_7b_qlora.yaml").read_text().count("quantization:") == 1


def test_wrapping_in_lora_shows_the_user_no_library_deprecation():
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model (a
    FutureWarning per process that no setting of ours or the user's can remove); the loader keeps it out of the
    run's output."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(ModelConfig(name_or_path=str(TINY_MODEL)), LoraConfig(), FreezeConfig())
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
