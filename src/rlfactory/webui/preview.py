"""Dataset preview: registered rows rendered exactly as the stage will see them, trained tokens highlighted.

The same code paths as training: ``data.loader.load_examples`` for the rows (with the stage's example
kind), ``model.loader.load_tokenizer`` for the tokenizer and template, and ``render.chat`` for the
tokens and loss masks (``render_sft`` labels for sft/kto, ``render_continuation`` masks for the
chosen/rejected responses of preference stages, ``render_prompt`` for the prompts of online stages).
"""

from __future__ import annotations

import functools
import html
from typing import Any

from rlfactory.config.schema import ModelConfig
from rlfactory.render.chat import IGNORE_INDEX

PAGE_SIZE = 3


@functools.lru_cache(maxsize=4)
def _tokenizer(model_path: str, template: str | None) -> Any:
    from rlfactory.model.loader import load_tokenizer

    return load_tokenizer(ModelConfig(name_or_path=model_path, template=template or None))


def registered_datasets(dataset_dir: str | None = None) -> list[str]:
    """Names in the dataset registry (empty when none is found)."""
    from rlfactory.data.registry import load_registry
    from rlfactory.errors import UserError

    try:
        return sorted(load_registry(dataset_dir)[1])
    except UserError:
        return []


def _spans(tokenizer: Any, ids: list[int], trained: list[bool]) -> str:
    """HTML of the token ids, runs of trained tokens wrapped in <mark>."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = html.escape(tokenizer.decode(ids[start:i]))
            out.append(f'<mark class="trained">{text}</mark>' if trained[start] else f"<span>{text}</span>")
            start = i
    return "".join(out)


def _block(title: str, body: str, n_tokens: int, n_trained: int) -> str:
    return (
        f'<div class="rf-example"><div class="rf-example-head">{html.escape(title)} · {n_tokens} tokens, '
        f'{n_trained} trained</div><pre class="rf-tokens">{body}</pre></div>'
    )


def render_example(tokenizer: Any, example: dict[str, Any], kind: str, data_cfg: Any) -> str:
    """One example as HTML blocks (two for a preference pair)."""
    from rlfactory.render.chat import render_continuation, render_prompt, render_sft
    from rlfactory.render.plain import tokenizer_for

    source = example.get("source", "")
    tools = example.get("tools")
    tokenizer = tokenizer_for(tokenizer, [example])  # standard TRL rows: plain text
    if kind == "text":  # stage pt: the document as it enters the packed blocks, every token trained
        from rlfactory.stages.pt import document_ids

        ids = document_ids(tokenizer, example["text"])
        return _block(source, _spans(tokenizer, ids, [True] * len(ids)), len(ids), len(ids))
    if kind in ("sft", "unpaired"):
        train_on = "last_assistant" if kind == "unpaired" else data_cfg.train_on
        fit = data_cfg.cutoff_len, data_cfg.truncation, example.get("train_from", 0)
        items = render_sft(tokenizer, example["messages"], tools, train_on, *fit)
        label = "" if kind == "sft" else f" · label: {'desirable' if example.get('label') else 'undesirable'}"
        blocks = []
        for n, item in enumerate(items):  # several when the template rewrites history: one per context
            title = source + label + (f" · sequence {n + 1} of {len(items)}" if len(items) > 1 else "")
            if item is None:
                blocks.append(_block(f"{title} (dropped: nothing to train within cutoff_len)", "", 0, 0))
                continue
            trained = [label != IGNORE_INDEX for label in item["labels"]]
            blocks.append(_block(title, _spans(tokenizer, item["input_ids"], trained), len(trained), sum(trained)))
        return "".join(blocks)
    if kind == "pairwise":
        blocks = []
        for side in ("chosen", "rejected"):
            prompt, response, mask = render_continuation(tokenizer, example["messages"], example[side], tools)
            ids, trained = prompt + response, [False] * len(prompt) + mask
            blocks.append(_block(f"{source} · {side}", _spans(tokenizer, ids, trained), len(ids), sum(trained)))
        return "".join(blocks)
    ids = render_prompt(tokenizer, example["messages"], tools)
    answer = f" · answer: {example['answer']}" if example.get("answer") is not None else ""
    title = f"{source}{answer} (prompt: the response is generated)"
    return _block(title, _spans(tokenizer, ids, [False] * len(ids)), len(ids), 0)


def _data_config(data: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from rlfactory.config.loader import format_validation_error
    from rlfactory.config.schema import DataConfig
    from rlfactory.errors import UserError

    try:
        return DataConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, "data", DataConfig)) from None


def _load(stage: str, data_cfg: Any) -> list[tuple[str, dict[str, Any]]]:
    """(kind, example) for every row of the datasets, each read as the kind the stage reads it as."""
    from rlfactory.data.loader import is_ranking, load_examples
    from rlfactory.data.registry import load_registry
    from rlfactory.stages import dataset_kind

    folder, specs = load_registry(data_cfg.dataset_dir)
    loaded = []
    for name in data_cfg.dataset:
        kind = dataset_kind(stage, is_ranking(name, folder, specs))
        rows = load_examples([name], kind, data_cfg.dataset_dir, data_cfg.max_samples, data_cfg.max_bad_rows)
        loaded += [(kind, row) for row in rows]
    return loaded


def preview_page(raw: dict[str, Any], page: int, page_size: int = PAGE_SIZE) -> tuple[str, int]:
    """(HTML of page ``page`` of the rendered examples, the page actually shown). Raises UserError."""
    from rlfactory.errors import UserError

    model = raw.get("model") or {}
    data_cfg = _data_config(raw.get("data") or {})
    if not model.get("name_or_path"):
        raise UserError("set model.name_or_path to preview what the model sees")
    if not data_cfg.dataset:
        raise UserError("pick at least one dataset to preview")
    stage = str(raw.get("stage") or "sft")
    examples = _load(stage, data_cfg)
    tokenizer = _tokenizer(str(model["name_or_path"]), model.get("template"))
    pages = max(1, -(-len(examples) // page_size))
    page = min(max(page, 0), pages - 1)
    shown = examples[page * page_size : (page + 1) * page_size]
    head = (
        f'<div class="rf-preview-head">{stage}: examples {page * page_size + 1}–{page * page_size + len(shown)} of '
        f'{len(examples)} · page {page + 1}/{pages} · <mark class="trained">highlighted</mark> tokens carry loss</div>'
    )
    return head + "".join(render_example(tokenizer, ex, kind, data_cfg) for kind, ex in shown), page
