"""Rollout layer: the packed batch layout (token-exact), the HF backend (stop/length, sampling settings that a
checkpoint's generation_config cannot override), and token-in/token-out log-probs on padded batches."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from tests.conftest import DATA_DIR, TINY_MODEL, random_prompts, sampled_prob_ratios

from rlfactory.config.schema import RunConfig
from rlfactory.errors import UserError
from rlfactory.rollout.base import Completion, SamplingParams
from rlfactory.rollout.batch import pack_rollouts, response_logits

PAD = 0


def test_pack_layout_is_token_exact():
    prompts = [[11, 12, 13], [21]]
    completions = [Completion([31, 32], "stop"), Completion([41, 42, 43, 44], "length", mask=[1, 1, 0, 1])]
    batch = pack_rollouts(prompts, completions, PAD, mask_truncated=False)
    assert batch.input_ids.tolist() == [[11, 12, 13, 31, 32, 0, 0], [0, 0, 21, 41, 42, 43, 44]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert batch.responses.tolist() == [[31, 32, 0, 0], [41, 42, 43, 44]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 1]]  # a tool token (mask 0) is not trained
    assert batch.loss_mask.tolist() == batch.response_mask.tolist()
    assert batch.response_length.tolist() == [2, 4] and batch.truncated.tolist() == [False, True]
    masked = pack_rollouts(prompts, completions, PAD, mask_truncated=True)
    assert masked.loss_mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]  # truncated: out of the loss ...
    assert masked.response_mask.tolist() == batch.response_mask.tolist()  # ... but still scored


def test_response_logits_predict_response_tokens():
    logits = torch.arange(7.0)[None, :, None]  # position t "predicts" t + 1
    assert response_logits(logits, 4)[0, :, 0].tolist() == [2.0, 3.0, 4.0, 5.0]  # P = 3: positions 2..5


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL), AutoTokenizer.from_pretrained(TINY_MODEL)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from rlfactory.render.chat import render_prompt

    rows = [json.loads(line) for line in (DATA_DIR / "arith" / "prompts_test.jsonl").read_text().splitlines()[:n]]
    return [render_prompt(tokenizer, row["messages"]) for row in rows]


def test_hf_backend_stops_at_end_of_turn_or_length(tiny):
    from rlfactory.rollout.hf import HFBackend

    model, tokenizer = tiny
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    backend = HFBackend(model, tokenizer, batch_size=3)
    prompts = _prompts(tokenizer, 4)
    out = backend.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    assert len(out) == 4 and all(c.finish_reason == "stop" and c.token_ids[-1] == stop for c in out)
    assert all(stop not in c.token_ids[:-1] for c in out)
    short = backend.generate(prompts, SamplingParams(max_tokens=3, temperature=1.0))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in short if stop not in c.token_ids)
    # greedy equals greedy one prompt at a time: padding never changes what is generated
    alone = HFBackend(model, tokenizer, batch_size=1).generate(prompts, SamplingParams(64, temperature=0))
    assert [c.token_ids for c in alone] == [c.token_ids for c in out]


def test_checkpoint_generation_config_cannot_change_sampling(tiny, tmp_path: Path):
    """Qwen ships top_k=20 / repetition_penalty in generation_config.json: rollouts must ignore them."""
    from transformers import AutoModelForCausalLM

    from rlfactory.rollout.hf import _sampling_kwargs

    shutil.copytree(TINY_MODEL, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(
        json.dumps({"top_k": 20, "top_p": 0.8, "temperature": 0.7, "repetition_penalty": 1.05, "do_sample": True})
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    config, _ = model._prepare_generation_config(
        None, repetition_penalty=1.0, **_sampling_kwargs(SamplingParams(8, temperature=1.0))
    )
    assert (config.do_sample, config.temperature, config.top_k, config.top_p, config.repetition_penalty) == (
        True,
        1.0,
        0,
        1.0,
        1.0,
    )


def test_logprobs_of_a_padded_batch_equal_unpadded_forwards(tiny):
    """Token-in, token-out: the log-prob of each sampled token, read from the padded batch, is the one the
    model gives that token after exactly its own prompt and earlier response tokens."""
    from rlfactory.algos.common import token_logprobs
    from rlfactory.engine.online.update import policy_forward
    from rlfactory.rollout.hf import HFBackend

    model, tokenizer = tiny
    prompts = _prompts(tokenizer, 3)
    torch.manual_seed(1)
    out = HFBackend(model, tokenizer).generate([prompts[0], prompts[1], prompts[2]], SamplingParams(24, 1.0))
    batch = pack_rollouts(prompts, out, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs, entropy = policy_forward(model, batch, torch.arange(3), entropy="metric")
        for row, (prompt, completion) in enumerate(zip(prompts, out, strict=True)):
            ids = torch.tensor([prompt + completion.token_ids])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            expected = token_logprobs(logits[None], torch.tensor([completion.token_ids]))[0]
            n = len(completion.token_ids)
            assert torch.allclose(logprobs[row, :n], expected, atol=1e-5)
            assert (logprobs[row, n:] == 0).all() and (entropy[row, n:] == 0).all()


def _grpo_config(**rollout) -> RunConfig:
    return RunConfig.model_validate(
        {
            "stage": "grpo",
            "model": {"name_or_path": str(TINY_MODEL)},
            "data": {"dataset": "arith_prompts", "dataset_dir": str(DATA_DIR)},
            "rollout": rollout,
            "reward": {"functions": {"answer_match": 1.0}},
        }
    )


def test_backends_are_built_by_name_and_their_traits_match_the_classes(tiny):
    from rlfactory.rollout.backends import BACKENDS, build_backend
    from rlfactory.rollout.hf import HFBackend
    from rlfactory.rollout.vllm import VLLMBackend  # the class only: vllm itself is imported by its __init__

    assert BACKENDS.names() == ["hf", "vllm"]
    assert BACKENDS.traits("hf") == {"syncs_weights": HFBackend.syncs_weights, "package": None}
    assert BACKENDS.traits("vllm") == {"syncs_weights": VLLMBackend.syncs_weights, "package": "vllm"}
    assert HFBackend.syncs_weights is False and VLLMBackend.syncs_weights is True
    model, tokenizer = tiny
    backend = build_backend(_grpo_config(generation_batch_size=5), model, tokenizer)
    assert isinstance(backend, HFBackend) and backend.batch_size == 5 and backend.model is model
    cfg = _grpo_config()
    typo = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"backend": "vlm"})})
    valid = r"unknown rollout backend 'vlm' \(did you mean 'vllm'\?\); valid names: hf, vllm"
    with pytest.raises(UserError, match=valid):
        build_backend(typo, model, tokenizer)


SETTINGS = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05}  # none of them a default


def test_sampling_params_take_every_sampling_setting_of_the_rollout_config_by_name():
    from rlfactory.config.online_schema import RolloutConfig

    ro = RolloutConfig(max_response_len=33, **SETTINGS)
    params = SamplingParams.from_rollout(ro)
    assert params == SamplingParams(max_tokens=33, ignore_eos=False, **SETTINGS)
    assert SamplingParams.from_rollout(ro, max_tokens=5) == SamplingParams(max_tokens=5, **SETTINGS)
    # a sampler field that rollout: also has must come from it (a new one, added to both, cannot be dropped)
    shared = {f.name for f in dataclasses.fields(SamplingParams)} & set(RolloutConfig.model_fields)
    assert shared == set(SETTINGS) and all(getattr(params, name) == SETTINGS[name] for name in shared)


class RecordingBackend:
    """The run's real backend, recording the sampling settings of every call."""

    def __init__(self, inner):
        self.inner, self.params = inner, []

    def generate(self, prompts, params):
        self.params.append(params)
        return self.inner.generate(prompts, params)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_the_online_step_samples_with_every_setting_of_the_rollout_config(tmp_path: Path):
    from accelerate.state import AcceleratorState

    from rlfactory.engine.online.loop import build_run
    from rlfactory.engine.online.phases import collect
    from rlfactory.model.loader import load_model, load_tokenizer
    from rlfactory.stages.rl import load_prompt_sets, render_prompts

    cfg = _grpo_config(prompts_per_step=2, num_samples=2, max_response_len=8, **SETTINGS)
    cfg = cfg.model_copy(update={"output_dir": str(tmp_path / "out")})
    tokenizer = load_tokenizer(cfg.model)
    prompts = render_prompts(cfg, tokenizer, load_prompt_sets(cfg)[0])
    try:
        run = build_run(cfg, load_model(cfg.model, cfg.lora, cfg.freeze), tokenizer, prompts, [])
        run.rollouts.backend = recording = RecordingBackend(run.rollouts.backend)
        kept, generated, _ = collect(run, 0)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: leave none behind
    assert len(generated) == 4 and recording.params == [SamplingParams(max_tokens=8, **SETTINGS)]


MIN_P = 0.3


def test_min_p_from_the_rollout_config_reaches_the_hf_sampler(tiny):
    """With min_p every sampled token has p >= min_p x the top token's p under the model's own softmax; without
    it, the same prompts and seed sample tokens below that line."""
    from rlfactory.config.online_schema import RolloutConfig
    from rlfactory.rollout.hf import HFBackend

    model, tokenizer = tiny
    prompts = random_prompts(4, 4)
    ratios = {}
    for min_p in (0.0, MIN_P):
        torch.manual_seed(0)
        params = SamplingParams.from_rollout(RolloutConfig(min_p=min_p, max_response_len=12))
        ratios[min_p] = sampled_prob_ratios(model, prompts, HFBackend(model, tokenizer).generate(prompts, params))
    print(f"p / top p below {MIN_P}: {int((ratios[0.0] < MIN_P).sum())} of {len(ratios[0.0])} tokens at min_p 0")
    assert len(ratios[MIN_P]) > 100 and ratios[MIN_P].min() >= MIN_P * 0.99  # 1%: padded vs unpadded forwards
    assert (ratios[0.0] < MIN_P * 0.99).sum() >= 10  # measured: 43 of 192


def test_generation_on_a_compiled_policy_runs_eager_and_leaves_the_training_graph_to_compile():
    """train.torch_compile with rollout.backend hf: generation would compile the policy's layers again for every
    cache state and length (prefill, then each decode length) until dynamo's recompile limit, after which the
    training forward of the same layers silently ran eager too. Generation now runs eager: it captures no frame,
    generates what the uncompiled model does, and the next training forward still compiles."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfactory.engine.shared import compile_layers
    from rlfactory.rollout.hf import HFBackend

    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    prompts = _prompts(tokenizer, 3)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    expected = [c.token_ids for c in HFBackend(model, tokenizer, batch_size=3).generate(prompts, greedy)]
    assert compile_layers(model) > 1
    before = counters["frames"]["total"]
    out = HFBackend(model, tokenizer, batch_size=3).generate(prompts, greedy)
    assert [c.token_ids for c in out] == expected
    assert counters["frames"]["total"] == before, "generation ran through the compiled layers"
    ids = torch.tensor([prompts[0]])
    model(input_ids=ids).logits.sum().backward()  # a training forward after generation: compiled, not eager
    assert counters["frames"]["total"] > before
    torch._dynamo.reset()


def test_update_micro_batches_are_cut_to_aligned_widths_within_the_batch():
    """The update's padded micro-batches span a multiple of 8 columns (prompt + response) where the batch is that
    wide, and the online loop packs its batches that wide, so sdpa's masked kernel sees one alignment on every step
    (a compiled layer would otherwise compile again when a step's width fell the other way); never wider than the
    batch, and the extra columns are padding, out of every mask."""
    from rlfactory.data.packing import ALIGN_COLUMNS
    from rlfactory.engine.online.update import _trimmed

    prompts = [[5] * 3, [6] * 7]
    completions = [Completion([7] * 4, "stop"), Completion([8] * 10, "length")]
    batch = pack_rollouts(prompts, completions, PAD)
    width_p = batch.input_ids.shape[1] - batch.responses.shape[1]
    assert (width_p, batch.responses.shape[1]) == (7, 10)
    assert _trimmed(batch, torch.tensor([0]), 4)[1] == 9  # 7 + 4 = 11 -> 16 columns
    assert _trimmed(batch, torch.tensor([1]), 10)[1] == 10  # 17 -> 24 columns is wider than the batch: capped
    assert _trimmed(batch, torch.tensor([0]), 1)[1] == 1  # 7 + 1 = 8 already
    aligned = pack_rollouts(prompts, completions, PAD, mask_truncated=True, align_columns=ALIGN_COLUMNS)
    assert aligned.input_ids.shape[1] == 24 and aligned.responses.shape[1] == 17  # 7 + 10 -> 24 columns
    for name in ("input_ids", "attention_mask", "position_ids"):  # the same batch, then padding
        assert torch.equal(getattr(aligned, name)[:, :17], getattr(batch, name)), name
    assert (aligned.attention_mask[:, 17:] == 0).all() and (aligned.input_ids[:, 17:] == PAD).all()
    for name in ("response_mask", "loss_mask"):
        assert (getattr(aligned, name)[:, 10:] == 0).all()
    assert aligned.response_length.tolist() == [4, 10] and aligned.truncated.tolist() == [False, True]
    for rows, longest in ((torch.tensor([0]), 4), (torch.tensor([0, 1]), 10), (torch.tensor([1]), 10)):
        inputs, width_r = _trimmed(aligned, rows, longest)
        assert inputs["input_ids"].shape[1] == width_p + width_r and width_r >= longest
        assert (width_p + width_r) % ALIGN_COLUMNS == 0
        assert (inputs["attention_mask"][:, width_p + longest :] == 0).all()


def test_policy_logprobs_and_loss_of_an_aligned_batch_equal_the_unaligned_ones(tiny):
    """Widening the batch to aligned columns changes no number: the update's log-probs (float64) are equal."""
    from rlfactory.data.packing import ALIGN_COLUMNS
    from rlfactory.engine.online.update import policy_forward

    model, tokenizer = tiny
    prompts = _prompts(tokenizer, 3)
    completions = [Completion([11, 12, 13], "stop"), Completion([14] * 6, "length"), Completion([15], "stop")]
    plain = pack_rollouts(prompts, completions, tokenizer.pad_token_id)
    aligned = pack_rollouts(prompts, completions, tokenizer.pad_token_id, align_columns=ALIGN_COLUMNS)
    assert aligned.input_ids.shape[1] % ALIGN_COLUMNS == 0 and aligned.responses.shape[1] > 6
    model64 = model.to(torch.float64)
    try:
        with torch.no_grad():
            for rows in (torch.arange(3), torch.tensor([0, 2])):
                a, _ = policy_forward(model64, plain, rows)
                b, _ = policy_forward(model64, aligned, rows)
                assert torch.equal(b[:, : a.shape[1]], a) and (b[:, a.shape[1] :] == 0).all()
    finally:
        model.to(torch.float32)
