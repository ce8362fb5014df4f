"""The multi-turn agent loop: generate a turn -> parse tool calls -> step the environment (tools run
concurrently) -> splice the observation tokens -> repeat, for a whole batch of conversations at once.

Token-in, token-out (DESIGN principle 2): each conversation is one growing token sequence; assistant turns
are the sampled ids (mask 1, the sampler's log-probs kept), observations are template glue + contents
tokenized once (``render.glue``; mask 0, log-prob placeholder 0.0). Nothing is ever re-rendered. A
conversation ends when the environment says so (for tools: a turn without calls, i.e. the final answer),
after ``agent.max_turns`` assistant turns, or when ``rollout.max_response_len`` (the budget of the whole
response, observations included) is spent. The response always ends with a sampled token, so the
sequence score sits on a token the policy produced.

Each live conversation's next turn is generated in ONE batched backend call per round, so the backend
(hf or vllm) batches across conversations exactly as in single-turn rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rlfactory.envs.base import Env, StepResult
from rlfactory.render.chat import stop_strings
from rlfactory.render.glue import ObservationGlue
from rlfactory.rollout.base import Completion, GenerationBackend, SamplingParams
from rlfactory.tools.execute import close_workers
from rlfactory.tools.parsers import TOOL_PARSERS, ParsedTurn, ToolCall, validate_calls

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rlfactory.config.schema import RunConfig


@dataclass
class Conversation:
    """One sample in flight: the response so far (ids, mask, log-probs), the messages and the per-turn trace."""

    example: dict[str, Any]
    env: Env
    messages: list[dict[str, Any]]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    reward_parts: dict[str, float] = field(default_factory=dict)
    finish: str | None = None  # answer | env_done | max_turns | length
    final_text: str = ""
    pending: list[ToolCall] = field(default_factory=list)  # the last turn's parsed calls, for the env step

    def extend(self, ids: list[int], policy: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(policy)] * len(ids)
        if self.logprobs is not None:
            self.logprobs = None if (policy and logprobs is None) else self.logprobs + (logprobs or [0.0] * len(ids))


@dataclass
class AgentResult:
    completion: Completion  # the whole response: ids, per-token mask and log-probs, finish_reason
    final_text: str  # the last assistant turn without its tool calls (what outcome rewards read)
    turns: list[dict[str, Any]]  # per turn: text, content, calls (with results), observation, reward parts
    messages: list[dict[str, Any]]  # prompt + generated conversation (renders to the same tokens)
    finish: str
    reward_parts: dict[str, float]

    def summary(self) -> dict[str, Any]:
        """What rewards see as ``example["agent"]``."""
        return {"turns": self.turns, "finish": self.finish, "reward_parts": self.reward_parts}


@dataclass(frozen=True)
class AgentSettings:
    max_turns: int = 4
    parser: str = "hermes"
    max_tokens_per_turn: int | None = None
    env_step_timeout_s: float = 60.0


def _log_failures(convs: list[Conversation]) -> None:
    """One line per batch for tool calls that failed and environment steps that raised, with the first reason
    (each is also in the trace: ``tool_error`` per call, ``env_error`` per turn, and in tool_errors/rate and
    finish/env_error, which count every process's). On several processes each line counts its own process's."""
    own = " (this process)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    calls = [c for conv in convs for turn in conv.turns for c in turn["calls"] if c["error_kind"] is None]
    failed = [c["tool_error"] for c in calls if c.get("tool_error")]
    if failed:
        log.info("tool calls failed%s: %d/%d (first: %s)", own, len(failed), len(calls), failed[0])
    env_errors = [t["env_error"] for conv in convs for t in conv.turns if "env_error" in t]
    if env_errors:
        log.warning(
            "environment steps raised%s in %d/%d episodes (first: %s)", own, len(env_errors), len(convs), env_errors[0]
        )


def _in_daemon_thread(lock: threading.Lock, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread (holding ``lock``), as a future of the running loop.

    A thread rather than ``run_in_executor``: a step that hangs cannot be killed in-process, and the executor's
    threads are joined at interpreter exit, so one hung step would keep the finished run from ever exiting.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def work() -> None:
        with lock:
            try:
                value, error = fn(*args), None
            except BaseException as exc:  # SystemExit too: reported as the episode's env_error
                value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed: the step was given up already
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, daemon=True, name="env-step").start()
    return future


class AgentLoop:
    """Runs conversations over a generation backend; ``env_factory()`` makes one environment per sample."""

    def __init__(self, backend: Any, tokenizer: Any, tools: dict, settings: AgentSettings, env_factory: Callable):
        self.backend, self.tokenizer, self.tools = backend, tokenizer, tools
        self.settings, self.env_factory = settings, env_factory
        self.parse = TOOL_PARSERS.get(settings.parser)
        self.glue = ObservationGlue(tokenizer)
        self.stops = stop_strings(tokenizer)  # harmony (GPT-OSS): <|return|> ends an answer, <|call|> a call

    def run(self, examples: list[dict[str, Any]], params: SamplingParams) -> list[AgentResult]:
        """One conversation per example (repeat an example for several samples); ``params.max_tokens`` is the
        budget of each whole response."""
        convs = [self._start(ex) for ex in examples]
        for turn in range(self.settings.max_turns):
            live = [c for c in convs if c.finish is None]
            if not live:
                break
            self._generate(live, params)
            stepping = [c for c in live if c.finish is None]
            results = asyncio.run(self._step_all(stepping))
            for conv, result in zip(stepping, results, strict=True):
                self._observe(conv, result, params.max_tokens, last_turn=turn == self.settings.max_turns - 1)
        _log_failures(convs)
        return [self._result(c) for c in convs]

    def _start(self, example: dict[str, Any]) -> Conversation:
        env = self.env_factory()
        env.reset(example)
        return Conversation(example, env, [dict(m) for m in example["messages"]])

    def _generate(self, live: list[Conversation], params: SamplingParams) -> None:
        """One batched backend call: the next assistant turn of every live conversation, parsed."""
        left = [params.max_tokens - len(c.ids) for c in live]
        cap = (
            max(left)
            if self.settings.max_tokens_per_turn is None
            else min(max(left), self.settings.max_tokens_per_turn)
        )
        turn_params = replace(params, max_tokens=cap)  # every other setting as given
        outs = self.backend.generate([c.example["prompt_ids"] + c.ids for c in live], turn_params)
        for conv, out, budget in zip(live, outs, left, strict=True):
            ids, logprobs, reason = out.token_ids, out.logprobs, out.finish_reason
            if len(ids) > budget:  # the batch's cap is the largest budget: cut this one to its own
                ids, logprobs, reason = ids[:budget], logprobs[:budget] if logprobs else None, "length"
            conv.extend(ids, True, logprobs)
            self._parse_turn(conv, ids, reason)

    def _parse_turn(self, conv: Conversation, ids: list[int], reason: str) -> None:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        stop = next((s for s in self.stops if text.endswith(s)), None) if reason == "stop" else None
        body = text[: -len(stop)] if stop else text
        parsed: ParsedTurn = self.parse(body)
        validate_calls(parsed.calls, self.tools)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if any(c.valid for c in parsed.calls):
            message["tool_calls"] = [c.as_message_call() for c in parsed.calls if c.valid]
        conv.messages.append(message)
        conv.pending = parsed.calls
        # what outcome rewards read: the turn's text as its parser reads it, outside any calls and without format
        # markup (harmony: the final channel's message), so an answer inside a broken call earns nothing
        conv.final_text = parsed.content
        conv.turns.append(
            {
                "assistant": body,
                "tokens": len(ids),
                "finish_reason": reason,  # length: the turn was cut by the response budget
                "calls": [
                    {"name": c.name, "arguments": c.arguments, "error": c.error, "error_kind": c.error_kind}
                    for c in parsed.calls
                ],
            }
        )
        if reason == "length":
            conv.finish = "length"

    async def _step_all(self, convs: list[Conversation]) -> list[StepResult]:
        """Every live conversation's environment step, concurrently; a step that raises or runs past
        ``env_step_timeout_s`` ends its episode (``env_error``), never the run."""
        timeout = self.settings.env_step_timeout_s
        plain_steps = threading.Lock()  # plain (not async) steps run one at a time, as they did on the event loop

        async def one(conv: Conversation) -> StepResult:
            is_async = inspect.iscoroutinefunction(conv.env.step)
            try:
                if is_async:  # cancelled at its next await when late
                    return await asyncio.wait_for(conv.env.step(conv.messages[-1], conv.pending), timeout)
                running = _in_daemon_thread(plain_steps, conv.env.step, conv.messages[-1], conv.pending)
                outcome = await asyncio.wait_for(running, timeout)
                return await outcome if inspect.isawaitable(outcome) else outcome
            except TimeoutError:
                turn = conv.turns[-1]
                turn["env_error"] = f"the environment's step ran past agent.env_step_timeout_s ({timeout:g} s)"
                turn["env_hung"] = not is_async  # its thread cannot be stopped: the online loop stops the run
                return StepResult([], True)
            except (Exception, SystemExit) as exc:  # a user environment's bug ends its episode, never the run
                conv.turns[-1]["env_error"] = f"{type(exc).__name__}: {exc}"
                return StepResult([], True)

        return list(await asyncio.gather(*(one(c) for c in convs)))

    def _observe(self, conv: Conversation, result: StepResult, budget: int, last_turn: bool) -> None:
        """Record the step; splice the observation unless the episode ends (the response must end on a sampled
        token)."""
        turn = conv.turns[-1]
        for call, res in zip(turn["calls"], result.tool_results, strict=False):
            call.update(result=res.content, tool_error=res.error, seconds=round(res.seconds, 4))
        turn["observation"] = [m["content"] for m in result.observation]
        if "env_error" in turn:
            conv.finish = "env_error"
            return
        turn["reward_parts"] = dict(result.reward_parts)
        for key, value in result.reward_parts.items():
            conv.reward_parts[key] = conv.reward_parts.get(key, 0.0) + float(value)
        if result.done or not result.observation:
            conv.finish = "answer" if not turn["calls"] else "env_done"
            return
        if last_turn:
            conv.finish = "max_turns"
            return
        ids = self.glue.ids(result.observation)
        if len(conv.ids) + len(ids) >= budget:  # no room left for another sampled token
            conv.finish = "length"
            return
        conv.extend(ids, False)
        conv.messages += result.observation
        turn["observation_tokens"] = len(ids)

    def _result(self, conv: Conversation) -> AgentResult:
        if conv.finish is None:
            conv.finish = "max_turns"
        reason = "length" if conv.finish == "length" else "stop"
        completion = Completion(conv.ids, reason, conv.logprobs, conv.mask)  # type: ignore[arg-type]
        return AgentResult(completion, conv.final_text, conv.turns, conv.messages, conv.finish, conv.reward_parts)


# --------------------------------------------------------------------------- the online loop's side
def agent_enabled(cfg: RunConfig) -> bool:
    """Multi-turn rollouts replace single-turn generation when tools are declared or ``agent.env`` is set."""
    return bool(cfg.tools) or bool(cfg.agent is not None and cfg.agent.env)


def prepare_tool_examples(cfg: RunConfig, examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Load and check the declared tools (before any model loads); rows without ``tools`` get their schemas,
    rows with their own may only offer declared tools. Returns the tools by name."""
    tools = offer_tools(cfg.tools, cfg.agent.parser if cfg.agent is not None else None, examples)
    if cfg.agent is not None:
        from rlfactory.envs.factory import env_class

        env_class(cfg.agent.env or "tools")
    return tools


def offer_tools(specs: list[Any], parser: str | None, examples: list[dict[str, Any]]) -> dict[str, Any]:
    """``prepare_tool_examples`` for any list of tool entries (the run's ``tools``, or ``evaluation.tools``) and
    tool-call parser (None: not checked)."""
    from rlfactory.tools.spec import check_example_tools, load_tools

    tools = load_tools(specs)
    check_example_tools(examples, tools)
    schemas = [tool.schema for tool in tools.values()]
    for example in examples:
        if not example.get("tools") and schemas:
            example["tools"] = schemas
    if parser is not None:
        TOOL_PARSERS.get(parser)
    return tools


class Rollouts:
    """What the online loop samples with: a generation backend, through the agent loop when one is configured.

    ``generate`` gives the same thing either way: one ``Completion`` per sample (one token sequence, mask 1 only
    on sampled tokens), so packing, advantages and the policy loss do not know whether tools ran. Rewards see
    the last assistant turn as the completion (``finals``) and the episode as ``example["agent"]``.
    """

    def __init__(self, backend: GenerationBackend, agent: AgentLoop | None):
        self.backend, self.agent = backend, agent

    @property
    def syncs_weights(self) -> bool:
        return self.backend.syncs_weights

    def generate(
        self, examples: list[dict], params: SamplingParams
    ) -> tuple[list[Completion], list[str | None], list[dict]]:
        """(completions, final texts or None for single-turn, examples as rewards see them)."""
        if self.agent is None:
            return (
                self.backend.generate([ex["prompt_ids"] for ex in examples], params),
                [None] * len(examples),
                examples,
            )
        results = self.agent.run(examples, params)
        return (
            [r.completion for r in results],
            [r.final_text for r in results],
            [{**ex, "agent": r.summary()} for ex, r in zip(examples, results, strict=True)],
        )

    def sync_weights(self, model: Any) -> None:
        self.backend.sync_weights(model)

    def close(self) -> None:
        self.backend.close()
        close_workers()


def build_rollouts(cfg: RunConfig, model: Any, tokenizer: Any, backend: GenerationBackend | None = None) -> Rollouts:
    """The run's backend (``rollout.backend``; or ``backend``), wrapped in the agent loop when tools or an env are
    configured."""
    from rlfactory.rollout.backends import build_backend
    from rlfactory.tools.execute import ExecLimits

    backend = backend if backend is not None else build_backend(cfg, model, tokenizer)
    if not agent_enabled(cfg):
        return Rollouts(backend, None)
    ag = cfg.agent
    assert ag is not None
    limits = ExecLimits(ag.tool_timeout_s, ag.max_concurrency, ag.tool_memory_mb, ag.max_tool_response_chars)
    settings = AgentSettings(ag.max_turns, ag.parser, ag.max_tokens_per_turn, ag.env_step_timeout_s)
    return agent_rollouts(backend, tokenizer, cfg.tools, settings, limits, ag.env or "tools", ag.env_args)


def agent_rollouts(
    backend: GenerationBackend,
    tokenizer: Any,
    tool_specs: list[Any],
    settings: AgentSettings,
    limits: Any = None,
    env: str = "tools",
    env_args: dict[str, Any] | None = None,
) -> Rollouts:
    """``backend`` through the agent loop: ``tool_specs`` (tool entries, as ``tools:`` holds them) answered by the
    environment ``env`` (default: the tools environment; ``limits``: an ``ExecLimits``, default limits if None).
    The online loop's sampler when tools or an env are configured, and every evaluation's with tools."""
    from rlfactory.envs.factory import build_env_factory
    from rlfactory.tools.execute import ExecLimits
    from rlfactory.tools.spec import load_tools

    tools = load_tools(tool_specs)
    factory = build_env_factory(env, tools, limits if limits is not None else ExecLimits(), env_args or {})
    return Rollouts(backend, AgentLoop(backend, tokenizer, tools, settings, factory))


def episode_metrics(examples: list[dict], prefix: str = "") -> dict[str, float]:
    """num_turns/{mean,max}, tool_calls/mean, tool_errors/rate, invalid_calls/rate, tool_calls/<tool> (counts),
    finish/<reason> (fractions) over the samples of a step; {} for single-turn samples."""
    episodes = [ex["agent"] for ex in examples if "agent" in ex]
    if not episodes:
        return {}
    turns = [len(ep["turns"]) for ep in episodes]
    calls = [call for ep in episodes for turn in ep["turns"] for call in turn["calls"]]
    executed = [c for c in calls if c["error_kind"] is None]
    out = {
        "num_turns/mean": sum(turns) / len(turns),
        "num_turns/max": float(max(turns)),
        "tool_calls/mean": len(calls) / len(episodes),
        "tool_errors/rate": sum(c.get("tool_error") is not None for c in executed) / max(len(executed), 1),
        "invalid_calls/rate": (len(calls) - len(executed)) / max(len(calls), 1),
        "env/hung_steps": float(sum(bool(t.get("env_hung")) for ep in episodes for t in ep["turns"])),
    }
    for call in executed:
        key = f"tool_calls/{call['name']}"
        out[key] = out.get(key, 0.0) + 1.0
    for ep in episodes:
        key = f"finish/{ep['finish']}"
        out[key] = out.get(key, 0.0) + 1.0 / len(episodes)
    return {f"{prefix}{k}": v for k, v in out.items()}


def episode_trace_fields(example: dict) -> dict[str, Any]:
    """Extra fields of a rollout trace line: how the episode ended and every turn (text, calls, results)."""
    if "agent" not in example:
        return {}
    return {"finish": example["agent"]["finish"], "turns": example["agent"]["turns"]}
