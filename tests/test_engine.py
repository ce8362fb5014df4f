"""The shared engine: accumulation invariance, document-masked packing, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, ROOT, TINY_MODEL, run_cli, write_yaml

from rlfactory.config.loader import validate_config
from rlfactory.config.schema import ModelConfig
from rlfactory.data.loader import load_examples
from rlfactory.engine.run_dir import read_log
from rlfactory.model.loader import load_tokenizer
from rlfactory.render.chat import render_sft
from rlfactory.stages import sft


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(out) if "loss" in r}


def test_packed_equals_padded_and_documents_do_not_attend_across():
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    examples = load_examples(["arith_sft"], "sft", str(DATA_DIR), max_samples=6)
    items = [render_sft(tokenizer, e["messages"])[0] for e in examples]
    with torch.no_grad():
        padded_loss, _ = sft.nll_sum(model, sft.collate_padded(tokenizer.pad_token_id)(items))
        packed_batch = sft.collate_packed(items)
        packed_loss, _ = sft.nll_sum(model, packed_batch)
        # the same row with one running position range: documents now see each other
        leaky = {**packed_batch, "position_ids": torch.arange(packed_batch["input_ids"].shape[1])[None]}
        leaky_loss, _ = sft.nll_sum(model, leaky)
    assert sft.count_tokens(sft.collate_padded(0)(items)) == sft.count_tokens(packed_batch)
    assert abs(float(packed_loss) - float(padded_loss)) < 1e-3 * float(padded_loss) / 100
    assert abs(float(leaky_loss) - float(padded_loss)) > 1e-3


def test_sdpa_varlen_takes_one_packed_row_by_its_documents(monkeypatch):
    """data.packing under ``model.attn_implementation: sdpa_varlen``: the whole micro-batch is one row that carries
    its documents' boundaries; every layer's attention runs per document (CPU: sdpa's causal kernel each), and the
    loss equals the padded one (float64: 1e-12 relative). The control: the same row with two documents given as one
    boundary span changes the loss."""
    from transformers import AutoModelForCausalLM

    from rlfactory.config.schema import RunConfig
    from rlfactory.model import attention

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    name = attention.attention_implementation("sdpa_varlen")
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float64, attn_implementation=name).eval()
    examples = load_examples(["arith_sft"], "sft", str(DATA_DIR), max_samples=6)
    items = [render_sft(tokenizer, e["messages"])[0] for e in examples]
    cfg = RunConfig.model_validate(
        {"stage": "sft", "output_dir": "unused", "data": {"dataset": "arith_sft", "packing": True},
         "model": {"name_or_path": str(TINY_MODEL), "attn_implementation": "sdpa_varlen"}}
    )  # fmt: skip
    row = sft.packed_collate(cfg, tokenizer.pad_token_id)(items)
    lengths = [len(item["input_ids"]) for item in items]
    assert row["input_ids"].shape == (1, sum(lengths)) and row["max_length_q"] == max(lengths)
    assert row["cu_seq_lens_q"].tolist()[1:] == [sum(lengths[: i + 1]) for i in range(len(items))]
    calls = []
    inner = attention._per_document
    monkeypatch.setattr(attention, "_per_document", lambda *a, **k: calls.append(1) or inner(*a, **k))
    starts = row["cu_seq_lens_q"]
    merged = {**row, "cu_seq_lens_q": torch.cat([starts[:1], starts[2:]])}  # documents 0 and 1 as one span
    merged["cu_seq_lens_k"] = merged["cu_seq_lens_q"]
    with torch.no_grad():
        padded_loss, _ = sft.nll_sum(model, sft.collate_padded(tokenizer.pad_token_id)(items))
        varlen_loss, _ = sft.nll_sum(model, row)
        assert len(calls) == model.config.num_hidden_layers
        merged_loss, _ = sft.nll_sum(model, merged)
    assert abs(float(varlen_loss) - float(padded_loss)) <= 1e-12 * float(padded_loss)
    assert abs(float(merged_loss) - float(padded_loss)) > 1e-3


def test_packed_rows_equal_padded_with_several_documents_per_row():
    """sdpa / eager's layout (``collate_packed_rows``): documents first fit into rows no longer than the longest, so
    short ones share a row; the loss equals the padded loss, and every labelled token is trained once."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float64, attn_implementation="sdpa").eval()
    examples = load_examples(["arith_sft"], "sft", str(DATA_DIR), max_samples=6)
    items = [render_sft(tokenizer, e["messages"])[0] for e in examples]
    cut = lambda item, n: {k: v[:n] for k, v in item.items()}  # a shorter document, still labelled at its end
    items = [items[0], cut(items[1], 20), cut(items[2], 30), items[3], cut(items[4], 12), cut(items[5], 25)]
    rows = sft.collate_packed_rows(tokenizer.pad_token_id, 8)(items)
    assert rows["input_ids"].shape[0] < len(items)  # some documents share a row
    assert rows["input_ids"].shape[1] == -(-max(len(i["input_ids"]) for i in items) // 8) * 8
    with torch.no_grad():
        padded_loss, _ = sft.nll_sum(model, sft.collate_padded(tokenizer.pad_token_id)(items))
        rows_loss, _ = sft.nll_sum(model, rows)
    assert sft.count_tokens(rows) == sft.count_tokens(sft.collate_padded(0)(items))
    assert abs(float(rows_loss) - float(padded_loss)) <= 1e-12 * float(padded_loss)


def test_lora_under_autocast_saves_no_float32_copies_of_adapter_inputs():
    """A bf16 model with PEFT's float32 adapters, under bf16 autocast (the GPU LoRA setting): the engine's forward
    context keeps PEFT from casting each adapter's input to float32, so autograd saves fewer bytes, while the loss
    and the adapter gradients stay bit-identical."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from rlfactory.config.schema import LoraConfig
    from rlfactory.engine.shared import autocast_forward
    from rlfactory.model.loader import apply_lora

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.bfloat16, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = apply_lora(base, LoraConfig(r=8, alpha=16, dropout=0.0, target_modules="all-linear"), False)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    examples = load_examples(["arith_sft"], "sft", str(DATA_DIR), max_samples=4)
    batch = sft.collate_padded(tokenizer.pad_token_id)([render_sft(tokenizer, e["messages"])[0] for e in examples])
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: bf16 only for this test
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")

    def run(context) -> tuple[float, list[torch.Tensor], int]:
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        model.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
            loss, _ = sft.nll_sum(model, batch)
        loss.backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if p.requires_grad]
        return float(loss), grads, sum(saved.values())

    try:
        plain_loss, plain_grads, plain_bytes = run(accelerator.autocast())
        loss, grads, saved_bytes = run(autocast_forward(accelerator, model))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert loss == plain_loss
    for mine, ref in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, ref, atol=0, rtol=0)
    assert saved_bytes < plain_bytes, (saved_bytes, plain_bytes)


def test_dora_with_gradient_checkpointing_recomputes_what_the_forward_saved():
    """DoRA on a bf16 model under bf16 autocast with gradient checkpointing (a 7B DoRA run on an H200 stopped with
    torch's "Recomputed values ... have different metadata"): the recompute inside the engine's ``backward`` casts
    the adapters' inputs as ``autocast_forward`` did, and the adapter gradients equal those without checkpointing."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from rlfactory.config.schema import LoraConfig
    from rlfactory.engine.shared import autocast_forward, backward
    from rlfactory.model.loader import apply_lora

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    examples = load_examples(["arith_sft"], "sft", str(DATA_DIR), max_samples=4)
    batch = sft.collate_padded(tokenizer.pad_token_id)([render_sft(tokenizer, e["messages"])[0] for e in examples])
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: bf16 only for this test
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.bfloat16, attn_implementation="sdpa")
        if checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)
        lora = LoraConfig(r=8, alpha=16, dropout=0.0, target_modules="all-linear", use_dora=True)
        model = apply_lora(base, lora, checkpointing)
        model.train()
        with autocast_forward(accelerator, model):
            loss, _ = sft.nll_sum(model, batch)
        backward(accelerator, model, loss)
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    try:
        plain, checkpointed = grads(False), grads(True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert any("lora_magnitude_vector" in n for n in plain)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def _run_in_process(cfg: dict) -> Path:
    config = validate_config(cfg, "test")
    sft.run(config)
    return Path(config.output_dir)


def test_batch_times_accumulation_invariance(sft_config: dict, tmp_path: Path):
    """batch 8 x accum 1 and batch 2 x accum 4 give the same loss and weights (TRL's invariance test)."""
    common = {"max_samples": 32, "shuffle": False}
    one = {
        **sft_config,
        "output_dir": str(tmp_path / "a"),
        "model": {**sft_config["model"], "finetuning": "full"},
        "data": {**sft_config["data"], **common},
        "train": {"max_steps": 3, "per_device_batch_size": 8, "grad_accum_steps": 1, "learning_rate": 1e-3},
    }
    four = {
        **one,
        "output_dir": str(tmp_path / "b"),
        "train": {**one["train"], "per_device_batch_size": 2, "grad_accum_steps": 4},
    }
    a, b = _losses(_run_in_process(one)), _losses(_run_in_process(four))
    assert a.keys() == b.keys() == {1, 2, 3}
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-5)
    grads = [[r["grad_norm"] for r in read_log(tmp_path / d) if "grad_norm" in r] for d in "ab"]
    assert grads[0] == pytest.approx(grads[1], rel=1e-4)


def test_a_run_resumed_with_no_save_left_still_keeps_save_total_limit(sft_config: dict, tmp_path: Path):
    """A run killed after renaming its last checkpoint into place but before rotating the old ones leaves one
    checkpoint too many; resumed from it with no save left to make, the run rotates when it ends."""
    train = {**sft_config["train"], "max_steps": 4, "save_steps": 1, "save_total_limit": None}
    path = write_yaml(tmp_path / "run.yaml", {**sft_config, "train": train})
    assert run_cli("train", str(path)).returncode == 0
    out = Path(sft_config["output_dir"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    resumed = run_cli("train", str(path), "resume_from_checkpoint=auto", "train.save_total_limit=2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "checkpoint-3" in resumed.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


@pytest.mark.slow
def test_killed_run_resumes_from_checkpoint(sft_config: dict, tmp_path: Path):
    cfg = {
        **sft_config,
        "model": {**sft_config["model"], "finetuning": "full"},
        "data": {**sft_config["data"], "shuffle": True},
        "train": {
            **sft_config["train"],
            "max_steps": 8,
            "save_steps": 2,
            "per_device_batch_size": 4,
            "save_total_limit": 2,
        },
    }
    reference = {**cfg, "output_dir": str(tmp_path / "ref")}
    write_yaml(tmp_path / "ref.yaml", reference)
    assert run_cli("train", str(tmp_path / "ref.yaml")).returncode == 0

    killed = {**cfg, "output_dir": str(tmp_path / "killed")}
    write_yaml(tmp_path / "killed.yaml", killed)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfactory", "train", str(tmp_path / "killed.yaml")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state = tmp_path / "killed" / "checkpoint-4" / "trainer_state.json"
    deadline = time.time() + 300
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists(), "the run should have written checkpoint-4 before being killed"
    assert not (tmp_path / "killed" / "run_summary.json").exists()

    refused = run_cli("train", str(tmp_path / "killed.yaml"))
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    resumed = run_cli("train", str(tmp_path / "killed.yaml"), "resume_from_checkpoint=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    ref_losses, new_losses = _losses(tmp_path / "ref"), _losses(tmp_path / "killed")
    assert sorted(new_losses) == sorted(ref_losses) == list(range(1, 9))  # no step lost or logged twice
    for step in range(5, 9):  # steps after the checkpoint reproduce the uninterrupted run
        assert new_losses[step] == pytest.approx(ref_losses[step], rel=1e-4)
    checkpoints = sorted(p.name for p in (tmp_path / "killed").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4", "checkpoint-6"]  # save_total_limit: 2
    summary = json.loads((tmp_path / "killed" / "run_summary.json").read_text())
    assert summary["global_step"] == 8


def test_rotation_removes_partial_checkpoints_a_kill_left_behind(tmp_path: Path):
    """A run killed while rotating leaves checkpoint-2 half deleted (no trainer_state.json): the next rotation
    removes it with the complete ones it drops; a newer partial folder (a save in progress) stays."""
    from rlfactory.engine.run_dir import list_checkpoints, rotate_checkpoints

    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if step != 2 and step != 8:
            state = {"global_step": step, "files": {}}
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "checkpoint-2" / "optimizer.bin").write_text("partial")
    rotate_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6"]


def test_compile_layers_finds_the_decoder_stack_under_peft():
    """train.torch_compile compiles each decoder layer (lazily: nothing runs here), also inside a PEFT wrapper."""
    from transformers import AutoModelForCausalLM

    from rlfactory.config.schema import LoraConfig
    from rlfactory.engine.shared import compile_layers
    from rlfactory.model.loader import apply_lora

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    layers = model.config.num_hidden_layers
    assert compile_layers(apply_lora(model, LoraConfig(), False)) == layers


def test_cuda_graphs_compile_layers_in_reduce_overhead_mode_and_mark_each_optimizer_step(tmp_path: Path, monkeypatch):
    """train.cuda_graphs: every decoder layer is compiled in torch.compile's reduce-overhead mode (CUDA graph trees),
    and each optimizer step (not each micro-batch) starts a new generation of the trees, so a replay never overwrites
    the gradients accumulated so far.
    (The compile itself is not under test here; the GPU measurement is in docs/BENCHMARKS.md.)"""
    from transformers import AutoConfig

    modes: list[str | None] = []
    marks: list[int] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: modes.append(kw.get("mode")))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    cfg = validate_config(
        {
            "stage": "sft",
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": str(TINY_MODEL), "finetuning": "lora"},
            "data": {"dataset": "arith_sft", "dataset_dir": str(DATA_DIR), "max_samples": 16, "cutoff_len": 128},
            "train": {
                "max_steps": 2,
                "per_device_batch_size": 2,
                "grad_accum_steps": 3,
                "torch_compile": True,
                "cuda_graphs": True,
            },
            "logging": {"progress_bar": False, "plot_loss": False},
        },
        "test",
    )
    sft.run(cfg)
    assert modes == ["reduce-overhead"] * AutoConfig.from_pretrained(TINY_MODEL).num_hidden_layers
    assert len(marks) == 2  # one per optimizer step, whatever the accumulation
    assert len(_losses(tmp_path / "run")) == 2


def ddp_split_graphs(whole: bool) -> int:
    """How many graphs dynamo's DDP optimizer splits when two compiled residual-MLP layers (4 MB each, a decoder
    layer's shape in small) run inside DDP with 1 MB buckets, on a 1-process gloo group; ``whole``: after
    ``keep_layer_graphs_whole``. Run by the test below in a fresh interpreter (dynamo's and torch's logging state are
    process-wide)."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from rlfactory.engine.shared import keep_layer_graphs_whole

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    splits = []
    split = DDPOptimizer.compile_fn
    DDPOptimizer.compile_fn = lambda self, *a, **k: splits.append(1) or split(self, *a, **k)
    if whole:
        keep_layer_graphs_whole()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = Stack()
        for layer in model.layers:
            layer.compile(backend="eager")  # the backend does not matter to the split; eager is quick on a CPU
        DistributedDataParallel(model, bucket_cap_mb=1)(torch.randn(2, 512)).backward()
    finally:
        dist.destroy_process_group()
    return len(splits)


def test_compiled_layers_stay_whole_graphs_inside_ddp():
    """Under DDP, dynamo splits a graph compiled inside DDP's forward at each gradient bucket (25 MB) -- cutting our
    per-layer graphs into pieces that fuse worse, for no overlap a layer-by-layer backward lacks. With
    ``train.torch_compile`` on several processes the split is switched off: dynamo splits the layers' graphs
    without ``keep_layer_graphs_whole`` and never with it."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    counts = []
    for whole in (False, True):
        code = f"from tests.test_engine import ddp_split_graphs; print(ddp_split_graphs({whole}))"
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        counts.append(int(result.stdout.split()[-1]))
    assert counts[0] > 0 and counts[1] == 0, counts


def test_eval_metrics_are_means_over_the_whole_eval_set_not_over_batches():
    """Batches of 3 and 1 pairs: a per-pair accuracy of 1,1,1 and 0 is 0.75 overall (a mean of batch means
    would say 0.5); the eval loss is the summed loss over the summed units."""
    from accelerate import Accelerator

    from rlfactory.engine.offline import StageParts, eval_shard, evaluate

    def loss_fn(model, batch):
        return (1 - batch).sum() * 2, {"accuracy": batch.mean()}

    parts = StageParts([], lambda items: torch.tensor(items), loss_fn, lambda batch: float(len(batch)))
    shard = eval_shard([1.0, 1.0, 1.0, 0.0], batch_size=3, rank=0, world=1)  # batches of 3 and 1
    out = evaluate(Accelerator(cpu=True), torch.nn.Linear(1, 1), shard, parts)
    assert out["eval_accuracy"] == pytest.approx(0.75)
    assert out["eval_loss"] == pytest.approx(0.5)


def test_eval_shards_cover_every_example_once_and_run_the_same_number_of_batches():
    """5 batches over 2 processes: 0, 2, 4 and 1, 3 plus a weight-0 repeat, so both run 3 forwards (a sharded
    forward is collective) and every example counts once."""
    from rlfactory.engine.offline import eval_shard

    shards = [eval_shard(list(range(10)), batch_size=2, rank=rank, world=2) for rank in (0, 1)]
    assert [len(shard) for shard in shards] == [3, 3]
    counted = sorted(x for shard in shards for items, weight in shard if weight for x in items)
    assert counted == list(range(10))
    assert shards[1][-1] == ([0, 1], 0.0)


STOP_SIGNALS_WITH_A_BLOCKED_MASK = """
import os, signal, time
from rlfactory.engine.shared import StopSignals

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # as a launcher may hand them down
with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    print("during", stop.signum, sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))))
print("after", sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, []))))
"""


def test_stop_signals_arrive_when_the_launcher_blocked_them():
    """A run started with SIGINT/SIGTERM blocked still stops at a step on either (they would otherwise wait, pending,
    until the run ended); the mask is the launcher's again afterwards."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, "-c", STOP_SIGNALS_WITH_A_BLOCKED_MASK], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "SIGTERM: stopping after this step" in proc.stderr
    blocked = [int(signal.SIGINT), int(signal.SIGTERM)]
    assert proc.stdout.splitlines() == [f"during {int(signal.SIGTERM)} []", f"after {blocked}"]
