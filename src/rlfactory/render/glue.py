"""The tokens a multi-turn rollout splices in after an assistant turn: observations (tool results, user
messages) plus the template text around them, ending with the next assistant generation prompt.

Token-in, token-out (DESIGN principle 2): the history is never re-rendered, also with a template that rewrites
earlier turns (Qwen3): each turn is trained in the context it was sampled in. The template's text for an
observation is found once per observation *shape* (roles and count) by rendering a skeleton conversation
with sentinel contents and taking the prefix difference after the assistant's end-of-turn string; later
observations only fill the contents in. The glue text is tokenized as one string, exactly as
``render.chat.render_segments`` tokenizes the same stretch for training, so the rollout's token sequence
equals the training render of the same conversation (tested token-exact).
"""

from __future__ import annotations

import json
from typing import Any

from rlfactory.errors import UserError
from rlfactory.render.chat import _apply, _encode, stop_strings, template_name

SENTINEL = "\u2063OBS{}\u2063"  # invisible separator: no template transforms it, no real content holds it


def _skeleton(observation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """user -> assistant (with one dummy call per tool message) -> the observation with sentinel contents."""
    tool_msgs = [m for m in observation if m["role"] == "tool"]
    calls = [{"type": "function", "function": {"name": m.get("name") or "tool", "arguments": {}}} for m in tool_msgs]
    assistant: dict[str, Any] = {"role": "assistant", "content": "A" if not calls else ""}
    if calls:
        assistant["tool_calls"] = calls
    filled = [{**m, "content": SENTINEL.format(i)} for i, m in enumerate(observation)]
    return [{"role": "user", "content": "U"}, assistant, *filled]


class ObservationGlue:
    """Text and token ids of observation messages as the chat template renders them after an assistant turn."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.stops = stop_strings(tokenizer)
        self._pieces: dict[tuple, list[str]] = {}
        self._quoted: dict[tuple, list[bool]] = {}

    def _shape(self, observation: list[dict[str, Any]]) -> tuple:
        return tuple((m["role"], m.get("name"), m.get("tool_call_id")) for m in observation)

    def pieces(self, observation: list[dict[str, Any]]) -> list[str]:
        """Template text around the n contents (n + 1 pieces), rendered once per observation shape."""
        shape = self._shape(observation)
        if shape not in self._pieces:
            skeleton = _skeleton(observation)
            full = _apply(self.tokenizer, skeleton, None, generation_prompt=True)
            # the glue starts after the assistant turn's end (harmony: <|call|> after a call): the last stop string
            # before the first observation. A template that rewrites the turn once an observation follows (Qwen3
            # drops its empty think block) still writes the same glue after it; the rollout keeps the turn as the
            # policy wrote it (token-in, token-out: each turn is trained in the context it was sampled in)
            first = full.find(SENTINEL.format(0))
            cut, stop = max((full.rfind(s, 0, first), s) for s in self.stops) if first >= 0 else (-1, "")
            if cut < 0:
                raise UserError(
                    f"{template_name(self.tokenizer)} writes no '{' or '.join(self.stops)}' before a tool result "
                    "or user message that follows an assistant turn, so rollout tokens cannot be spliced; "
                    "set `model.template`"
                )
            tail = full[cut + len(stop) :]
            pieces = []
            for i in range(len(observation)):
                head, sep, tail = tail.partition(SENTINEL.format(i))
                if not sep:
                    raise UserError(f"the chat template drops the content of a '{observation[i]['role']}' message")
                pieces.append(head)
            self._pieces[shape] = [*pieces, tail]
            # a template that writes contents as JSON strings (GPT-OSS: ``content | tojson``) put the sentinel
            # between quotes: fill those contents JSON-escaped, as the template would render them
            quote = [a.endswith('"') and b.startswith('"') for a, b in zip(pieces, [*pieces[1:], tail], strict=True)]
            self._quoted[shape] = quote
        return self._pieces[shape]

    def text(self, observation: list[dict[str, Any]]) -> str:
        pieces = self.pieces(observation)
        quoted = self._quoted[self._shape(observation)]
        fill = [
            json.dumps(m["content"], ensure_ascii=False)[1:-1] if q else m["content"]
            for m, q in zip(observation, quoted, strict=True)
        ]
        return "".join(p + c for p, c in zip(pieces, fill, strict=False)) + pieces[-1]

    def ids(self, observation: list[dict[str, Any]]) -> list[int]:
        return _encode(self.tokenizer, self.text(observation))
