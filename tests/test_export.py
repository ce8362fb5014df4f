"""`rlfactory export`: merged and adapter-only round trips on the bundled model, and the refusals (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, TINY_MODEL, run_cli

PROMPT = [{"role": "user", "content": "Tom has 12 apples and buys 7 more. How many apples does he have?"}]


def greedy(model, tokenizer, new_tokens: int = 24) -> list[int]:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def load_base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(TINY_MODEL), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A LoRA adapter whose random (not zero) B changes the greedy answer: what a trained adapter looks like."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        load_base(), LoraConfig(r=4, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    )
    folder = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def expected(adapter) -> dict[str, list[int]]:
    from peft import PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    with_adapter = PeftModel.from_pretrained(load_base(), str(adapter)).eval()
    return {"base": greedy(load_base(), tokenizer), "adapter": greedy(with_adapter, tokenizer)}


def test_merged_export_generates_what_the_adapter_on_its_base_generates(adapter, expected, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    result = run_cli("export", str(adapter), "--to", str(out), "--max-shard-size", "2MB")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"merged {adapter} into {TINY_MODEL}" in result.stdout and "load it:" in result.stdout
    names = {f.name for f in out.iterdir()}
    shards = sorted(n for n in names if n.startswith("model-") and n.endswith(".safetensors"))
    assert len(shards) >= 3 and "model.safetensors.index.json" in names  # 2MB shards of a 7 MB model
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith("adapter") for n in names)
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # the temporary folder was renamed away
    assert (out / "chat_template.jinja").read_text() == (TINY_MODEL / "chat_template.jinja").read_text()

    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert merged.dtype == torch.float32  # the base checkpoint's dtype
    tokens = greedy(merged, AutoTokenizer.from_pretrained(str(out)))
    assert expected["adapter"] != expected["base"]  # the adapter matters, so equality below can fail
    assert tokens == expected["adapter"]


def test_adapter_only_export_loads_with_peft(adapter, expected, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from rlfactory.use.export import export

    out = tmp_path / "adapter-out"
    result = export(str(adapter), str(out), adapter_only=True)
    assert result.kind == "adapter"
    names = {f.name for f in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith("model") for n in names)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(TINY_MODEL.resolve())
    model = PeftModel.from_pretrained(load_base(), str(out)).eval()
    assert greedy(model, AutoTokenizer.from_pretrained(str(out))) == expected["adapter"]
    assert any("PeftModel.from_pretrained" in line for line in result.summary())


def test_non_empty_target_is_refused_and_left_untouched(adapter, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_cli("export", str(adapter), "--to", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "is not empty" in result.stderr and "--overwrite" in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no partial folder beside it


def test_overwrite_replaces_only_an_earlier_export(adapter, tmp_path):
    from rlfactory.errors import UserError
    from rlfactory.use.export import export

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no model"):
        export(str(adapter), str(other), adapter_only=True, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"

    out = tmp_path / "export"
    export(str(adapter), str(out), adapter_only=True)
    (out / "stale.txt").write_text("from the first export")
    export(str(adapter), str(out), adapter_only=True, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "other"]
    with pytest.raises(UserError, match="which is being exported"):
        export(str(adapter), str(adapter), overwrite=True)
    with pytest.raises(UserError, match="--max-shard-size 'big'"):
        export(str(adapter), str(tmp_path / "x"), max_shard_size="big")


def test_push_without_the_hub_exits_2_before_writing(adapter, tmp_path):
    out = tmp_path / "pushed"
    offline = run_cli("export", str(adapter), "--to", str(out), "--adapter-only", "--push-to-hub", "me/model")
    assert offline.returncode == 2 and "Traceback" not in offline.stderr
    assert "--push-to-hub: HF_HUB_OFFLINE is set" in offline.stderr
    # online as far as the settings go, but the endpoint does not answer (a closed local port)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "PYTHONPATH": str(ROOT / "src")}
    unreachable = subprocess.run(
        [sys.executable, "-m", "rlfactory", "export", str(adapter), "--to", str(out), "--adapter-only"]
        + ["--push-to-hub", "me/model"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stderr
    assert "the Hub (http://127.0.0.1:9) cannot be reached" in unreachable.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
