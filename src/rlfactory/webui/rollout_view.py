"""The Monitor's run health: the alerts the health rules wrote to trainer_log.jsonl, and the rollout browser that
opens the samples of the step an alert fired at, ordered by what the rule points to.

Read from files only, like the rest of Monitor: the alerts are the log's ``{"step": N, "health": {...}}`` records
(``engine/health.py``), the samples the loop's ``rollouts/step_XXXXX.jsonl`` traces (the loop writes one at every
step a rule fired, besides every ``logging.rollout_trace_steps``). Each trace line carries the response as
``segments`` (``[text, kind]`` runs: trained, observation, masked), shown with the trained tokens highlighted as in
the dataset preview.
"""

from __future__ import annotations

import html
import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfactory.rewards.builtin import answer_match

ALERT_COLUMNS = ["step", "rule", "action", "value", "message", "likely fixes"]
SHOWN = 4  # samples shown for a pick; the rest stay in the trace file


def alerts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The health alerts of a run, in the order they fired."""
    return [{"step": r["step"], **r["health"]} for r in records if isinstance(r.get("health"), dict)]


def alert_rows(found: list[dict[str, Any]]) -> list[list[Any]]:
    """The alerts panel's table: one row per alert (its columns: ALERT_COLUMNS)."""
    return [
        [a["step"], a.get("rule"), a.get("action"), _number(a.get("value")), a.get("message"), a.get("fixes")]
        for a in found
    ]


def _number(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


# --------------------------------------------------------------------------- which samples an alert points to
def _wrong(row: dict[str, Any]) -> bool:
    """The sample's final answer differs from the row's answer (answer_match's own comparison); no answer: unknown,
    never counted wrong."""
    answer = row.get("answer")
    return answer is not None and not answer_match("", str(row.get("completion") or ""), str(answer), {})


def _score(row: dict[str, Any]) -> float:
    value = row.get("score")
    return float(value) if isinstance(value, int | float) else 0.0


def _length(row: dict[str, Any]) -> int:
    return int(row.get("response_tokens") or len(str(row.get("completion") or "")))


def _groups(rows: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row.get("group", row.get("prompt"))].append(row)
    return groups


def _repeated(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Groups with the fewest distinct completions first (a collapsed policy samples one answer per prompt)."""
    groups = sorted(_groups(rows).values(), key=lambda g: len({r.get("completion") for r in g}))
    return [row for group in groups for row in group]


def _same_reward(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples of groups where every sample got one reward (zero advantage)."""
    return [row for g in _groups(rows).values() if len({_score(r) for r in g}) == 1 for row in g]


@dataclass(frozen=True)
class Pick:
    label: str  # what the browser says it shows
    select: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


PICKS: dict[str, Pick] = {
    "high_reward_wrong": Pick(
        "highest reward with a wrong answer",
        lambda rows: sorted((r for r in rows if _wrong(r)), key=_score, reverse=True),
    ),
    "truncated": Pick(
        "cut at the length cap, longest first",
        lambda rows: sorted((r for r in rows if r.get("finish_reason") == "length"), key=_length, reverse=True),
    ),
    "longest": Pick("longest responses", lambda rows: sorted(rows, key=_length, reverse=True)),
    "repeated": Pick("prompts whose samples repeat one answer", _repeated),
    "same_reward": Pick("groups where every sample got one reward (zero advantage)", _same_reward),
    "largest_advantage": Pick(
        "largest |advantage|", lambda rows: sorted(rows, key=lambda r: abs(r.get("advantage") or 0.0), reverse=True)
    ),
    "highest_reward": Pick("highest reward", lambda rows: sorted(rows, key=_score, reverse=True)),
    "all": Pick("all samples, in order", list),
}

# what each health rule points to (tests/test_health_ui.py keeps this and HEALTH_RULES the same set)
RULE_PICKS: dict[str, str] = {
    "reward_hacking": "high_reward_wrong",  # what the reward pays that the task does not
    "entropy_collapse": "repeated",
    "reference_kl": "highest_reward",  # the policy runs to what the reward pays most
    "policy_kl": "largest_advantage",  # the samples that push the update hardest
    "truncation": "truncated",
    "zero_advantage": "same_reward",
    "clip_fraction": "largest_advantage",
    "sampler_mismatch": "longest",  # the mismatch grows with the length
    "non_finite": "largest_advantage",
    "constant_component": "all",  # every sample has the component's one value
    "memory_pressure": "longest",  # activation memory grows with a sample's length
}


# --------------------------------------------------------------------------- traces
def trace_steps(output_dir: str | Path) -> list[int]:
    """Steps with a ``rollouts/step_XXXXX.jsonl`` trace, in order."""
    folder = Path(output_dir) / "rollouts"
    steps = (re.fullmatch(r"step_(\d+)", p.stem) for p in folder.glob("step_*.jsonl"))
    return sorted(int(m.group(1)) for m in steps if m)


def nearest_step(steps: list[int], step: int) -> int | None:
    """The traced step closest to ``step`` (the earlier one on a tie), None without traces."""
    return min(steps, key=lambda s: (abs(s - step), s)) if steps else None


def read_trace(output_dir: str | Path, step: int) -> list[dict[str, Any]]:
    path = Path(output_dir) / "rollouts" / f"step_{step:05d}.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def browse(output_dir: str | Path, step: int | None, pick: str) -> tuple[str, str]:
    """(a one-line note: which step, which samples and why; the samples as HTML) for a trace step and a pick."""
    if step is None:
        return "no rollout traces in this run (logging.rollout_trace_steps: null, or not an RL run)", ""
    rows = read_trace(output_dir, step)
    chosen = PICKS[pick].select(rows)
    name = f"rollouts/step_{step:05d}.jsonl"
    note = f"`{name}` · {PICKS[pick].label}: {len(chosen)} of {len(rows)} samples"
    if len(chosen) > SHOWN:
        note += f" (the first {SHOWN} shown)"
    return note, "".join(sample_html(row) for row in chosen[:SHOWN])


def for_alert(output_dir: str | Path, alert: dict[str, Any]) -> tuple[int | None, str, str, str]:
    """(the step shown, the pick, the note, the HTML) for an alert: its step's trace, else the nearest one."""
    steps = trace_steps(output_dir)
    step = alert["step"] if alert["step"] in steps else nearest_step(steps, alert["step"])
    pick = RULE_PICKS.get(str(alert.get("rule")), "highest_reward")
    note, body = browse(output_dir, step, pick)
    head = f"**{alert.get('rule')}** at step {alert['step']}: {alert.get('message')}"
    if step is not None and step != alert["step"]:
        head += f"\n\nno trace of step {alert['step']} (an older run): the nearest, step {step}, is shown"
    return step, pick, f"{head}\n\n{note}", body


# --------------------------------------------------------------------------- one sample as HTML
# tag and inline style per part (mark.trained is the page's own style, as in the dataset preview)
KIND_TAGS = {
    "trained": ("mark", ""),
    "observation": ("span", "opacity:0.6;font-style:italic"),
    "masked": ("del", "opacity:0.7"),
}


def segments_html(row: dict[str, Any]) -> str:
    """The response, trained tokens highlighted, observations (tool results) dimmed, masked tokens struck out;
    a trace without segments (an older run) shows the completion text."""
    segments = row.get("segments")
    if not isinstance(segments, list):
        return html.escape(str(row.get("completion") or ""))
    out = []
    for text, kind in segments:
        tag, style = KIND_TAGS.get(kind, ("span", ""))
        out.append(f'<{tag} class="{kind}" style="{style}" title="{kind}">{html.escape(text)}</{tag}>')
    return "".join(out)


def _parts(row: dict[str, Any]) -> str:
    rewards = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
    cells = [("score", row.get("score")), *rewards.items(), ("advantage", row.get("advantage"))]
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k, _ in cells)
    body = "".join(f"<td>{_number(v) if v is not None else ''}</td>" for _, v in cells)
    return f'<table class="rf-parts" style="font-size:12px;margin:4px 8px"><tr>{head}</tr><tr>{body}</tr></table>'


def sample_html(row: dict[str, Any]) -> str:
    """One sample: what it was asked, its response with the loss mask, its reward parts."""
    from rlfactory.webui.monitor import prompt_text

    tokens = row.get("response_tokens")
    trained = row.get("trained_tokens")
    counts = f"{tokens} response tokens" + (f", {trained} trained" if trained is not None else "")
    answer = row.get("answer")
    verdict = "" if answer is None else (" · wrong answer" if _wrong(row) else " · right answer")
    head = (
        f"group {row.get('group', '?')} · answer {html.escape(str(answer))}{verdict} · {counts} · finish "
        f"{row.get('finish_reason', '?')}"
    )
    prompt = html.escape(prompt_text(row.get("prompt")))
    return (
        f'<div class="rf-example rf-sample"><div class="rf-example-head">{head}</div>'
        f'<div class="rf-sample-prompt" style="font-size:12px;padding:4px 8px">{prompt}</div>'
        f'<pre class="rf-tokens">{segments_html(row)}</pre>{_parts(row)}</div>'
    )


def kinds_legend() -> str:
    return (
        '<div class="rf-preview-head"><mark class="trained">trained</mark> tokens carry loss · '
        f'<span style="{KIND_TAGS["observation"][1]}">tool results / environment text</span>: not sampled, not '
        f'trained · <del style="{KIND_TAGS["masked"][1]}">struck out</del>: sampled, masked out of the loss '
        "(rollout.mask_truncated)</div>"
    )
