"""The ``health:`` section: one sub-section per named health rule (``engine/health.py``), each with its thresholds
and an action (``warn``, ``stop`` or ``ignore``).

Part of the one schema (``config/schema.py`` puts ``health`` into ``RunConfig``); kept apart so that schema.py
stays readable. The rules read the metrics every logged step already carries (``trainer_log.jsonl``), so the field
names say which metric a threshold is compared with. Every stage has the section; the rules about rollouts,
rewards, KL and entropy only ever see metrics in ppo/grpo runs, ``non_finite`` and ``memory_pressure`` apply to
every stage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfactory.config.base import Section

Action = Literal["warn", "stop", "ignore"]
ACTION_DOC = (
    "warn: one alert (console + a trainer_log.jsonl record) when the rule fires; stop: the alert, then a checkpoint "
    "and the run stops (exit code 3); ignore: not checked."
)


class Rule(Section):
    """Base of every rule's settings: what to do when it fires."""

    action: Action = Field("warn", description=ACTION_DOC)


class RewardHackingRule(Rule):
    """reward_hacking: the training reward rises while the held-out score (val/score) falls or stays flat. Checked at
    each validation from the third on (needs evaluation.dataset and train.eval_steps): the two latest intervals
    between validations are compared."""

    min_train_rise: float = Field(
        0.1,
        gt=0.0,
        description="The mean training reward (score/mean, in reward units) over the latest interval between "
        "validations is at least this much above its mean over the interval before: rising.",
    )
    max_val_gain: float = Field(
        0.0, description="val/score gained at most this much between the two latest validations: flat or falling."
    )


class EntropyCollapseRule(Rule):
    """entropy_collapse: the policy's token entropy (actor/entropy) fell below a floor or by a factor."""

    window: int = Field(3, ge=1, description="Logged steps averaged, at the start (the baseline) and now.")
    min_entropy: float = Field(0.01, ge=0.0, description="Fires when the recent mean entropy is below this.")
    drop_factor: float = Field(
        10.0, gt=1.0, description="Fires when the recent mean entropy is below the first `window` steps' mean / this."
    )


class KLRule(Rule):
    """Shared by the two KL rules: an absolute ceiling, and growth by a factor over `window` logged steps."""

    window: int = Field(3, ge=1, description="Logged steps averaged (the recent mean, and the one before it).")
    growth: float = Field(
        10.0,
        gt=1.0,
        description="Fires when the recent mean is this many times the mean of the `window` steps before it "
        "(and above growth_floor).",
    )


class ReferenceKLRule(KLRule):
    """reference_kl: the KL to the reference policy blows up: actor/kl_loss (the KL loss term, per token) and
    actor/reward_kl / response_length/mean (the in-reward KL, per sequence, over the mean response length)."""

    max_kl: float = Field(0.5, gt=0.0, description="Fires when the recent mean KL per token is above this.")
    growth_floor: float = Field(0.05, ge=0.0, description="Growth counts only above this KL per token.")


class PolicyKLRule(KLRule):
    """policy_kl: the KL between the updated policy and the one that sampled (the absolute value of actor/ppo_kl)
    blows up: the updates move the policy too far per step."""

    max_kl: float = Field(0.1, gt=0.0, description="Fires when the recent mean of abs(actor/ppo_kl) is above this.")
    growth_floor: float = Field(0.02, ge=0.0, description="Growth counts only above this abs(actor/ppo_kl).")


class RateRule(Rule):
    """A rate metric whose recent mean must stay under a ceiling."""

    window: int = Field(3, ge=1, description="Logged steps averaged.")


class TruncationRule(RateRule):
    """truncation: responses run to rollout.max_response_len (response_length/clip_ratio: the share cut by the cap)."""

    max_rate: float = Field(0.25, ge=0.0, le=1.0, description="Fires when the recent mean share cut is above this.")


class ZeroAdvantageRule(RateRule):
    """zero_advantage: groups whose samples all got the same reward (rollout/zero_adv_groups): no learning signal for
    an estimator that compares a prompt's samples (grpo, rloo, ...); not measured under gae or reinforce_plus_plus,
    whose baselines give such a group an advantage."""

    max_rate: float = Field(
        0.8, ge=0.0, le=1.0, description="Fires when the recent mean share of such groups is above this."
    )


class ClipFractionRule(RateRule):
    """clip_fraction: the share of tokens whose policy ratio was clipped (actor/pg_clipfrac)."""

    max_rate: float = Field(0.2, ge=0.0, le=1.0, description="Fires when the recent mean clip fraction is above this.")


class SamplerMismatchRule(RateRule):
    """sampler_mismatch: a separate sampler (vllm, or rollout.overlap's copy one step behind) and the trainer
    disagree: the share of response tokens whose trainer/sampler probability ratio is above rollout.is_threshold
    (rollout/ratio_over_cap)."""

    max_rate: float = Field(
        0.02, ge=0.0, le=1.0, description="Fires when the recent mean share of tokens over the cap is above this."
    )


class ConstantComponentRule(Rule):
    """constant_component: a reward component (reward/<name>/mean) with the same value on every logged step of a
    window: it adds nothing to the advantages."""

    window: int = Field(10, ge=2, description="Logged steps in a row with the same value.")


def _doc(cls: type) -> str:
    """A rule's docstring as one line (the field's description in docs/CONFIG.md and the WebUI)."""
    return " ".join((cls.__doc__ or "").split())


class HealthConfig(Section):
    """RL run health: named rules checked on each logged step's metrics (alerts in trainer_log.jsonl)."""

    reward_hacking: RewardHackingRule = Field(default_factory=RewardHackingRule, description=_doc(RewardHackingRule))
    entropy_collapse: EntropyCollapseRule = Field(
        default_factory=EntropyCollapseRule, description=_doc(EntropyCollapseRule)
    )
    reference_kl: ReferenceKLRule = Field(default_factory=ReferenceKLRule, description=_doc(ReferenceKLRule))
    policy_kl: PolicyKLRule = Field(default_factory=PolicyKLRule, description=_doc(PolicyKLRule))
    truncation: TruncationRule = Field(default_factory=TruncationRule, description=_doc(TruncationRule))
    zero_advantage: ZeroAdvantageRule = Field(default_factory=ZeroAdvantageRule, description=_doc(ZeroAdvantageRule))
    clip_fraction: ClipFractionRule = Field(default_factory=ClipFractionRule, description=_doc(ClipFractionRule))
    sampler_mismatch: SamplerMismatchRule = Field(
        default_factory=SamplerMismatchRule, description=_doc(SamplerMismatchRule)
    )
    non_finite: Rule = Field(
        default_factory=Rule,
        description="non_finite: updates skipped for a NaN/inf loss or gradient norm (train.skip_nonfinite_steps), "
        "or a logged metric that is not finite. Stopping on divergence itself is train.skip_nonfinite_steps' job; "
        "that stop is recorded as a non_finite alert too.",
    )
    constant_component: ConstantComponentRule = Field(
        default_factory=ConstantComponentRule, description=_doc(ConstantComponentRule)
    )
    memory_pressure: Rule = Field(
        default_factory=Rule,
        description="memory_pressure: torch's CUDA allocator emptied its cache to fit an allocation (alloc_flushes / "
        "perf/alloc_flushes above 0): the run is at its GPU memory limit and each flush stalls the step.",
    )
