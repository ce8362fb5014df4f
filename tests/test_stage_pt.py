"""Stage pt: raw text (.txt lines or a `text` column) packed into blocks, every token trained; the loss falls."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import DATA_DIR, TINY_MODEL, expect_train_error, run_cli, write_yaml

from rlfactory.config.schema import ModelConfig
from rlfactory.data.loader import load_examples
from rlfactory.engine.run_dir import read_log
from rlfactory.model.loader import load_tokenizer
from rlfactory.stages.pt import pack_blocks


def test_documents_end_with_eos_and_are_packed_into_blocks(tmp_path: Path):
    (tmp_path / "corpus.txt").write_text("one two\n\nthree four five\nsix\n")
    (tmp_path / "dataset_info.yaml").write_text("corpus: {file_name: corpus.txt}\n")
    docs = load_examples(["corpus"], "text", str(tmp_path))
    assert [d["text"] for d in docs] == ["one two", "three four five", "six"]  # blank lines carry no text
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    eos = tokenizer.eos_token_id
    stream = [t for text in ("one two", "three four five", "six") for t in tokenizer.encode(text) + [eos]]
    blocks, counts = pack_blocks(tokenizer, docs, 4)
    assert [b["input_ids"] for b in blocks] == [stream[i : i + 4] for i in range(0, len(stream), 4)]
    assert all(b["labels"] == b["input_ids"] for b in blocks)  # every token trained
    assert counts.tokens == len(stream) and counts.blocks == len(blocks) and "nothing dropped" in counts.summary()


@pytest.fixture(autouse=True)
def _passive_openmp(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")


def _pt_config(tmp_path: Path, **data) -> dict:
    return {
        "stage": "pt",
        "output_dir": str(tmp_path / "out"),
        "model": {"name_or_path": str(TINY_MODEL), "finetuning": "full"},
        "data": {"dataset": "arith_pt", "eval_dataset": "arith_pt_eval", "dataset_dir": str(DATA_DIR),
                 "cutoff_len": 128, "max_samples": 200, **data},
        "train": {"max_steps": 8, "per_device_batch_size": 8, "learning_rate": 5e-4, "eval_steps": 8},
        "logging": {"progress_bar": False, "plot_loss": False},
    }


def test_pt_trains_on_a_txt_corpus_and_the_loss_falls(tmp_path: Path):
    result = run_cli("train", str(write_yaml(tmp_path / "pt.yaml", _pt_config(tmp_path))))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "200 documents" in result.stderr and "nothing dropped" in result.stderr
    evals = [r["eval_loss"] for r in read_log(tmp_path / "out") if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < 0.6 * evals[0], evals
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_pt_refuses_conversations(tmp_path: Path):
    cfg = _pt_config(tmp_path, dataset="arith_sft", eval_dataset=[])
    cfg["train"]["eval_steps"] = None  # nothing to evaluate on (an error of its own otherwise)
    expect_train_error(tmp_path, cfg, "stage pt", "needs a `text` column")


def test_preview_shows_a_pt_document_fully_trained():
    from rlfactory.webui import preview

    raw = {
        "stage": "pt",
        "model": {"name_or_path": str(TINY_MODEL)},
        "data": {"dataset": ["arith_pt"], "dataset_dir": str(DATA_DIR), "max_samples": 2},
    }
    body, _ = preview.preview_page(raw, 0)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_MODEL)))
    first = (DATA_DIR / "arith" / "pt_corpus.txt").read_text().splitlines()[0]
    n = len(tokenizer.encode(first)) + 1  # + eos
    assert f"{n} tokens, {n} trained" in body and "pt: examples 1–2 of 2" in body
