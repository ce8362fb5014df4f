"""Packed (padding-free) training passes of the online stages (``rollout.packing``): each micro-batch of rollouts
as one row, samples back to back with position ids restarting at each. They must compute what padded rows compute:
the same per-token log-probs, entropies and critic values, the same loss and the same gradients, on rollouts of
very different lengths; and the same row with running position ids must differ (so these tests can fail)."""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import replace

import pytest
import torch
from tests.conftest import TINY_MODEL

from rlfactory.config.schema import AlgorithmConfig
from rlfactory.engine.online.update import (
    MicroBatching,
    MiniBatch,
    PackedRows,
    Updater,
    actor_loss_fn,
    critic_loss_fn,
    host_lengths,
    host_prompt_groups,
    packed_micro_batch,
    policy_forward,
    value_forward,
)
from rlfactory.rollout.base import Completion
from rlfactory.rollout.batch import pack_rollouts

MAX_LEN = 120
EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps

# responses of 0 to 120 tokens: padded, the micro-batch costs 6 x (9 + 120) positions; packed, its 211 real tokens
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18], [19], [20, 21, 22, 23, 24], [25, 26], [27, 28, 29, 30]]
COMPLETIONS = [
    Completion([40], "stop"),
    Completion([41 + i % 50 for i in range(MAX_LEN)], "length"),
    Completion([60, 61, 62, 63, 64, 65, 2], "stop"),
    Completion([70 + i % 30 for i in range(37)] + [2], "stop", mask=[1] * 20 + [0] * 5 + [1] * 13),  # a tool result
    Completion([90 + i % 20 for i in range(15)] + [2], "stop"),
    Completion([], "stop"),  # nothing sampled: a row without response tokens
]


def _load(attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=attn).to(dtype)


@pytest.fixture(scope="module")
def model():
    """The bundled model in float64 (so that "the same" can be asserted tightly) with sdpa, the default kernel."""
    return _load("sdpa", torch.float64)


def _noisy_batch(prompts: list[list[int]], completions: list[Completion]):
    """The rollouts as a padded batch with random advantages, returns and values on the response tokens."""
    torch.manual_seed(0)
    packed = pack_rollouts(prompts, completions, pad_id=0, mask_truncated=False)
    noise = lambda scale: torch.randn(packed.responses.shape, dtype=torch.float64) * scale * packed.response_mask
    packed.advantages = noise(1.0)
    packed.returns = noise(1.0)
    packed.values = noise(0.5)
    return packed


@pytest.fixture(scope="module")
def batch():
    return _noisy_batch(PROMPTS, COMPLETIONS)


def _packed(batch, rows: list[int], layout: str = "row") -> PackedRows:
    groups = host_prompt_groups(batch) if layout == "shared" else None
    return packed_micro_batch(batch, *host_lengths(batch), rows, layout, groups)


LAYOUTS = pytest.mark.parametrize("layout", ["row", "rows"])  # one row (flash / flex), rows (sdpa / eager)


def test_a_packed_row_holds_exactly_the_real_tokens(batch):
    """Token-exact: the packed row is each sample's prompt + response back to back, position ids restart at each
    sample, and the kept positions predict exactly the response tokens."""
    rows = [3, 0, 5, 1]
    packed = _packed(batch, rows)
    inputs = packed.inputs(batch, torch.tensor(rows))
    expected = [t for i in rows for t in PROMPTS[i] + COMPLETIONS[i].token_ids]
    assert inputs["input_ids"][0].tolist() == expected and "attention_mask" not in inputs
    lengths = [len(PROMPTS[i]) + len(COMPLETIONS[i].token_ids) for i in rows]  # the boundaries the varlen kernels read
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 43, 47, 51, 180]
    assert inputs["max_length_q"] == inputs["max_length_k"] == max(lengths) == 129
    assert inputs["position_ids"][0].tolist() == [
        p for i in rows for p in range(len(PROMPTS[i]) + len(COMPLETIONS[i].token_ids))
    ]
    predicted = inputs["input_ids"][0, packed.keep + 1].tolist()
    assert predicted == [t for i in rows for t in COMPLETIONS[i].token_ids]
    assert packed.width == MAX_LEN and len(expected) == 43 + 4 + 4 + 129  # real tokens only (padded: 4 x 129)
    placed = packed.scatter(torch.arange(1, len(predicted) + 1, dtype=torch.float64), batch)
    assert placed.shape == (4, batch.responses.shape[1])
    assert [int((placed[r] > 0).sum()) for r in range(4)] == [len(COMPLETIONS[i].token_ids) for i in rows]


def test_rows_as_long_as_the_longest_sample_hold_each_sample_whole(batch):
    """The "rows" layout (sdpa / eager): samples first fit, longest first, into rows as long as the longest sample
    (rounded up to a multiple of 8 columns); each sample's tokens contiguous in one row with its own position ids,
    a row's tail its own positions; the kept positions predict exactly each sample's response tokens."""
    rows = [0, 1, 2, 3, 4, 5]
    packed = _packed(batch, rows, "rows")
    inputs = packed.inputs(batch, torch.tensor(rows))
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    assert ids.shape == positions.shape == (2, 136)  # 129 (the longest) rounded up; padded: 6 x 129
    # row 0: the 129-token sample alone; row 1: the rest, in their order, then a tail of 136 - 77 = 59
    lengths = [len(PROMPTS[i]) + len(COMPLETIONS[i].token_ids) for i in rows]
    assert ids[0, :129].tolist() == PROMPTS[1] + COMPLETIONS[1].token_ids
    rest = [i for i in rows if i != 1]
    assert ids[1, :77].tolist() == [t for i in rest for t in PROMPTS[i] + COMPLETIONS[i].token_ids]
    assert positions[0].tolist() == list(range(129)) + list(range(7))
    assert positions[1].tolist() == [p for i in rest for p in range(lengths[i])] + list(range(59))
    placed = packed.scatter(ids.reshape(-1)[packed.keep + 1].double(), batch)
    for r in rows:  # each response token lands at its own row and column
        n = len(COMPLETIONS[r].token_ids)
        assert placed[r, :n].tolist() == [float(t) for t in COMPLETIONS[r].token_ids] and not placed[r, n:].any()


@LAYOUTS
def test_packed_logprobs_and_entropy_equal_padded_ones(model, batch, layout: str):
    """Per token, for every row of a micro-batch of lengths 0 to 120. Log-probs and entropies are float32 by design
    (``algos.common``), so the bound is a few float32 ulps of the value (measured: 0, bit for bit)."""
    rows = torch.arange(len(PROMPTS))
    with torch.no_grad():
        padded, padded_ent = policy_forward(model, batch, rows, 0.7, "metric")
        packed, packed_ent = policy_forward(
            model, batch, rows, 0.7, "metric", packed=_packed(batch, rows.tolist(), layout)
        )
    beyond = torch.arange(padded.shape[1])[None] >= batch.response_length[:, None]
    assert packed.shape == padded.shape and (packed[beyond] == 0).all() and (packed_ent[beyond] == 0).all()
    assert (packed - padded).abs().max() <= 4 * EPS32 * padded.abs().max()
    assert (packed_ent - padded_ent).abs().max() <= 4 * EPS32 * padded_ent.abs().max()
    assert padded.abs().max() > 1  # real numbers, not zeros compared with zeros


def test_running_positions_change_the_numbers(model, batch):
    """The control: the same packed row with position ids that run on across samples (no restart) is one long
    sequence, in which later samples attend to earlier ones; their log-probs differ by far more than the bound."""
    rows = torch.arange(len(PROMPTS))
    packed = _packed(batch, rows.tolist())
    running = replace(packed, position_ids=torch.arange(packed.position_ids.shape[1])[None])
    with torch.no_grad():
        right, _ = policy_forward(model, batch, rows, packed=packed)
        wrong, _ = policy_forward(model, batch, rows, packed=running)
    assert torch.equal(right[0], wrong[0])  # the first sample attends only to itself either way
    assert (right - wrong).abs().max() > 0.1


@pytest.mark.parametrize("packing", [None, "row", "rows"], ids=["padded", "row", "rows"])
def test_the_chunked_head_equals_the_full_logits(model, batch, packing, monkeypatch):
    """Without an entropy loss the head runs chunked on the response positions' hidden states (``linear_token_
    logprobs``: no (b, R, V) logits held to backward); with one it takes the full logits. Both give the same log-
    probs, logged entropy and policy gradient, at temperature 0.7. The log-probs are float32 by design, so the bound
    is float32's: a few ulps on the values, 1e-5 relative on the gradients."""
    from rlfactory.engine.online import update

    chunked_calls = []
    real = update.linear_token_logprobs
    monkeypatch.setattr(update, "linear_token_logprobs", lambda *a, **k: chunked_calls.append(1) or real(*a, **k))
    rows = torch.arange(len(PROMPTS))
    packed = _packed(batch, rows.tolist(), packing) if packing else None

    def run(entropy: str):
        model.zero_grad()
        logprobs, ent = policy_forward(model, batch, rows, 0.7, entropy, packed=packed)
        (logprobs * batch.advantages).sum().backward()
        return logprobs.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    chunked, full = run("metric"), run("loss")
    assert len(chunked_calls) == 1  # the metric run went through the chunked head, the loss run did not
    assert (chunked[0] - full[0]).abs().max() <= 4 * EPS32 * full[0].abs().max()
    assert (chunked[1] - full[1]).abs().max() <= 4 * EPS32 * full[1].abs().max()
    assert full[0].abs().max() > 1 and full[1].abs().max() > 1
    for name, grad in full[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()))
    assert max(float(g.abs().max()) for g in full[2].values()) > 1e-3  # a gradient to compare


@LAYOUTS
def test_eager_attention_packs_exactly_too(batch, layout: str):
    """eager builds the same block-diagonal mask from the position ids. In float32 (eager's padded rows are NaN in
    float64: a padding query row masked with float64's minimum overflows to -inf in its float32 softmax), where a
    different summation order moves a log-prob by a few float32 ulps of its size (measured: 2.3)."""
    model = _load("eager", torch.float32)
    rows = torch.arange(len(PROMPTS))
    with torch.no_grad():
        padded, padded_ent = policy_forward(model, batch, rows, 1.0, "metric")
        packed, packed_ent = policy_forward(
            model, batch, rows, 1.0, "metric", packed=_packed(batch, rows.tolist(), layout)
        )
    assert (packed - padded).abs().max() <= 32 * EPS32 * padded.abs().max()
    assert (packed_ent - padded_ent).abs().max() <= 32 * EPS32 * padded_ent.abs().max()


def _loss_and_grads(model, batch, splits: list[list[int]], packing: str | None, alg: AlgorithmConfig, critic=None):
    """The mini-batch loss summed over micro-batch parts (each packed or padded) and the gradients."""
    net = model if critic is None else critic
    if critic is None:
        loss_fn = actor_loss_fn(model, batch, alg, 0.7, MAX_LEN)
    else:
        loss_fn = critic_loss_fn(critic, batch, alg, MAX_LEN)
    mini = torch.arange(len(PROMPTS))
    net.zero_grad()
    total = 0.0
    for split in splits:
        pos = torch.tensor(split)
        packed = _packed(batch, split, packing) if packing else None
        loss = loss_fn(mini[pos], pos, MiniBatch.local(mini, batch.loss_mask), None, packed).loss
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in net.parameters() if p.grad is not None]


def _varlen_and_padded_gradients(model, varlen_model, batch, splits, layout: str, alg: AlgorithmConfig):
    """(varlen gradient, padded gradient) of every parameter for the actor's loss over ``splits`` (old log-probs !=
    current ones), ``layout`` on the sdpa_varlen model against padded rows; the losses agree to a float32 ulp."""
    with torch.no_grad():
        current, _ = policy_forward(model, batch, torch.arange(batch.responses.shape[0]))
    scored = replace(batch, old_logprobs=current.double() + 0.05 * batch.advantages, ref_logprobs=current.double())
    padded, padded_grads = _loss_and_grads(copy.deepcopy(model), scored, splits, None, alg)
    packed, packed_grads = _loss_and_grads(copy.deepcopy(varlen_model), scored, splits, layout, alg)
    assert packed == pytest.approx(padded, rel=4 * EPS32, abs=4 * EPS32) and padded != 0
    assert len(packed_grads) == len(padded_grads) == len(list(model.parameters()))
    return list(zip(packed_grads, padded_grads, strict=True))


@LAYOUTS
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_packed_updates_give_the_padded_loss_and_gradients(model, batch, agg: str, layout: str):
    """The actor's loss (policy loss + KL loss - entropy bonus, old != current) and every parameter's gradient,
    packed and padded, over the same micro-batches. The loss goes through float32 log-probs (a float32 ulp, as in
    test_stage_grpo's micro-batch test; measured: equal); gradients flow in float64: 1024 float64 ulps, relative
    (measured: 1.2e-15)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        current, _ = policy_forward(model, batch, torch.arange(len(PROMPTS)))
    scored = replace(batch, old_logprobs=current.double() + 0.05 * batch.advantages, ref_logprobs=current.double())
    alg = AlgorithmConfig(adv_estimator="grpo", loss_agg=agg, kl_loss_coef=0.1, entropy_coef=0.01)
    splits = [[1, 5, 2], [0, 4, 3]]
    padded, padded_grads = _loss_and_grads(model, scored, splits, None, alg)
    packed, packed_grads = _loss_and_grads(model, scored, splits, layout, alg)
    assert packed == pytest.approx(padded, rel=4 * EPS32, abs=4 * EPS32) and padded != 0
    assert len(packed_grads) == len(list(model.parameters()))
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert a.dtype == torch.float64
        assert (a - b).abs().max() <= 1024 * EPS64 * b.abs().max()


@LAYOUTS
def test_packed_critic_values_loss_and_gradients_equal_padded_ones(model, batch, layout: str):
    """The critic (trunk + value head) on the packed row: its values, value loss and gradients (measured: values and
    loss equal, gradients 7.7e-16 relative)."""
    from rlfactory.model.value_head import ValueModel

    critic = ValueModel(copy.deepcopy(model)).double()
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # a zero head would value everything 0
    rows = torch.arange(len(PROMPTS))
    with torch.no_grad():
        padded = value_forward(critic, batch, rows)
        packed = value_forward(critic, batch, rows, packed=_packed(batch, rows.tolist(), layout))
    assert (packed - padded).abs().max() <= 1024 * EPS64 * padded.abs().max() and padded.abs().max() > 0
    alg = AlgorithmConfig(adv_estimator="gae")
    loss, grads = _loss_and_grads(model, batch, [[0, 1, 2, 3, 4, 5]], None, alg, critic)
    loss_packed, grads_packed = _loss_and_grads(model, batch, [[0, 1, 2, 3, 4, 5]], layout, alg, critic)
    assert loss_packed == pytest.approx(loss, rel=1024 * EPS64)
    for a, b in zip(grads_packed, grads, strict=True):
        assert (a - b).abs().max() <= 1024 * EPS64 * b.abs().max()


def test_micro_batches_end_at_the_sample_count_or_the_token_budget():
    assert MicroBatching(4).spans([5, 5, 5, 5, 5]) == [(0, 4), (4, 5)]
    assert MicroBatching(8, tokens=10).spans([4, 4, 4, 20, 1]) == [(0, 2), (2, 3), (3, 4), (4, 5)]  # 20: alone
    assert MicroBatching(2, tokens=100).spans([1, 1, 1]) == [(0, 2), (2, 3)]  # the sample count still caps
    assert MicroBatching(2, tokens=100).spans([]) == []


@LAYOUTS
def test_a_token_budget_cuts_the_update_into_smaller_micro_batches_with_the_same_step(model, batch, layout: str):
    """``rollout.micro_batch_tokens`` through the Updater: every micro-batch of the update holds at most the budget's
    prompt + response tokens (or one sample), there are more of them than samples allow alone, and the optimizer
    step is the one the whole mini-batch gives (float64: the parameters agree to float64 rounding)."""
    from accelerate import Accelerator

    prompt, response = host_lengths(batch)
    tokens = [p + r for p, r in zip(prompt, response, strict=True)]
    alg = AlgorithmConfig(adv_estimator="grpo", entropy_coef=0.01)

    def update(micro: MicroBatching):
        net = copy.deepcopy(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        updater = Updater(Accelerator(cpu=True), net, optimizer, scheduler, max_grad_norm=None)
        updater.packing = layout
        inner, calls = actor_loss_fn(net, batch, alg, 0.7, MAX_LEN), []

        def loss_fn(rows, pos, mini, width, packed):
            calls.append(rows.tolist())
            return inner(rows, pos, mini, width, packed)

        torch.manual_seed(0)  # the update's shuffle of the rows
        updater.run(batch, alg, micro, batch.loss_mask, loss_fn, "actor")
        return net, calls

    whole, whole_calls = update(MicroBatching(8))
    cut, cut_calls = update(MicroBatching(8, tokens=60))
    assert len(whole_calls) == 1 and len(cut_calls) > 2
    assert sorted(r for call in cut_calls for r in call) == list(range(len(PROMPTS)))
    assert all(len(call) == 1 or sum(tokens[r] for r in call) <= 60 for call in cut_calls)
    moved = 0.0
    with torch.no_grad():
        for a, b, before in zip(cut.parameters(), whole.parameters(), model.parameters(), strict=True):
            assert (a - b).abs().max() <= 1024 * EPS64 * max(1.0, b.abs().max())
            moved = max(moved, float((b - before).abs().max()))
    assert moved > 1e-6  # the step did something


def test_packing_setting(tmp_path):
    """auto packs transformers' own models (one row with the kernels that skip masked blocks, rows as long as the
    longest sample with sdpa / eager); on and off force it."""
    from rlfactory.config.schema import RunConfig
    from rlfactory.engine.online.loop import packing_on

    def cfg(packing: str, attn: str = "flash_attention_2", remote: bool = False) -> RunConfig:
        return RunConfig.model_validate(
            {
                "stage": "grpo",
                "output_dir": str(tmp_path / "out"),
                "model": {"name_or_path": str(TINY_MODEL), "trust_remote_code": remote, "attn_implementation": attn},
                "data": {"dataset": "arith_prompts"},
                "rollout": {"packing": packing},
                "reward": {"functions": {"answer_match": 1.0}},
            }
        )

    assert packing_on(cfg("auto")) == packing_on(cfg("auto", "flex_attention")) == "row"  # one row: blocks skipped
    assert packing_on(cfg("on", "sdpa")) == packing_on(cfg("on", "eager")) == "rows"  # rows of the longest sample
    assert packing_on(cfg("auto", "sdpa")) == packing_on(cfg("auto", "eager")) == "rows"
    assert packing_on(cfg("auto", remote=True)) is None and packing_on(cfg("on", remote=True)) == "row"
    assert packing_on(cfg("off")) is None


# --------------------------------------------------------------------------- model.attn_implementation: sdpa_varlen
@pytest.fixture(scope="module")
def varlen_model(model):
    """The same float64 weights under ``sdpa_varlen`` (``model.attention``), loaded the way the loader loads it."""
    from rlfactory.model.attention import attention_implementation

    net = _load(attention_implementation("sdpa_varlen"), torch.float64)
    net.load_state_dict(model.state_dict())
    return net


@pytest.fixture
def per_document_calls(monkeypatch):
    """How many attention calls took the varlen path (on CPU: sdpa once per document)."""
    from rlfactory.model import attention

    calls, inner = [], attention._per_document
    monkeypatch.setattr(attention, "_per_document", lambda *a, **k: calls.append(1) or inner(*a, **k))
    return calls


def test_sdpa_varlen_runs_one_packed_row_by_its_documents_with_the_padded_numbers(
    model, varlen_model, batch, per_document_calls
):
    """One row of six samples (lengths 4 to 129), its boundaries passed with it: every layer's attention runs per
    document (not sdpa's masked row), and the log-probs and entropies equal sdpa's padded rows (float64: measured
    equal; bound as the other layouts')."""
    rows = torch.arange(len(PROMPTS))
    packed = _packed(batch, rows.tolist(), "row")
    prompt, response = host_lengths(batch)
    lengths = [p + r for p, r in zip(prompt, response, strict=True)]
    assert packed.cu_seqlens.tolist() == [0, *itertools.accumulate(lengths)] and packed.max_length == max(lengths)
    assert packed.cu_seqlens.dtype == torch.int32 and _packed(batch, rows.tolist(), "rows").cu_seqlens is None
    _assert_varlen_logprobs_are_padded_ones(model, varlen_model, batch, rows, packed, per_document_calls)


def _assert_varlen_logprobs_are_padded_ones(model, varlen_model, batch, rows, packed, per_document_calls) -> None:
    """Log-probs and entropies of ``packed`` on the sdpa_varlen model equal padded sdpa's (bound as the other
    layouts'), and every layer's attention took the per-document path."""
    with torch.no_grad():
        padded, padded_ent = policy_forward(model, batch, rows, 0.7, "metric")
        varlen, varlen_ent = policy_forward(varlen_model, batch, rows, 0.7, "metric", packed=packed)
    assert len(per_document_calls) == varlen_model.config.num_hidden_layers
    assert (varlen - padded).abs().max() <= 4 * EPS32 * padded.abs().max() and padded.abs().max() > 1
    assert (varlen_ent - padded_ent).abs().max() <= 4 * EPS32 * padded_ent.abs().max()


def test_sdpa_varlen_attends_by_the_boundaries_it_is_given(varlen_model, batch):
    """The control: the same row with samples 1 and 2 given as one document (a boundary dropped) changes sample 2's
    numbers and leaves the others' as they were: the boundaries, not the position ids' mask, decide."""
    rows = torch.arange(len(PROMPTS))
    packed = _packed(batch, rows.tolist(), "row")
    merged = replace(packed, cu_seqlens=torch.cat([packed.cu_seqlens[:2], packed.cu_seqlens[3:]]))
    with torch.no_grad():
        right, _ = policy_forward(varlen_model, batch, rows, packed=packed)
        wrong, _ = policy_forward(varlen_model, batch, rows, packed=merged)
    assert torch.equal(right[[0, 1, 3, 4, 5]], wrong[[0, 1, 3, 4, 5]])
    assert (right[2] - wrong[2]).abs().max() > 0.1


def test_sdpa_varlen_is_sdpa_for_padded_rows(model, varlen_model, batch, per_document_calls):
    """A call without boundaries (padded rows, the HF backend's generation) is transformers' sdpa, bit for bit."""
    rows = torch.arange(len(PROMPTS))
    with torch.no_grad():
        sdpa, _ = policy_forward(model, batch, rows)
        varlen, _ = policy_forward(varlen_model, batch, rows)
    assert torch.equal(sdpa, varlen) and not per_document_calls


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_sdpa_varlen_updates_and_critic_give_the_padded_loss_and_gradients(model, varlen_model, batch, agg: str):
    """The actor's loss and every gradient (as test_packed_updates_give_the_padded_loss_and_gradients), and the
    critic's values on the varlen trunk (its ``forward`` passes the boundaries on), equal padded sdpa's."""
    from rlfactory.model.value_head import ValueModel

    alg = AlgorithmConfig(adv_estimator="grpo", loss_agg=agg, kl_loss_coef=0.1, entropy_coef=0.01)
    for a, b in _varlen_and_padded_gradients(model, varlen_model, batch, [[1, 5, 2], [0, 4, 3]], "row", alg):
        assert (a - b).abs().max() <= 1024 * EPS64 * b.abs().max()
    critics = [ValueModel(copy.deepcopy(net)).double() for net in (model, varlen_model)]
    for critic in critics:
        torch.manual_seed(1)
        torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    rows = torch.arange(len(PROMPTS))
    with torch.no_grad():
        padded_values = value_forward(critics[0], batch, rows)
        varlen_values = value_forward(critics[1], batch, rows, packed=_packed(batch, rows.tolist(), "row"))
    assert (varlen_values - padded_values).abs().max() <= 1024 * EPS64 * padded_values.abs().max()
    assert padded_values.abs().max() > 0


def _varlen_grpo_config(tmp_path):
    from rlfactory.config.schema import RunConfig

    return RunConfig.model_validate(
        {
            "stage": "grpo",
            "output_dir": str(tmp_path / "out"),
            "model": {"name_or_path": str(TINY_MODEL), "attn_implementation": "sdpa_varlen"},
            "data": {"dataset": "arith_prompts"},
            "reward": {"functions": {"answer_match": 1.0}},
        }
    )


def test_sdpa_varlen_setting(tmp_path):
    """The loader registers the kernel with transformers; ppo/grpo then pack a micro-batch into one row; this torch
    has the varlen kernel (so a CUDA machine with it gets no environment problem)."""
    from rlfactory.engine.environment import environment_problems
    from rlfactory.engine.online.loop import packing_on
    from rlfactory.model.attention import varlen_kernel_problem
    from rlfactory.model.loader import load_model

    cfg = _varlen_grpo_config(tmp_path)
    assert packing_on(cfg) == "row"
    loaded = load_model(cfg.model, cfg.lora, cfg.freeze)
    assert loaded.config._attn_implementation == "sdpa_varlen"
    assert varlen_kernel_problem() is None and environment_problems(cfg) == []


def test_auto_attention_is_sdpa_varlen_where_the_kernel_runs_and_sdpa_elsewhere(tmp_path, monkeypatch):
    """``model.attn_implementation: auto`` (the default): sdpa_varlen on a CUDA machine whose torch has the kernel,
    for a model with transformers' own code; sdpa on a CPU, for remote code, and on a torch without the kernel,
    where it is no environment problem (an explicit sdpa_varlen is one: the test above). Explicit names stay."""
    import torch.nn.attention.varlen as varlen

    from rlfactory.config.schema import RunConfig
    from rlfactory.engine.environment import environment_problems
    from rlfactory.engine.online.loop import packing_on
    from rlfactory.model.attention import resolved_attention
    from rlfactory.model.loader import load_model

    def cfg(**model) -> RunConfig:
        return RunConfig.model_validate(
            {
                "stage": "grpo",
                "output_dir": str(tmp_path / "out"),
                "model": {"name_or_path": str(TINY_MODEL), **model},
                "data": {"dataset": "arith_prompts"},
                "reward": {"functions": {"answer_match": 1.0}},
            }
        )

    default = cfg()
    assert default.model.attn_implementation == "auto"
    assert resolved_attention(default.model) == "sdpa" and packing_on(default) == "rows"  # this CPU machine
    assert load_model(default.model, default.lora, default.freeze).config._attn_implementation == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolved_attention(default.model) == "sdpa_varlen" and packing_on(default) == "row"
    assert resolved_attention(cfg(trust_remote_code=True).model) == "sdpa"
    for name in ("sdpa", "eager", "flash_attention_2", "sdpa_varlen"):
        assert resolved_attention(cfg(attn_implementation=name).model) == name
    # a model some of whose calls would leave the kernel for sdpa over the whole row keeps sdpa's rows
    config = json.loads((TINY_MODEL / "config.json").read_text())
    changes = {
        "windowed": {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 64},
        "softcapped": {"attn_logit_softcapping": 50.0},
        "dropout": {"attention_dropout": 0.1},
    }
    for name, change in changes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        assert resolved_attention(cfg(name_or_path=str(tmp_path / name)).model) == "sdpa", name
    monkeypatch.setattr(varlen, "varlen_attn", lambda query, key, value, cu_seq_q, cu_seq_k, max_q, max_k: None)
    assert resolved_attention(default.model) == "sdpa"  # torch 2.9's kernel: no scale
    assert not [p for p in environment_problems(default) if "attn_implementation" in p]


def test_a_float32_query_under_cuda_autocast_takes_the_flash_kernel_in_autocasts_dtype():
    """Full and freeze fine-tuning keep float32 weights under bf16 autocast, and the rotary embedding lifts q and k
    to float32: such a call must still take the flash kernel (in bf16, as sdpa would under autocast), not the
    per-document loop (a host sync and a graph break per layer; an H200 caught it). The decision alone, on the CPU:
    CUDA's autocast flag is thread-local state that a CPU build can set; tests/gpu/test_gpu_varlen.py runs it."""
    from types import SimpleNamespace

    from rlfactory.model.attention import flash_dtype

    def query(dtype, cuda=True):
        return SimpleNamespace(is_cuda=cuda, dtype=dtype)

    assert flash_dtype(query(torch.bfloat16)) == torch.bfloat16 and flash_dtype(query(torch.float16)) == torch.float16
    assert flash_dtype(query(torch.float32)) is None  # a float32 model without autocast keeps float32 attention
    assert flash_dtype(query(torch.bfloat16, cuda=False)) is None  # CPU: the per-document path
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        assert flash_dtype(query(torch.float32)) == torch.bfloat16
        assert flash_dtype(query(torch.float32, cuda=False)) is None
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)


def test_sdpa_varlen_on_a_torch_without_the_kernel_is_a_clear_environment_problem(tmp_path, monkeypatch):
    """On a CUDA machine whose torch has no usable varlen kernel (torch 2.9's took no ``scale``), ``train`` refuses
    the run before loading anything, naming the setting, the reason and the way out."""
    import torch.nn.attention.varlen as varlen

    from rlfactory.engine.environment import environment_problems
    from rlfactory.model.attention import varlen_kernel_problem

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):  # 2.9's signature
        raise AssertionError("never called")

    monkeypatch.setattr(varlen, "varlen_attn", old_varlen_attn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _varlen_grpo_config(tmp_path)
    assert "takes no scale (torch >= 2.10 does)" in varlen_kernel_problem()
    (problem,) = [p for p in environment_problems(cfg) if "sdpa_varlen" in p]
    assert problem.startswith("model.attn_implementation: sdpa_varlen needs torch's varlen kernel: torch ")
    assert problem.endswith("; use sdpa")


def test_sdpa_varlen_generates_what_sdpa_generates(model, varlen_model):
    """The HF backend's generation (left-padded prompts, a KV cache, one query position per step) under sdpa_varlen
    is sdpa's: the same greedy tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tokenizer.padding_side = "left"
    prompts = tokenizer(["What is 3 + 4?", "Compute 12 * 11, step by step"], return_tensors="pt", padding=True)
    assert (prompts["attention_mask"] == 0).any()  # padding in the batch
    sdpa = model.generate(**prompts, max_new_tokens=12, do_sample=False)
    varlen = varlen_model.generate(**prompts, max_new_tokens=12, do_sample=False)
    assert torch.equal(sdpa, varlen) and sdpa.shape[1] > prompts["input_ids"].shape[1]


# --------------------------------------------------------------------------- rollout.packing: shared
# three prompts, sampled 3, 2 and 1 times (a group's samples are consecutive rows); one later sample has no response
# tokens, one has a tool result in its response (masked)
GROUP_PROMPTS = [[5, 6, 7]] * 3 + [[19, 3]] * 2 + [[20, 21, 22, 23, 24]]
GROUP_COMPLETIONS = [
    Completion([40], "stop"),
    Completion([41 + i % 50 for i in range(MAX_LEN)], "length"),
    Completion([], "stop"),
    Completion([60, 61, 62, 63, 64, 65, 2], "stop"),
    Completion([70 + i % 30 for i in range(37)] + [2], "stop", mask=[1] * 20 + [0] * 5 + [1] * 13),
    Completion([90 + i % 20 for i in range(15)] + [2], "stop"),
]


@pytest.fixture(scope="module")
def grouped():
    return _noisy_batch(GROUP_PROMPTS, GROUP_COMPLETIONS)


def test_the_shared_layout_holds_each_prompt_once_token_exactly():
    """Rows of prompt/response lengths 2/2, 2/1 (the first row's prompt) and 1/2 in a batch of 2 prompt and 2
    response columns, laid out by hand: the second row's response follows the first row's, its keys are that prompt's
    and its own, its first token is predicted from the prompt's last position, its positions continue the prompt's."""
    packed = PackedRows.build([2, 2, 1], [2, 1, 2], 2, 2, "shared", [0, 0, 2])
    assert packed.gather.tolist() == [0, 1, 2, 3, 6, 9, 10, 11]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    assert packed.kv_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 7]
    assert packed.cu_seqlens.tolist() == [0, 4, 5, 8] and packed.cu_seqlens_k.tolist() == [0, 4, 7, 10]
    assert (packed.max_length, packed.max_length_k) == (4, 4)
    assert packed.keep.tolist() == [1, 2, 1, 5, 6] and packed.targets.tolist() == [2, 3, 4, 6, 7]
    assert packed.place.tolist() == [0, 1, 2, 4, 5] and (packed.rows, packed.width) == (3, 2)


def test_prompt_groups_are_read_from_the_rows(grouped, batch):
    assert host_prompt_groups(grouped) == [0, 0, 0, 3, 3, 5]
    assert host_prompt_groups(batch) == list(range(len(PROMPTS)))  # six different prompts: nothing shared


def test_shared_rows_give_the_padded_log_probs_entropies_and_values(model, varlen_model, grouped, per_document_calls):
    """Log-probs and entropies (float64, as the other layouts), and a critic's values on the varlen trunk."""
    from rlfactory.model.value_head import ValueModel

    rows = torch.arange(len(GROUP_PROMPTS))
    packed = _packed(grouped, rows.tolist(), "shared")
    assert (
        packed.gather.numel()
        == sum(map(len, GROUP_PROMPTS)) + sum(len(c.token_ids) for c in GROUP_COMPLETIONS) - 3 - 3 - 2
    )
    _assert_varlen_logprobs_are_padded_ones(model, varlen_model, grouped, rows, packed, per_document_calls)
    critics = [ValueModel(copy.deepcopy(net)).double() for net in (model, varlen_model)]
    for critic in critics:
        torch.manual_seed(1)
        torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    with torch.no_grad():
        padded_values = value_forward(critics[0], grouped, rows)
        shared_values = value_forward(critics[1], grouped, rows, packed=packed)
    assert (shared_values - padded_values).abs().max() <= 1024 * EPS64 * padded_values.abs().max()
    assert padded_values.abs().max() > 0


@pytest.mark.parametrize("splits", [[[0, 1, 2, 3, 4, 5]], [[1, 3, 0], [4, 5, 2]]], ids=["whole", "split-groups"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01], ids=["chunked-head", "full-logits"])
def test_shared_updates_give_the_padded_loss_and_gradients(model, varlen_model, grouped, splits, entropy_coef):
    """The actor's loss and every gradient, with a group's prompt shared by its samples in a micro-batch (also when a
    group is split over micro-batches); the prompt's last position feeds several samples' first tokens, so its
    gradients must add. Without an entropy loss the LM head runs chunked on the kept positions' hidden states, with
    it on the full logits (``policy_forward``)."""
    alg = AlgorithmConfig(adv_estimator="grpo", loss_agg="token-mean", kl_loss_coef=0.1, entropy_coef=entropy_coef)
    # the log-probs are float32: a later sample's attention (its own mask shape) can round one to the neighbouring
    # float32, and the loss's gradient carries that (measured: 8e-8 of the largest gradient); a gradient that missed
    # a sample's share of the prompt would be off by far more
    for a, b in _varlen_and_padded_gradients(model, varlen_model, grouped, splits, "shared", alg):
        assert (a - b).abs().max() <= 8 * EPS32 * b.abs().max()


def test_the_update_puts_a_groups_samples_side_by_side_within_each_mini_batch():
    from rlfactory.engine.online.update import _grouped

    order = torch.tensor([5, 0, 3, 1, 4, 2])
    assert _grouped(order, [0, 0, 0, 3, 3, 5], 2).tolist() == [0, 3, 5, 1, 2, 4]  # the same rows per mini-batch
    assert _grouped(order, [0, 1, 2, 3, 4, 5], 1).tolist() == [0, 1, 2, 3, 4, 5]


def test_a_shared_update_with_a_token_budget_takes_the_padded_step(model, varlen_model, grouped):
    """The Updater with packing "shared" and a token budget (micro-batches of a few samples) takes the optimizer step
    of padded micro-batches (float64 parameters)."""
    from accelerate import Accelerator

    alg = AlgorithmConfig(adv_estimator="grpo", entropy_coef=0.01, num_mini_batches=2)

    def update(net, packing, micro):
        net = copy.deepcopy(net)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        updater = Updater(Accelerator(cpu=True), net, optimizer, scheduler, max_grad_norm=None)
        updater.packing = packing
        torch.manual_seed(0)  # the update's shuffle of the rows
        updater.run(grouped, alg, micro, grouped.loss_mask, actor_loss_fn(net, grouped, alg, 0.7, MAX_LEN), "actor")
        return net

    padded = update(model, None, MicroBatching(8))
    shared = update(varlen_model, "shared", MicroBatching(8, tokens=60))
    with torch.no_grad():
        pairs = zip(padded.parameters(), model.parameters(), strict=True)
        moved = max(float((b - before).abs().max()) for b, before in pairs)
        assert moved > 1e-6
        for a, b in zip(shared.parameters(), padded.parameters(), strict=True):
            assert (a - b).abs().max() <= 8 * EPS32 * moved  # the step's float32 log-prob rounding, as above


def test_shared_packing_setting(tmp_path):
    from rlfactory.engine.online.loop import packing_on
    from rlfactory.errors import UserError

    cfg = _varlen_grpo_config(tmp_path)
    assert packing_on(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"packing": "shared"})})) == (
        "shared"
    )
    sdpa = cfg.model_copy(
        update={
            "rollout": cfg.rollout.model_copy(update={"packing": "shared"}),
            "model": cfg.model.model_copy(update={"attn_implementation": "sdpa"}),
        }
    )
    with pytest.raises(UserError, match="rollout.packing shared needs model.attn_implementation sdpa_varlen"):
        packing_on(sdpa)


@pytest.mark.slow
def test_a_grpo_run_with_shared_prompts_logs_the_packed_runs_first_step(tmp_path):
    """Through the CLI, one step of grpo (4 prompts x 4 samples, sdpa_varlen) with rollout.packing shared and with
    one packed row: the same rollouts (the same seed and starting weights), so the same loss, gradient norm and KL,
    to float32 rounding."""
    from tests.conftest import run_cli, write_yaml
    from tests.test_stage_grpo import grpo_config

    from rlfactory.engine.run_dir import read_log

    records = {}
    for packing in ("auto", "shared"):
        cfg = grpo_config(
            tmp_path / packing,
            model={"attn_implementation": "sdpa_varlen"},
            rollout={"num_samples": 4, "packing": packing, "temperature": 2.0},
            train={"max_steps": 1},
            algorithm={"kl_loss_coef": 0.1},
            reward={"functions": {"length_penalty": 1.0}},  # lengths vary within groups: advantages do too
        )
        del cfg["evaluation"]
        (tmp_path / packing).mkdir()
        result = run_cli("train", str(write_yaml(tmp_path / packing / "run.yaml", cfg)))
        assert result.returncode == 0, result.stderr[-3000:]
        records[packing] = next(r for r in read_log(tmp_path / packing / "out") if "score/mean" in r)
    assert "rollout.packing shared: micro-batches train as one row" in result.stderr + result.stdout
    auto, shared = records["auto"], records["shared"]
    assert shared["response_length/mean"] == auto["response_length/mean"] and auto["actor/grad_norm"] > 0
    for key in ("loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert shared[key] == pytest.approx(auto[key], rel=1e-5, abs=1e-6), key
