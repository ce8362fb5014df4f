"""Standard (non-conversational) TRL rows: plain text, rendered through the one rendering path.

TRL tokenizes a standard row without a chat template: the prompt text, then the completion text and the eos
token (``prompt + completion + eos``; a language-modeling ``text`` row is ``text + eos``; a tokenizer with a BOS
token puts it first). The data layer gives such rows as messages (user = prompt, assistant = completion) marked
``plain``; rendering them with ``PLAIN_TEMPLATE`` instead of the model's chat template gives those ids, while
masks, truncation, rollouts and the agent loop keep working unchanged: the template is prefix-stable, its
generation prompt is empty and an assistant turn ends with eos. The template is an attribute of a copy of the
tokenizer (``render_template``), so the model's own chat template is what gets saved with the trained model.
"""

from __future__ import annotations

import copy
from typing import Any

from rlfactory.errors import UserError

PLAIN_TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif -%}"
    "{%- for message in messages -%}"
    "{{ message['content'] }}{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
)


def plain_tokenizer(tokenizer: Any) -> Any:
    """A shallow copy of ``tokenizer`` that renders with ``PLAIN_TEMPLATE`` and ends turns with eos."""
    if tokenizer.eos_token is None:
        raise UserError("standard (plain text) rows end every completion with the eos token; this tokenizer has none")
    plain = copy.copy(tokenizer)
    plain.render_template = PLAIN_TEMPLATE
    plain.end_of_turn = tokenizer.eos_token
    return plain


def tokenizer_for(tokenizer: Any, *example_sets: list[dict]) -> Any:
    """The tokenizer a stage renders these examples with: the plain-text one when they are standard TRL rows,
    the model's own (with its chat template) when they are conversations. A mix cannot share one rollout format
    (stop token, prompt text), so it is refused."""
    examples = [e for examples in example_sets for e in examples]
    plain = [e for e in examples if e.get("plain")]
    if not plain:
        return tokenizer
    if len(plain) < len(examples):
        other = next(e for e in examples if not e.get("plain"))
        raise UserError(
            f"standard (plain text) rows ({plain[0].get('source')}) and conversations ({other.get('source')}) in one "
            "run: TRL renders the first without a chat template and the second with one; train them in separate "
            "runs or convert one kind"
        )
    for example in plain:
        if example.get("tools"):
            raise UserError(f"{example.get('source')}: a standard (plain text) row cannot offer tools; use messages")
    return plain_tokenizer(tokenizer)
