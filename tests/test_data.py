"""Data layer: registry, readers and the three formats -> one canonical example; row-level errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tests.conftest import DATA_DIR

from rlfactory.data.loader import load_examples
from rlfactory.errors import UserError


def make_registry(tmp_path: Path, entries: dict, files: dict[str, object]) -> Path:
    for name, content in files.items():
        path = tmp_path / name
        if isinstance(content, list) and name.endswith(".jsonl"):
            path.write_text("".join(json.dumps(row) + "\n" for row in content))
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
    (tmp_path / "dataset_info.yaml").write_text(yaml.safe_dump(entries))
    return tmp_path


def test_bundled_registry_loads_every_kind():
    assert len(load_examples(["arith_sft"], "sft", str(DATA_DIR), max_samples=5)) == 5
    assert len(load_examples(["arith_sft_alpaca"], "sft", str(DATA_DIR), max_samples=5)) == 5
    pairs = load_examples(["arith_pref", "arith_pref_sharegpt"], "pairwise", str(DATA_DIR), max_samples=3)
    assert len(pairs) == 6 and all(p["chosen"][0]["role"] == "assistant" for p in pairs)
    kto = load_examples(["arith_kto"], "unpaired", str(DATA_DIR), max_samples=20)
    assert {e["label"] for e in kto} == {True, False}
    prompts = load_examples(["arith_prompts"], "prompt", str(DATA_DIR), max_samples=2)
    assert prompts[0]["messages"][-1]["role"] == "user" and prompts[0]["answer"].lstrip("-").isdigit()


def test_alpaca_with_history_and_system(tmp_path: Path):
    folder = make_registry(
        tmp_path,
        {"a": {"file_name": "a.json", "formatting": "alpaca",
               "columns": {"prompt": "instruction", "query": "input", "response": "output",
                           "history": "history", "system": "system"}}},
        {"a.json": [{"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be brief.",
                     "history": [["hi", "hello"]]}]},
    )
    (example,) = load_examples(["a"], "sft", str(folder))
    assert example["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Add\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    assert example["source"] == "a:1"


def test_sharegpt_function_call_and_observation(tmp_path: Path):
    conv = [
        {"from": "human", "value": "weather in Paris?"},
        {"from": "gpt", "value": "Let me check."},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "It is sunny."},
    ]
    tools = json.dumps([{"type": "function", "function": {"name": "weather", "parameters": {}}}])
    folder = make_registry(
        tmp_path,
        {"s": {"file_name": "s.json", "formatting": "sharegpt", "columns": {"messages": "conversations",
                                                                            "tools": "tools"}}},
        {"s.json": [{"conversations": conv, "tools": tools}]},
    )
    (example,) = load_examples(["s"], "sft", str(folder))
    roles = [m["role"] for m in example["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    # one assistant turn carries both text and the tool call
    assert example["messages"][1]["content"] == "Let me check."
    assert example["messages"][1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Paris"}}
    assert example["tools"][0]["function"]["name"] == "weather"


def test_openai_tool_call_arguments_as_json_string(tmp_path: Path):
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
        {"role": "assistant", "content": "4"},
    ]
    folder = make_registry(tmp_path, {"o": {"file_name": "o.jsonl"}}, {"o.jsonl": [{"messages": msgs}]})
    (example,) = load_examples(["o"], "sft", str(folder))
    assert example["messages"][1] == {
        "role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"x": "2+2"}}, "id": "c1"}],
    }
    assert example["messages"][2]["tool_call_id"] == "c1"


def test_missing_file_and_unknown_dataset(tmp_path: Path):
    folder = make_registry(tmp_path, {"gone": {"file_name": "gone.jsonl"}}, {})
    with pytest.raises(UserError, match=r"dataset 'gone': file '.*gone.jsonl' does not exist"):
        load_examples(["gone"], "sft", str(folder))
    with pytest.raises(UserError, match=r"dataset 'gonee' is not in .*dataset_info.yaml \(did you mean 'gone'\?\)"):
        load_examples(["gonee"], "sft", str(folder))


def test_row_without_mapped_column_names_file_and_row(tmp_path: Path):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"conversation": []}]
    folder = make_registry(tmp_path, {"o": {"file_name": "o.jsonl"}}, {"o.jsonl": rows})
    with pytest.raises(UserError) as err:
        load_examples(["o"], "sft", str(folder))
    assert "o.jsonl row 2: missing column 'messages' (row has: conversation)" in str(err.value)
    assert "max_bad_rows" in str(err.value)
    # within the budget the bad row is skipped
    assert len(load_examples(["o"], "sft", str(folder), max_bad_rows=1)) == 1


def test_empty_after_filtering(tmp_path: Path):
    rows = [{"messages": [{"role": "user", "content": "only a question"}]}]
    folder = make_registry(tmp_path, {"o": {"file_name": "o.jsonl"}}, {"o.jsonl": rows})
    with pytest.raises(UserError, match="gave no usable sft examples"):
        load_examples(["o"], "sft", str(folder), max_bad_rows=5)


def test_invalid_json_line_and_tools(tmp_path: Path):
    folder = make_registry(tmp_path, {"o": {"file_name": "o.jsonl"}}, {"o.jsonl": '{"messages": []}\n{oops\n'})
    with pytest.raises(UserError, match=r"o.jsonl: line 2 is not valid JSON"):
        load_examples(["o"], "sft", str(folder))
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": "[{"}]
    folder = make_registry(tmp_path, {"t": {"file_name": "t.jsonl", "columns": {"tools": "tools"}}}, {"t.jsonl": rows})
    with pytest.raises(UserError, match=r"row 1: column 'tools' is not valid JSON"):
        load_examples(["t"], "sft", str(folder))


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}], "chosen": "", "rejected": "b"},
            "'chosen' is missing or empty",
        ),
        ({"messages": [{"role": "user", "content": "q"}], "rejected": "b"}, "missing column 'chosen'"),
        ({"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "a"}, "identical"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
          "chosen": "a", "rejected": "b"}, "must end before the response"),
    ],
)
def test_bad_preference_rows(tmp_path: Path, row: dict, message: str):
    spec = {"p": {"file_name": "p.jsonl", "ranking": True, "columns": {"chosen": "chosen", "rejected": "rejected"}}}
    folder = make_registry(tmp_path, spec, {"p.jsonl": [row]})
    with pytest.raises(UserError, match=message):
        load_examples(["p"], "pairwise", str(folder))


def test_bad_role_and_system_position(tmp_path: Path):
    rows = [{"messages": [{"role": "robot", "content": "q"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                          {"role": "assistant", "content": "a"}]}]
    folder = make_registry(tmp_path, {"o": {"file_name": "o.jsonl"}}, {"o.jsonl": rows})
    with pytest.raises(UserError) as err:
        load_examples(["o"], "sft", str(folder))
    assert "row 1: messages[0]: role 'robot' is not one of" in str(err.value)
    assert "row 2: a system message may only come first" in str(err.value)


def test_csv_and_parquet_through_datasets(tmp_path: Path):
    import pandas as pd

    frame = pd.DataFrame({"instruction": ["q1", "q2"], "output": ["a1", "a2"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    spec = {"formatting": "alpaca", "columns": {"prompt": "instruction", "response": "output"}}
    folder = make_registry(tmp_path, {"c": {"file_name": "d.csv", **spec}, "p": {"file_name": "d.parquet", **spec}}, {})
    for name in ("c", "p"):
        examples = load_examples([name], "sft", str(folder))
        assert [m["content"] for m in examples[1]["messages"]] == ["q2", "a2"]
