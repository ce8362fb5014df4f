"""The memory terms of ``rlfactory plan``: pure functions of a model's shape and a run's sizes -> bytes per GPU.

Each term models what this project's code does (not a generic rule of thumb), and says which code that is:
transformers' decoder layers as they save tensors for backward, the LM-head kernels of ``algos/common.py``, the
optimizer of ``engine/shared.py``, the strategies of ``engine/deepspeed/*.json`` and Accelerate's FSDP2 plugin,
the vLLM engine of ``rollout/vllm.py``. ``engine/plan.py`` reads a config and adds them up.

Units: bytes; "per token per layer" terms are multiplied by the micro-batch's tokens and the layer count.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

GiB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the terms need from a model's config.json (read by ``engine.plan.model_shape``, no weights).

    ``linears``: every ``nn.Linear`` of one decoder layer as ``name -> (in_features, out_features)`` (q_proj,
    ..., down_proj), from which LoRA's adapter sizes follow. ``params_*``: parameter counts by part; ``head`` is 0
    when the output embedding is tied to the input one."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    params_embed: int
    params_layers: int
    params_head: int
    params_other: int
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def params(self) -> int:
        return self.params_embed + self.params_layers + self.params_head + self.params_other

    @property
    def params_per_layer(self) -> int:
        return self.params_layers // self.layers

    @property
    def linear_params_per_layer(self) -> int:
        return sum(i * o for i, o in self.linears.values())


# --------------------------------------------------------------------------- parameters
def lora_params(shape: ModelShape, targets: str | list[str], rank: int) -> int:
    """Adapter parameters: each targeted linear (in, out) gets A (r x in) and B (out x r), so r (in + out) each.

    ``targets`` as PEFT reads them: ``all-linear`` (every linear but the output head), a list of names (a module
    matches by its last name), or one string (a regular expression over the module's full name; matched here
    against ``layers.<i>.<name>``). Per layer times the layer count: only decoder-layer linears are counted."""
    if targets == "all-linear":
        chosen = list(shape.linears)
    elif isinstance(targets, str):
        chosen = [name for name in shape.linears if re.fullmatch(targets, f"model.layers.0.{name}")]
    else:
        chosen = [name for name in shape.linears if name.split(".")[-1] in targets]
    return shape.layers * sum(rank * (shape.linears[n][0] + shape.linears[n][1]) for n in chosen)


def weights_bytes(params: int, dtype_bytes: int, shards: int = 1) -> float:
    """The weights held on one GPU: params x bytes of their dtype, split over ``shards`` (ZeRO-3/FSDP2)."""
    return params * dtype_bytes / shards


def quantized_weights_bytes(shape: ModelShape, bits: int, double_quant: bool) -> float:
    """QLoRA's frozen base as ``model.loader`` loads it: the decoder layers' linears in ``bits`` bits through
    bitsandbytes, and everything else (embeddings, head, norms) cast to float32 by peft's
    ``prepare_model_for_kbit_training``.

    4 bits: half a byte per weight plus one absmax per block of 64 (float32, or with ``double_quant`` an 8-bit
    absmax and one float32 per 256 of those). 8 bits (LLM.int8): one byte per weight plus a float32 scale per
    output row."""
    linear = shape.layers * shape.linear_params_per_layer
    if bits == 8:
        quantized = linear + shape.layers * sum(out for _, out in shape.linears.values()) * 4
    else:
        constants = 1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64
        quantized = linear * (0.5 + constants)
    return quantized + (shape.params - linear) * 4


@dataclass(frozen=True)
class States:
    """Per-GPU bytes of the trainable parameters' gradients, optimizer moments and fp32 master copy."""

    grads: float
    optimizer: float
    master: float = 0.0
    buckets: float = 0.0


def adamw_states(trainable: int, param_bytes: int, strategy: str, processes: int) -> States:
    """AdamW's state per GPU for ``trainable`` parameters stored in ``param_bytes``.

    ddp (torch AdamW, fused on CUDA): gradients in the parameter's dtype, two moments in it too (torch's
    ``zeros_like``), no master copy: fp32 params (the default for full fine-tuning, LoRA adapters) give 4 + 8
    bytes, bf16 params 2 + 4. Several DDP processes add a gradient bucket copy (Accelerate's DDP default,
    ``gradient_as_bucket_view`` off). DeepSpeed zero2/zero3 (bf16 on): an fp32 master copy, an fp32 gradient
    partition and fp32 moments, each split over the processes (4 + 4 + 8 bytes / N, the ZeRO paper's K = 12 plus the
    fp32 gradient); zero2 also keeps its reduce + all-gather buckets (5e8 elements in bf16 each, bundled JSON),
    at most the trainable size. zero3_offload: all of it on the host. fsdp2: the ddp states, sharded."""
    n = processes
    if strategy in ("zero2", "zero3"):
        buckets = 2 * min(5e8, trainable) * 2 if strategy == "zero2" else 0.0
        return States(grads=4 * trainable / n, optimizer=8 * trainable / n, master=4 * trainable / n, buckets=buckets)
    if strategy == "zero3_offload":
        return States(grads=0.0, optimizer=0.0)
    shards = n if strategy == "fsdp2" else 1
    buckets = trainable * param_bytes if strategy == "ddp" and n > 1 else 0.0
    grads = trainable * param_bytes / shards
    return States(grads=grads, optimizer=2 * grads, buckets=buckets)


# --------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class Precision:
    """Bytes of the compute dtype (``compute``: the matmuls' outputs) and of the weights; ``autocast``: fp32 weights
    run under bf16/fp16 autocast, so every linear saves its own low-precision copy of its input."""

    compute: int
    weights: int

    @property
    def autocast(self) -> bool:
        return self.weights == 4 and self.compute == 2


def eager_layer_bytes(shape: ModelShape, p: Precision) -> float:
    """Bytes one decoder layer saves for backward per token, transformers' eager modules (Llama/Qwen2 layout).

    Counted from what autograd keeps (checked with ``saved_tensors_hooks`` in tests/test_plan.py):
    - each of the 2 RMSNorms: its input in float32 (4h), the 1/rms per token (4), the normalised x (a h) and, with
      weights in the compute dtype, the weighted output the next linears read (a h); under autocast (fp32
      weights) the weighted output stays fp32 and each linear reading it saves its own cast (a h x 3 for q/k/v,
      x 2 for gate/up) instead;
    - attention (sdpa): q (a x q_dim), k and v (a x kv_dim each), the output (a x q_dim), the log-sum-exp (4 per head)
      (under CPU autocast the Qwen2.5-0.5B shape at 1024 tokens also saved the q/k/v projections once more,
      a (q_dim + 2 kv_dim), 2% of its layer; the bundled model's shape does not: not counted);
    - SwiGLU MLP: gate, up, silu(gate) and the product down_proj reads: 4 x a x intermediate.
    """
    a, h = p.compute, shape.hidden
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if p.autocast:
        norms = 2 * (4 * h + 4 + 4 * h) + 5 * a * h
    else:
        norms = 2 * (4 * h + 4 + 2 * a * h)
    attention = 2 * a * q_dim + 2 * a * kv_dim + 4 * shape.heads
    return norms + attention + 4 * a * shape.intermediate


def liger_layer_bytes(shape: ModelShape, p: Precision) -> float:
    """Liger's layer kernels (full/freeze on CUDA, ``model.liger_kernel`` auto/on, uncompiled): its RMSNorm saves
    its input and 1/rms only, its SwiGLU saves gate and up (silu is recomputed), the rest is the eager layer's."""
    a, h = p.compute, shape.hidden
    eager = eager_layer_bytes(shape, p)
    eager_norms = 2 * (4 * h + 4 + 4 * h) if p.autocast else 2 * (4 * h + 4 + 2 * a * h)
    liger_norms = 2 * (p.weights * h + 4) if p.autocast else 2 * (a * h + 4 + a * h)
    return eager - eager_norms + liger_norms - a * shape.intermediate


# measured compiled activations / the eager formula's (Qwen2.5-0.5B LoRA sft, H100, BENCHMARKS call 7)
COMPILED_FACTOR = 0.72


def compiled_layer_bytes(shape: ModelShape, p: Precision) -> float:
    """``train.torch_compile``: the compiler recomputes pointwise ops (norms, silu, the SwiGLU product) in backward
    instead of saving them. Not derived op by op (what Inductor's partitioner keeps depends on its heuristics):
    the eager formula scaled by a measured ratio: 41.2 KB per token per layer compiled (8.59 GiB after the decoder's
    forward, 8 x 1024 tokens, less weights and adapter states) against 57.4 KB from ``eager_layer_bytes`` (the
    same run uncompiled measured 54.5 KB: the eager formula is 5% above that card's)."""
    return COMPILED_FACTOR * eager_layer_bytes(shape, p)


LAYER_PATHS: dict[str, Callable[[ModelShape, Precision], float]] = {
    "eager": eager_layer_bytes,
    "liger": liger_layer_bytes,
    "compiled": compiled_layer_bytes,
}


def lora_layer_bytes(shape: ModelShape, targets: list[str], rank: int, dropout: float, p: Precision) -> float:
    """What LoRA adds per token per layer: each adapter saves A's output (r floats, the adapter is float32); with
    ``lora.dropout`` > 0 each also saves its dropped-out input copy and the mask (a + 1 bytes per input feature)."""
    extra = 0.0
    for name in targets:
        extra += 4 * rank + (shape.linears[name][0] * (p.compute + 1) if dropout > 0 else 0)
    return extra


def decoder_activation_bytes(
    per_layer: float, shape: ModelShape, tokens: int, checkpointing: bool, p: Precision
) -> float:
    """The decoder's saved activations for ``tokens`` tokens of one micro-batch.

    Without checkpointing every layer keeps ``per_layer`` per token. With ``model.gradient_checkpointing``
    (transformers, non-reentrant) a layer keeps only its input (the residual stream, 4h under autocast, else a h) and
    backward recomputes one layer at a time, whose full activations exist once. The final norm adds its own."""
    residual = 4 if p.autocast else p.compute
    final_norm = 4 * shape.hidden + 4 + residual * shape.hidden
    if checkpointing:
        return tokens * (shape.layers * residual * shape.hidden + per_layer + final_norm)
    return tokens * (shape.layers * per_layer + final_norm)


def autocast_copy_bytes(shape: ModelShape, p: Precision) -> float:
    """fp32 weights under bf16 autocast: autocast caches a bf16 copy of every linear weight of the forward, and
    backward keeps them (saved by the matmuls) until it is done: 2 bytes per linear parameter of the layers."""
    return shape.layers * shape.linear_params_per_layer * p.compute if p.autocast else 0.0


# --------------------------------------------------------------------------- the LM head
FLOAT32_ROWS = 1024  # algos.common._FLOAT32_ROWS: rows of a chunk upcast at a time on the eager path
CHUNK_LOGITS_BYTES = 1.25e9  # algos.common._CHUNK_LOGITS_BYTES


def chunk_rows(vocab: int, eager: bool) -> int:
    """Rows per chunk of sft's head (``algos.common._chunk_rows``): whole 1024s within 1.25 GB of bf16 logits,
    half that on the eager path."""
    budget = CHUNK_LOGITS_BYTES / (2 if eager else 1)
    return max(1024, int(budget // (vocab * 2)) // 1024 * 1024)


def sft_head_bytes(
    shape: ModelShape, rows: int, p: Precision, compiled: bool, weight_trainable: bool
) -> tuple[float, float]:
    """sft/pt's loss (``algos.common.linear_nll_sum``): gradients are formed in the forward, chunk by chunk.
    Returns (held, transient).

    Held from the loss to backward: grad_hidden (rows x h in the hidden's dtype) and, when the head weight trains,
    grad_weight (V x h in its dtype); the hidden rows picked (a copy) and, under autocast, their cast and the
    weight's cast. Transient, one chunk at a time: its logits (chunk x V x a), and on the eager path the float32
    pass over 1024 rows plus log-sum-exp's float32 temporary (2 x 1024 x V x 4) when the logits are not float32."""
    v, h = shape.vocab, shape.hidden
    hidden_bytes = 4 if p.autocast else p.compute
    held = rows * h * hidden_bytes * 2 + (v * h * p.weights if weight_trainable else 0)
    if p.autocast:
        held += rows * h * p.compute + v * h * p.compute
    chunk = min(rows, chunk_rows(v, eager=not compiled))
    transient = chunk * v * p.compute
    if not compiled and p.compute != 4:
        transient += 2 * min(chunk, FLOAT32_ROWS) * v * 4
    return held, transient


LOGPROB_CHUNK = 2048  # algos.common.linear_token_logprobs' chunk_size


def logprob_head_bytes(shape: ModelShape, rows: int, p: Precision) -> tuple[float, float]:
    """dpo/kto/orpo's and the online update's per-token log-probs (``linear_token_logprobs``, recomputed in
    backward; the online update's logged entropy runs in smaller chunks, without gradient): the picked hidden
    rows (held), and one chunk's logits, their float32 copy and the log-sum-exp temporary at a time (transient).
    Liger's fused kernel (CUDA default) uses smaller chunks; this is the torch loop's budget, the larger of the two."""
    chunk = min(rows, LOGPROB_CHUNK)
    return rows * shape.hidden * p.compute, chunk * shape.vocab * (p.compute + 4 + 4)


def full_logits_bytes(shape: ModelShape, rows: int, p: Precision) -> tuple[float, float]:
    """ZeRO-3, whose partitioned head falls back to the model's own loss (transformers' ``ForCausalLMLoss``: the
    logits cast to float32, then cross-entropy). Held to backward: log-softmax's float32 output; transient: the
    backward's two float32 gradients of the logits at once. Measured on CPU: 12 bytes per logit at the peak
    (tests/test_plan.py), above the forward's (8)."""
    logits = rows * shape.vocab
    return logits * 4, logits * 8


def liger_fused_head_bytes(shape: ModelShape, rows: int, p: Precision, trains_head: bool) -> tuple[float, float]:
    """ZeRO-3 with Liger's layer kernels: the model's own loss is Liger's fused linear cross-entropy (patched in
    by ``model.loader.maybe_apply_liger``), which forms the gradients in the forward, a few rows of logits at a
    time: held, the hidden states' gradient (compute dtype) and, when the head trains, its float32 weight
    gradient; the chunk of logits is negligible. A 0.5B ZeRO-3 run on 2 H200s peaked at 12.4 GiB of torch's
    memory (docs/BENCHMARKS.md), 13.9 GiB less than with the full logits."""
    return rows * shape.hidden * p.compute + (shape.vocab * shape.hidden * 4 if trains_head else 0), 0.0


TOKEN_LOGPROBS_CHUNK = 4096  # algos.common.token_logprobs' chunk_size


def online_head_bytes(shape: ModelShape, rows: int, p: Precision) -> tuple[float, float]:
    """The online update's head on the full logits (``engine/online/update.policy_forward`` with the entropy in the
    loss, or a ZeRO-3 partitioned head; otherwise it runs chunked: ``logprob_head_bytes``) for ``rows`` response
    positions. Held to
    backward: ``token_logprobs``' float32 row chunks, which log-sum-exp saves (4 bytes per logit). Beyond that, the
    head's peak (transient), the larger of its forward's, where the logits and their contiguous copy (compute dtype)
    meet a chunk's exp temporary, and its backward's, three float32 gradients of a chunk at once. The chunk's share
    of the rows sets both; fitted to the peaks measured at shares 1, 1/2 and 1/4 (tests/test_plan.py). The logged
    entropy (1,024-row chunks, at the forward's end) stays below them."""
    logits = rows * shape.vocab
    share = min(rows, TOKEN_LOGPROBS_CHUNK) / rows
    return logits * 4, logits * max(2 * p.compute + 4 * share, 12 * share)


def backward_layer_bytes(per_layer: float, tokens: int) -> float:
    """Backward's working memory: while a layer's backward runs, the gradients of what it saved exist next to the
    saved tensors, at most one layer's worth (tokens x per_layer). Measured on CPU it is what separates the forward's
    saved bytes from the peak (tests/test_plan.py); it never coexists with the head's chunk (the forward's end)."""
    return tokens * per_layer


# --------------------------------------------------------------------------- generation
def kv_cache_bytes(shape: ModelShape, sequences: int, length: int, p: Precision) -> float:
    """transformers' generate (``rollout.backend: hf``): keys and values of every layer for every sequence,
    2 x layers x kv_dim x a per token, plus the last position's float32 logits per sequence (sampling)."""
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * p.compute
    return sequences * length * per_token + sequences * shape.vocab * 4 * 2


def vllm_engine_bytes(gpu_bytes: float, utilization: float) -> float:
    """vLLM preallocates ``gpu_memory_utilization`` x the GPU's memory (its weights, KV cache and CUDA graphs
    inside it) when the engine starts, and holds it for the run unless sleep mode frees it during the update."""
    return utilization * gpu_bytes


CUDA_OVERHEAD = 0.75 * GiB  # CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's rounding
