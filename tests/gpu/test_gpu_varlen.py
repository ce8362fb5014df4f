"""``model.attn_implementation: sdpa_varlen`` on CUDA: torch's flash-attention varlen kernel computes each document's
causal attention as the per-document float32 reference does (forward and gradients, grouped-query heads), and a
packed GRPO row through a compiled model gives the padded sdpa log-probs. Tolerances from bfloat16's epsilon."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlfactory.model import attention

EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2^-7 = 0.0078


def _documents(lengths: list[int], heads: int, kv_heads: int, dim: int = 128):
    total = sum(lengths)
    torch.manual_seed(0)
    q, k, v = (torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("heads,kv_heads", [(28, 4), (8, 8)], ids=["gqa", "mha"])
def test_the_varlen_kernel_computes_each_documents_causal_attention(heads: int, kv_heads: int):
    assert attention.varlen_kernel_problem() is None
    attention.register()  # as the loader does: this torch's grouped-query setting is read there
    lengths = [1, 37, 300, 1024, 5]
    q, k, v, cu = _documents(lengths, heads, kv_heads)
    _assert_kernel_matches_reference(q, k, v, cu, cu, max(lengths), max(lengths))


def _assert_kernel_matches_reference(q, k, v, cu_q, cu_k, max_q: int, max_k: int) -> None:
    """The flash kernel's bfloat16 output and q/k/v gradients against the per-document float32 reference."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    reference = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = attention._flash_varlen(*inputs, cu_q, cu_k, max_q, max_k, 128**-0.5)
    ref = attention._per_document(*reference, cu_q, cu_k, 128**-0.5)
    assert out.shape == ref.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() <= 4 * EPS_BF16 * ref.abs().max()
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for mine, theirs in zip(inputs, reference, strict=True):
        assert (mine.grad.float() - theirs.grad).abs().max() <= 16 * EPS_BF16 * theirs.grad.abs().max()


@pytest.mark.parametrize("heads,kv_heads", [(28, 4), (8, 8)], ids=["gqa", "mha"])
def test_documents_with_more_keys_than_queries_are_causal_at_the_bottom_right(heads: int, kv_heads: int):
    """``data.share_prompt``'s layout: a document's keys longer than its queries (a rejected response's queries over
    the prompt's keys and its own). The flash kernel aligns the causal mask at the bottom right, as the per-document
    float32 reference spells it out; a top-left kernel would fail this by far more than bfloat16 rounding."""
    attention.register()
    q_lengths, k_lengths = [300, 200, 37, 5], [300, 456, 37, 60]
    q, _, _, cu_q = _documents(q_lengths, heads, kv_heads)
    _, k, v, cu_k = _documents(k_lengths, heads, kv_heads)
    _assert_kernel_matches_reference(q, k, v, cu_q, cu_k, max(q_lengths), max(k_lengths))


def test_float32_queries_under_autocast_run_the_flash_kernel_in_its_dtype():
    """Full fine-tuning keeps float32 weights under bf16 autocast, and the rotary embedding lifts q and k to float32:
    the packed call still runs the flash kernel (in bfloat16, as sdpa would under autocast), not the per-document
    path with its host sync and graph break per layer; the numbers are the float32 reference's within bfloat16
    rounding, gradients reach the float32 inputs. Without autocast a float32 call keeps the float32 path."""
    attention.register()
    lengths = [1, 37, 300, 5]
    q, k, v, cu = (t.float() if t.is_floating_point() else t for t in _documents(lengths, 8, 2))
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    as_model = [t.transpose(0, 1).unsqueeze(0) for t in inputs]  # (1, H, T, D), transformers' layout
    ran = []
    inner = attention._flash_varlen
    attention._flash_varlen = lambda *a, **kw: ran.append(a[0].dtype) or inner(*a, **kw)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = attention.varlen_attention(None, *as_model, None, scaling=128**-0.5, cu_seq_lens_q=cu,
                                                max_length_q=max(lengths))  # fmt: skip
        plain, _ = attention.varlen_attention(None, *as_model, None, scaling=128**-0.5, cu_seq_lens_q=cu,
                                              max_length_q=max(lengths))  # fmt: skip
    finally:
        attention._flash_varlen = inner
    assert ran == [torch.bfloat16]  # autocast's call only
    assert out.dtype == torch.bfloat16 and plain.dtype == torch.float32
    ref = attention._per_document(*(t.detach() for t in (q, k, v)), cu, cu, 128**-0.5).unsqueeze(0)
    assert (plain - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (out.float() - ref).abs().max() <= 4 * EPS_BF16 * ref.abs().max()
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in inputs)


def _three_models():
    """A two-layer Qwen2 shape with one set of weights: float32 sdpa (the reference), bfloat16 sdpa, and bfloat16
    sdpa_varlen with its layers compiled as train.torch_compile compiles them."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().float()
    padded_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().bfloat16()
    varlen = attention.attention_implementation("sdpa_varlen")
    varlen_model = AutoModelForCausalLM.from_config(config, attn_implementation=varlen).cuda().bfloat16()
    padded_model.load_state_dict(reference.state_dict())
    varlen_model.load_state_dict(reference.state_dict())
    for layer in varlen_model.model.layers:
        layer.compile()
    return reference, padded_model, varlen_model


@pytest.mark.parametrize("layout", ["row", "shared"])
def test_a_packed_row_through_compiled_varlen_layers_gives_the_padded_logprobs(layout: str):
    """A two-layer Qwen2 shape, layers compiled as train.torch_compile compiles them: the packed row's bfloat16
    log-probs (varlen) are as close to float32 padded sdpa's as bfloat16 padded sdpa's are (twice their largest
    error, plus a few bfloat16 ulps), and the varlen kernel did run. "shared" (``rollout.packing: shared``): groups
    of samples of one prompt, each prompt computed once."""
    from rlfactory.engine.online.packed_rows import host_prompt_groups
    from rlfactory.engine.online.update import host_lengths, packed_micro_batch, policy_forward
    from rlfactory.rollout.base import Completion
    from rlfactory.rollout.batch import pack_rollouts

    reference, padded_model, varlen_model = _three_models()
    prompts = [[5, 6, 7], list(range(10, 40)), [19]]
    lengths = (700, 3, 64)
    if layout == "shared":  # three samples of the long prompt, two of the first
        prompts, lengths = [prompts[0]] * 2 + [prompts[1]] * 3 + [prompts[2]], (700, 5, 3, 400, 90, 64)
    completions = [Completion([40 + (i * (n + 1)) % 50 for i in range(n)], "length") for n in lengths]
    batch = pack_rollouts(prompts, completions, pad_id=0, mask_truncated=False).to("cuda")
    rows = torch.arange(len(prompts), device="cuda")
    groups = host_prompt_groups(batch) if layout == "shared" else None
    packed = packed_micro_batch(batch, *host_lengths(batch), list(range(len(prompts))), layout, groups)
    ran = []
    inner = attention._flash_varlen
    attention._flash_varlen = lambda *a, **k: ran.append(1) or inner(*a, **k)
    try:
        with torch.no_grad():
            exact, _ = policy_forward(reference, batch, rows)
            padded, _ = policy_forward(padded_model, batch, rows)
            varlen, _ = policy_forward(varlen_model, batch, rows, packed=packed)
    finally:
        attention._flash_varlen = inner
    assert ran  # the compiled layers traced through the varlen kernel
    mask = batch.response_mask.bool()
    padded_error = (padded - exact)[mask].abs().max()
    assert (varlen - exact)[mask].abs().max() <= 2 * padded_error + 4 * EPS_BF16
    assert exact[mask].std() > 0.1  # a model whose log-probs vary (not a flat distribution compared with itself)


def test_shared_prompt_pairs_through_compiled_varlen_layers_give_the_padded_logprobs():
    """``data.share_prompt`` on the GPU: pairs as one row through compiled layers (the kernel's separate key
    documents, ``kv_index``'s gather) against float32 padded sdpa, within twice bfloat16 padded sdpa's own error
    plus a few ulps; the same for the gradient of a weighted sum."""
    from rlfactory.stages.preference_data import collate_pairs, collate_shared_pairs, forward_logps

    reference, padded_model, shared_model = _three_models()
    g = torch.Generator().manual_seed(0)
    items = []
    for prompt, chosen, rejected in ((256, 768, 768), (3, 40, 900), (500, 1, 7)):
        ids = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (prompt, chosen, rejected)]
        items.append({"prompt_ids": ids[0], "chosen_ids": ids[1], "chosen_mask": [True] * chosen,
                      "rejected_ids": ids[2], "rejected_mask": [True] * rejected, "margin": None})  # fmt: skip
    padded_batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate_pairs(0, 8)(items).items()}
    shared_batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in collate_shared_pairs(items).items()}
    weights = torch.arange(1.0, 7.0, device="cuda")
    results = []
    for model, batch in ((reference, padded_batch), (padded_model, padded_batch), (shared_model, shared_batch)):
        sums = forward_logps(model, batch)[0]
        (sums * weights).sum().backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad.float()
        results.append((sums.detach().float(), grad))
    (exact, exact_grad), (padded, padded_grad), (shared, shared_grad) = results
    assert (shared - exact).abs().max() <= 2 * (padded - exact).abs().max() + 4 * EPS_BF16 * exact.abs().max()
    assert (shared_grad - exact_grad).abs().max() <= 2 * (padded_grad - exact_grad).abs().max() + 4 * EPS_BF16 * (
        exact_grad.abs().max()
    )
