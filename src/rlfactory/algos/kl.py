"""Per-token KL estimators between the policy and the reference model, plus KL-coefficient controllers.

Estimator signature: ``fn(log_prob (B, T), ref_log_prob (B, T)) -> (B, T)``; each is a per-token
sample estimate of KL(pi || pi_ref) for tokens sampled from pi (see J. Schulman, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html). Used either as a reward penalty (PPO, subtracted
from ``token_rewards``) or as a loss term (GRPO). Masking and reduction are left to the caller.
"""

from __future__ import annotations

import torch

from rlfactory.errors import UserError
from rlfactory.plugins import Registry

KL_ESTIMATORS = Registry("kl estimator")


@KL_ESTIMATORS.register("k1")
def k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1: the plain log-ratio log pi - log pi_ref (unbiased, high variance, can be negative).

    Reference: http://joschu.net/blog/kl-approx.html. Shapes: (B, T), (B, T) -> (B, T).
    The estimator used by RLHF reward penalties (Ziegler et al. 2019) and RLOO (Ahmadian et al. 2024).
    """
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("k2")
def k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2: half the squared log-ratio 0.5 * (log pi - log pi_ref)^2 (biased, low variance, >= 0).

    Reference: http://joschu.net/blog/kl-approx.html. Shapes: (B, T), (B, T) -> (B, T).
    Its gradient equals that of the true KL in expectation for on-policy samples (verl's ``mse``).
    """
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3")
def k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3: exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, always >= 0).

    Reference: http://joschu.net/blog/kl-approx.html; the GRPO paper's KL term
    (https://arxiv.org/abs/2402.03300). Shapes: (B, T), (B, T) -> (B, T).
    As verl's ``low_var_kl``: the log-ratio is clamped to [-20, 20] and the result to [-10, 10].
    """
    log_ratio = (ref_log_prob - log_prob).clamp(min=-20.0, max=20.0)
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return kl.clamp(min=-10.0, max=10.0)


class FixedKLController:
    """Constant KL coefficient: ``.value`` never changes; ``update`` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers share one interface)."""


class AdaptiveKLController:
    """Adaptive KL coefficient steering the measured KL towards a target (Ziegler et al. 2019).

    Paper: https://arxiv.org/abs/1909.08593, section 2.2. After each batch of ``n_steps`` samples:
    e = clip(KL / target - 1, -0.2, 0.2) and beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise UserError(f"adaptive KL controller: target and horizon must be > 0, got {target} and {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply ``.value`` by 1 + clip(current_kl / target - 1, +-0.2) * n_steps / horizon."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
