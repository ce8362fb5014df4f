"""`rlfactory serve` (HF backend) answered by the real `openai` client: the bundled tool model in a subprocess.

Checked: the served greedy reply is exactly what the training code generates in-process from the same
rendered prompt (text and token counts); a stream's chunks add up to that reply and end with `data: [DONE]`;
the bundled model's calculator call comes back as OpenAI `tool_calls` (streamed too), and the tool result sent
back gives the final answer; n, seed, stop and max_tokens; a wrong API key gets 401, bad requests 400 with
OpenAI's error JSON; a busy port is one line and exit code 2. Pure helpers (what may be streamed, the request's
messages as the template gets them) are checked on their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import ROOT, run_cli

openai = pytest.importorskip("openai", reason="the serve tests use the openai client (dev extra)")
pytest.importorskip("uvicorn", reason="the HF server needs the serve extra (starlette, uvicorn)")

TOOL_MODEL = ROOT / "data" / "models" / "tiny-arith-tools"
KEY = "test-key-123"
SYSTEM = "Solve the problem. End with 'The answer is N.'"
QUESTION = "Mia had 12 apples. She bought 30 more apples. How many apples does Mia have now?"
# the schema the bundled model was trained with (data/arith/tool_sft.jsonl)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
ARITH = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(
    log_path: Path, *args: str, python: str = sys.executable, timeout: float = 600, meanwhile=lambda: None
) -> Iterator[str]:
    """`rlfactory serve` on a free loopback port in a subprocess; yields its base URL (…/v1) once /health answers
    (``meanwhile`` runs while the server loads)."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "RLFACTORY_API_KEY": KEY}
    command = [python, "-m", "rlfactory", "serve", str(TOOL_MODEL), "--port", str(port), *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout
        meanwhile()
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"rlfactory serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError(f"no answer within {timeout} s:\n{log_path.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    except BaseException:
        process.kill()
        raise
    # a SIGTERM (what a service manager or `docker stop` sends) ends the server with everything it started
    import psutil

    children = psutil.Process(process.pid).children(recursive=True)
    process.terminate()
    process.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=60)
    left = [" ".join(child.cmdline()[:4]) for child in alive]
    for child in alive:
        child.kill()
    assert not left, f"rlfactory serve ended on SIGTERM but left running: {left}"


REFERENCE: dict[str, list[int]] = {}


def greedy_reference() -> None:
    """The arith question's prompt and greedy reply ids from the training code, in this process."""
    from rlfactory.render.chat import render_prompt
    from rlfactory.rollout.hf import generate_ids
    from rlfactory.use.source import load_source, resolve_source

    model, tokenizer = load_source(resolve_source(str(TOOL_MODEL)))
    REFERENCE["prompt"] = render_prompt(tokenizer, ARITH)
    REFERENCE["ids"] = generate_ids(model, tokenizer, [REFERENCE["prompt"]], 64)[0]
    REFERENCE["text"] = tokenizer.decode(REFERENCE["ids"])


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(log, "--backend", "hf", meanwhile=greedy_reference) as url:  # both load at once
        yield url


@pytest.fixture(scope="module")
def client(base_url: str):
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def post(base_url: str, body: bytes, key: str = KEY) -> tuple[int, dict | str]:
    """A raw POST to /chat/completions: (status, JSON body or the raw text of a stream)."""
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            return response.status, (text if text.startswith("data:") else json.loads(text))
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check_tool_round_trip(client, model: str) -> None:
    """The bundled model calls the calculator on the arith question, then answers from the tool's result."""
    first = client.chat.completions.create(model=model, messages=ARITH, tools=[CALCULATOR], temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12 + 30"}
    assert call.id and not choice.message.content
    history = [*ARITH, choice.message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
    final = client.chat.completions.create(model=model, messages=history, tools=[CALCULATOR], temperature=0)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content.endswith("The answer is 42.")


# --------------------------------------------------------------------------- against the server
def test_greedy_reply_is_the_training_code_s(client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-arith-tools"]
    reply = client.chat.completions.create(model="tiny-arith-tools", messages=ARITH, temperature=0)
    prompt, ids = REFERENCE["prompt"], REFERENCE["ids"]
    assert REFERENCE["text"] == reply.choices[0].message.content + "<|im_end|>"
    assert reply.choices[0].message.content.startswith("12 + 30 = ")
    assert reply.choices[0].finish_reason == "stop"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(ids))
    assert usage.total_tokens == len(prompt) + len(ids)


def test_stream_adds_up_to_the_reply(client, base_url: str) -> None:
    whole = client.chat.completions.create(model="tiny-arith-tools", messages=ARITH, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-arith-tools", messages=ARITH, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 4  # token by token, not one piece
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks[-1:]] == ["stop"]
    assert len({c.id for c in chunks}) == 1
    body = {"model": "tiny-arith-tools", "messages": ARITH, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    status, text = post(base_url, json.dumps(body).encode())
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"] == whole.usage.model_dump(exclude_none=True)


def test_tool_call_and_result(client) -> None:
    check_tool_round_trip(client, "tiny-arith-tools")
    stream = client.chat.completions.create(
        model="tiny-arith-tools", messages=ARITH, tools=[CALCULATOR], temperature=0, stream=True
    )
    deltas = [c.choices[0] for c in stream]
    calls = [call for d in deltas for call in d.delta.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "calculator", {"expression": "12 + 30"})
    ]
    assert "".join(d.delta.content or "" for d in deltas) == ""  # the call's markup never streams as text
    assert deltas[-1].finish_reason == "tool_calls"
    off = client.chat.completions.create(
        model="tiny-arith-tools", messages=ARITH, tools=[CALCULATOR], tool_choice="none", temperature=0
    )
    assert off.choices[0].message.content.startswith("<tool_call>") and off.choices[0].finish_reason == "stop"


def test_sampling_parameters(client) -> None:
    def ask(**kwargs):
        return client.chat.completions.create(model="tiny-arith-tools", messages=ARITH, **kwargs)

    a, b = ask(n=3, temperature=1.5, seed=7, max_tokens=24), ask(n=3, temperature=1.5, seed=7, max_tokens=24)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # sampled, not three greedy copies
    cut = ask(temperature=0, stop=[" = "])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("12 + 30", "stop")
    short = ask(temperature=0, max_completion_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_errors_are_openai_json(client, base_url: str) -> None:
    wrong = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny-arith-tools", messages=ARITH)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-arith-tools", messages=[])
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-arith-tools'"):
        client.chat.completions.create(model="gpt-4o", messages=ARITH)
    hi = b'{"model": "tiny-arith-tools", "messages": [{"role": "user", "content": "hi"}]'
    cases = {
        b"{not json": None,
        b'["a list"]': None,
        hi + b', "temprature": 0}': "temprature",
        hi + b', "logprobs": true}': "logprobs",
        b'{"model": "tiny-arith-tools", "messages": [{"role": "robot", "content": "hi"}]}': "messages.0.role",
        hi + b', "max_tokens": 5000}': "messages",
    }
    for body, param in cases.items():
        status, answer = post(base_url, body)
        assert status == 400, body
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param, answer
        assert "Traceback" not in answer["error"]["message"]
    assert "did you mean 'temperature'" in post(base_url, list(cases)[2])[1]["error"]["message"]
    bad_call = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{x"}}]}
    status, answer = post(base_url, json.dumps({"model": "tiny-arith-tools", "messages": [*ARITH, bad_call]}).encode())
    assert status == 400 and "arguments: not valid JSON" in answer["error"]["message"]


def test_busy_port_is_one_line(base_url: str) -> None:
    port = base_url.split(":")[-1].split("/")[0]
    result = run_cli("serve", str(TOOL_MODEL), "--backend", "hf", "--port", port, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --port {port} on 127.0.0.1 is not free (Address already in use): choose another with --port"
    ]


# --------------------------------------------------------------------------- pure parts
def test_streamable_holds_back_what_may_become_a_stop() -> None:
    from rlfactory.use.serve import streamable

    holds = ["<|im_end|>", "\n<tool_call>", "<tool_call>"]
    assert streamable("12 + 30 = 42.<|im_e", holds) == "12 + 30 = 42."
    assert streamable("Let me see.\n", holds) == "Let me see."  # the newline may belong to a call
    assert streamable("Let me see.\n<tool_call>\n{", holds) == "Let me see."
    assert streamable("<tool_ca", holds) == ""
    assert streamable("a < b", holds) == "a < b"
    assert streamable("caf\ufffd", holds) == "caf"  # half a character


def test_request_messages_become_training_rows() -> None:
    from rlfactory.use.openai_api import ApiError, parse_request, template_messages

    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ],
    }
    assert template_messages(parse_request(body)) == [
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1", "name": "calculator"},
    ]
    with pytest.raises(ApiError, match="tool_choice"):
        parse_request({**body, "tool_choice": "required"})
    with pytest.raises(ApiError, match="at most 4"):
        parse_request({**body, "stop": ["a", "b", "c", "d", "e"]})


def test_vllm_command_serves_the_adapter_as_a_lora_module(tmp_path: Path) -> None:
    from rlfactory.errors import UserError
    from rlfactory.use.serve import ServeOptions, vllm_command
    from rlfactory.use.source import ModelSource

    adapter = tmp_path / "run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 12, "base_model_name_or_path": "base"}))
    opts = ServeOptions(port=9000, name="run", parser="json", extra=("--max-model-len", "2048"))
    command = vllm_command(ModelSource("base", [str(adapter)], None, "base"), opts, "/t/chat.jinja")
    assert command[1:6] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "base", "--max-model-len"]
    assert " ".join(command).endswith(
        "--port 9000 --chat-template /t/chat.jinja --enable-auto-tool-choice --tool-call-parser llama3_json "
        f"--enable-lora --max-lora-rank 16 --lora-modules run={adapter}"
    )
    plain = vllm_command(ModelSource("m", [], None, "tok"), ServeOptions(name="m"), "/t/c.jinja")
    assert plain[-4:] == ["--tokenizer", "tok", "--served-model-name", "m"]
    with pytest.raises(UserError, match="rlfactory export"):
        vllm_command(ModelSource("base", ["a", str(adapter)], None, "base"), opts, "/t/c.jinja")
