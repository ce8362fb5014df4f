"""Shared tensor mechanics used by every stage: masked reductions and token log-probs.

Kept in one tested place so SFT, preference and RL stages compute them identically.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadKernels:
    """How the chunked LM head runs, decided once per run (``model.loader.head_kernels``) and passed down.

    An argument rather than module switches, so two runs in one process (the WebUI, the tests) never see each
    other's choices. ``compiled``: sft's chunk is one compiled kernel on CUDA (``train.torch_compile``);
    ``logprobs``: the kernel of ``linear_token_logprobs`` on CUDA ("liger": Liger's fused linear cross-entropy),
    and with ``compiled`` of sft's chunk ("liger": Liger's cross-entropy kernel);
    ``chunk_rows``: rows per chunk in ``linear_nll_sum`` (None: ``_chunk_rows``, a fixed logits budget).
    """

    compiled: bool = False
    logprobs: Literal["torch", "liger"] = "torch"
    chunk_rows: int | None = None


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is true. Shapes broadcast; ``dim=None`` sums all."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true (0 where the mask is empty)."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    """Log-probability of each label token: ``log_softmax(logits)[..., labels]``.

    logits: (B, T, V); labels: (B, T) int64 (any value where unused, e.g. 0 for -100 positions).
    Returns (B, T) float32. Works row-chunked as ``logit[label] - logsumexp(logit)`` so a full
    (B, T, V) float32 log-softmax is never materialised (the vocabulary can be 150k wide).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = flat_logits[start : start + chunk_size].float()
        picked = rows.gather(-1, flat_labels[start : start + chunk_size, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).reshape(labels.shape) if out else flat_logits.new_zeros(labels.shape, dtype=torch.float32)


class _LinearLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[label]`` in row chunks; logits are recomputed in backward, never stored."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, labels, chunk_size):  # noqa: ANN001 (autograd signature)
        out = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_size):
            logits = (hidden[start : start + chunk_size] @ weight.T).float()
            lse[start : start + chunk_size] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, labels[start : start + chunk_size, None]).squeeze(-1)
            out[start : start + chunk_size] = picked - lse[start : start + chunk_size]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):  # noqa: ANN001
        hidden, weight, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h, g = hidden[rows], grad_out[rows].float()
            # d logp[label] / d logits = onehot(label) - softmax(logits)
            dlogits = torch.exp((h @ weight.T).float() - lse[rows, None]).mul_(-g[:, None])
            dlogits.scatter_add_(-1, labels[rows, None], g[:, None])
            if not torch.is_autocast_enabled(h.device.type):  # under autocast the products cast themselves
                dlogits = dlogits.to(weight.dtype)
            if need_h:
                grad_h[rows] = (dlogits @ weight).to(hidden.dtype)
            if need_w:
                grad_w += (dlogits.T @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 2048,
    kernels: HeadKernels = HeadKernels(),
) -> torch.Tensor:
    """Log-probability of each label under the LM head: ``log_softmax(hidden @ weight.T)[labels]``.

    hidden: (N, H) final hidden states of the positions to score; weight: (V, H) the output embedding;
    labels: (N,) int64. Returns (N,) float32. Equals ``token_logprobs(hidden @ weight.T, labels)`` but
    the (N, V) logits exist one chunk at a time in forward AND backward (recomputed there), so scoring
    16k positions over a 152k vocabulary needs ~1 GB instead of ~5 GB of bf16 logits plus their fp32 grads.
    Under autocast the matrix products run in the autocast dtype; the log-sum-exp is always float32.
    ``kernels.logprobs == "liger"`` runs Liger's fused linear cross-entropy instead (CUDA only).
    """
    if kernels.logprobs == "liger" and hidden.is_cuda:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        # reduction="none" recomputes the chunked logits in backward with the per-token upstream gradient
        nll = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels, None, None, -100, 0.0, 0.0, "none")[0]
        return -nll.float()
    return _LinearLogprobs.apply(hidden, weight, labels, chunk_size)


class _LinearNLLSum(torch.autograd.Function):
    """``sum(-log_softmax(hidden @ weight.T)[label])`` with both gradients computed in the forward, chunk by chunk.

    Written by hand because Liger's fused linear cross-entropy, the library option, sizes its chunks from
    vocabulary / hidden (152k / 896 -> 64-token chunks): 128 under-filled matmuls per 8k tokens and as many
    read-modify-writes of the (V, H) weight gradient. Here a chunk is ``chunk_size`` tokens (a few, for a batch).
    A loss sum needs no per-token upstream gradient, so nothing is recomputed in backward (unlike
    ``_LinearLogprobs``); the price is holding grad_hidden and grad_weight from forward to backward.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, labels, chunk_size, kernel):  # noqa: ANN001 (autograd signature)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        h_all, w = hidden.to(dtype), weight.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        grads = need_h or need_w
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h, target = h_all[rows], labels[rows, None]
            logits = h @ w.T
            # d nll / d logits = softmax - onehot(label) overwrites the logits: one fused kernel when compiled
            nll = _fused_chunk(logits, target, kernel) if grads and kernel != "eager" and h.is_cuda else None
            if nll is None:
                nll = _nll_and_dlogits_(logits, target, grads)
            loss += nll
            if need_h and grad_h.dtype == dtype:
                torch.mm(logits, w, out=grad_h[rows])
            elif need_h:
                grad_h[rows] = (logits @ w).to(hidden.dtype)
            if need_w:
                grad_w = _accumulate_mm(grad_w, logits.T, h, weight.dtype)
            del logits  # freed before the next chunk's logits are allocated: one chunk alive at a time
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_out):  # noqa: ANN001
        grad_h, grad_w = ctx.saved_tensors  # used once: scaled in place, no second (V, H) buffer
        scale = grad_out.to(torch.float32)
        return (
            None if grad_h is None else grad_h.mul_(scale.to(grad_h.dtype)),
            None if grad_w is None else grad_w.mul_(scale.to(grad_w.dtype)),
            None,
            None,
            None,
        )


def _accumulate_mm(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``total + a @ b`` as a ``dtype`` tensor. When ``a``/``b`` are already ``dtype`` (a bf16 model), one
    ``addmm_`` per chunk: the product is added to the running sum before rounding, with no float32 copy of
    the (V, H) weight gradient (4 GB of memory traffic per step at a 152k vocabulary)."""
    if total is None:
        return (a @ b).to(dtype)
    if a.dtype == dtype:
        return total.addmm_(a, b)
    return total.add_((a @ b).to(dtype))


_FLOAT32_ROWS = 1024  # rows of a logits chunk upcast to float32 at a time on the eager path (0.6 GB at 152k)


def _nll_and_dlogits_(logits: torch.Tensor, target: torch.Tensor, grads: bool) -> torch.Tensor:
    """Summed NLL of a (n, V) chunk of logits; with ``grads``, overwrites the logits with their gradient
    ``softmax - onehot(target)``. The eager path: the float32 copy exists ``_FLOAT32_ROWS`` rows at a time
    and the gradient needs no buffer of its own, so the head's memory is the one chunk of logits."""
    nll = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], _FLOAT32_ROWS):
        part, part_target = logits[start : start + _FLOAT32_ROWS], target[start : start + _FLOAT32_ROWS]
        full = part.float()  # float32 logits are used as they are: then everything below is in place
        lse = torch.logsumexp(full, dim=-1, keepdim=True)
        nll += (lse - full.gather(-1, part_target)).sum()
        if grads:
            full.sub_(lse).exp_().scatter_add_(-1, part_target, torch.full_like(lse, -1.0))
            if full is not part:
                part.copy_(full)
    return nll


def _nll_and_dlogits_fusable_(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``_nll_and_dlogits_`` written for the compiler (a where() rather than an in-place scatter): the float32
    logits are never stored, and the gradient is written over the logits (no second buffer)."""
    full = logits.float()
    lse = torch.logsumexp(full, dim=-1, keepdim=True)
    nll = (lse - full.gather(-1, target)).sum()
    vocab = torch.arange(full.shape[-1], device=full.device)
    probs = torch.exp(full - lse)
    logits.copy_(torch.where(vocab == target, probs - 1.0, probs))
    return nll


@functools.cache
def _compiled_nll_and_dlogits_():
    """The compiled chunk with only its rows dynamic. Under ``dynamic=True`` the vocabulary size is symbolic too,
    and the pointwise gradient kernel then finds each element's column by an integer division by a runtime value:
    on an H200 that kernel ran at ~1 TB/s, and a static vocabulary made the sft full step 1.14x faster
    (docs/BENCHMARKS.md). One graph per vocabulary size; the chunk's row count varies freely."""
    compiled = torch.compile(_nll_and_dlogits_fusable_)

    def chunk(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(logits, 0)
        torch._dynamo.maybe_mark_dynamic(target, 0)
        return compiled(logits, target)

    return chunk


def _liger_nll_and_dlogits_(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``_nll_and_dlogits_`` by Liger's cross-entropy kernel: one program per row, an online log-sum-exp pass and a
    gradient pass over the bf16 logits, the gradient written over them. Launched directly, because Liger's
    ``cross_entropy_forward`` reads the target count and bounds on the host (three waits for the GPU per chunk)
    and returns the row losses in the logits' dtype; here they are float32 and nothing waits. On an H200 the sft
    full step with it was 1.06x the compiled chunk's (docs/BENCHMARKS.md, nineteenth session), whose two kernels
    move the logits at ~1.4 TB/s."""
    import triton
    from liger_kernel.ops import cross_entropy as liger_ce

    rows, vocab = logits.shape
    losses = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    liger_ce.liger_cross_entropy_kernel[(rows,)](
        X_ptr=logits,
        X_stride=logits.stride(-2),
        Y_ptr=target.reshape(-1).contiguous(),
        Y_stride=1,
        weight_ptr=None,
        loss_ptr=losses,
        z_loss_ptr=None,
        loss_stride=1,
        token_accuracy_ptr=None,
        token_accuracy_stride=0,
        predicted_tokens_ptr=None,
        predicted_tokens_stride=0,
        n_cols=vocab,
        n_non_ignore=1,  # "sum": no division by the token count
        sum_non_ignore_weight=1,
        weight_sum=0.0,
        ignore_index=-100,  # the chunk holds trained positions only
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="sum",
        softcap=None,
        RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False,
        RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(getattr(liger_ce, "MAX_FUSED_SIZE", 32768), triton.next_power_of_2(vocab)),
        HAS_WEIGHT=False,
        HAS_SOFTCAPPING=False,
        HAS_GRADIENTS=True,
        num_warps=32,  # Liger's own choice for Hopper and earlier (bandwidth-bound)
    )
    return losses.sum()


_UNCOMPILABLE: set[str] = set()  # device types where compiling the chunk failed: a fact of the machine, not a setting
_LIGER_CE_FAILED: set[str] = set()  # device types where Liger's kernel could not be launched (e.g. a changed signature)


def _fused_chunk(logits: torch.Tensor, target: torch.Tensor, kernel: str = "compiled") -> torch.Tensor | None:
    """The chunk by ``kernel`` ("liger" or "compiled"; summed NLL, the gradient over the logits), or None (the eager
    path) when this machine cannot run it. "liger" falls back to "compiled". A failure is logged once and remembered
    per device type: a machine without a working compiler (triton) fails the same way on every chunk, and retrying
    would re-trace each time. The run's ``HeadKernels`` is untouched, so what one run found never reads as another
    run's choice."""
    device = logits.device.type
    if kernel == "liger" and device not in _LIGER_CE_FAILED:
        try:  # a launch that fails does so before the kernel runs: the logits are untouched
            return _liger_nll_and_dlogits_(logits, target)
        except Exception as exc:  # noqa: BLE001 (an incompatible liger-kernel must not stop training)
            log.warning("Liger cross-entropy kernel not usable (%s); compiled chunk on %s from here on", exc, device)
            _LIGER_CE_FAILED.add(device)
    if device in _UNCOMPILABLE:
        return None
    try:
        return _compiled_nll_and_dlogits_()(logits, target)
    except Exception as exc:  # noqa: BLE001 (a missing compiler/triton must not stop training)
        log.warning("LM-head chunk not compiled (%s); eager on %s from here on", exc, device)
        _UNCOMPILABLE.add(device)
        return None


_CHUNK_LOGITS_BYTES = 1.25e9  # a chunk's bf16 logits: 4096 rows at a 152k vocabulary, 2048 at 256k


def _chunk_rows(vocab_size: int, eager: bool = False) -> int:
    """Rows per LM-head chunk: as many whole 1024s as fit ``_CHUNK_LOGITS_BYTES`` of bf16 logits (at least 1024),
    half that on the eager path, whose float32 pass adds ``_FLOAT32_ROWS`` rows of float32 logits on top.

    The gradient is written over the logits, so a compiled chunk costs its logits and nothing more. Measured (full
    SFT, docs/BENCHMARKS.md): one 8192-row chunk instead of two of 4096 was 4% faster on an H200, equal on an H100,
    and 1.2 GB more at peak on both; eager, half-size chunks took uncompiled LoRA SFT's peak from 13.36 to 12.78 GB.
    """
    budget = _CHUNK_LOGITS_BYTES / (2 if eager else 1)
    return max(1024, int(budget // (vocab_size * 2)) // 1024 * 1024)


def linear_nll_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    kernels: HeadKernels = HeadKernels(),
) -> torch.Tensor:
    """Summed next-token NLL under the LM head, ``sum(-log_softmax(hidden @ weight.T)[labels])``, float32 scalar.

    hidden: (N, H) final hidden states of the positions that are trained; weight: (V, H); labels: (N,). The
    (N, V) logits exist ``chunk_size`` rows at a time and their gradient is formed right there: sft's loss
    without the full-vocabulary logits or a recompute. Rows per chunk: ``chunk_size``, else
    ``kernels.chunk_rows``, else ``_chunk_rows``. With ``kernels.compiled`` on CUDA each chunk is one kernel pass:
    Liger's cross-entropy kernel where ``kernels.logprobs`` is "liger", else the compiled chunk.
    """
    kernel = "eager"
    if kernels.compiled and hidden.is_cuda:
        device = hidden.device.type
        if kernels.logprobs == "liger" and device not in _LIGER_CE_FAILED:
            kernel = "liger"
        elif device not in _UNCOMPILABLE:
            kernel = "compiled"
    rows = chunk_size or kernels.chunk_rows or _chunk_rows(weight.shape[0], eager=kernel == "eager")
    return _LinearNLLSum.apply(hidden, weight, labels, rows, kernel)


ENTROPY_METRIC_CHUNK = 1024  # rows per chunk of the logged (no-gradient) entropy


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
    """Per-token entropy of the categorical distribution given by ``logits`` (B, T, V) -> (B, T).

    Without a gradient (the entropy every online update logs) it runs on ``ENTROPY_METRIC_CHUNK`` rows at a time,
    in place: it runs at the forward's end, next to everything the update holds for backward, and 4,096-row chunks
    with a fresh tensor per operation made it the update's peak (16 bytes per logit of a chunk, 7 GiB at a 152k
    vocabulary; a 0.5B GRPO run on an H200, docs/BENCHMARKS.md)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    if not (torch.is_grad_enabled() and logits.requires_grad):
        for start in range(0, flat.shape[0], ENTROPY_METRIC_CHUNK):
            log_p = F.log_softmax(flat[start : start + ENTROPY_METRIC_CHUNK].float(), dim=-1)
            out.append(log_p.exp().mul_(log_p).sum(-1).neg_())
        return torch.cat(out).reshape(logits.shape[:-1])
    for start in range(0, flat.shape[0], chunk_size):
        rows = flat[start : start + chunk_size].float()
        log_p = F.log_softmax(rows, dim=-1)
        out.append(-(log_p.exp() * log_p).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


@torch.no_grad()
def linear_entropy(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int = ENTROPY_METRIC_CHUNK) -> torch.Tensor:
    """(N,) float32 entropy of ``softmax(hidden @ weight.T)``, without gradient, ``chunk_size`` rows at a time: the
    logged entropy of a head that never forms the (N, V) logits (the online update's chunked head)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        log_p = F.log_softmax((hidden[start : start + chunk_size] @ weight.T).float(), dim=-1)
        out[start : start + chunk_size] = log_p.exp().mul_(log_p).sum(-1).neg_()
    return out


def shift_for_causal_lm(labels: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Align labels with next-token logits: returns (targets, mask), both (B, T).

    Position t of the logits predicts token t+1, so targets are labels shifted left by one
    and the last position is masked. Masked targets are replaced by 0 so they can index.
    """
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    mask = targets != ignore_index
    return targets.masked_fill(~mask, 0), mask


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is true (scalar).

    ``unbiased`` applies Bessel's correction n/(n-1) when n > 1 (as verl's ``masked_var``);
    with n <= 1 the biased value (0) is returned instead of raising.
    """
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        bessel = torch.where(count > 1, count / (count - 1).clamp(min=1.0), torch.ones_like(count))
        variance = variance * bessel
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Standardise ``values`` with the masked mean and unbiased masked variance: (x - mu) / sqrt(var + eps).

    Statistics come from masked positions only (as verl's ``masked_whiten``); every position is
    transformed, so multiply by the mask afterwards to zero padding.
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    return (values - mean) * torch.rsqrt(var + eps)
