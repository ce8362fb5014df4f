"""``rlfactory chat PATH``: talk to a model, a LoRA adapter or a run's output dir in the terminal.

A reply is the online stages' agent loop (``rollout.agent.AgentLoop``) run on one conversation, so the model sees
what it saw in rollouts: the prompt is ``render_prompt``'s (the chat template with the offered tools' schemas),
tool calls are parsed by ``agent.parser``'s parser, run by the tools executor with the ``agent`` section's default
limits (timeout, subprocess sandbox, result length), and their results are spliced back as tokens until the model
answers without a call or ``--max-turns`` assistant turns are spent. Each turn streams as it is generated.

``ChatSession.reply`` yields :class:`ChatEvent` s (text pieces, tool calls, results, the end) and keeps the
history, so the WebUI's Chat tab can stream the same way; ``run_terminal`` prints them and reads commands.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator

from rlfactory.config.base import Section
from rlfactory.config.online_schema import ToolSpec, _tool_entries
from rlfactory.envs.base import StepResult, ToolEnv
from rlfactory.errors import UserError
from rlfactory.tools.parsers import ToolCall
from rlfactory.tools.spec import Tool

TOOL_FILE_SUFFIXES = (".yaml", ".yml", ".json")
COMMANDS = "/clear resets the history (the system prompt stays), /exit or Ctrl-D quits, Ctrl-C stops a reply"


@dataclass(frozen=True)
class ChatEvent:
    """One thing to show. ``turn``: an assistant turn starts; ``text``: a piece of it; ``call``: a parsed tool call
    (``name``, ``text`` = its arguments as JSON, ``error`` when it cannot run); ``result``: a tool's result
    (``text``, ``error`` when it failed); ``end``: the reply is over (``text`` = how: answer, length, max_turns,
    stopped)."""

    kind: Literal["turn", "text", "call", "result", "end"]
    text: str = ""
    name: str = ""
    error: str | None = None


@dataclass(frozen=True)
class ChatSettings:
    max_new_tokens: int = 256  # per assistant turn
    temperature: float = 0.0  # 0: greedy
    max_turns: int = 4  # assistant turns per user message
    parser: str = "hermes"


Emit = Callable[[ChatEvent | None], None]


def _event_streamer(tokenizer: Any, emit: Emit, stops: list[str]) -> Any:
    """A transformers ``TextStreamer`` that emits text events instead of printing. It decodes the whole turn so far
    at each token (multi-byte characters print whole) and keeps special tokens, so tool-call tags show as the model
    wrote them; only the end-of-turn string is left out."""
    from transformers import TextStreamer

    class EventStreamer(TextStreamer):
        def put(self, value: Any) -> None:
            if self.next_tokens_are_prompt:  # generate() passes the prompt first: a new turn starts
                emit(ChatEvent("turn"))
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if stream_end:  # the end-of-turn token is the last one, and the streamer holds symbols until the end
                text = next((text.removesuffix(s) for s in stops if text.endswith(s)), text)
            if text:
                emit(ChatEvent("text", text))

    return EventStreamer(tokenizer, skip_prompt=True, skip_special_tokens=False)


def _stop_criterion(stop: threading.Event) -> Any:
    from transformers import StoppingCriteria

    class Stopped(StoppingCriteria):
        """Ends generation once ``stop`` is set (Ctrl-C); checked after each token."""

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            import torch

            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

    return Stopped()


class ShownToolEnv(ToolEnv):
    """The agent loop's tool environment, telling the session each call before it runs and each result after."""

    def __init__(self, tools: dict[str, Tool], limits: Any, emit: Emit, stop: threading.Event):
        super().__init__(tools, limits)
        self.emit, self.stop = emit, stop

    async def step(self, message: dict[str, Any], calls: list[ToolCall]) -> StepResult:
        for call in calls:
            arguments = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else call.raw
            self.emit(ChatEvent("call", arguments, call.name or "", call.error))
        result = await super().step(message, calls)
        for call, outcome in zip(calls, result.tool_results, strict=True):
            self.emit(ChatEvent("result", outcome.content, call.name or "", outcome.error))
        if self.stop.is_set():  # Ctrl-C while the tools ran: the model does not continue
            return StepResult([], True, {}, result.tool_results)
        return result


def exec_limits() -> Any:
    """The limits tool calls run under in training by default (the ``agent`` section's defaults)."""
    from rlfactory.config.online_schema import AgentConfig
    from rlfactory.tools.execute import ExecLimits

    ag = AgentConfig()
    return ExecLimits(ag.tool_timeout_s, ag.max_concurrency, ag.tool_memory_mb, ag.max_tool_response_chars)


class ChatSession:
    """A conversation with one loaded model: the history, and the next reply as a stream of events."""

    def __init__(self, model: Any, tokenizer: Any, tools: dict[str, Tool], settings: ChatSettings, system: str = ""):
        from rlfactory.render.chat import stop_strings
        from rlfactory.rollout.agent import AgentLoop, AgentSettings
        from rlfactory.rollout.hf import HFBackend

        self.tokenizer, self.tools, self.settings, self.system = tokenizer, tools, settings, system
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.messages = self._fresh()
        self._events: queue.Queue[ChatEvent | None] = queue.Queue()
        self._stop = threading.Event()
        streamer = _event_streamer(tokenizer, self._events.put, stop_strings(tokenizer))
        extra = {"streamer": streamer, "stopping_criteria": [_stop_criterion(self._stop)]}
        limits = exec_limits()
        self.loop = AgentLoop(
            HFBackend(model, tokenizer, 1, extra),
            tokenizer,
            tools,
            AgentSettings(settings.max_turns, settings.parser, settings.max_new_tokens),
            lambda: ShownToolEnv(tools, limits, self._events.put, self._stop),
        )

    def _fresh(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def clear(self) -> None:
        """Forget the conversation; the system prompt stays."""
        self.messages = self._fresh()

    def stop(self) -> None:
        """Stop the reply in progress after its current token (or its running tool calls); safe from a signal."""
        self._stop.set()

    def _budget(self, prompt_len: int) -> int:
        """Tokens the whole reply may take (turns and tool results): what is left of the model's context."""
        if self.context is None:
            return self.settings.max_turns * self.settings.max_new_tokens * 4
        left = self.context - prompt_len
        if left < 1:
            raise UserError(
                f"the conversation is {prompt_len} tokens and the model's context {self.context}: /clear to start over"
            )
        return left

    def reply(self, text: str) -> Iterator[ChatEvent]:
        """Events of the model's answer to the user message ``text``; the history has the reply once it ends."""
        from rlfactory.render.chat import render_prompt
        from rlfactory.rollout.base import SamplingParams

        messages = [*self.messages, {"role": "user", "content": text}]
        schemas = [tool.schema for tool in self.tools.values()] or None
        prompt = render_prompt(self.tokenizer, messages, schemas)
        params = SamplingParams(self._budget(len(prompt)), temperature=self.settings.temperature)
        example = {"messages": messages, "prompt_ids": prompt, "tools": schemas}
        self._stop.clear()
        outcome: dict[str, Any] = {}

        def work() -> None:  # generate() runs here; the caller's thread reads the events (and takes signals)
            try:
                outcome["result"] = self.loop.run([example], params)[0]
            except BaseException as exc:  # re-raised in the caller's thread
                outcome["error"] = exc
            finally:
                self._events.put(None)

        worker = threading.Thread(target=work, name="chat-reply", daemon=True)
        _start_without_sigint(worker)
        finished = False
        try:
            while (event := self._events.get()) is not None:
                yield event
            finished = True
        finally:
            if not finished:  # the caller stopped reading (a page closed): end this reply before another starts
                self.stop()
                while self._events.get() is not None:
                    pass
            worker.join()
        if "error" in outcome:
            raise outcome["error"]
        self.messages = outcome["result"].messages
        yield ChatEvent("end", "stopped" if self._stop.is_set() else outcome["result"].finish)


# --------------------------------------------------------------------------- building a session from the CLI
class ToolsSection(Section):
    """A run's ``tools:`` section on its own (so errors name ``tools.0.function`` as in a run YAML)."""

    tools: list[ToolSpec]

    _tool_list = field_validator("tools", mode="before")(_tool_entries)


def _tools_file(path: Path) -> list[Any]:
    """A YAML/JSON list of ``tools:`` entries, or a run YAML whose ``tools:`` section is used."""
    from rlfactory.config.yaml_io import load_yaml_file

    raw = load_yaml_file(path, "tools file")
    if isinstance(raw, dict) and "tools" in raw:
        raw = raw["tools"]
    if not isinstance(raw, list) or not raw:
        raise UserError(
            f"tools file '{path}': expected a list of tools (as a run's `tools:` section), e.g. "
            "[calculator, path/to/file.py:function, {function: ..., name: ...}]"
        )
    return raw


def load_chat_tools(values: list[str]) -> dict[str, Tool]:
    """``--tools`` values (a YAML/JSON file, or comma-separated entries: bundled names, ``file.py:function``) ->
    the tools by name, checked as a run's ``tools:`` section is (its schema class, then ``load_tools``)."""
    from pydantic import ValidationError

    from rlfactory.config.loader import format_validation_error
    from rlfactory.tools.spec import load_tools

    specs: list[Any] = []
    for value in values:
        is_file = value.endswith(TOOL_FILE_SUFFIXES)
        raw = _tools_file(Path(value)) if is_file else [v.strip() for v in value.split(",") if v.strip()]
        try:
            specs += ToolsSection.model_validate({"tools": raw}).tools
        except ValidationError as exc:
            raise UserError(format_validation_error(exc, value if is_file else "--tools", ToolsSection)) from None
    return load_tools(specs)


def build_session(args: Any) -> tuple[ChatSession, str]:
    """The session the command line asks for, and the banner describing it. Paths, tools and the parser are
    checked before the model loads."""
    from rlfactory.tools.parsers import TOOL_PARSERS
    from rlfactory.use.source import load_source, resolve_source

    source = resolve_source(args.path, args.base or "", args.template or "")
    tools = load_chat_tools(args.tools or [])
    TOOL_PARSERS.get(args.parser)
    if args.max_new_tokens < 1 or args.max_turns < 1 or args.temperature < 0:
        raise UserError("--max-new-tokens and --max-turns must be at least 1, --temperature at least 0")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weights' loading bar would sit above the banner
    with warnings.catch_warnings():  # libraries' deprecation notices about their own internals, not the user's input
        warnings.simplefilter("ignore", FutureWarning)
        model, tokenizer = load_source(source)
    settings = ChatSettings(args.max_new_tokens, args.temperature, args.max_turns, args.parser)
    session = ChatSession(model, tokenizer, tools, settings, args.system or "")
    adapters = f" + adapter {', '.join(source.adapters)}" if source.adapters else ""
    params = sum(p.numel() for p in model.parameters())
    sampling = "greedy" if settings.temperature <= 0 else f"temperature {settings.temperature:g}"
    offered = f"{', '.join(tools)} (parser {settings.parser})" if tools else "none"
    template = source.template or "the tokenizer's own"
    banner = (
        f"chat with {source.base}{adapters} ({params:,} parameters; template: {template})\n"
        f"tools: {offered}; {sampling}, {settings.max_new_tokens} new tokens per turn, "
        f"{settings.max_turns} turns per message\n{COMMANDS}"
    )
    return session, banner


# --------------------------------------------------------------------------- the terminal
ENDINGS = {
    "length": "[cut: --max-new-tokens reached, or the model's context is full]",
    "max_turns": "[--max-turns assistant turns spent; the model did not see the last tool results]",
    "stopped": "[stopped]",
}


class TerminalPrinter:
    """Prints events as they come: each turn after ``assistant>``, each call and result on its own line."""

    def __init__(self, out: Any = None):
        self.out = out or sys.stdout
        self.at_line_start = True

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()
            self.at_line_start = text.endswith("\n")

    def line(self, text: str) -> None:
        self.write(("" if self.at_line_start else "\n") + text + "\n")

    def show(self, event: ChatEvent) -> None:
        if event.kind == "turn":
            self.write(("" if self.at_line_start else "\n") + "assistant> ")
        elif event.kind == "text":
            self.write(event.text)
        elif event.kind == "call":
            self.line(f"  [tool call] {event.name or '?'} {event.text}" + (f" -- {event.error}" if event.error else ""))
        elif event.kind == "result":
            self.line(f"  [tool result] {event.text}")
        elif event.text in ENDINGS:
            self.line(ENDINGS[event.text])
        elif not self.at_line_start:  # an answer: end its line
            self.write("\n")


def _start_without_sigint(thread: threading.Thread) -> None:
    """Start ``thread`` with SIGINT blocked in it and in the threads it starts (the generation's, the tools' pool).
    Python runs signal handlers in the main thread only, and a Ctrl-C the kernel hands to another thread never wakes
    the main thread's ``input()`` (seen on CI: the hint never came); blocked everywhere else, it can only go there."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks (nor this problem)
        thread.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _answer(session: ChatSession, text: str, printer: TerminalPrinter) -> None:
    """One reply; Ctrl-C stops it (the session goes on) instead of raising KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, lambda _sig, _frame: session.stop())
    try:
        for event in session.reply(text):
            printer.show(event)
    finally:
        signal.signal(signal.SIGINT, previous)


def run_terminal(session: ChatSession, banner: str) -> int:
    """Read messages and commands until /exit or end of input; input errors in a message are shown, not fatal."""
    from rlfactory.tools.execute import close_workers

    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:  # Windows
        pass
    printer = TerminalPrinter()
    printer.write(banner + "\n")
    # Ctrl-C is part of this UI, so take it even where the launcher left SIGINT ignored (a background job of a
    # non-interactive shell does, and Python then keeps SIG_IGN instead of raising KeyboardInterrupt) or blocked (an
    # inherited signal mask: the signal then waits, pending, and input() never returns).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    unblock = getattr(signal, "pthread_sigmask", None)  # not on Windows
    previous_mask = unblock(signal.SIG_UNBLOCK, {signal.SIGINT}) if unblock else None
    try:
        while True:
            try:
                text = input("you> ").strip()
                if not sys.stdin.isatty():  # piped messages: a terminal would have echoed them
                    printer.write(text + "\n")
            except EOFError:
                printer.write("\n")
                return 0
            except KeyboardInterrupt:
                printer.write("\n(/exit or Ctrl-D quits)\n")
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/clear":
                session.clear()
                printer.write("(history cleared)\n")
            elif text.startswith("/"):
                printer.write(f"unknown command '{text.split()[0]}'; {COMMANDS}\n")
            elif text:
                try:
                    _answer(session, text, printer)
                except UserError as exc:
                    printer.line(f"error: {exc}")
                except KeyboardInterrupt:  # pressed in the instant before the reply took Ctrl-C over
                    printer.line(ENDINGS["stopped"])
    finally:
        signal.signal(signal.SIGINT, previous)
        if unblock:
            unblock(signal.SIG_SETMASK, previous_mask)
        close_workers()


def cmd_chat(args: Any) -> int:
    """``rlfactory chat``: load, print the banner, talk."""
    import logging

    logging.getLogger("rlfactory.rollout.agent").setLevel(logging.WARNING)  # failed calls show as their results
    session, banner = build_session(args)
    return run_terminal(session, banner)
