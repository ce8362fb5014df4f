"""Tools: declaration and schema (derived / explicit / mismatched), call parsing in each format, validation
against the schema, async execution (timeouts, exceptions, sandboxed code), and bad-input errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlfactory.config.schema import ToolSpec
from rlfactory.errors import UserError
from rlfactory.tools.builtin import calculator
from rlfactory.tools.execute import ExecLimits, run_calls
from rlfactory.tools.parsers import TOOL_PARSERS, ToolCall, parse_hermes, parse_json_calls, validate_calls
from rlfactory.tools.spec import Tool, check_arguments, load_tools

USER_TOOLS = '''
import time


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def boom(x: str) -> str:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError("tool exploded: " + x)


def undocumented(x):
    return x
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


@pytest.fixture(scope="module")
def tools(user_file) -> dict[str, Tool]:
    specs = [ToolSpec(function="calculator")] + [
        ToolSpec(function=f"{user_file}:{name}", timeout_s=0.5 if name == "slow" else None)
        for name in ("add", "slow", "boom")
    ]
    return load_tools(specs)


# --------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    "expr, want", [("12 + 7", "19"), ("6 * 7", "42"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("-(3 - 5) ** 2", "-4")]
)
def test_calculator(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "x + 1", "2 ** 10 ** 10", "open('f')", "1 +"])
def test_calculator_refuses_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        calculator(expr)


# --------------------------------------------------------------------------- declaration and schema
def test_schema_is_derived_from_hints_and_docstring_as_transformers_does(tools):
    import json

    from tests.conftest import DATA_DIR

    # the bundled calculator offers the schema its bundled data carry (what the bundled model was trained on)
    rows = (DATA_DIR / "arith" / "tool_prompts_test.jsonl").read_text().splitlines()[:4]
    assert all(json.loads(row)["tools"] == [tools["calculator"].schema] for row in rows)
    params = tools["add"].parameters
    assert params["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert params["required"] == ["a"]


def test_explicit_schema_is_checked_against_the_function(user_file):
    good = {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}  # fmt: skip
    tool = load_tools([ToolSpec(function=f"{user_file}:add", json_schema=good, name="plus")])["plus"]
    assert tool.schema["function"]["name"] == "plus" and tool.fn(a=1, b=2) == 3
    bad = json.loads(json.dumps(good))
    bad["parameters"]["properties"]["c"] = {"type": "string"}
    bad["parameters"]["properties"]["a"]["type"] = "string"
    bad["parameters"]["required"] = []
    with pytest.raises(UserError) as err:
        load_tools([ToolSpec(function=f"{user_file}:add", json_schema=bad)])
    msg = str(err.value)
    assert "does not match the function" in msg and "'c' is not a parameter" in msg
    assert "requires 'a'" in msg and "'a' is integer in the function but string" in msg


@pytest.mark.parametrize(
    "ref, expected",
    [
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' does not import"),
        ("{file}:missing", "has no function 'missing'"),
        ("/nope/tools.py:fn", "does not exist"),
        ("calculater", "did you mean 'calculator'"),
        ("{file}:undocumented", "cannot derive a JSON schema"),
    ],
)
def test_tool_paths_that_do_not_resolve_are_clear_errors(user_file, ref, expected):
    with pytest.raises(UserError, match="tools") as err:
        load_tools([ToolSpec(function=ref.format(file=user_file))])
    assert expected in str(err.value)


def test_duplicate_tool_names_are_an_error():
    with pytest.raises(UserError, match="declared twice"):
        load_tools([ToolSpec(function="calculator"), ToolSpec(function="calculator")])


# --------------------------------------------------------------------------- parsing
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>'


def test_hermes_valid_call_and_text():
    turn = parse_hermes("Let me compute.\n" + CALL)
    assert turn.content == "Let me compute."
    [call] = turn.calls
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "12 + 7"}, None)


def test_hermes_several_calls_in_one_turn():
    second = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>'
    turn = parse_hermes(CALL + "\n" + second)
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("calculator", {"expression": "12 + 7"}),
        ("add", {"a": 1, "b": 2}),
    ]


def test_no_call_is_a_final_answer_kept_verbatim():
    assert parse_hermes("12 + 7 = 19. The answer is 19.").calls == []
    assert parse_hermes(" x ").content == " x "  # the content is what was sampled


@pytest.mark.parametrize(
    "text, why",
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>', "invalid JSON"),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}', "not closed"),
        ('<tool_call>\n["calculator"]\n</tool_call>', "expected {"),
        ('<tool_call>\n{"name": "calculator", "arguments": [1]}\n</tool_call>', "must be a JSON object"),
    ],
)
def test_hermes_malformed_calls(text, why):
    [call] = parse_hermes(text).calls
    assert call.error_kind == "malformed" and why in str(call.error)


def test_validation_marks_unknown_tools_and_bad_arguments(tools):
    calls = [
        ToolCall("calculator", {"expression": "1 + 1"}, ""),
        ToolCall("weather", {"city": "Paris"}, ""),
        ToolCall("calculator", {}, ""),
        ToolCall("calculator", {"expression": 12}, ""),
        ToolCall("calculator", {"expression": "1", "precision": 2}, ""),
        ToolCall("add", {"a": True}, ""),
    ]
    validate_calls(calls, tools)
    assert [c.error_kind for c in calls] == [None, "unknown_tool", "bad_arguments", "bad_arguments", "bad_arguments",
                                             "bad_arguments"]  # fmt: skip
    assert "unknown tool 'weather'; available: calculator, add, slow, boom" == calls[1].error
    assert "missing required argument 'expression'" in str(calls[2].error)
    assert "must be string, got int" in str(calls[3].error)
    assert "unknown argument 'precision'" in str(calls[4].error)
    assert "must be integer, got bool" in str(calls[5].error)


def test_json_parser_plain_calls_lists_and_fences():
    assert parse_json_calls('{"name": "calculator", "arguments": {"expression": "2"}}').calls[0].name == "calculator"
    turn = parse_json_calls('[{"name": "a", "parameters": {}}, {"name": "b", "arguments": {"x": 1}}]')
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {}), ("b", {"x": 1})]
    fenced = parse_json_calls('I will call it.\n```json\n{"name": "calculator", "arguments": {"expression": "2"}}\n```')
    assert fenced.content == "I will call it." and fenced.calls[0].arguments == {"expression": "2"}
    assert parse_json_calls('{"name": "calculator", "arguments": {').calls[0].error_kind == "malformed"


def test_parser_registry_lists_formats():
    assert {"hermes", "json", "harmony"} <= set(TOOL_PARSERS.names())
    with pytest.raises(UserError, match="valid names"):
        TOOL_PARSERS.get("qwen")


def test_check_arguments_enum():
    params = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}}
    assert check_arguments({"unit": "k"}, params) == "argument 'unit' must be one of ['c', 'f']"


# --------------------------------------------------------------------------- execution
def test_slow_and_raising_tools_become_errors_and_the_batch_goes_on(tools):
    batches = [
        [ToolCall("slow", {"seconds": 30}, ""), ToolCall("calculator", {"expression": "6 * 7"}, "")],
        [ToolCall("boom", {"x": "now"}, "")],
        [ToolCall(None, None, "{", "malformed tool call: invalid JSON", "malformed")],
        [ToolCall("add", {"a": 2, "b": 3}, "")],
    ]
    start = time.monotonic()
    results = run_calls(batches, tools, ExecLimits(timeout_s=5.0))
    assert time.monotonic() - start < 3  # the slow tool's own 0.5 s timeout, not 30 s
    (slow, calc), (boom,), (bad,), (add,) = results
    assert slow.error == "tool 'slow' timed out after 0.5s" and slow.content.startswith("Error: ")
    assert (calc.content, calc.error) == ("42", None)
    assert boom.content == "Error: RuntimeError: tool exploded: now"
    assert bad.content == "Error: malformed tool call: invalid JSON"
    assert add.content == "5"  # non-string results are JSON


def test_concurrency_limit_and_parallelism(tools):
    calls = [[ToolCall("slow", {"seconds": 0.3}, "")] for _ in range(4)]
    run_calls(calls, tools, ExecLimits(max_concurrency=4))  # starts the 4 worker processes (kept for the run)
    start = time.monotonic()
    run_calls(calls, tools, ExecLimits(max_concurrency=4))
    parallel = time.monotonic() - start
    start = time.monotonic()
    run_calls(calls, tools, ExecLimits(max_concurrency=1))
    serial = time.monotonic() - start
    assert parallel < 0.9 < 1.2 <= serial


def test_long_results_are_cut(tools):
    [[res]] = run_calls([[ToolCall("calculator", {"expression": "7 ** 90"}, "")]], tools, ExecLimits(max_chars=20))
    assert res.content.startswith(calculator("7 ** 90")[:20]) and "characters cut" in res.content


def test_code_tools_run_in_a_subprocess_with_time_and_memory_limits():
    tools = load_tools([ToolSpec(function="python", timeout_s=2.0)])
    assert tools["python"].runs_code
    calls = [
        [ToolCall("python", {"code": "print(sum(range(10)))"}, "")],
        [ToolCall("python", {"code": "while True:\n    pass"}, "")],
        [ToolCall("python", {"code": "x = bytearray(2 * 1024 ** 3)"}, "")],
        [ToolCall("python", {"code": "import os; print(os.getpid())"}, "")],
    ]
    ok, spin, hog, pid = (r[0] for r in run_calls(calls, tools, ExecLimits(memory_mb=256)))
    assert (ok.content, ok.error) == ("45\n", None)
    assert "timed out" in str(spin.error)
    assert "MemoryError" in str(hog.error)
    assert int(pid.content) != __import__("os").getpid()


# --------------------------------------------------------------------------- dataset tools field
def test_dataset_tools_field_that_is_not_json_names_file_row_and_column(tmp_path):
    from rlfactory.data.loader import load_examples

    rows = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "tools": "[]"},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "tools": "[{name"},
    ]
    (tmp_path / "bad.json").write_text(json.dumps(rows))
    (tmp_path / "dataset_info.yaml").write_text(
        "bad:\n  file_name: bad.json\n  formatting: sharegpt\n  columns: {messages: conversations, tools: tools}\n"
    )
    with pytest.raises(UserError) as err:
        load_examples(["bad"], "sft", str(tmp_path))
    msg = str(err.value)
    assert "bad.json row 2" in msg and "column 'tools' is not valid JSON" in msg and "fix the rows" in msg
