"""Preference-optimisation losses as pure tensor functions, registered by name.

Every entry takes per-sequence log-probabilities (already reduced over the completion tokens, summed or
length-averaged as each docstring says) and returns per-example losses plus detached rewards for logging;
the stage reduces them (usually ``losses.mean()``). Traits: ``reference_free`` (no reference model needed),
``paired`` (chosen/rejected pairs vs. KTO's unpaired desirable/undesirable examples), ``length_normalised``
(expects logps averaged over completion tokens instead of summed) and ``own_stage`` (the objective of a
stage of its own, e.g. ``orpo`` adds an NLL term, so it is not a ``dpo.loss_type``).

Paired entries share one call signature::

    fn(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta, ...)
    -> (losses (B,), chosen_rewards (B,), rejected_rewards (B,))

``orpo`` additionally returns two per-example log-odds metrics (see its docstring); ``kto`` has its own
signature. Formulas follow TRL 1.16 (``DPOTrainer._compute_loss``, ``CPOTrainer.cpo_loss``,
``ORPOTrainer.odds_ratio_loss``, ``KTOTrainer._compute_loss``) and are tested against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfactory.errors import UserError
from rlfactory.plugins import Registry

PREFERENCE_LOSSES = Registry("preference loss")


def _logratio_delta(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor) -> Tensor:
    """``(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))``, the implicit-reward margin / beta."""
    return (pc - rc) - (pr - rr)


def _rewards(policy: Tensor, ref: Tensor | None, beta: float) -> Tensor:
    """Detached implicit reward ``beta * (policy - ref)`` (``beta * policy`` when there is no reference)."""
    return (beta * (policy if ref is None else policy - ref)).detach()


def _smoothed_sigmoid(logits: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``: the conservative (cDPO) binary cross-entropy."""
    losses = -F.logsigmoid(logits) * (1 - label_smoothing)
    if label_smoothing:
        losses = losses - F.logsigmoid(-logits) * label_smoothing
    return losses


@PREFERENCE_LOSSES.register("sigmoid", reference_free=False, paired=True, length_normalised=False)
def sigmoid(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO's logistic loss (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290, Eq. 7).

    Shapes: the four logps are (B,) sums over completion tokens; returns (B,), (B,), (B,).
    ``loss = -log sigmoid(beta * delta)`` with ``delta = (pi_w - ref_w) - (pi_l - ref_l)``. With
    ``label_smoothing = eps > 0`` it is conservative DPO (cDPO, Mitchell 2023,
    https://ericmitchell.ai/cdpo.pdf): ``-(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)``,
    i.e. the labels are assumed flipped with probability eps (same form as TRL's CPO ``sigmoid``).
    """
    delta = _logratio_delta(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = _smoothed_sigmoid(beta * delta, label_smoothing)
    return (
        losses,
        _rewards(policy_chosen_logps, ref_chosen_logps, beta),
        _rewards(policy_rejected_logps, ref_rejected_logps, beta),
    )


@PREFERENCE_LOSSES.register("robust", reference_free=False, paired=True, length_normalised=False)
def robust(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """Robust DPO (Chowdhury et al. 2024, https://arxiv.org/abs/2403.00409, Eq. 9): unbiased under noise.

    Shapes as :func:`sigmoid`. ``label_smoothing = eps`` in [0, 0.5) is the label-flip rate:
    ``loss = ((1 - eps) * -log sigmoid(beta delta) - eps * -log sigmoid(-beta delta)) / (1 - 2 eps)``.
    Unlike cDPO the flipped term is *subtracted* and renormalised, so the loss is an unbiased estimate of the
    clean-label DPO loss (it can be negative). eps = 0 gives plain DPO.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise UserError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    delta = _logratio_delta(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
    flipped = -label_smoothing * F.logsigmoid(-beta * delta)
    losses = (clean - flipped) / (1 - 2 * label_smoothing)
    return (
        losses,
        _rewards(policy_chosen_logps, ref_chosen_logps, beta),
        _rewards(policy_rejected_logps, ref_rejected_logps, beta),
    )


@PREFERENCE_LOSSES.register("ipo", reference_free=False, paired=True, length_normalised=True)
def ipo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO's squared loss (Azar et al. 2023, https://arxiv.org/abs/2310.12036, Eq. 17; beta is tau).

    Shapes as :func:`sigmoid`, but the four logps must be LENGTH-AVERAGED (sum over completion tokens divided
    by the number of completion tokens), as TRL does for ``loss_type="ipo"``; summed logps make the squared
    loss scale with length. ``loss = (delta - 1 / (2 beta))^2``: regresses the margin to a fixed target
    instead of pushing it to infinity like DPO. Rewards are ``beta * (avg policy - avg ref)``.
    """
    delta = _logratio_delta(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = (delta - 1 / (2 * beta)) ** 2
    return (
        losses,
        _rewards(policy_chosen_logps, ref_chosen_logps, beta),
        _rewards(policy_rejected_logps, ref_rejected_logps, beta),
    )


@PREFERENCE_LOSSES.register("hinge", reference_free=False, paired=True, length_normalised=False)
def hinge(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """SLiC-HF's hinge calibration loss (Zhao et al. 2023, https://arxiv.org/abs/2305.10425, Eq. 1).

    Shapes as :func:`sigmoid`. ``loss = max(0, 1 - beta * delta)`` (TRL's form): SLiC's margin
    ``delta_margin = 1 / beta`` scaled by beta, applied to the reference-normalised margin as in the DPO
    paper's comparison. Zero loss once the margin exceeds 1/beta, unlike DPO's never-saturating sigmoid.
    """
    delta = _logratio_delta(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    losses = torch.relu(1 - beta * delta)
    return (
        losses,
        _rewards(policy_chosen_logps, ref_chosen_logps, beta),
        _rewards(policy_rejected_logps, ref_rejected_logps, beta),
    )


@PREFERENCE_LOSSES.register("simpo", reference_free=True, paired=True, length_normalised=True)
def simpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    *,
    beta: float,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """SimPO (Meng et al. 2024, https://arxiv.org/abs/2405.14734, Eq. 6): reference-free, length-normalised.

    Shapes: policy logps (B,) LENGTH-AVERAGED over completion tokens; reference logps are ignored (may be
    None). ``loss = -log sigmoid(beta * (pi_w - pi_l) - gamma)``, smoothed like cDPO when label_smoothing > 0.
    ``gamma`` is the absolute target margin, TRL's ``CPOConfig.simpo_gamma`` (the SimPO repo's
    ``gamma_beta_ratio`` is gamma / beta). TRL computes ``beta * (pi_w - pi_l - simpo_gamma / beta)``, the
    same value. Rewards are ``beta * policy_logps`` (no reference).
    """
    logits = beta * (policy_chosen_logps - policy_rejected_logps - gamma / beta)
    losses = _smoothed_sigmoid(logits, label_smoothing)
    return losses, _rewards(policy_chosen_logps, None, beta), _rewards(policy_rejected_logps, None, beta)


_ORPO_MAX_LOGP = -1e-7  # log1mexp(0) = -inf: keep length-averaged logps strictly negative (finite gradients)


def _log1mexp(x: Tensor) -> Tensor:
    """Numerically stable ``log(1 - exp(x))`` for x < 0 (branch at -ln 2; Maechler 2012), as TRL's ORPO."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@PREFERENCE_LOSSES.register("orpo", reference_free=True, paired=True, length_normalised=True, own_stage="orpo")
def orpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    *,
    beta: float,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """ORPO's odds-ratio term (Hong et al. 2024, https://arxiv.org/abs/2403.07691, Eqs. 4-7); beta is lambda.

    Shapes: policy logps (B,) LENGTH-AVERAGED over completion tokens (computed in float32); reference logps
    are ignored (may be None). With ``odds(y) = p / (1 - p)``,
    ``log_odds = (pi_w - pi_l) - (log(1 - exp(pi_w)) - log(1 - exp(pi_l)))`` and
    ``loss = -beta * log sigmoid(log_odds)``. This is ONLY the OR component: the full ORPO objective is
    ``NLL(chosen) + loss.mean()``, the stage adds the SFT NLL on the chosen completion. (TRL's
    ``odds_ratio_loss`` returns ``+beta * log sigmoid(log_odds)`` and subtracts it.)
    Returns ``(losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen)``, the last two (B,)
    detached: ``log sigmoid(log_odds)`` and ``log_odds``, whose means TRL logs as ``log_odds_ratio`` and
    ``log_odds_chosen``. Logps above -1e-7 are clamped (log(1 - exp(0)) is -inf).
    """
    chosen = policy_chosen_logps.float().clamp(max=_ORPO_MAX_LOGP)
    rejected = policy_rejected_logps.float().clamp(max=_ORPO_MAX_LOGP)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    return (
        -beta * ratio,
        _rewards(policy_chosen_logps.float(), None, beta),
        _rewards(policy_rejected_logps.float(), None, beta),
        ratio.detach(),
        log_odds.detach(),
    )


@PREFERENCE_LOSSES.register("kto", reference_free=False, paired=False, length_normalised=False, own_stage="kto")
def kto(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels_desirable: Tensor,
    policy_kl_logps: Tensor | None,
    ref_kl_logps: Tensor | None,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306, Eq. 7): unpaired, prospect-theoretic.

    Shapes: ``policy_logps``, ``ref_logps`` (B,) summed over completion tokens; ``labels_desirable`` (B,)
    bool; ``policy_kl_logps``, ``ref_kl_logps`` (B_kl,) summed logps of mismatched (prompt, completion) pairs
    used only for the reference point (None -> reference point 0). With ``r = policy - ref`` and
    ``z0 = clamp(mean(policy_kl - ref_kl), min=0)`` (detached, mean-then-clamp as TRL's KTOTrainer):
    desirable ``loss = w_d * (1 - sigmoid(beta * (r - z0)))``, undesirable
    ``loss = w_u * (1 - sigmoid(beta * (z0 - r)))``. Returns ``(losses (B,), rewards (B,) = beta * r
    detached, kl ())`` with losses in input order (TRL concatenates desirable then undesirable; the mean
    is the same). Under data parallelism TRL averages z0 over ranks; the caller may all-reduce first.
    """
    if policy_kl_logps is None or ref_kl_logps is None:
        kl = policy_logps.new_zeros(())
    else:
        kl = (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    logratios = policy_logps - ref_logps
    desirable = labels_desirable.to(torch.bool)
    chosen_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    losses = torch.where(desirable, chosen_losses, rejected_losses)
    return losses, (beta * logratios).detach(), kl


def preference_metrics(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
) -> dict[str, Tensor]:
    """Batch means logged by paired preference stages, under TRL's metric names.

    All inputs (B,); returns 0-d tensors (no device sync in the step: the engine reads them at log time).
    ``rewards/accuracies`` is the fraction with chosen reward strictly above rejected.
    """
    chosen_rewards, rejected_rewards = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "logps/chosen": policy_chosen_logps.detach().float().mean(),
        "logps/rejected": policy_rejected_logps.detach().float().mean(),
    }
