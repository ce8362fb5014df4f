"""Preference data path shared by rm/dpo/kto/orpo: rendering, truncation, the concatenated batch, log-probs.

No training here: token-exact masks, the one-forward batch against separate forwards computed by hand,
truncation counts, loss-type checks, KTO's mismatched KL rows and the RM loss against TRL's.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import DATA_DIR, TINY_MODEL

from rlfactory.config.loader import validate_config
from rlfactory.config.schema import ModelConfig
from rlfactory.data.loader import load_examples
from rlfactory.errors import UserError
from rlfactory.model.loader import load_tokenizer
from rlfactory.stages import dpo, kto, preference_data, rm


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()


def _pairs(n: int) -> list[dict]:
    return load_examples(["arith_pref_test"], "pairwise", str(DATA_DIR), max_samples=n)


def _cfg(**data) -> object:
    return validate_config(
        {"stage": "dpo", "model": {"name_or_path": str(TINY_MODEL)}, "data": {"dataset": "arith_pref", **data}}, "test"
    )


def _by_hand(model, prompt: list[int], response: list[int], mask: list[bool]) -> tuple[float, float]:
    """Summed and averaged log-probs of the masked response tokens, one unpadded sequence, full log_softmax."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = F.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    picked = [float(logp[len(prompt) + j - 1, tok]) for j, (tok, m) in enumerate(zip(response, mask, strict=True)) if m]
    return sum(picked), sum(picked) / len(picked)


def test_concatenated_forward_equals_separate_forwards(tokenizer, model):
    examples = _pairs(8)
    items = preference_data.render_pairs(_cfg(), tokenizer, examples)
    batch = preference_data.collate_pairs(tokenizer.pad_token_id)(items)
    assert batch["input_ids"].shape[0] == 2 * len(items)
    assert (
        len(
            {len(it["prompt_ids"]) + len(it["chosen_ids"]) for it in items}
            | {len(it["prompt_ids"]) + len(it["rejected_ids"]) for it in items}
        )
        > 1
    )  # rows of different lengths: padding is exercised
    with torch.no_grad():
        sums, means = preference_data.forward_logps(model, batch)
    rows = [(it["prompt_ids"], it["chosen_ids"], it["chosen_mask"]) for it in items]
    rows += [(it["prompt_ids"], it["rejected_ids"], it["rejected_mask"]) for it in items]
    for row, (prompt, response, mask) in enumerate(rows):
        total, mean = _by_hand(model, prompt, response, mask)
        assert float(sums[row]) == pytest.approx(total, abs=1e-4)
        assert float(means[row]) == pytest.approx(mean, abs=1e-5)


def test_loss_mask_is_token_exact(tokenizer):
    example = _pairs(1)[0]
    item = preference_data.render_pairs(_cfg(), tokenizer, [example])[0]
    assert item["prompt_ids"] == preference_data.render_pair(tokenizer, example)["prompt_ids"]
    batch = preference_data.collate_pairs(tokenizer.pad_token_id)([item, item])
    for row, side in ((0, "chosen"), (2, "rejected")):
        trained = batch["input_ids"][row][batch["loss_mask"][row]].tolist()
        # exactly the assistant turn and its end-of-turn token: no prompt, no "\n" glue, no padding
        assert tokenizer.decode(trained) == example[side][0]["content"] + "<|im_end|>"
        n = len(item["prompt_ids"]) + len(item[f"{side}_ids"])
        assert not batch["loss_mask"][row, : len(item["prompt_ids"])].any()
        attention = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))  # absent: no padding
        assert not batch["loss_mask"][row, n:].any() and not attention[row, n:].any()
    assert tokenizer.decode(item["prompt_ids"]).endswith("<|im_start|>assistant\n")


def test_pad_rows_leaves_out_the_mask_only_without_padding():
    same = preference_data.pad_rows([([1, 2], [3], [True]), ([4], [5, 6], [True, True])], pad_id=0)
    assert "attention_mask" not in same  # sdpa's causal path
    padded = preference_data.pad_rows([([1, 2], [3], [True]), ([4], [5], [True])], pad_id=0)
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_padded_batches_are_aligned_only_when_padded_and_never_past_the_cutoff():
    from rlfactory.data.packing import ALIGN_COLUMNS, padded_width

    assert padded_width([5, 5], ALIGN_COLUMNS) == 5  # unpadded: no mask, sdpa's causal kernel
    assert padded_width([5, 3], ALIGN_COLUMNS) == 8
    assert padded_width([16, 3], ALIGN_COLUMNS) == 16
    assert padded_width([17, 3], ALIGN_COLUMNS, cap=20) == 20  # data.cutoff_len: no position past it
    assert padded_width([5, 3]) == 5  # align 1: as long as the longest row
    rows = [([1, 2], [3], [True]), ([4], [5], [True])]
    batch = preference_data.pad_rows(rows, pad_id=0, align=ALIGN_COLUMNS)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    assert not batch["loss_mask"][:, 3:].any() and batch["logp_rows"].tolist() == [1, 8]


def test_aligned_batches_give_the_same_losses_and_grads_in_float64(tokenizer, model):
    """The columns an aligned collate adds are padding out of every mask: sft's NLL and the pairs' log-probs, and
    their gradients, equal the unaligned batch's in float64."""
    from rlfactory.data.packing import ALIGN_COLUMNS
    from rlfactory.stages import sft

    model64 = copy.deepcopy(model).double()
    weight = model64.lm_head.weight
    sft_items = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [4, 3, 2], "labels": [-100, 3, 2]},
    ]
    pair_items = preference_data.render_pairs(_cfg(), tokenizer, _pairs(4))
    results = []
    for align in (1, ALIGN_COLUMNS):
        padded = sft.collate_padded(tokenizer.pad_token_id, align)(sft_items)
        pairs = preference_data.collate_pairs(tokenizer.pad_token_id, align)(pair_items)
        assert padded["input_ids"].shape[1] % align == 0 and pairs["input_ids"].shape[1] % align == 0
        nll, _ = sft.nll_sum(model64, padded)
        sums, means = preference_data.forward_logps(model64, pairs)
        grads = torch.autograd.grad(nll + sums.sum() + means.sum(), weight)
        results.append((nll.detach(), sums.detach(), means.detach(), grads[0]))
    assert pairs["input_ids"].shape[1] > max(len(i["prompt_ids"]) + len(i["chosen_ids"]) for i in pair_items)
    for unaligned, aligned in zip(*results, strict=True):
        torch.testing.assert_close(aligned, unaligned, rtol=1e-12, atol=1e-12)


def test_linear_token_logprobs_matches_full_log_softmax():
    """Values and both gradients against a float64 log_softmax, with chunks that do not divide the rows."""
    from rlfactory.algos.common import linear_token_logprobs

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels, upstream = torch.randint(0, 50, (37,), generator=g), torch.randn(37, generator=g)
    got = linear_token_logprobs(hidden, weight, labels, chunk_size=8)
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    want = F.log_softmax((hidden @ weight.T).double(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    want_grads = torch.autograd.grad((want * upstream.double()).sum(), (hidden, weight))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    for mine, ref in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("float32_rows", [1024, 3])
def test_linear_nll_sum_matches_cross_entropy_with_gradients_formed_in_forward(monkeypatch, float32_rows):
    """sft's head loss: value and both gradients (scaled by the upstream gradient, as the engine's 1/tokens)
    against a float64 cross-entropy sum, with chunks that do not divide the rows (and float32 passes that do not
    divide a chunk); no grads when not needed."""
    from rlfactory.algos import common
    from rlfactory.algos.common import linear_nll_sum

    monkeypatch.setattr(common, "_FLOAT32_ROWS", float32_rows)

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    got = linear_nll_sum(hidden, weight, labels, chunk_size=8)
    got_grads = torch.autograd.grad(got * 0.25, (hidden, weight))
    want = F.cross_entropy((hidden @ weight.T).double(), labels, reduction="sum")
    want_grads = torch.autograd.grad(want * 0.25, (hidden, weight))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-6)
    for mine, ref in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(mine.double(), ref.double(), atol=1e-5, rtol=1e-5)
    frozen = linear_nll_sum(hidden, weight.detach(), labels, chunk_size=8)  # LoRA: the head is frozen
    (only_h,) = torch.autograd.grad(frozen * 0.25, (hidden,))
    torch.testing.assert_close(only_h.double(), want_grads[0].double(), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # evaluation: the value alone
        torch.testing.assert_close(linear_nll_sum(hidden, weight, labels).double(), want, atol=1e-4, rtol=1e-6)


def test_bf16_head_loss_writes_the_logit_gradient_over_the_logits_and_matches_float64(monkeypatch):
    """The eager path on a bf16 chunk (float32 passes of 4 rows, the gradient cast back into the logits)."""
    from rlfactory.algos import common

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(10, 40, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (10, 1), generator=g)
    work = logits.to(torch.bfloat16)
    exact = work.double().requires_grad_()
    want = F.cross_entropy(exact, labels[:, 0], reduction="sum")
    monkeypatch.setattr(common, "_FLOAT32_ROWS", 4)
    nll = common._nll_and_dlogits_(work, labels, grads=True)
    torch.testing.assert_close(nll.double(), want.detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(work.double(), torch.autograd.grad(want, exact)[0], atol=4e-3, rtol=1e-2)


def test_the_fusable_chunk_function_gives_the_same_nll_and_logit_gradient():
    """The function train.torch_compile compiles on CUDA (one kernel per chunk, the gradient written over the
    logits), run eagerly here."""
    from rlfactory.algos.common import _nll_and_dlogits_fusable_

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 30, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 30, (9,), generator=g)
    work = logits.detach().clone()
    nll = _nll_and_dlogits_fusable_(work, labels[:, None])
    want = F.cross_entropy(logits, labels, reduction="sum")
    torch.testing.assert_close(nll.double(), want.detach(), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(work, torch.autograd.grad(want, logits)[0], atol=1e-6, rtol=1e-6)


def test_lm_head_chunks_hold_a_fixed_logits_budget():
    from rlfactory.algos.common import _chunk_rows

    assert _chunk_rows(151936) == 4096  # Qwen2.5: 1.2 GB of bf16 logits
    assert _chunk_rows(262144) == 2048
    assert _chunk_rows(32000) == 19 * 1024
    assert _chunk_rows(151936, eager=True) == 2048  # eager: room for the float32 pass
    assert _chunk_rows(10_000_000) == 1024  # never fewer rows than this


def test_sft_loss_through_the_chunked_head_equals_the_models_own_loss(tokenizer, model):
    """sft.nll_sum (hooked hidden states + chunked head, labelled positions only) against transformers' own
    summed loss on the full logits, value and LM-head gradient, on a padded batch with masked prompt tokens."""
    from rlfactory.stages import sft

    items = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [4, 3, 2], "labels": [-100, 3, 2]},
    ]
    batch = sft.collate_padded(tokenizer.pad_token_id)(items)
    got, _ = sft.nll_sum(model, batch)
    got_grad = torch.autograd.grad(got, model.lm_head.weight)[0]
    want = model(
        **{k: batch[k] for k in ("input_ids", "attention_mask")}, labels=batch["labels"], num_items_in_batch=1
    ).loss
    want_grad = torch.autograd.grad(want, model.lm_head.weight)[0]
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-4, rtol=1e-4)  # tied: embedding grads add in


def test_target_rows_are_the_labelled_next_token_positions_found_on_the_host(tokenizer, model):
    """The collate's flat row indices (padded and packed) are exactly the positions whose next token is trained,
    and the loss through them equals the boolean-mask path."""
    from rlfactory.model.lm_head import nll_sum as head_nll_sum
    from rlfactory.stages import sft

    items = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [4, 3, 2], "labels": [-100, 3, 2]},
    ]
    padded = sft.collate_padded(tokenizer.pad_token_id)(items)
    assert padded["target_rows"].tolist() == [1, 2, 3, 5, 6]  # row 0: t=1..3 predict 7, 8, 9; row 1: t=0, 1
    packed = sft.collate_packed(items)
    # one row of 8: position 4 (the first document's end) does not predict the second document's first token
    assert packed["target_rows"].tolist() == [1, 2, 3, 5, 6]
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        by_rows = head_nll_sum(model, inputs, padded["labels"], padded["target_rows"])
        by_mask = head_nll_sum(model, inputs, padded["labels"])
    torch.testing.assert_close(by_rows, by_mask)


def test_forward_logps_fused_head_equals_full_logits(tokenizer, model):
    """The hooked path (hidden states + chunked head, response positions only) against full logits, with grads."""
    items = preference_data.render_pairs(_cfg(), tokenizer, _pairs(4))
    batch = preference_data.collate_pairs(tokenizer.pad_token_id)(items)
    from rlfactory.model.lm_head import lm_parts

    assert lm_parts(model) is not None  # the chunked-head path is the one under test
    sums, means = preference_data.forward_logps(model, batch)
    fused_grad = torch.autograd.grad(sums.sum() + means.sum(), model.lm_head.weight)[0]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want_sums, want_means = preference_data.sequence_logps(logits, batch["input_ids"], batch["loss_mask"])
    want_grad = torch.autograd.grad(want_sums.sum() + want_means.sum(), model.lm_head.weight)[0]
    torch.testing.assert_close(sums, want_sums, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(means, want_means, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grad, want_grad, atol=1e-4, rtol=1e-4)


def test_logp_rows_from_the_host_give_the_boolean_masks_logps_and_grads(tokenizer, model):
    """``logp_rows`` (the collate's flat indices of the trained next-token positions, found on the host so the GPU
    never waits on a boolean selection) selects exactly the mask's positions: the same log-probs and gradients as
    the boolean-mask path, in float64."""
    items = preference_data.render_pairs(_cfg(), tokenizer, _pairs(4))
    batch = preference_data.collate_pairs(tokenizer.pad_token_id)(items)
    shifted = torch.zeros_like(batch["loss_mask"])
    shifted[:, :-1] = batch["loss_mask"][:, 1:]
    assert batch["logp_rows"].tolist() == shifted.flatten().nonzero().squeeze(1).tolist()
    model64 = copy.deepcopy(model).double()
    params = [p for p in model64.parameters() if p.requires_grad]
    results = []
    for with_rows in (True, False):
        use = batch if with_rows else {k: v for k, v in batch.items() if k != "logp_rows"}
        sums, means = preference_data.forward_logps(model64, use)
        results.append((sums, means, torch.autograd.grad(sums.sum() + means.sum(), params)))
    (sums, means, grads), (want_sums, want_means, want_grads) = results
    torch.testing.assert_close(sums, want_sums, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(means, want_means, rtol=1e-12, atol=1e-12)
    for grad, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def test_select_rows_has_index_selects_values_and_gradient():
    """``lm_head.select_rows`` (a copying backward instead of index_select's atomic adds) is index_select, forward
    and backward, for distinct rows; rows left out get a zero gradient."""
    from rlfactory.model.lm_head import select_rows

    source = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([7, 0, 3, 11, 4])
    weights = torch.randn(5, 5, dtype=torch.float64)
    picked = select_rows(source, rows)
    want = source.index_select(0, rows)
    torch.testing.assert_close(picked, want, rtol=0, atol=0)
    grad = torch.autograd.grad((picked * weights).sum(), source)[0]
    want_grad = torch.autograd.grad((want * weights).sum(), source)[0]
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    assert grad[[1, 2, 5, 6, 8, 9, 10]].abs().sum() == 0


def test_truncation_splits_the_budget_as_llamafactory_and_counts(tokenizer, caplog):
    assert preference_data.fit_prompt([1, 2, 3, 4], 3, 10, "right") == [1, 2, 3, 4]
    assert preference_data.fit_prompt([1, 2, 3, 4], 8, 10, "right") == [3, 4]
    assert preference_data.fit_prompt([1, 2, 3, 4], 8, 10, "drop") is None
    assert preference_data.fit_prompt([1, 2, 3, 4], 10, 10, "right") is None  # no prompt token left
    # a pair with a long prompt and long responses: LLaMA-Factory's proportional split (prompt 60, responses 90 ->
    # 40 + 60 of 100 tokens); the prompt keeps its end, each response its start
    item = {
        "prompt_ids": list(range(60)),
        "chosen_ids": list(range(100, 190)),
        "chosen_mask": [True] * 90,
        "rejected_ids": list(range(200, 280)),
        "rejected_mask": [True] * 80,
    }
    cut, outcome = preference_data.fit_pair(item, 100, "right")
    assert outcome == "shortened"
    assert cut["prompt_ids"] == list(range(20, 60)) and cut["chosen_ids"] == list(range(100, 160))
    assert cut["rejected_ids"] == list(range(200, 260)) and len(cut["rejected_mask"]) == 60
    assert preference_data.fit_pair(item, 200, "right") == (item, "kept")
    assert preference_data.fit_pair(item, 100, "drop") == (None, "longer than the limit (data.truncation: drop)")
    # sides that differ only at their end: the proportional cut would make them equal, so the responses keep their
    # whole length and the prompt gives way
    same_start = {**item, "rejected_ids": list(range(100, 189)) + [7], "rejected_mask": [True] * 90}
    cut, outcome = preference_data.fit_pair(same_start, 100, "right")
    assert outcome == "shortened" and cut["chosen_ids"] == item["chosen_ids"] and len(cut["prompt_ids"]) == 10
    assert preference_data.fit_pair(same_start, 60, "right") == (None, "chosen and rejected identical within the limit")

    examples = _pairs(4)
    full = preference_data.render_pairs(_cfg(), tokenizer, examples)
    longest = max(max(len(it["chosen_ids"]), len(it["rejected_ids"])) for it in full)
    cutoff = longest + 5
    with caplog.at_level(logging.WARNING):
        cut = preference_data.render_pairs(_cfg(cutoff_len=cutoff), tokenizer, examples)
    assert len(cut) == 4 and f"after data.cutoff_len={cutoff}: 4 of 4 kept (4 shortened)" in caplog.text
    for before, after in zip(full, cut, strict=True):
        assert after["prompt_ids"] == before["prompt_ids"][-len(after["prompt_ids"]) :]
        assert len(after["prompt_ids"]) + max(len(after["chosen_ids"]), len(after["rejected_ids"])) <= cutoff
    with pytest.raises(UserError, match="no example fits data.cutoff_len"):
        preference_data.render_pairs(_cfg(cutoff_len=cutoff, truncation="drop"), tokenizer, examples)


def test_dpo_loss_type_checks():
    with pytest.raises(UserError) as err:
        dpo.check_loss_type("sigmod")
    assert "did you mean 'sigmoid'" in str(err.value)
    for name in ("sigmoid", "ipo", "hinge", "robust", "simpo"):
        assert name in str(err.value)
        dpo.check_loss_type(name)
    for name in ("orpo", "kto"):
        with pytest.raises(UserError, match=f"objective of stage {name}"):
            dpo.check_loss_type(name)


def test_kto_splits_pairs_and_kl_rows_never_reuse_the_prompt(tokenizer):
    pairs = _pairs(3)
    examples = kto.split_pairs(pairs)
    assert [e["label"] for e in examples] == [True, False] * 3
    assert examples[1]["messages"][-1] == pairs[0]["rejected"][0]
    cfg = validate_config(
        {"stage": "kto", "model": {"name_or_path": str(TINY_MODEL)}, "data": {"dataset": "arith_kto"}}, "test"
    )
    items = kto.render_unpaired(cfg, tokenizer, examples)
    batch = kto.collate_unpaired(tokenizer.pad_token_id, 256)(items)
    assert batch["desirable"].tolist() == [True, False] * 3
    for row, other in enumerate(kto.mismatched(items)):
        assert other["prompt_ids"] != items[row]["prompt_ids"]
        kl_trained = batch["kl_input_ids"][row][batch["kl_loss_mask"][row]].tolist()
        assert kl_trained == [t for t, m in zip(other["ids"], other["mask"], strict=True) if m]
    with pytest.raises(UserError, match="only desirable"):
        kto.check_labels([e for e in examples if e["label"]], ["mine"], cfg.kto)


def test_reward_loss_matches_trl_reward_trainer(tokenizer, tmp_path):
    """Our summed Bradley-Terry loss / pairs == TRL 1.16 RewardTrainer.compute_loss on the same model and batch."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    cfg = validate_config(
        {
            "stage": "rm",
            "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
            "data": {"dataset": "arith_pref"},
            "rm": {"center_rewards_coefficient": 0.01},
        },
        "test",
    )
    from rlfactory.model.heads import load_reward_model_for_training

    model = load_reward_model_for_training(cfg, tokenizer.pad_token_id)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # rewards far from 0, so the centering term matters
    model.train()  # TRL files metrics under the mode; dropout is 0 in the tiny model
    items = preference_data.render_pairs(cfg, tokenizer, _pairs(6))
    batch = preference_data.collate_pairs(tokenizer.pad_token_id)(items)
    batch["margin"] = torch.linspace(0.0, 1.0, len(items))
    section = cfg.rm.model_copy(update={"margin_column": True})
    ours, metrics = rm.make_loss(section)(model, batch)
    data = Dataset.from_dict({"chosen": ["a"], "rejected": ["b"]})
    args = RewardConfig(
        output_dir=str(tmp_path), center_rewards_coefficient=0.01, report_to=[], use_cpu=True, bf16=False
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "margin": batch["margin"]}
    theirs = trainer.compute_loss(model, inputs)
    assert float(ours) / len(items) == pytest.approx(float(theirs), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(trainer._metrics["train"]["accuracy"][-1])


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "ipo", "hinge", "simpo"])
def test_every_dpo_loss_type_on_one_batch(tokenizer, model, loss_type):
    """Policy == reference: DPO-family losses sit at their value for a zero margin; precomputed == live reference;
    sft_weight (RPO) adds exactly the chosen responses' mean token NLL."""
    from rlfactory.config.schema import DPOConfig
    from rlfactory.model.reference import ReferencePolicy

    section = DPOConfig(loss_type=loss_type, beta=0.5, simpo_gamma=0.0)
    loss, traits = dpo.check_loss_type(loss_type)
    items = preference_data.render_pairs(_cfg(), tokenizer, _pairs(4))
    collate = preference_data.collate_pairs(tokenizer.pad_token_id)
    live = None if traits["reference_free"] else ReferencePolicy(model, copy=model)
    with torch.no_grad():
        total, metrics = dpo.make_loss(section, loss, traits, live)(model, collate(items))
        # -log sigmoid(0) = log 2; ipo (0 - 1/(2 beta))^2 = 1; hinge max(0, 1 - 0) = 1
        zero_margin = {"sigmoid": math.log(2), "robust": math.log(2), "ipo": 1.0, "hinge": 1.0}
        if loss_type != "simpo":  # simpo compares chosen with rejected directly: not zero at the start
            assert float(total) / len(items) == pytest.approx(zero_margin[loss_type], rel=1e-5)
            assert metrics["rewards/margins"] == 0.0
        if live is not None:
            dpo.precompute_pairs(
                None,
                _cfg(),
                model,
                [items],
                collate=collate,
                batch_size=3,
                length_normalised=traits["length_normalised"],
            )
            precomputed, _ = dpo.make_loss(section, loss, traits, None)(model, collate(items))
            assert float(precomputed) == pytest.approx(float(total), rel=1e-6)
        with_nll, _ = dpo.make_loss(section.model_copy(update={"sft_weight": 1.0}), loss, traits, live)(
            model, collate(items)
        )
        _, means = preference_data.forward_logps(model, collate(items))
    assert float(with_nll - total) == pytest.approx(float(-means[: len(items)].sum()), rel=1e-5)
