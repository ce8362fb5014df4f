"""The tensor side of an online step, on a packed :class:`RolloutBatch` (layout: ``rollout.batch``).

Forward passes (policy log-probs, critic values), token rewards and advantages, and the actor /
critic updates: ``algorithm.ppo_epochs`` passes over the batch, each split into
``algorithm.num_mini_batches`` optimizer steps, each of micro-batches of
``train.per_device_batch_size`` rows. Losses, estimators, KL and aggregation come from the
registries by name; this module never branches on a name.

Exactness: every aggregation in ``LOSS_AGG`` is linear in the per-token loss, so a micro-batch
contributes ``agg(loss placed in its rows of a zero (mini-batch) tensor, mini-batch mask)`` and the
micro-batch contributions sum to the mini-batch loss exactly — whatever the mode (token-mean,
seq-mean, ...) and however rows are split. On several processes the mini-batch is the union of every
rank's rows (:class:`MiniBatch`): a micro-batch's loss is placed at its rows' places in the whole
mini-batch and aggregated with the whole mini-batch's mask, and the backward pass multiplies it by the
number of processes, which undoes DDP's gradient average: the gradient is that of the whole
mini-batch, as on one process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rlfactory.algos.common import (
    HeadKernels,
    entropy_from_logits,
    linear_entropy,
    linear_token_logprobs,
    masked_mean,
    masked_var,
    token_logprobs,
)
from rlfactory.config.schema import AlgorithmConfig
from rlfactory.data.packing import ALIGN_COLUMNS, MicroBatching, round_up
from rlfactory.engine.online.packed_rows import (
    PackedRows,
    PackLayout,
    host_lengths,
    host_prompt_groups,
    packed_micro_batch,
)
from rlfactory.engine.shared import NonFiniteGuard, autocast_forward, backward, clip_grad_norm
from rlfactory.model.lm_head import final_hidden, lm_parts, select_rows
from rlfactory.rollout.batch import RolloutBatch, response_logits

if TYPE_CHECKING:
    from rlfactory.engine.online.ranks import Ranks

Batch = RolloutBatch


def _trimmed(batch: Batch, rows: torch.Tensor, width: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Model inputs for ``rows`` without the right padding no row of them needs; and their response width
    (the rows' longest response, rounded up so that prompt + response columns are a multiple of ALIGN_COLUMNS
    where the batch is that wide -- the online loop packs it so -- : the extra columns are padding, out of every
    mask; data/packing.py says why).

    ``width``: the rows' longest response, when the caller knows it from host-side lengths. Reading it from
    the device here would be a GPU sync per micro-batch, which stops the CPU from queueing the next one.
    """
    width_r = max(1, width if width is not None else int(batch.response_length[rows].max()))
    width_p = batch.input_ids.shape[1] - batch.responses.shape[1]
    width_r = min(batch.responses.shape[1], round_up(width_p + width_r, ALIGN_COLUMNS) - width_p)
    end = width_p + width_r
    inputs = {k: getattr(batch, k)[rows, :end] for k in ("input_ids", "attention_mask", "position_ids")}
    return inputs, width_r


def _to_full_width(values: torch.Tensor, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
    """(b, r) -> (b, R): zeros after each row's response (padding holds no number that could leak)."""
    valid = torch.arange(values.shape[1], device=values.device)[None] < batch.response_length[rows][:, None]
    values = torch.where(valid, values, torch.zeros_like(values))
    return F.pad(values, (0, batch.responses.shape[1] - values.shape[1]))


def policy_forward(
    model: Any,
    batch: Batch,
    rows: torch.Tensor,
    temperature: float = 1.0,
    entropy: str = "none",
    width: int | None = None,
    packed: PackedRows | None = None,
    kernels: HeadKernels = HeadKernels(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (b, R) of the sampled response tokens under ``model`` at the sampling temperature.

    ``entropy``: ``none``, ``metric`` (computed without gradient) or ``loss`` (with gradient). ``packed``: the rows
    as one padding-free row (the same numbers, computed on real tokens only). Unless the entropy is in the loss,
    the LM head runs chunked on the response positions' hidden states (``linear_token_logprobs``, the logits
    recomputed in backward; ``kernels``: the run's choice, Liger's on CUDA), so the (b, R, V) logits and their
    float32 chunks are never held to backward: at a 152k vocabulary 4 bytes per logit less (10 GB for 64 x 256
    response tokens). A model without a decoder/head split (a ZeRO-3 partitioned head) takes its full logits.
    """
    if packed is not None:
        inputs = packed.inputs(batch, rows)
        targets = packed.target_ids(inputs)
        width_r = packed.width
    else:
        inputs, width_r = _trimmed(batch, rows, width)
        targets = batch.responses[rows, :width_r]
    parts = lm_parts(model) if entropy != "loss" else None
    if parts is not None:
        decoder, head = parts
        hidden = final_hidden(model, decoder, inputs)
        # the positions that predict response tokens: the packed row's kept ones, or each row's last width_r + 1
        # but the last (what logits_to_keep selects below)
        if packed is None:
            picked = hidden[:, -(width_r + 1) : -1]
        elif packed.kv_index is not None:  # a shared prompt's last position is kept once per sample: gradients add
            picked = hidden.flatten(0, 1).index_select(0, packed.keep)
        else:
            picked = select_rows(hidden.flatten(0, 1), packed.keep)
        flat = picked.reshape(-1, picked.shape[-1])
        flat = flat / temperature if temperature != 1.0 else flat  # (h / T) @ W.T = logits / T
        # detached without gradient: Liger's kernel forms the weight's gradient in its forward when it requires one
        weight = head.weight if torch.is_grad_enabled() else head.weight.detach()
        logprobs = linear_token_logprobs(flat, weight, targets.reshape(-1), kernels=kernels).view(targets.shape)
        ent = None if entropy == "none" else linear_entropy(flat.detach(), head.weight).view(targets.shape)
    else:
        if packed is not None and packed.position_ids.shape[0] == 1:  # logits only where response tokens are
            logits = model(**inputs, use_cache=False, logits_to_keep=packed.keep).logits  # predicted
        elif packed is not None:  # several rows: logits_to_keep picks the same columns in every row
            logits = model(**inputs, use_cache=False).logits.flatten(0, 1)[packed.keep][None]
        else:  # logits only for the positions that predict response tokens: prompt positions are never computed
            logits = model(**inputs, use_cache=False, logits_to_keep=width_r + 1).logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = token_logprobs(logits, targets)
        ent = None
        if entropy != "none":
            with torch.set_grad_enabled(entropy == "loss" and torch.is_grad_enabled()):
                ent = entropy_from_logits(logits if entropy == "loss" else logits.detach())
    if packed is not None:
        place = lambda values: packed.scatter(values[0], batch)
    else:
        place = lambda values: _to_full_width(values, batch, rows)
    return place(logprobs), None if ent is None else place(ent)


def value_forward(
    critic: Any, batch: Batch, rows: torch.Tensor, width: int | None = None, packed: PackedRows | None = None
) -> torch.Tensor:
    """Critic values (b, R): V at the state *before* each response token (the position that predicts it)."""
    if packed is not None:
        values = critic(**packed.inputs(batch, rows), attention_mask=None)
        return packed.scatter(values.reshape(-1)[packed.keep], batch)
    inputs, width_r = _trimmed(batch, rows, width)
    return _to_full_width(response_logits(critic(**inputs), width_r), batch, rows)


@dataclass
class HostRows:
    """What the passes read about the batch's rows on the host, once per pass: each row's prompt length (where
    packing or a token budget needs it), response length, the count ``micro`` cuts by (prompt + response under a
    token budget, else the response) and, for packing "shared", each row's prompt group (``host_prompt_groups``)."""

    prompt: list[int]
    response: list[int]
    tokens: list[int]
    prompt_of: list[int] | None = None

    def packed(self, batch: Batch, rows: list[int], packing: PackLayout) -> PackedRows | None:
        """The micro-batch ``rows`` packed in ``packing`` (None: padded)."""
        if not packing:
            return None
        return packed_micro_batch(batch, self.prompt, self.response, rows, packing, self.prompt_of)


def _host_rows(batch: Batch, packing: PackLayout, micro: MicroBatching) -> HostRows:
    """The batch's ``HostRows``."""
    if not packing and micro.tokens is None:
        response = batch.response_length.long().tolist()
        return HostRows([], response, response)
    prompt, response = host_lengths(batch)
    tokens = [p + r for p, r in zip(prompt, response, strict=True)] if micro.tokens is not None else response
    return HostRows(prompt, response, tokens, host_prompt_groups(batch) if packing == "shared" else None)


def _grouped(order: torch.Tensor, prompt_of: list[int], mini_batches: int) -> torch.Tensor:
    """``order`` with each mini-batch's rows sorted by prompt group (stable, so the random order stays within a
    group): the same rows per mini-batch, hence the same update, with a group's samples in the same micro-batches."""
    chunks = torch.tensor_split(order, mini_batches)
    return torch.cat([c[torch.tensor(sorted(range(len(c)), key=lambda i: prompt_of[int(c[i])]))] for c in chunks])


def _gradient_first(order: torch.Tensor, grad_rows: torch.Tensor, mini_batches: int) -> torch.Tensor:
    """``order`` with each mini-batch's rows that need a gradient first, the rest after (stable within each)."""
    chunks = torch.tensor_split(order, mini_batches)
    return torch.cat([torch.cat([c[grad_rows[c]], c[~grad_rows[c]]]) for c in chunks])


def _spans(
    micro: MicroBatching, lengths: list[int], grad_rows: torch.Tensor | None, order: list[int]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A mini-batch's micro-batches (rows ordered by ``_gradient_first``): (forward-only spans, spans with a
    gradient). At least one span has a gradient: with none, the last forward-only one gets it (its gradient is
    zero), so every rank runs a backward and the optimizer steps with zero gradients as it would without the skip."""
    if grad_rows is None:
        return [], micro.spans(lengths)
    n_grad = int(grad_rows[order].sum()) if order else 0
    with_grad = micro.spans(lengths[:n_grad])
    forward_only = [(start + n_grad, end + n_grad) for start, end in micro.spans(lengths[n_grad:])]
    if not with_grad:
        with_grad = [forward_only.pop()]
    return forward_only, with_grad


def rows_with_gradient(alg: AlgorithmConfig, batch: Batch, mask: torch.Tensor) -> torch.Tensor | None:
    """(B,) bool: the actor's rows whose loss can have a gradient, or None (every row; the skip does not apply).

    A row whose every advantage is exactly zero adds exactly zero to the policy-gradient term of a loss that
    vanishes at zero advantage (the ``zero_at_zero_advantage`` trait: ppo_clip, gspo, cispo), so with no KL or
    entropy term its backward can be skipped and the update is the same up to the order of the sums. In GRPO these
    are the groups whose samples all got one reward (``rollout/zero_adv_groups``), often a third or more of a batch
    late in training. Its forward still runs: the metrics (entropy, clip fractions) and the trainer's log-probs
    cover every row as before (``algorithm.skip_zero_advantage_backward``)."""
    from rlfactory.algos.policy_loss import POLICY_LOSSES

    if not alg.skip_zero_advantage_backward or alg.kl_loss_coef > 0 or alg.entropy_coef > 0:
        return None
    if batch.advantages is None or not POLICY_LOSSES.traits(alg.policy_loss).get("zero_at_zero_advantage"):
        return None
    return ((batch.advantages != 0) & mask.bool()).any(-1)


@torch.no_grad()
def full_pass(
    fn: Callable[..., torch.Tensor], batch: Batch, micro: MicroBatching, packing: PackLayout = None
) -> torch.Tensor:
    """``fn(rows, width, packed) -> (b, R)`` over the whole batch in micro-batches (no gradient); ``width`` is the
    micro-batch's longest response, read from the host once for the whole pass; ``packed`` its padding-free row
    (``packing``) or None."""
    host = _host_rows(batch, packing, micro)
    out = []
    for start, end in micro.spans(host.tokens):
        chunk = torch.arange(start, end, device=batch.responses.device)
        packed = host.packed(batch, list(range(start, end)), packing)
        out.append(fn(chunk, max(host.response[start:end]), packed).float())
    return torch.cat(out)


def logprob_pass(
    model: Any,
    batch: Batch,
    temperature: float,
    micro: MicroBatching,
    packing: PackLayout,
    kernels: HeadKernels = HeadKernels(),
) -> torch.Tensor:
    """(B, R) log-probs of every row's response under ``model``, without gradient (the reference and pi_old)."""
    forward = lambda rows, width, packed: policy_forward(  # noqa: E731
        model, batch, rows, temperature, "none", width, packed, kernels
    )[0]
    return full_pass(forward, batch, micro, packing)


def token_rewards(batch: Batch, kl_penalty: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """(B, R): the sequence score on the last response token, minus ``kl_coef * KL`` on every response token."""
    assert batch.scores is not None
    mask = batch.response_mask
    rewards = torch.zeros_like(mask)
    last = (batch.response_length.long() - 1).clamp(min=0)
    rewards[torch.arange(mask.shape[0]), last] = batch.scores
    if kl_penalty is not None and kl_coef > 0:
        rewards = rewards - kl_coef * kl_penalty * mask
    return rewards


def advantages(
    alg: AlgorithmConfig,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) (B, R) from the estimator named by ``algorithm.adv_estimator``."""
    from rlfactory.algos.advantages import ADV_ESTIMATORS

    estimator = ADV_ESTIMATORS.get(str(alg.adv_estimator))
    return estimator(
        token_rewards,
        response_mask,
        index=group,
        values=values,
        gamma=alg.gamma,
        lam=alg.lam,
        config={"scale": alg.grpo_scale},
    )


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens (1 = perfect critic, <= 0 = useless)."""
    var_returns = masked_var(returns, mask)
    return float(1 - masked_var(returns - values, mask) / var_returns.clamp(min=1e-8))


@dataclass
class MiniBatch:
    """One mini-batch as a loss sees it: this rank's ``rows`` of it, and the mask of the whole mini-batch.

    On one process ``mask`` is ``mask[rows]``. On several it is every rank's rows' mask in rank order (each rank
    holds the same number of rows of every mini-batch), right-padded to the widest rank's responses, and this
    rank's rows start at ``offset``.
    """

    rows: torch.Tensor  # (m,) this rank's rows (indices into its batch)
    mask: torch.Tensor  # (M, R) the whole mini-batch's mask; M = m x the number of processes
    offset: int = 0  # where this rank's rows sit in ``mask``

    @classmethod
    def local(cls, rows: torch.Tensor, mask: torch.Tensor) -> MiniBatch:
        """The mini-batch ``rows`` of a batch trained on one process."""
        return cls(rows, mask[rows])


def _part(agg: Callable, per_token: torch.Tensor, mini: MiniBatch, pos: torch.Tensor, max_len: int):
    """This micro-batch's exact share of the (whole) mini-batch aggregate (see module doc)."""
    full = per_token.new_zeros(mini.mask.shape)
    if per_token.shape[1] < full.shape[1]:  # another rank's responses are longer
        per_token = F.pad(per_token, (0, full.shape[1] - per_token.shape[1]))
    full = full.index_put((pos + mini.offset if mini.offset else pos,), per_token)
    return agg(full, mini.mask, max_response_length=max_len)


@dataclass
class LossPart:
    """A micro-batch's share of a loss, its metrics (device tensors), and for the actor with a separate sampler
    the trainer's log-probs of its rows (pi_old of a single on-policy update, for the mismatch metrics)."""

    loss: torch.Tensor
    metrics: dict[str, Any]
    logprobs: torch.Tensor | None = None  # (b, R), detached


@dataclass
class UpdateResult:
    metrics: dict[str, float]  # "<prefix>/<name>", averaged over the optimizer steps
    logprobs: torch.Tensor | None = None  # (B, R) trainer log-probs of each row as first seen (NaN: never seen)


LossFn = Callable[..., LossPart]  # (rows, pos, mini, width, packed[, model=]: another module to run, e.g. past DDP)


class Updater:
    """One trained model: its optimizer steps over the mini-batch epochs of a rollout batch.

    ``loss_fn(rows, pos, mini, width, packed) -> LossPart``: ``rows`` index the batch, ``pos`` the micro-batch's
    places among this rank's rows of the :class:`MiniBatch` ``mini``, ``width`` is the micro-batch's longest
    response, ``packed`` the micro-batch as one padding-free row when ``packing`` is on (else None).

    On several processes each rank runs this on its own equal share of the rows: it shuffles its share (its own
    RNG, restored per rank on resume) and its k-th chunk is its part of mini-batch k, so a mini-batch is the union
    of every rank's k-th chunk (one process shuffles all rows instead: the same distribution of mini-batches, not
    the same draw). Every rank runs the same mini-batches (equal shares; a mini-batch without tokens is skipped
    only when no rank has any), as DDP needs; the gradient is synchronised once per mini-batch (``no_sync`` before
    the last micro-batch), so under a token budget (``MicroBatching.tokens``) ranks may cut their shares into
    different numbers of micro-batches.
    """

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        max_grad_norm: float | None,
        ranks: Ranks | None = None,
    ):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.ranks = ranks
        self.guard: NonFiniteGuard | None = None  # the run's: a non-finite loss or gradient skips or stops
        self.packing: PackLayout = None  # micro-batches as padding-free rows (``rollout.packing``, by the loop)

    def _mini_batch(self, mask: torch.Tensor, rows: torch.Tensor) -> MiniBatch:
        if self.ranks is None or not self.ranks.many:
            return MiniBatch.local(rows, mask)
        return MiniBatch(rows, self.ranks.gather_rows(mask[rows]), self.ranks.rank * len(rows))

    def run(
        self,
        batch: Batch,
        alg: AlgorithmConfig,
        micro: MicroBatching,
        mask: torch.Tensor,
        loss_fn: LossFn,
        prefix: str,
        step: int = 0,
        needs_grad: torch.Tensor | None = None,
    ) -> UpdateResult:
        """``needs_grad`` (B,) bool: the rows whose loss can have a gradient (``rows_with_gradient``); the others
        run their forward without one (metrics, the trainer's log-probs), before the mini-batch's micro-batches
        with a gradient, at least one of which runs on every rank (DDP's reduction needs a backward from each).
        None: every row's backward runs."""
        # metrics stay device tensors until the end of the step: a float() per micro-batch is a GPU sync that
        # stops the CPU from queueing the next micro-batch's kernels
        sums: dict[str, list[Any]] = defaultdict(list)
        seen: torch.Tensor | None = None
        device = batch.responses.device
        world = 1 if self.ranks is None else self.ranks.world
        # row order, lengths and which mini-batches have tokens live on the host: every micro-batch's shape is
        # known without asking the GPU, so the CPU queues micro-batches back to back (one sync per call)
        host = _host_rows(batch, self.packing, micro)
        response, tokens = host.response, host.tokens
        bare = self.accelerator.unwrap_model(self.model) if needs_grad is not None else None
        has_tokens = mask.sum(-1) > 0
        if needs_grad is None:
            has_tokens, grad_rows = has_tokens.cpu(), None
        else:  # one read of both
            has_tokens, grad_rows = torch.stack([has_tokens, needs_grad & has_tokens]).cpu()
        for _ in range(alg.ppo_epochs):
            order = torch.randperm(len(response))
            if host.prompt_of is not None:  # a mini-batch's samples of one prompt side by side: they share it
                order = _grouped(order, host.prompt_of, alg.num_mini_batches)
            if grad_rows is not None:  # each mini-batch's rows with a gradient first (the same rows per mini-batch)
                order = _gradient_first(order, grad_rows, alg.num_mini_batches)
            order_on_device = (order.pin_memory() if device.type == "cuda" else order).to(device, non_blocking=True)
            minis = list(
                zip(
                    torch.tensor_split(order, alg.num_mini_batches),
                    torch.tensor_split(order_on_device, alg.num_mini_batches),
                    strict=True,
                )
            )
            active = [bool(has_tokens[mini_host].any()) for mini_host, _ in minis]
            if self.ranks is not None:
                active = self.ranks.any(active)  # the same decision on every rank: DDP needs the same backwards
            for (mini_host, mini_rows), has_any in zip(minis, active, strict=True):
                if not has_any:
                    continue  # nothing to learn from (e.g. every sample truncated and masked)
                mini_batch = self._mini_batch(mask, mini_rows)
                mini: dict[str, Any] = defaultdict(float)
                mini_loss = torch.zeros((), device=device)
                order_host = mini_host.tolist()
                forward_only, spans = _spans(micro, [tokens[i] for i in order_host], grad_rows, order_host)
                if grad_rows is not None:  # every rank logs it (the metrics' reduction needs the same keys)
                    mini["rows_forward_only"] = sum(e - s for s, e in forward_only) / (len(order_host) * world)
                for start, end in forward_only + spans:
                    pos = torch.arange(start, end, device=device)
                    host_rows = order_host[start:end]
                    width = max(response[i] for i in host_rows)
                    packed = host.packed(batch, host_rows, self.packing)
                    rows = mini_rows[pos]
                    if (start, end) in forward_only:  # a zero gradient: the loss's value and metrics only
                        # past DDP, as the other passes without a gradient: its forward hooks are collectives
                        # (buffers, bucket rebuilds) that other ranks would meet in another order
                        with torch.no_grad(), autocast_forward(self.accelerator, self.model):
                            part = loss_fn(rows, pos, mini_batch, width, packed, model=bare)
                    else:
                        last = (start, end) == spans[-1]
                        with nullcontext() if last or world == 1 else self.accelerator.no_sync(self.model):
                            with autocast_forward(self.accelerator, self.model):
                                part = loss_fn(rows, pos, mini_batch, width, packed)
                            # x world: DDP averages the ranks' gradients, the parts of a mini-batch aggregate add up
                            backward(self.accelerator, self.model, part.loss if world == 1 else part.loss * world)
                    mini_loss += part.loss.detach().float()
                    if part.logprobs is not None:
                        if seen is None:
                            seen = torch.full(batch.responses.shape, float("nan"), device=device)
                        seen[rows] = part.logprobs
                    for key, value in part.metrics.items():
                        mini[key] = mini[key] + (value.detach().float() if torch.is_tensor(value) else value)
                norm = clip_grad_norm(self.accelerator, self.model, self.max_grad_norm)
                mini["grad_norm"] = 0.0 if norm is None else norm
                # several processes: the gradient norm (global after DDP's all-reduce; a NaN loss anywhere makes it
                # NaN) alone decides, so every process skips or stops alike; one process: the loss too
                if self.guard is None or self.guard.ok(step, mini_loss if world == 1 else norm, norm):
                    self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                for key, value in mini.items():
                    sums[key].append(value)
        if world == 1:
            metrics = {f"{prefix}/{k}": float(sum(v)) / len(v) for k, v in sums.items()}
        else:
            metrics = self._reduced(sums, prefix)
        metrics[f"{prefix}/lr"] = self.scheduler.get_last_lr()[0]
        return UpdateResult(metrics, seen)

    def _reduced(self, sums: dict[str, list[Any]], prefix: str) -> dict[str, float]:
        """Several processes: each rank's metrics are its rows' shares of the whole mini-batch's (the loss parts,
        token-weighted means), so they add up over the ranks; the gradient norm is already global (DDP), the
        same on every rank. One collective for all of them."""
        assert self.ranks is not None
        keys = sorted(sums)
        device = self.accelerator.device
        means = [torch.as_tensor(sum(sums[k]) / len(sums[k]), dtype=torch.float32, device=device) for k in keys]
        totals = self.ranks.sum(torch.stack(means)).tolist() if keys else []
        world = self.ranks.world
        return {f"{prefix}/{k}": v / world if k == "grad_norm" else v for k, v in zip(keys, totals, strict=True)}


def actor_loss_fn(
    model: Any,
    batch: Batch,
    alg: AlgorithmConfig,
    temperature: float,
    max_len: int,
    is_correction: str = "none",
    is_threshold: float = 2.0,
    kernels: HeadKernels = HeadKernels(),
) -> LossFn:
    """The actor's micro-batch loss: policy loss + kl_loss_coef * KL - entropy_coef * entropy, each aggregated.

    With a separate sampler (``batch.sampler_logprobs`` set), the policy-gradient term is weighted by the
    ``rollout.is_correction`` entry (pi_old / pi_sampler importance weights). With one on-policy update the
    forward of each row's first pass is the trainer's pi_old: it is returned (``LossPart.logprobs``) for the
    mismatch metrics, so no extra log-prob pass is spent on them.
    """
    from rlfactory.algos.aggregation import LOSS_AGG
    from rlfactory.algos.kl import KL_ESTIMATORS
    from rlfactory.algos.policy_loss import POLICY_LOSSES
    from rlfactory.algos.rollout_correction import IS_CORRECTIONS

    policy_loss, agg = POLICY_LOSSES.get(alg.policy_loss), LOSS_AGG.get(alg.loss_agg)
    correction = IS_CORRECTIONS.get(is_correction)
    kl_fn = KL_ESTIMATORS.get(alg.kl_loss_estimator)
    loss_cfg = {k: v for k, v in (("clip_low", alg.clip_low), ("clip_high", alg.clip_high)) if v is not None}
    loss_cfg["clip_c"] = alg.clip_c
    assert batch.advantages is not None
    trained = model  # the module the update trains (DDP-wrapped on several processes); a call may pass another

    def loss_fn(
        rows: torch.Tensor,
        pos: torch.Tensor,
        mini: MiniBatch,
        width: int | None = None,
        packed: PackedRows | None = None,
        model: Any = None,
    ) -> LossPart:
        entropy_mode = "loss" if alg.entropy_coef > 0 else "metric"
        net = trained if model is None else model
        logprobs, entropy = policy_forward(net, batch, rows, temperature, entropy_mode, width, packed, kernels)
        # one update per rollout batch: the old policy IS the current one, so no extra forward was spent
        old = batch.old_logprobs[rows] if batch.old_logprobs is not None else logprobs.detach()
        mask = batch.loss_mask[rows]
        per_token, pg_metrics = policy_loss(logprobs, old, batch.advantages[rows], mask, config=loss_cfg)
        trainer_logprobs = None
        if batch.sampler_logprobs is not None:
            trainer_logprobs = old if batch.old_logprobs is None else None
            weights, is_metrics = correction(old, batch.sampler_logprobs[rows], mask, threshold=is_threshold)
            per_token = per_token * weights
            pg_metrics = {**pg_metrics, **is_metrics}
        pg_loss = _part(agg, per_token, mini, pos, max_len)
        loss = pg_loss
        share = mask.sum() / mini.mask.sum().clamp(min=1)  # token weight of masked-mean metrics (a tensor: no sync)
        metrics = {"pg_loss": pg_loss.detach(), **{k: v * share for k, v in pg_metrics.items()}}
        metrics["entropy"] = masked_mean(entropy.detach(), mask) * share
        if alg.kl_loss_coef > 0:
            assert batch.ref_logprobs is not None
            kl_loss = _part(agg, kl_fn(logprobs, batch.ref_logprobs[rows]), mini, pos, max_len)
            loss = loss + alg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if alg.entropy_coef > 0:
            loss = loss - alg.entropy_coef * _part(agg, entropy, mini, pos, max_len)
        metrics["loss"] = loss.detach()
        return LossPart(loss, metrics, trainer_logprobs)

    return loss_fn


def critic_loss_fn(critic: Any, batch: Batch, alg: AlgorithmConfig, max_len: int) -> LossFn:
    """The critic's micro-batch loss: clipped value loss (``algorithm.value_clip``), aggregated like the actor's."""
    from rlfactory.algos.aggregation import LOSS_AGG
    from rlfactory.algos.policy_loss import value_loss

    agg = LOSS_AGG.get(alg.loss_agg)
    assert batch.values is not None and batch.returns is not None

    def loss_fn(
        rows: torch.Tensor,
        pos: torch.Tensor,
        mini: MiniBatch,
        width: int | None = None,
        packed: PackedRows | None = None,
        model: Any = None,
    ) -> LossPart:
        values = value_forward(critic if model is None else model, batch, rows, width, packed)
        mask = batch.response_mask[rows]
        per_token, metrics = value_loss(
            values, batch.values[rows], batch.returns[rows], mask, clip_range=alg.value_clip
        )
        loss = _part(agg, per_token, mini, pos, max_len)
        share = mask.sum() / mini.mask.sum().clamp(min=1)
        return LossPart(loss, {"vf_loss": loss.detach(), **{k: v * share for k, v in metrics.items()}})

    return loss_fn
