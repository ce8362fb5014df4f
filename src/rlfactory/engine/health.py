"""RL run health: small named rules over the metrics each logged step already carries, so that a run going wrong
(reward hacking, entropy collapse, a KL blow-up, responses running to the cap, groups without a learning signal,
clipping, sampler mismatch, non-finite values, a reward part that never moves, a GPU at its memory limit) is
said while it happens.

Each rule is a pure function in ``HEALTH_RULES`` (``@HEALTH_RULES.register(name, fixes=...)``, verl core_algos
style): ``rule(history, settings) -> [Finding]``, reading the logged values (``History``) and its own settings
(``health.<name>`` in the run config, ``config/health_schema.py``). ``HealthMonitor`` feeds it every record the loop
logs and turns a finding into an ``Alert``, once per run for each (rule, metric): a one-line explanation and the
likely fixes, on the console (main process) and as a record in ``trainer_log.jsonl``::

    {"step": 40, "health": {"rule": "entropy_collapse", "action": "warn", "metric": "actor/entropy",
     "value": 0.012, "message": "entropy collapsed from 0.16 to 0.012 ...", "fixes": "raise rollout.temperature, ..."}}

``step`` is the step whose record fired it (the WebUI can open that step's rollouts); ``action`` is the configured
one (warn or stop). With ``stop`` the loop saves a checkpoint and raises ``stopped(alert, checkpoint)`` (exit code 3).
Every process runs the rules on the same reduced records, so every process decides alike; only the main one writes.

Non-finite values: ``engine.shared.NonFiniteGuard`` decides (stop, or skip the update under
``train.skip_nonfinite_steps``); a stop is written as a ``non_finite`` alert too, and skipped updates (the logged
``skipped_steps``) fire the ``non_finite`` rule.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlfactory.config.health_schema import HealthConfig
from rlfactory.engine import run_dir
from rlfactory.errors import RunStopped
from rlfactory.plugins import Registry

log = logging.getLogger(__name__)

HEALTH_RULES = Registry("health rule")
STOP_EXIT_CODE = 3  # a health rule with action stop (1: divergence, 2: bad input or failing user code, 128+n: signal)


@dataclass(frozen=True)
class Finding:
    """What a rule saw: the metric, its value (as compared with the threshold) and a one-line explanation."""

    metric: str
    value: float
    message: str


@dataclass(frozen=True)
class Alert:
    """A finding of a rule at a step, with the rule's action and likely fixes: one trainer_log.jsonl record."""

    step: int
    rule: str
    action: str
    metric: str
    value: float
    message: str
    fixes: str

    def record(self) -> dict[str, Any]:
        health = {k: v for k, v in asdict(self).items() if k != "step"}
        health["value"] = round(self.value, 6) if math.isfinite(self.value) else self.value
        return {"step": self.step, "health": health}

    def line(self) -> str:
        return f"health: {self.rule} at step {self.step}: {self.message}; likely fixes: {self.fixes}"


class History:
    """The logged values so far, per metric in step order; ``latest``: the newest record (rules check only the
    metrics it holds, so each is judged at the step it was logged)."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.latest: dict[str, Any] = {}

    def add(self, record: dict[str, Any]) -> None:
        self.latest = record
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.series[key].append((record["step"], float(value)))

    def values(self, metric: str) -> list[float]:
        return [v for _, v in self.series.get(metric, [])]

    def fresh(self, metric: str) -> bool:
        return metric in self.latest


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# --------------------------------------------------------------------------- the rules
@HEALTH_RULES.register(
    "reward_hacking",
    fixes="read that step's rollouts with a high reward and a wrong answer (rollouts/step_*.jsonl); make the reward "
    "pay only for the task (cap or drop length and format parts, weight the outcome higher); add a KL term "
    "(algorithm.kl_loss_coef); keep the checkpoint with the best val/score",
)
def reward_hacking(history: History, rule: Any) -> list[Finding]:
    """At a validation: the mean training reward (score/mean) over the interval since the previous validation is
    ``min_train_rise`` above its mean over the interval before, while val/score gained at most ``max_val_gain``
    between those two validations. Interval means, not single steps: a step's reward is noisy (+-0.15 at 32 samples
    on the bundled task), and so is a small held-out set."""
    if not history.fresh("val/score"):
        return []
    vals = history.series["val/score"]
    if len(vals) < 3:
        return []
    (start, _), (middle, val_before), (end, val_now) = vals[-3:]
    train = history.series.get("score/mean", [])
    earlier = [v for s, v in train if start < s <= middle]
    later = [v for s, v in train if middle < s <= end]
    if not earlier or not later:
        return []
    before, now = _mean(earlier), _mean(later)
    if now - before < rule.min_train_rise or val_now - val_before > rule.max_val_gain:
        return []
    return [
        Finding(
            "val/score",
            val_now,
            f"the training reward rose {before:.3f} -> {now:.3f} (mean score/mean of steps {start + 1}-{middle}, then "
            f"{middle + 1}-{end}) while val/score went {val_before:.3f} -> {val_now:.3f}: the policy is learning the "
            "reward, not the task",
        )
    ]


@HEALTH_RULES.register(
    "entropy_collapse",
    fixes="raise rollout.temperature, lower train.learning_rate, add an entropy bonus (algorithm.entropy_coef), "
    "clip higher (algorithm.clip_high: 0.28), or add a KL term (algorithm.kl_loss_coef)",
)
def entropy_collapse(history: History, rule: Any) -> list[Finding]:
    """The mean of the last ``window`` actor/entropy values is below ``min_entropy``, or below the first ``window``
    values' mean divided by ``drop_factor``."""
    metric = "actor/entropy"
    values = history.values(metric)
    if not history.fresh(metric) or len(values) < rule.window:
        return []
    start, now = _mean(values[: rule.window]), _mean(values[-rule.window :])
    if now >= max(rule.min_entropy, start / rule.drop_factor):
        return []
    return [
        Finding(
            metric,
            now,
            f"entropy collapsed from {start:.3g} to {now:.3g} (actor/entropy, means of {rule.window} logged steps): "
            "the policy samples nearly one answer and stops exploring",
        )
    ]


def _blowup(values: list[float], rule: Any, metric: str, what: str) -> list[Finding]:
    """A KL series above ``max_kl`` (recent mean), or ``growth`` times the ``window`` values before (above
    ``growth_floor``)."""
    w = rule.window
    if len(values) < w:
        return []
    now = _mean(values[-w:])
    if now > rule.max_kl:
        return [Finding(metric, now, f"{what} is {now:.3g}, above {rule.max_kl:g} (mean of {w} logged steps)")]
    if len(values) >= 2 * w:
        before = _mean(values[-2 * w : -w])
        if now > rule.growth_floor and now > rule.growth * before:
            grew = f"{now / before:.0f}-fold" if before > 0 else "from 0"
            return [Finding(metric, now, f"{what} grew {grew} in {w} logged steps ({before:.3g} -> {now:.3g})")]
    return []


@HEALTH_RULES.register(
    "reference_kl",
    fixes="lower train.learning_rate, raise algorithm.kl_loss_coef (or kl_in_reward_coef), keep train.max_grad_norm "
    "set; check the rollouts for an exploit of the reward the policy runs to",
)
def reference_kl(history: History, rule: Any) -> list[Finding]:
    """KL to the reference per token: actor/kl_loss, and actor/reward_kl (a sum over the response) divided by the
    step's response_length/mean."""
    found = []
    if history.fresh("actor/kl_loss"):
        found += _blowup(history.values("actor/kl_loss"), rule, "actor/kl_loss", "the KL to the reference per token")
    if history.fresh("actor/reward_kl"):
        lengths = dict(history.series.get("response_length/mean", []))
        per_token = [v / lengths[s] for s, v in history.series["actor/reward_kl"] if lengths.get(s)]
        found += _blowup(per_token, rule, "actor/reward_kl", "the in-reward KL to the reference per token")
    return found


@HEALTH_RULES.register(
    "policy_kl",
    fixes="lower train.learning_rate, use fewer algorithm.ppo_epochs or num_mini_batches, keep train.max_grad_norm "
    "set, or tighten algorithm.clip_low / clip_high",
)
def policy_kl(history: History, rule: Any) -> list[Finding]:
    """|actor/ppo_kl|: how far the updates moved the policy from the one that sampled the batch."""
    if not history.fresh("actor/ppo_kl"):
        return []
    values = [abs(v) for v in history.values("actor/ppo_kl")]
    return _blowup(values, rule, "actor/ppo_kl", "the KL between the updated and the sampling policy (|actor/ppo_kl|)")


def _ceiling(history: History, metric: str, window: int, limit: float, what: str) -> list[Finding]:
    """The mean of the last ``window`` values of ``metric`` is above ``limit``."""
    values = history.values(metric)
    if not history.fresh(metric) or len(values) < window:
        return []
    now = _mean(values[-window:])
    if now <= limit:
        return []
    return [Finding(metric, now, f"{what}: {now:.3g} ({metric}, mean of {window} logged steps), above {limit:g}")]


# rules on a rate metric whose recent mean must stay under ``max_rate``: name -> (metric, what it means, fixes)
RATE_RULES = {
    "truncation": (
        "response_length/clip_ratio",  # the share of responses cut at rollout.max_response_len
        "responses run to the length cap",
        "raise rollout.max_response_len, add a length penalty (reward.functions: length_penalty), set "
        "rollout.mask_truncated: true; check that the reward does not pay for length",
    ),
    "zero_advantage": (
        "rollout/zero_adv_groups",  # the share of groups whose samples all got the same reward
        "groups with one reward for all samples (zero advantage, nothing to learn)",
        "turn on rollout.dynamic_sampling, raise rollout.num_samples, train on prompts of the policy's level "
        "(neither all solved nor all failed), or give the reward partial credit",
    ),
    "clip_fraction": (
        "actor/pg_clipfrac",  # the share of tokens whose policy ratio the loss clipped
        "the policy ratio is clipped often",
        "lower train.learning_rate, use fewer algorithm.ppo_epochs or num_mini_batches; with a vllm sampler, look "
        "at the sampler mismatch (rollout/logprob_diff_mean)",
    ),
    "sampler_mismatch": (
        "rollout/ratio_over_cap",  # the share of tokens whose trainer/sampler ratio is above rollout.is_threshold
        "tokens beyond the importance-sampling cap (rollout.is_threshold)",
        "check that the weights reach the sampler after each update, sample and train in the same precision; with "
        "rollout.overlap (a sampler one step behind) lower train.learning_rate or turn overlap off; turn on "
        "rollout.is_correction (token_truncate or seq_mask), or raise rollout.is_threshold",
    ),
}


def _rate_rule(metric: str, what: str) -> Any:
    def rule(history: History, settings: Any) -> list[Finding]:
        return _ceiling(history, metric, settings.window, settings.max_rate, what)

    rule.__doc__ = f"The mean of the last ``window`` values of {metric} is above ``max_rate``: {what}."
    return rule


for _name, (_metric, _what, _fixes) in RATE_RULES.items():
    HEALTH_RULES.register(_name, fixes=_fixes)(_rate_rule(_metric, _what))


@HEALTH_RULES.register(
    "non_finite",
    fixes="lower train.learning_rate, keep train.max_grad_norm set, train in bf16 rather than fp16, and look for "
    "extreme values in the data or the rewards",
)
def non_finite(history: History, rule: Any) -> list[Finding]:
    """Updates skipped for a non-finite loss or gradient norm (``skipped_steps``), or a logged value NaN/inf: one
    finding per record (a skipped update also logs its NaN loss)."""
    latest = history.latest
    bad = [k for k, v in latest.items() if isinstance(v, float) and not math.isfinite(v)]
    if latest.get("skipped_steps"):
        n = latest["skipped_steps"]
        also = f" ({', '.join(f'{k} {latest[k]}' for k in bad)})" if bad else ""
        return [Finding("skipped_steps", n, f"{n:g} update(s) skipped: the loss or gradient norm was not finite{also}")]
    if bad:
        return [Finding(bad[0], latest[bad[0]], f"{', '.join(f'{k} is {latest[k]}' for k in bad)}")]
    return []


@HEALTH_RULES.register(
    "memory_pressure",
    fixes="lower train.per_device_batch_size (ppo/grpo: or set rollout.micro_batch_tokens), set "
    "model.gradient_checkpointing: true, or give vLLM less with rollout.gpu_memory_utilization",
)
def memory_pressure(history: History, rule: Any) -> list[Finding]:
    """torch's CUDA allocator had to empty its cache to fit an allocation (``alloc_flushes`` offline,
    ``perf/alloc_flushes`` online: the most of any process since the last logged step). A flush waits for the device
    and returns memory to the driver: the run is at its GPU memory limit and slowed by it."""
    latest = history.latest
    for metric in ("alloc_flushes", "perf/alloc_flushes"):
        n = latest.get(metric) or 0
        if n > 0:
            # online, the main process's flushes per phase (perf/alloc_flushes/<phase>) say where
            phases = {k.rsplit("/", 1)[1]: v for k, v in latest.items() if k.startswith("perf/alloc_flushes/")}
            where = f" (in {', '.join(f'{k} {v:g}' for k, v in phases.items())})" if phases else ""
            message = (
                f"torch's CUDA allocator emptied its cache {n:g} time(s) since the last logged step{where}: the run "
                "is at its GPU memory limit and each flush stalls the step"
            )
            return [Finding(metric, float(n), message)]
    return []


@HEALTH_RULES.register(
    "constant_component",
    fixes="check that the component can score this policy's outputs (a format it never matches, an answer it never "
    "sees), or drop it from reward.functions",
)
def constant_component(history: History, rule: Any) -> list[Finding]:
    """A reward/<name>/mean with one value on each of the last ``window`` logged steps."""
    found = []
    for key in history.latest:
        if not (key.startswith("reward/") and key.endswith("/mean")):
            continue
        values = history.values(key)
        if len(values) >= rule.window and len(set(values[-rule.window :])) == 1:
            name = key[len("reward/") : -len("/mean")]
            found.append(
                Finding(
                    key,
                    values[-1],
                    f"reward component '{name}' was {values[-1]:g} on each of the last {rule.window} logged steps: "
                    "it adds nothing to the advantages",
                )
            )
    return found


# --------------------------------------------------------------------------- the monitor
class HealthMonitor:
    """Runs the enabled rules on every logged record; each (rule, metric) alerts once per run.

    ``check`` decides (pure); ``observe`` also reports (console and trainer_log.jsonl, main process only).
    ``stop`` is the first alert whose action is stop: the loop checkpoints and raises ``stopped(stop, path)``."""

    def __init__(self, settings: HealthConfig, out: Path | None = None, main: bool = True):
        rules = {name: getattr(settings, name) for name in HEALTH_RULES.names()}
        self.rules = {name: rule for name, rule in rules.items() if rule.action != "ignore"}
        self.out, self.main = out, main
        self.history = History()
        self.fired: set[tuple[str, str]] = set()
        self.alert_steps: set[int] = set()  # steps whose records fired a rule (the loop traces their rollouts)
        self.stop: Alert | None = None

    def check(self, record: dict[str, Any]) -> list[Alert]:
        self.history.add(record)
        alerts = []
        for name, rule in self.rules.items():
            for finding in HEALTH_RULES.get(name)(self.history, rule):
                if (name, finding.metric) in self.fired:
                    continue
                self.fired.add((name, finding.metric))
                fixes = HEALTH_RULES.traits(name)["fixes"]
                alerts.append(
                    Alert(record["step"], name, rule.action, finding.metric, finding.value, finding.message, fixes)
                )
                self.alert_steps.add(record["step"])
        if self.stop is None:
            self.stop = next((a for a in alerts if a.action == "stop"), None)
        return alerts

    def observe(self, record: dict[str, Any]) -> list[Alert]:
        alerts = self.check(record)
        for alert in alerts:
            report(alert, self.out, self.main)
        return alerts

    def replay(self, records: list[dict[str, Any]]) -> None:
        """A resumed run: the log up to its checkpoint, so that windows go on and what fired does not fire again."""
        for record in records:
            if "health" in record:
                self.fired.add((record["health"]["rule"], record["health"]["metric"]))
            else:
                self.history.add(record)


def report(alert: Alert, out: Path | None, main: bool) -> None:
    """The alert on the console and in trainer_log.jsonl (the main process writes both)."""
    if not main:
        return
    log.warning(alert.line())
    if out is not None:
        run_dir.append_log(out, alert.record())


def stopped(alert: Alert, checkpoint: Path) -> RunStopped:
    """The stop of a rule whose action is stop, after the loop saved ``checkpoint``."""
    return RunStopped(
        f"health rule {alert.rule} at step {alert.step}: {alert.message}; saved {checkpoint}. Likely fixes: "
        f"{alert.fixes}. To go on as it is: health.{alert.rule}.action=warn resume_from_checkpoint=auto",
        exit_code=STOP_EXIT_CODE,
    )


def divergence_alert(step: int, metric: str, value: float, message: str) -> Alert:
    """NonFiniteGuard's stop, as a non_finite alert (recorded whatever health.non_finite.action says: the stop is
    train.skip_nonfinite_steps' decision)."""
    return Alert(step, "non_finite", "stop", metric, value, message, HEALTH_RULES.traits("non_finite")["fixes"])
