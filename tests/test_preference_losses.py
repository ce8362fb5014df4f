"""Preference losses: hand-computed values, parity with TRL 1.16, registry names and traits.

TRL parity: TRL's DPO and KTO losses live inside ``DPOTrainer._compute_loss`` / ``KTOTrainer._compute_loss``,
which run the model themselves. We call those methods on a bare ``SimpleNamespace`` "self" with a fake
model whose ``log_probs`` put each sequence's log-prob in one token slot (TRL sums over tokens) and with
precomputed reference log-probs, so TRL's own loss code runs on exactly the numbers we feed ours.
``CPOTrainer.cpo_loss`` (simpo, and cDPO via its smoothed ``sigmoid``) and ``ORPOTrainer.odds_ratio_loss``
are pure apart from a few attributes and are called on a namespace directly. The harness reads TRL 1.16
internals (the attributes ``_compute_loss`` touches); if a TRL upgrade breaks it, re-check the formulas.

Not comparable to ``DPOTrainer`` as-is: TRL 1.16's DPO ``sigmoid`` has no label smoothing any more, so
cDPO (``sigmoid`` with label_smoothing > 0) is compared with CPO's smoothed ``sigmoid`` on the log-ratios
(CPO's loss is DPO's with the reference terms folded into the inputs). ORPO: TRL returns
``+beta * log sigmoid(log_odds)`` (subtracted from the NLL); ours returns its negation.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlfactory.algos.preference import PREFERENCE_LOSSES, kto, preference_metrics
from rlfactory.errors import UserError

TOL = 1e-6
PAIRED = ["sigmoid", "robust", "ipo", "hinge", "simpo", "orpo"]


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)


# policy chosen/rejected, ref chosen/rejected (summed logps):
# pc - rc = [1, 1], pr - rr = [-1, 2], so delta = (pc - rc) - (pr - rr) = [2.0, -1.0]
PC, PR, RC, RR = t(-10.0, -12.0), t(-14.0, -9.0), t(-11.0, -13.0), t(-13.0, -11.0)


# ---------------------------------------------------------------- hand-computed values


def test_sigmoid_hand_computed():
    losses, cr, rr = PREFERENCE_LOSSES.get("sigmoid")(PC, PR, RC, RR, beta=0.5)
    close(losses, [-logsig(0.5 * 2.0), -logsig(0.5 * -1.0)])  # [0.313262, 0.974077]
    close(cr, [0.5 * (-10 + 11), 0.5 * (-12 + 13)])  # beta * (policy - ref) = [0.5, 0.5]
    close(rr, [0.5 * (-14 + 13), 0.5 * (-9 + 11)])  # [-0.5, 1.0]
    assert not cr.requires_grad


def test_sigmoid_label_smoothing_is_cdpo():
    losses, _, _ = PREFERENCE_LOSSES.get("sigmoid")(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    close(losses, [-0.9 * logsig(1.0) - 0.1 * logsig(-1.0), -0.9 * logsig(-0.5) - 0.1 * logsig(0.5)])


def test_robust_hand_computed():
    eps = 0.2
    losses, _, _ = PREFERENCE_LOSSES.get("robust")(PC, PR, RC, RR, beta=0.5, label_smoothing=eps)
    # ((1 - eps) * -logsig(b d) - eps * -logsig(-b d)) / (1 - 2 eps)
    close(losses, [((0.8 * -logsig(z)) - (0.2 * -logsig(-z))) / 0.6 for z in (1.0, -0.5)])
    losses0, _, _ = PREFERENCE_LOSSES.get("robust")(PC, PR, RC, RR, beta=0.5)
    close(losses0, [-logsig(1.0), -logsig(-0.5)])
    with pytest.raises(UserError, match="label_smoothing"):
        PREFERENCE_LOSSES.get("robust")(PC, PR, RC, RR, beta=0.5, label_smoothing=0.5)


def test_ipo_hand_computed():
    losses, cr, _ = PREFERENCE_LOSSES.get("ipo")(PC, PR, RC, RR, beta=0.25)
    close(losses, [(2.0 - 1 / (2 * 0.25)) ** 2, (-1.0 - 2.0) ** 2])  # target margin 1/(2 tau) = 2 -> [0, 9]
    close(cr, [0.25, 0.25])


def test_hinge_hand_computed():
    losses, _, _ = PREFERENCE_LOSSES.get("hinge")(PC, PR, RC, RR, beta=0.25)
    close(losses, [max(0.0, 1 - 0.25 * 2.0), max(0.0, 1 - 0.25 * -1.0)])  # [0.5, 1.25]
    losses, _, _ = PREFERENCE_LOSSES.get("hinge")(PC, PR, RC, RR, beta=1.0)
    close(losses, [0.0, 2.0])  # saturates once beta * delta >= 1


def test_simpo_hand_computed():
    pc, pr = t(-0.5, -1.2), t(-1.5, -1.0)  # length-averaged
    losses, cr, rr = PREFERENCE_LOSSES.get("simpo")(pc, pr, None, None, beta=2.0, gamma=0.5)
    # -logsig(beta * (pc - pr) - gamma): z = 2 * 1.0 - 0.5 = 1.5 ; 2 * -0.2 - 0.5 = -0.9
    close(losses, [-logsig(1.5), -logsig(-0.9)])
    close(cr, [-1.0, -2.4])  # beta * policy
    close(rr, [-3.0, -2.0])
    smoothed = PREFERENCE_LOSSES.get("simpo")(pc, pr, None, None, beta=2.0, gamma=0.5, label_smoothing=0.1)[0]
    close(smoothed, [-0.9 * logsig(z) - 0.1 * logsig(-z) for z in (1.5, -0.9)])


def test_orpo_hand_computed():
    pc, pr = t(-0.1, -2.0), t(-1.0, -0.5)  # length-averaged
    losses, cr, _, ratio, log_odds = PREFERENCE_LOSSES.get("orpo")(pc, pr, None, None, beta=0.1)

    def lo(a: float, b: float) -> float:  # log odds(a) - log odds(b), odds = p / (1 - p)
        return (a - math.log(1 - math.exp(a))) - (b - math.log(1 - math.exp(b)))

    # lo(-0.1, -1.0) = 2.251... ; lo(-2.0, -0.5) = -2.300...
    expected = [lo(-0.1, -1.0), lo(-2.0, -0.5)]
    close(log_odds, expected)
    close(ratio, [logsig(z) for z in expected])
    close(losses, [-0.1 * logsig(z) for z in expected])
    close(cr, [-0.01, -0.2])


def test_orpo_gradient_finite_at_logp_zero():
    pc = torch.tensor([0.0, -0.5], requires_grad=True)
    losses = PREFERENCE_LOSSES.get("orpo")(pc, torch.tensor([-1.0, -2.0]), None, None, beta=0.1)[0]
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(pc.grad).all()


def test_kto_hand_computed():
    pol, ref = t(-10.0, -12.0, -8.0), t(-11.0, -11.0, -9.0)  # r = policy - ref = [1, -1, 1]
    desirable = torch.tensor([True, False, False])
    kl_pol, kl_ref = t(-5.0, -7.0), t(-5.5, -6.9)  # z0 = mean([0.5, -0.1]) = 0.2
    losses, rewards, kl = kto(pol, ref, desirable, kl_pol, kl_ref, beta=0.5, desirable_weight=2.0)

    def sig(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    close(kl, [0.2])
    close(losses, [2.0 * (1 - sig(0.5 * (1 - 0.2))), 1 - sig(0.5 * (0.2 + 1)), 1 - sig(0.5 * (0.2 - 1))])
    close(rewards, [0.5, -0.5, 0.5])
    # reference point is clamped at 0 (mean-then-clamp) and None means 0
    _, _, kl_neg = kto(pol, ref, desirable, t(-6.0, -7.0), t(-5.0, -6.9), beta=0.5)
    close(kl_neg, [0.0])
    losses_none, _, kl_none = kto(pol, ref, desirable, None, None, beta=0.5)
    close(kl_none, [0.0])
    close(losses_none, [1 - sig(0.5), 1 - sig(0.5), 1 - sig(-0.5)])


def test_preference_metrics():
    m = preference_metrics(t(0.5, -1.0, 2.0), t(0.0, 1.0, 1.0), t(-3.0, -4.0, -5.0), t(-6.0, -8.0, -7.0))
    assert {k: float(v) for k, v in m.items()} == pytest.approx(
        {
            "rewards/chosen": 0.5,
            "rewards/rejected": 2 / 3,
            "rewards/margins": (0.5 - 2.0 + 1.0) / 3,
            "rewards/accuracies": 2 / 3,
            "logps/chosen": -4.0,
            "logps/rejected": -7.0,
        },
        abs=TOL,
    )


# ---------------------------------------------------------------- registry


def test_unknown_name_lists_valid_names():
    with pytest.raises(UserError) as err:
        PREFERENCE_LOSSES.get("dpo")
    for name in PAIRED + ["kto"]:
        assert name in str(err.value)


def test_traits():
    assert PREFERENCE_LOSSES.names() == sorted(PAIRED + ["kto"])
    for name in PAIRED + ["kto"]:
        traits = PREFERENCE_LOSSES.traits(name)
        assert traits["reference_free"] is (name in {"simpo", "orpo"}), name
        assert traits["paired"] is (name != "kto"), name
        assert PREFERENCE_LOSSES.get(name).__doc__.count("arxiv.org") >= 1, name


# ---------------------------------------------------------------- parity with TRL 1.16

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # before trl.experimental is imported (lazily, below)
MAX_DIFF: dict[str, float] = {}  # largest |ours - TRL| per comparison (printed with pytest -s)

G = torch.Generator().manual_seed(0)
B = 6


def rand(lo: float, hi: float, n: int = B) -> torch.Tensor:
    # float64 so that differences measure the formulas, not float32 rounding
    return lo + (hi - lo) * torch.rand(n, generator=G, dtype=torch.float64)


def record(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    diff = (ours.double() - theirs.double()).abs().max().item()
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)
    print(f"max |ours - trl| {key}: {diff:.3g}")
    assert diff <= TOL, (key, diff)


def fake_accelerator() -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)


class FakeModel:
    """Stands in for the model: ``log_probs`` holds each sequence's total log-prob in token slot 0."""

    training = True

    def __init__(self, seq_logps: torch.Tensor, width: int):
        self.log_probs = torch.zeros(len(seq_logps), width - 1, dtype=seq_logps.dtype)
        self.log_probs[:, 0] = seq_logps

    def __call__(self, **_: object) -> SimpleNamespace:
        zeros = torch.zeros_like(self.log_probs)
        out = {"log_probs": self.log_probs, "entropy": zeros, "mean_logits": zeros, "is_top1": zeros.bool()}
        return SimpleNamespace(**out)


def trl_dpo_loss(loss_type, pc, pr, rc, rr, *, beta, label_smoothing=0.0, lengths=None) -> torch.Tensor:
    """Mean loss from ``trl.DPOTrainer._compute_loss`` with precomputed reference logps."""
    from trl import DPOTrainer

    width = 8
    lengths = lengths if lengths is not None else torch.full((2 * len(pc),), width - 1)
    completion_mask = (torch.arange(width)[None, :] >= width - lengths[:, None]).long()
    model = FakeModel(torch.cat([pc, pr]), width)
    ns = SimpleNamespace(
        model=model, accelerator=fake_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {
        "input_ids": torch.ones(2 * len(pc), width, dtype=torch.long),
        "attention_mask": torch.ones(2 * len(pc), width, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    return DPOTrainer._compute_loss(ns, model, inputs, return_outputs=False)


def paired_inputs():
    return rand(-40, -5), rand(-40, -5), rand(-40, -5), rand(-40, -5)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("sigmoid", {"beta": 0.1}), ("robust", {"beta": 0.1, "label_smoothing": 0.2}), ("hinge", {"beta": 0.1})],
)
def test_dpo_losses_match_trl(name, kwargs):
    pc, pr, rc, rr = paired_inputs()
    ours, cr, rej = PREFERENCE_LOSSES.get(name)(pc, pr, rc, rr, **kwargs)
    record(f"{name} (batch mean)", ours.mean(), trl_dpo_loss(name, pc, pr, rc, rr, **kwargs))
    for i in range(B):  # one example at a time: per-example equality, not only the mean
        one = [x[i : i + 1] for x in (pc, pr, rc, rr)]
        record(name, ours[i], trl_dpo_loss(name, *one, **kwargs))
    close(cr, (0.1 * (pc - rc)).tolist())
    close(rej, (0.1 * (pr - rr)).tolist())


def test_ipo_matches_trl_with_length_averaged_logps():
    pc, pr, rc, rr = paired_inputs()
    lengths = torch.randint(1, 8, (2 * B,), generator=G)
    lc, lr = lengths[:B].double(), lengths[B:].double()
    # TRL's ipo gets summed logps + completion_mask and divides by length itself; ours gets averages
    ours, _, _ = PREFERENCE_LOSSES.get("ipo")(pc / lc, pr / lr, rc / lc, rr / lr, beta=0.1)
    record("ipo (batch mean)", ours.mean(), trl_dpo_loss("ipo", pc, pr, rc, rr, beta=0.1, lengths=lengths))
    for i in range(B):
        one = [x[i : i + 1] for x in (pc, pr, rc, rr)]
        theirs = trl_dpo_loss("ipo", *one, beta=0.1, lengths=lengths[[i, B + i]])
        record("ipo", ours[i], theirs)


def trl_cpo(loss_type: str, pc, pr, *, beta, label_smoothing=0.0, simpo_gamma=0.5):
    from trl.experimental.cpo import CPOTrainer

    ns = SimpleNamespace(
        alpha=0.0, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
        accelerator=fake_accelerator(),
    )  # fmt: skip
    return CPOTrainer.cpo_loss(ns, pc, pr)


@pytest.mark.parametrize("ls", [0.0, 0.15])
def test_simpo_matches_trl_cpo(ls):
    pc, pr = rand(-3, -0.05), rand(-3, -0.05)
    ours = PREFERENCE_LOSSES.get("simpo")(pc, pr, None, None, beta=2.0, gamma=0.7, label_smoothing=ls)
    theirs = trl_cpo("simpo", pc, pr, beta=2.0, label_smoothing=ls, simpo_gamma=0.7)
    for key, a, b in zip(("losses", "chosen_rewards", "rejected_rewards"), ours, theirs, strict=True):
        record(f"simpo {key} ls={ls}", a, b)


def test_cdpo_matches_trl_cpo_sigmoid():
    # CPO's sigmoid is DPO's cDPO with the reference folded in: feed it the log-ratios.
    pc, pr, rc, rr = paired_inputs()
    ours, _, _ = PREFERENCE_LOSSES.get("sigmoid")(pc, pr, rc, rr, beta=0.1, label_smoothing=0.15)
    theirs, _, _ = trl_cpo("sigmoid", pc - rc, pr - rr, beta=0.1, label_smoothing=0.15)
    record("sigmoid cDPO ls=0.15", ours, theirs)


def test_orpo_matches_trl_odds_ratio_loss():
    from trl.experimental.orpo import ORPOTrainer

    pc, pr = rand(-4, -0.01).float(), rand(-4, -0.01).float()
    ns = SimpleNamespace(beta=0.1, accelerator=fake_accelerator())
    t_losses, t_cr, t_rr, t_ratio_mean, t_log_odds_mean = ORPOTrainer.odds_ratio_loss(ns, pc, pr)
    losses, cr, rr, ratio, log_odds = PREFERENCE_LOSSES.get("orpo")(pc, pr, None, None, beta=0.1)
    record("orpo losses (= -trl losses)", losses, -t_losses)
    record("orpo rewards", torch.cat([cr, rr]), torch.cat([t_cr, t_rr]))
    record("orpo log_odds_ratio mean", ratio.mean(), t_ratio_mean)
    record("orpo log_odds_chosen mean", log_odds.mean(), t_log_odds_mean)


def trl_kto_loss(pol, ref, desirable, kl_pol, kl_ref, *, beta, desirable_weight, undesirable_weight):
    """Mean loss and kl from ``trl.KTOTrainer._compute_loss`` with precomputed reference logps."""
    from trl import KTOTrainer

    width = 4
    model = FakeModel(pol, width)
    ns = SimpleNamespace(
        model=model, accelerator=fake_accelerator(), aux_loss_enabled=False, precompute_ref_logps=True,
        calculate_KL=True, loss_type="kto", beta=beta, desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1, _compute_kl_logps=lambda model, batch: kl_pol,
    )  # fmt: skip
    batch = {
        "input_ids": torch.ones(len(pol), width, dtype=torch.long),
        "attention_mask": torch.ones(len(pol), width, dtype=torch.long),
        "completion_mask": torch.ones(len(pol), width, dtype=torch.long),
        "label": desirable,
        "ref_logps": ref,
        "ref_KL_logps": kl_ref,
    }
    loss = KTOTrainer._compute_loss(ns, model, batch, return_outputs=False)
    return loss, ns._metrics["train"]["kl"][-1]


@pytest.mark.parametrize("kl_shift", [5.0, -5.0])  # -5: negative mean KL, clamped to 0
def test_kto_matches_trl(kl_shift):
    pol, ref = rand(-30, -5), rand(-30, -5)
    kl_pol, kl_ref = rand(-30, -5) + kl_shift, rand(-30, -5)
    desirable = torch.tensor([True, False, True, True, False, False])
    kw = {"beta": 0.1, "desirable_weight": 1.3, "undesirable_weight": 0.7}
    losses, rewards, kl = kto(pol, ref, desirable, kl_pol, kl_ref, **kw)
    theirs, their_kl = trl_kto_loss(pol, ref, desirable, kl_pol, kl_ref, **kw)
    record(f"kto (batch mean) shift={kl_shift}", losses.mean(), theirs)
    record(f"kto kl shift={kl_shift}", kl, torch.tensor(their_kl, dtype=torch.float64))
    for i in range(B):  # per example: same KL batch, one labelled example
        theirs_i, _ = trl_kto_loss(pol[i : i + 1], ref[i : i + 1], desirable[i : i + 1], kl_pol, kl_ref, **kw)
        record(f"kto shift={kl_shift}", losses[i], theirs_i)
    close(rewards, (0.1 * (pol - ref)).tolist())
