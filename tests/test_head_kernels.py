"""LM-head kernel choices are a per-run value (``HeadKernels``), decided from the config and passed down.

Nothing is left in module state between runs in one process (the WebUI, the tests): a compiled run followed by
a default one gets the default kernels, and a machine that cannot compile falls back without touching them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL

from rlfactory.algos import common
from rlfactory.algos.common import HeadKernels
from rlfactory.config.loader import validate_config
from rlfactory.config.schema import ModelConfig, TrainConfig
from rlfactory.errors import UserError
from rlfactory.model.loader import head_kernels


def test_head_kernels_follow_each_configs_settings():
    """compiled from train.torch_compile, nothing carried over to the next call; liger_kernel: off (or a machine
    without CUDA or liger-kernel) gives the torch log-prob loop."""
    import dataclasses

    model = ModelConfig(name_or_path=str(TINY_MODEL))
    compiled = head_kernels(model, TrainConfig(torch_compile=True))
    assert compiled.compiled and compiled.chunk_rows is None
    assert head_kernels(model, TrainConfig()) == HeadKernels(logprobs=compiled.logprobs)
    off = model.model_copy(update={"liger_kernel": "off"})
    assert head_kernels(off, TrainConfig()) == HeadKernels() == HeadKernels(False, "torch", None)
    if not torch.cuda.is_available():
        assert compiled == HeadKernels(compiled=True)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a run's choice cannot be flipped later
        compiled.compiled = False  # type: ignore[misc]


def test_liger_on_without_the_package_is_a_config_error():
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        pytest.skip("liger-kernel is installed")
    on = ModelConfig(name_or_path=str(TINY_MODEL), liger_kernel="on")
    with pytest.raises(UserError, match="liger-kernel package"):
        head_kernels(on, TrainConfig())


def test_linear_nll_sum_takes_its_chunk_rows_from_the_call(monkeypatch):
    """Rows per chunk: ``chunk_size``, else ``kernels.chunk_rows``, else the eager logits budget (on CPU even when
    compiled); a call with explicit rows leaves the next default call at the default."""
    seen: list[tuple[int, str]] = []
    apply = common._LinearNLLSum.apply

    def spy(hidden, weight, labels, rows, kernel):  # noqa: ANN001
        seen.append((rows, kernel))
        return apply(hidden, weight, labels, rows, kernel)

    monkeypatch.setattr(common._LinearNLLSum, "apply", spy)
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(5, 4, generator=g), torch.randn(11, 4, generator=g)
    labels = torch.randint(0, 11, (5,), generator=g)
    common.linear_nll_sum(hidden, weight, labels, kernels=HeadKernels(compiled=True, chunk_rows=2))
    common.linear_nll_sum(hidden, weight, labels)
    common.linear_nll_sum(hidden, weight, labels, chunk_size=3, kernels=HeadKernels(chunk_rows=2))
    common.linear_nll_sum(hidden, weight, labels, kernels=HeadKernels(compiled=True, logprobs="liger"))
    eager_rows = common._chunk_rows(11, eager=True)
    assert seen == [(2, "eager"), (eager_rows, "eager"), (3, "eager"), (eager_rows, "eager")]


def test_a_chunk_that_cannot_compile_falls_back_once_and_is_remembered(monkeypatch, caplog):
    """The compile failure is logged once and the eager path is taken from then on, on this device type only;
    no run setting changes (the former COMPILE_HEAD switch was flipped here)."""
    calls = []

    def broken(*_: object) -> None:
        calls.append(1)
        raise RuntimeError("no triton")

    monkeypatch.setattr(common, "_UNCOMPILABLE", set())
    monkeypatch.setattr(common, "_compiled_nll_and_dlogits_", lambda: broken)
    logits, target = torch.randn(3, 5), torch.zeros(3, 1, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="rlfactory.algos.common"):
        assert common._fused_chunk(logits, target) is None
        assert common._fused_chunk(logits, target) is None
    assert len(calls) == 1 and common._UNCOMPILABLE == {"cpu"}
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "no triton" in caplog.records[0].message


def test_liger_chunk_that_cannot_launch_falls_back_to_the_compiled_one(monkeypatch, caplog):
    """A liger-kernel whose kernel no longer takes our arguments: logged once, the compiled chunk from then on."""
    launches, compiled = [], []

    def incompatible(*_: object) -> None:
        launches.append(1)
        raise TypeError("liger_cross_entropy_kernel() got an unexpected keyword argument 'RETURN_PREDICTED_TOKENS'")

    def fused(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        compiled.append(1)
        return common._nll_and_dlogits_(logits, target, grads=True)

    monkeypatch.setattr(common, "_LIGER_CE_FAILED", set())
    monkeypatch.setattr(common, "_UNCOMPILABLE", set())
    monkeypatch.setattr(common, "_liger_nll_and_dlogits_", incompatible)
    monkeypatch.setattr(common, "_compiled_nll_and_dlogits_", lambda: fused)
    g = torch.Generator().manual_seed(3)
    logits, target = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.tensor([[1], [4], [0]])
    want = torch.nn.functional.cross_entropy(logits, target[:, 0], reduction="sum")
    with caplog.at_level(logging.WARNING, logger="rlfactory.algos.common"):
        for _ in range(2):
            torch.testing.assert_close(common._fused_chunk(logits.clone(), target, "liger"), want.float())
    assert (len(launches), len(compiled)) == (1, 2) and common._LIGER_CE_FAILED == {"cpu"}
    assert len(caplog.records) == 1 and "unexpected keyword argument" in caplog.records[0].message


def _sft_config(tmp_path: Path, name: str, **train: object) -> object:
    return validate_config(
        {
            "stage": "sft",
            "output_dir": str(tmp_path / name),
            "model": {"name_or_path": str(TINY_MODEL), "finetuning": "lora"},
            "lora": {"r": 4, "alpha": 8},
            "data": {"dataset": "arith_sft", "dataset_dir": str(DATA_DIR), "max_samples": 16, "cutoff_len": 128},
            "train": {"max_steps": 1, "per_device_batch_size": 4, "learning_rate": 1e-3, **train},
            "logging": {"progress_bar": False, "plot_loss": False},
        },
        "test",
    )


def test_two_sft_runs_in_one_process_each_use_their_own_kernels(tmp_path: Path, monkeypatch):
    """A torch_compile run, then a default one, in one process: the second's LM head gets the default kernels
    (before, the first run's ``COMPILE_HEAD = True`` stayed set for every later run)."""
    from rlfactory.engine import shared
    from rlfactory.model import lm_head
    from rlfactory.stages import sft

    seen: list[HeadKernels] = []
    linear_nll_sum = lm_head.linear_nll_sum

    def spy(*args: object, kernels: HeadKernels, **kw: object) -> torch.Tensor:
        seen.append(kernels)
        return linear_nll_sum(*args, kernels=kernels, **kw)

    monkeypatch.setattr(lm_head, "linear_nll_sum", spy)
    monkeypatch.setattr(shared, "compile_layers", lambda _model, **_: 0)  # the layers' compile is not under test
    sft.run(_sft_config(tmp_path, "compiled", torch_compile=True))
    compiled_calls = len(seen)
    sft.run(_sft_config(tmp_path, "default"))
    assert compiled_calls > 0 and len(seen) > compiled_calls
    assert set(seen[:compiled_calls]) == {HeadKernels(compiled=True)}
    assert set(seen[compiled_calls:]) == {HeadKernels()}


def test_a_zero3_partitioned_head_takes_the_full_logits_path_with_the_same_values():
    """Under ZeRO-3 the head weight is an empty shard outside its forward (marked ``ds_id``): the chunked head
    must not read it, and the full-logits fallback gives the same NLL sum and log-probs (float64)."""
    from transformers import AutoModelForCausalLM

    from rlfactory.model.lm_head import lm_parts, next_token_logps, nll_sum

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, 3:-1] = True
    inputs = {"input_ids": ids}
    assert lm_parts(model) is not None
    chunked = nll_sum(model, inputs, labels), next_token_logps(model, inputs, mask)
    model.get_output_embeddings().weight.ds_id = 7  # what deepspeed.zero sets on a partitioned parameter
    assert lm_parts(model) is None
    full = nll_sum(model, inputs, labels), next_token_logps(model, inputs, mask)
    torch.testing.assert_close(full[0], chunked[0].to(full[0].dtype), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(full[1], chunked[1].to(full[1].dtype), rtol=1e-6, atol=1e-9)


def test_gradient_norm_of_fsdp2_shards_is_a_plain_tensor(tmp_path):
    """FSDP2 hands back DTensor gradients (and a DTensor norm from clipping); the divergence guard reads them with
    ``.tolist()``, which a DTensor refuses (seen on 4 GPUs): ``clip_grad_norm`` returns the plain global norm."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rlfactory.engine.shared import clip_grad_norm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3, dtype=torch.float64), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.full((4, 3), 2.0, dtype=torch.float64), mesh, [Shard(0)])

        class Plain:  # what the accelerator's clip returns under FSDP2: a DTensor norm
            @staticmethod
            def clip_grad_norm_(params, max_norm):
                return torch.nn.utils.clip_grad_norm_(params, max_norm)

        model = torch.nn.Module()
        model.weight = weight
        for max_norm in (None, 100.0):
            norm = clip_grad_norm(Plain(), model, max_norm)
            assert not hasattr(norm, "full_tensor")
            assert torch.stack([norm.reshape(())]).tolist() == [pytest.approx(2.0 * 12**0.5)]
    finally:
        dist.destroy_process_group()
