"""``data.share_prompt``: a micro-batch of preference pairs as ONE row (each prompt once, then its chosen and its
rejected response; the rejected response attends to the prompt's keys through ``kv_index``) gives the numbers of the
padded two-rows-per-pair layout: token-exact layout, the same log-probs, rewards and gradients (float64), and the
same losses through the real stages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import TINY_MODEL
from tests.test_stage_preference import _config

from rlfactory.config.loader import validate_config
from rlfactory.engine.run_dir import read_log
from rlfactory.errors import UserError
from rlfactory.model.attention import attention_implementation
from rlfactory.stages import dpo, orpo, preference_data, rm
from rlfactory.stages.preference_data import collate_pairs, collate_shared_pairs, forward_logps

EPS32 = torch.finfo(torch.float32).eps  # the LM head's log-probs are float32 by design (``model.lm_head``)


def _pairs(vocab: int, seed: int = 0) -> list[dict]:
    """Four pairs of different prompt and response lengths; some response tokens untrained (template glue)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    items = []
    for prompt, chosen, rejected in ((5, 7, 3), (1, 4, 9), (12, 2, 2), (3, 11, 6)):
        items.append({
            "prompt_ids": ids(prompt),
            "chosen_ids": ids(chosen), "chosen_mask": [True] * (chosen - 1) + [False],
            "rejected_ids": ids(rejected), "rejected_mask": [True] * rejected,
            "margin": None,
        })  # fmt: skip
    return items


def test_the_shared_row_lays_out_each_pair_token_exactly():
    """One pair of prompt [a b], chosen [c d] (d untrained) and rejected [e]: the row, positions, key documents, the
    positions that predict each trained token and each side's last position, as written out by hand."""
    item = {"prompt_ids": [10, 11], "chosen_ids": [12, 13], "chosen_mask": [True, False],
            "rejected_ids": [14], "rejected_mask": [True], "margin": 0.5}  # fmt: skip
    second = {"prompt_ids": [20], "chosen_ids": [21], "chosen_mask": [True],
              "rejected_ids": [22, 23], "rejected_mask": [True, True], "margin": None}  # fmt: skip
    batch = collate_shared_pairs([item, second])
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 23]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 2, 0, 1, 1, 2]]
    assert batch["kv_index"].tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6, 5, 7, 8]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 5, 7, 9] and batch["cu_seq_lens_k"].tolist() == [0, 4, 7, 9, 12]
    assert (batch["max_length_q"], batch["max_length_k"]) == (4, 4)
    assert batch["cu_seq_lens_q"].dtype == batch["cu_seq_lens_k"].dtype == torch.int32
    # sides: 0 = chosen of pair 0, 1 = chosen of pair 1, 2 = rejected of pair 0, 3 = rejected of pair 1
    assert batch["logp_rows"].tolist() == [1, 1, 5, 5, 7]  # token 14 is predicted from the prompt's end, as 12 is
    assert batch["logp_targets"].tolist() == [12, 14, 21, 22, 23]
    assert batch["logp_sides"].tolist() == [0, 2, 1, 3, 3]
    assert batch["logp_counts"].tolist() == [1.0, 1.0, 1.0, 2.0]
    assert batch["score_rows"].tolist() == [3, 6, 4, 8]
    assert batch["margin"].tolist() == [0.5, 0.0] and preference_data.count_pairs(batch) == 2.0


@pytest.fixture(scope="module")
def causal_lms():
    """The bundled model in float64 under sdpa (the padded layout) and under sdpa_varlen (the shared row)."""
    from transformers import AutoModelForCausalLM

    padded = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation="sdpa").double()
    varlen = attention_implementation("sdpa_varlen")
    shared = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=varlen).double()
    shared.load_state_dict(padded.state_dict())
    return padded, shared


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_close(mine: torch.Tensor, theirs: torch.Tensor, ulps: float = 8) -> None:
    """Equal but for the float32 rounding of sums taken in another order (the model itself runs in float64)."""
    assert (mine - theirs).abs().max() <= ulps * EPS32 * max(theirs.abs().max().item(), 1.0), (mine, theirs)


def test_shared_rows_give_the_padded_log_probs_and_gradients(causal_lms):
    padded_model, shared_model = causal_lms
    items = _pairs(padded_model.config.vocab_size)
    sums, means = forward_logps(padded_model, collate_pairs(0, 8)(items))
    shared_sums, shared_means = forward_logps(shared_model, collate_shared_pairs(items))
    _assert_close(shared_sums, sums)
    _assert_close(shared_means, means)
    assert sums.abs().min() > 1  # real log-probs, several tokens per side
    (sums * torch.arange(1.0, 9.0, dtype=sums.dtype)).sum().backward()  # every side weighted differently
    (shared_sums * torch.arange(1.0, 9.0, dtype=sums.dtype)).sum().backward()
    padded_grads, shared_grads = _grads(padded_model), _grads(shared_model)
    assert padded_grads.keys() == shared_grads.keys() and len(padded_grads) > 10
    for name, grad in padded_grads.items():
        _assert_close(shared_grads[name], grad, ulps=64)


def test_the_rejected_response_does_not_see_the_chosen_one(causal_lms):
    """Changing a pair's chosen response leaves its rejected response's log-probs as they were (float64 equal)."""
    _, shared_model = causal_lms
    items = _pairs(shared_model.config.vocab_size)
    changed = [{**it, "chosen_ids": [t + 1 for t in it["chosen_ids"]]} for it in items]
    with torch.no_grad():
        before = forward_logps(shared_model, collate_shared_pairs(items))[0]
        after = forward_logps(shared_model, collate_shared_pairs(changed))[0]
    assert torch.equal(before[4:], after[4:]) and not torch.equal(before[:4], after[:4])


def test_shared_rows_give_the_padded_rewards_and_gradients():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    padded_model = AutoModelForSequenceClassification.from_pretrained(
        TINY_MODEL, num_labels=1, attn_implementation="sdpa"
    ).double()
    padded_model.config.pad_token_id = 0
    shared_model = AutoModelForSequenceClassification.from_pretrained(
        TINY_MODEL, num_labels=1, attn_implementation=attention_implementation("sdpa_varlen")
    ).double()
    shared_model.load_state_dict(padded_model.state_dict())
    shared_model.config.pad_token_id = 0
    items = _pairs(padded_model.config.vocab_size, seed=1)
    # responses that end in the pad id (eos used as pad): the classifier pools at the last token that is not pad
    items[0]["chosen_ids"][-1] = 0
    items[1]["rejected_ids"][-2:] = [0, 0]
    rewards = rm.pair_rewards(padded_model, collate_pairs(0, 8)(items))
    shared_rewards = rm.pair_rewards(shared_model, collate_shared_pairs(items, pad_id=0))
    _assert_close(shared_rewards, rewards)
    assert rewards.std() > 0
    rm.bradley_terry(*rewards.chunk(2), 0.0, None).sum().backward()
    rm.bradley_terry(*shared_rewards.chunk(2), 0.0, None).sum().backward()
    padded_grads, shared_grads = _grads(padded_model), _grads(shared_model)
    for name, grad in padded_grads.items():
        _assert_close(shared_grads[name], grad, ulps=64)


def test_share_prompt_is_refused_where_it_cannot_apply(tmp_path: Path):
    cfg = _config(tmp_path, "dpo", data={"share_prompt": True}, model={"attn_implementation": "sdpa"})
    with pytest.raises(UserError, match="data.share_prompt needs model.attn_implementation sdpa_varlen"):
        preference_data.pair_collate(validate_config(cfg, "test"), 0)
    sft = {"stage": "sft", "model": {"name_or_path": "m"}, "data": {"dataset": "d", "share_prompt": True}}
    with pytest.raises(Exception, match="data.share_prompt applies to the paired stages rm, dpo and orpo"):
        validate_config(sft, "test")


@pytest.mark.parametrize("stage", ["dpo", "dpo-precomputed", "orpo", "rm"])
def test_a_stage_with_shared_prompts_logs_the_padded_runs_losses(tmp_path: Path, stage: str, monkeypatch):
    """Three steps of the real stage (LoRA, float32) with and without data.share_prompt: the same logged losses and
    held-out metrics, to float32 rounding of a few hundred sums; only the shared run's attention took the
    per-document (varlen) path."""
    from rlfactory.model import attention

    varlen_calls, inner = [], attention._per_document
    monkeypatch.setattr(attention, "_per_document", lambda *a, **k: varlen_calls.append(1) or inner(*a, **k))
    losses, calls = {}, {}
    for share in (False, True):
        out = tmp_path / str(share)
        out.mkdir()
        sections = {"dpo": {"precompute_ref_logps": True}} if stage == "dpo-precomputed" else {}
        cfg = _config(out, stage.split("-")[0], data={"share_prompt": share, "max_samples": 96}, **sections,
                      model={"attn_implementation": "sdpa_varlen"},
                      train={"max_steps": 3, "per_device_batch_size": 16},
                      logging={"logging_steps": 1, "progress_bar": False, "plot_loss": False})  # fmt: skip
        {"dpo": dpo, "orpo": orpo, "rm": rm}[stage.split("-")[0]].run(validate_config(cfg, "test"))
        losses[share] = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_log(out / "out")]
        calls[share] = len(varlen_calls) - sum(calls.values())
    assert calls[False] == 0 and calls[True] > 0
    assert sum(loss is not None for _, loss, _ in losses[True]) == 3
    assert sum(eval_loss is not None for *_, eval_loss in losses[True]) >= 2
    assert [s for s, *_ in losses[True]] == [s for s, *_ in losses[False]]
    for (_, loss, eval_loss), (_, shared_loss, shared_eval) in zip(losses[False], losses[True], strict=True):
        for a, b in ((loss, shared_loss), (eval_loss, shared_eval)):
            assert (a is None) == (b is None)
            assert a is None or abs(a - b) <= 1e-5 * max(abs(a), 1.0), (losses[False], losses[True])
