"""``model.attn_implementation: sdpa_varlen``: sdpa, except that a packed row arrives at torch's flash-attention
varlen kernel (``torch.nn.attention.varlen.varlen_attn``) with its documents' boundaries.

Why: a packed row under sdpa goes to the model with a block-diagonal mask built from its position ids, and sdpa's
masked kernel (the memory-efficient one) computes every block of the row's attention, masked or not. In a 7B GRPO
update on an H200 that kernel took 22% of the GPU's time (docs/BENCHMARKS.md, twenty-sixth session), rows being as
long as the longest sample. The varlen kernel computes each document's causal triangle only, so the online stages'
passes can pack a whole micro-batch into ONE row (``packed_rows.PackLayout`` "row") at the cost of its real tokens.
``flash_attention_2`` does the same but needs the flash-attn package (a CUDA build per torch version); this needs
torch alone.

Registered with transformers' ``AttentionInterface`` (its documented way to add a kernel) under ``sdpa_varlen``,
with sdpa's mask function: a call that carries ``cu_seq_lens_q`` (``packed_rows.PackedRows.inputs`` passes them, the
names transformers' flash-attention path reads) runs varlen and ignores the mask; every other call (padded rows,
generation with a cache, sliding windows, dropout) is transformers' sdpa, unchanged. A float32 query runs the flash
kernel in autocast's dtype under CUDA autocast (``flash_dtype``), else the per-document path below.
On CPU (no flash kernel) the varlen call runs sdpa's causal kernel once per document: the same numbers, used by the
CPU tests and by CPU runs.

A call that also carries ``kv_index`` (``data.share_prompt``: a preference pair's prompt computed once, see
``stages/preference_data.collate_shared_pairs``; ``rollout.packing: shared``: a group's, ``packed_rows.PackLayout``)
reads each document's keys and values from those positions of the
row, so a document's keys may be longer than its queries (the rejected response attends to the prompt before the
chosen one); ``cu_seq_lens_k`` / ``max_length_k`` give the key documents. The causal mask is then aligned at the
bottom right (query i of a document with q queries and k keys sees keys 0 .. i + k - q), as the flash kernels align
it when the lengths differ.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rlfactory.errors import model_read_errors

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.9: varlen_kernel_problem says so
    varlen_attn = None

if TYPE_CHECKING:
    from rlfactory.config.model_schema import ModelConfig

log = logging.getLogger(__name__)
NAME = "sdpa_varlen"
# set by register(), outside any compiled code (dynamo would break its graph on inspect or a cached call):
_sdpa_forward: Any = None  # transformers' sdpa attention function, for every call that is not varlen
_varlen_gqa = False  # this torch's varlen_attn has an enable_gqa switch (2.12+)


def resolved_attention(model_cfg: ModelConfig) -> str:
    """``model.attn_implementation`` with ``auto`` settled for this machine: ``sdpa_varlen`` on a CUDA GPU whose torch
    has the varlen kernel, for a model with transformers' own code whose every layer takes it; else ``sdpa``.

    Why varlen by default: it is sdpa for every call but a packed row, and a packed row through it is what made the
    7B GRPO update 1.26x faster with 10 GB less memory on an H200 (docs/BENCHMARKS.md, twenty-seventh session). A
    model with its own code (``trust_remote_code``) may not call transformers' attention interface, so it keeps
    sdpa."""
    name = model_cfg.attn_implementation
    if name != "auto":
        return name
    if model_cfg.trust_remote_code or not torch.cuda.is_available() or varlen_kernel_problem() is not None:
        return _settled("sdpa")
    return _settled(NAME if _every_layer_takes_varlen(str(model_cfg.name_or_path)) else "sdpa")


@functools.cache
def _every_layer_takes_varlen(path: str) -> bool:
    """Whether every layer's packed row would reach the varlen kernel. A sliding-window layer, softcapped logits or
    attention dropout send the call to sdpa (``varlen_attention``), and sdpa over one packed row computes the whole
    row under a mask: 0.26x the padded speed on an H200 (docs/BENCHMARKS.md). Such a model keeps sdpa and its
    rows as long as the longest sample; so does one whose config cannot be read here."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path).get_text_config()
    except model_read_errors():
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        windowed = any(kind != "full_attention" for kind in layer_types)
    else:
        windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    return not (
        windowed
        or getattr(config, "attn_logit_softcapping", None) is not None
        or (getattr(config, "attention_dropout", 0.0) or 0.0) > 0.0
    )


@functools.cache
def _settled(name: str) -> str:
    log.info("model.attn_implementation auto: %s", name)  # once per run, however often it is asked
    return name


def attention_implementation(name: str) -> str:
    """An attention name as transformers takes it (``auto`` settled first: :func:`resolved_attention`):
    ``sdpa_varlen`` is registered first."""
    if name == NAME:
        register()
    return name


@functools.cache
def register() -> None:
    global _sdpa_forward, _varlen_gqa
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _sdpa_forward = sdpa_attention_forward
    _varlen_gqa = varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters
    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the calls that are not varlen need sdpa's masks


def varlen_kernel_problem() -> str | None:
    """Why this torch cannot run the varlen kernel on CUDA (None: it can). torch 2.10 added ``varlen_attn`` with
    ``scale`` and ``window_size``; 2.9's had neither."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if getattr(varlen, "varlen_attn", None) is None:  # read at call time (a test replaces it)
        return f"torch {torch.__version__} has no varlen_attn"
    if "scale" not in inspect.signature(varlen.varlen_attn).parameters:
        return f"torch {torch.__version__}'s varlen_attn takes no scale (torch >= 2.10 does)"
    return None


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, T, D) inputs, (B, T, H, D) output and no weights."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    plain = (
        cu_seqlens is None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]  # a cache: not a packed training row
        or dropout > 0.0
        or sliding_window is not None
        or kwargs.get("softcap") is not None
    )
    if plain:
        return _sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # (T, H, D)
    # max_length_q as given (an int, or a symbolic one in a compiled layer: int() would specialize on it)
    max_q = kwargs.get("max_length_q")
    cu_k, max_k = cu_seqlens, max_q  # a document's keys are its queries, unless kv_index says otherwise
    kv_index = kwargs.get("kv_index")
    if kv_index is not None:  # shared prompts: each document's keys gathered from the row (see the module's doc)
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
        cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_length_k"]
    flash = flash_dtype(query)
    if flash is not None:
        q, k, v = q.to(flash), k.to(flash), v.to(flash)
        out = _flash_varlen(q, k, v, cu_seqlens, cu_k, max_q, max_k, scale)
    else:
        out = _per_document(q, k, v, cu_seqlens, cu_k, scale)
    return out.unsqueeze(0), None


def flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The dtype the flash kernel runs this call in; None: no flash kernel (per-document sdpa).

    A float32 query under CUDA autocast runs in autocast's dtype, as sdpa would: full fine-tuning keeps float32
    weights and trains under bf16 autocast, where the rotary embedding (float32 cos/sin) lifts q and k back to
    float32, and autocast does not cast a custom op's inputs (``varlen_attn``). Without this, every packed
    full-fine-tuning step on a GPU took the per-document path: a host sync and a graph break per layer
    (tests/gpu/test_gpu_host_syncs.py). A float32 model without autocast keeps float32 attention."""
    if not query.is_cuda:
        return None
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if query.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    # (-1, 0): causal, aligned at the bottom right where a document has more keys than queries
    options: dict[str, Any] = {"scale": scale, "window_size": (-1, 0)}
    if k.shape[1] != q.shape[1] and _varlen_gqa:  # grouped-query attention, said out loud where torch asks for it
        options["enable_gqa"] = True
    # torch < 2.12 has no enable_gqa, but its flash kernel takes grouped key/value heads as they are (torch 2.11 on
    # an H200: equal to the call with repeated heads, and 0.57 ms against 0.76: bench/varlen_probe.py), so the heads
    # are never repeated here
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)


def _per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float
) -> torch.Tensor:
    """Each document's causal attention with sdpa (CPU, or a dtype the flash kernel does not take); a document
    with more keys than queries gets the bottom-right-aligned causal mask the flash kernels use."""
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    parts = []
    for q_start, q_end, k_start, k_end in zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:], strict=False):
        if q_end == q_start:
            continue
        doc = [q[q_start:q_end].transpose(0, 1)] + [t[k_start:k_end].transpose(0, 1) for t in (k, v)]  # (H, n, D)
        gqa = doc[1].shape[0] != doc[0].shape[0]
        n_q, n_k = q_end - q_start, k_end - k_start
        if n_q == n_k:
            out = F.scaled_dot_product_attention(*doc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # sdpa's is_causal aligns at the top left: the mask is spelled out
            mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
            out = F.scaled_dot_product_attention(*doc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        parts.append(out.transpose(0, 1))
    return torch.cat(parts) if parts else q.new_zeros(q.shape)
