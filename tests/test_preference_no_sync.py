"""kto and orpo loss functions read nothing back from the device: metrics are 0-d tensors the engine's ``_Meter``
reads once per log line, and the logged numbers are those of the former ``.item()`` code.

A host read (``.item()``, ``float()``, ``bool()``, ``.tolist()``) is what syncs a GPU step; on CPU the test makes
each of them raise while the loss function runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from rlfactory.algos.preference import PREFERENCE_LOSSES
from rlfactory.config.schema import KTOConfig, ORPOConfig
from rlfactory.engine.offline import _Meter
from rlfactory.stages import kto, orpo


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*_: object) -> None:
        raise AssertionError("a device tensor was read on the host inside the loss function")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            m.setattr(torch.Tensor, name, refuse)
        yield


def old_kto_metrics(rewards: torch.Tensor, logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor) -> dict:
    """The former ``kto.kto_metrics``, verbatim: the numbers the new code must log."""
    metrics = {"kl": float(kl)}
    for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
        if rows.any():
            metrics[f"rewards/{name}"] = rewards[rows].mean().item()
            metrics[f"logps/{name}"] = logps.detach()[rows].mean().item()
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


def _kto_batch(labels: list[bool], seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """A collated-looking batch (labels and their host flags) and fixed policy/reference log-probs per row prefix."""
    g = torch.Generator().manual_seed(seed)
    n = len(labels)
    batch = {
        "input_ids": torch.zeros(n, 3, dtype=torch.long),
        "desirable": torch.tensor(labels),
        "labels_present": (any(labels), not all(labels)),
    }
    logps = {key: -10 * torch.rand(n, generator=g) for key in ("policy", "policykl_", "ref", "refkl_")}
    logps["policy"].requires_grad_()
    return batch, logps


def _kto_loss(monkeypatch: pytest.MonkeyPatch, logps: dict[str, torch.Tensor]):
    """kto's loss function with the forwards replaced by the fixed log-probs (the model is not under test)."""
    monkeypatch.setattr(kto, "forward_logps", lambda _m, _b, prefix, _k: (logps[f"policy{prefix}"], None))
    monkeypatch.setattr(kto, "reference_logps", lambda _r, _b, prefix, _k: (logps[f"ref{prefix}"], None))
    return kto.make_loss(KTOConfig(beta=0.2, desirable_weight=1.0, undesirable_weight=1.5), ref=None)


def _old_metrics(logps: dict[str, torch.Tensor], desirable: torch.Tensor) -> dict:
    _, rewards, kl = PREFERENCE_LOSSES.get("kto")(
        logps["policy"], logps["ref"], desirable, logps["policykl_"], logps["refkl_"], beta=0.2
    )
    return old_kto_metrics(rewards, logps["policy"], desirable, kl)


def test_the_old_metrics_code_fails_the_no_host_read_check(monkeypatch):
    """The check can fail: the former code read every class mean back with ``.item()``."""
    batch, logps = _kto_batch([True, False], seed=0)
    with no_host_reads(monkeypatch), pytest.raises(AssertionError, match="read on the host"):
        _old_metrics(logps, batch["desirable"])


@pytest.mark.parametrize("labels", [[True, False, True, False], [True, True, True], [False, False]])
def test_kto_metrics_are_device_tensors_with_the_old_values(monkeypatch, labels):
    """Both classes, only desirable, only undesirable: same keys (a class absent logs no mean, no margin) and
    the same float32 values as before."""
    batch, logps = _kto_batch(labels, seed=len(labels))
    loss_fn = _kto_loss(monkeypatch, logps)
    with no_host_reads(monkeypatch):
        _, metrics = loss_fn(None, batch)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    old = _old_metrics(logps, batch["desirable"])
    assert metrics.keys() == old.keys()
    for key, value in old.items():
        torch.testing.assert_close(metrics[key], torch.tensor(value, dtype=torch.float32), msg=key)


def test_kto_logged_averages_equal_the_old_ones_when_a_class_is_missing(monkeypatch):
    """The engine's meter over three micro-batches, one without undesirable rows and one without desirable ones:
    each class mean averages over the batches that have the class, exactly as the ``.item()`` code logged."""
    new, old = _Meter(), _Meter()
    for seed, labels in enumerate([[True, False, False], [True, True], [False, False, False, True], [False]]):
        batch, logps = _kto_batch(labels, seed)
        with no_host_reads(monkeypatch):
            new.add(_kto_loss(monkeypatch, logps)(None, batch)[1])
        old.add(_old_metrics(logps, batch["desirable"]))
    logged, want = new.pop(), old.pop()
    assert logged.keys() == want.keys() == {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
                                            "logps/chosen", "logps/rejected"}
    for key in want:
        assert logged[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key


def test_orpo_metrics_are_device_tensors_with_the_old_values(monkeypatch):
    g = torch.Generator().manual_seed(1)
    sums = -20 * torch.rand(6, generator=g)
    means = (sums / torch.tensor([5.0, 7.0, 3.0, 5.0, 9.0, 2.0])).requires_grad_()
    monkeypatch.setattr(orpo, "forward_logps", lambda _m, _b, _p, _k: (sums, means))
    with no_host_reads(monkeypatch):
        loss, metrics = orpo.make_loss(ORPOConfig(beta=0.1))(None, {})
    assert loss.requires_grad
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    chosen, rejected = means.detach().chunk(2)
    _, _, _, log_odds_ratio, log_odds = PREFERENCE_LOSSES.get("orpo")(chosen, rejected, beta=0.1)
    old = {  # the former .item() values
        "nll_loss": (-chosen).mean().item(),
        "log_odds_ratio": log_odds_ratio.mean().item(),
        "log_odds_chosen": log_odds.mean().item(),
    }
    for key, value in old.items():
        assert metrics[key].item() == value, key
