"""Messages -> token ids + loss masks, through the tokenizer's own chat template.

One rendering path for training and rollout (DESIGN principle 2). A conversation is cut into
*segments*: text the template adds around messages (never trained) and the assistant turns
(trained: the content, tool calls and the end-of-turn token, exactly what the policy generates).
Segment boundaries are found by rendering growing prefixes of the conversation, so masks are
computed from the template itself, not guessed. Each segment is tokenized on its own: the prompt
of a rollout is exactly the prefix segments, and the sampled tokens are the assistant segment,
so training tokens equal generated tokens (token-in, token-out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfactory.errors import UserError

IGNORE_INDEX = -100


@dataclass
class Segment:
    ids: list[int]
    trainable: bool  # produced by the model (an assistant turn)
    message_index: int  # index of the message this segment ends, -1 for trailing glue


def _apply(tokenizer: Any, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        chat_template=getattr(tokenizer, "render_template", None),  # standard TRL rows: render.plain
    )


def end_of_turn(tokenizer: Any) -> str:
    """The string that closes an assistant turn (set by the model loader; eos by default)."""
    return getattr(tokenizer, "end_of_turn", None) or tokenizer.eos_token


HARMONY_STOPS = ("<|return|>", "<|call|>")  # GPT-OSS: a turn ends with its answer or with a tool call


def stop_strings(tokenizer: Any) -> list[str]:
    """Every string that ends an assistant turn: generation stops on any of them. One for most templates; the
    harmony format (GPT-OSS) has two, ``<|return|>`` after an answer and ``<|call|>`` after a tool call."""
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab() if isinstance(template, str) and "<|call|>" in template else {}
    if all(stop in vocab for stop in HARMONY_STOPS):
        return list(HARMONY_STOPS)
    return [end_of_turn(tokenizer)]


def stop_ids(tokenizer: Any) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(stop) for stop in stop_strings(tokenizer)]


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(position, string) of the earliest stop string in ``text``, or None."""
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found) if found else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def _not_prefix(i: int, what: str) -> UserError:
    return UserError(
        f"the chat template is not prefix-stable at message {i} ({what}): rendering a conversation "
        "changes how earlier turns look, so trained tokens cannot be located exactly. "
        "Set `model.template` to a named template (e.g. chatml) or use a template without history rewriting"
    )


def _turn_segments(tokenizer: Any, messages: list[dict], tools: list | None) -> tuple[list[Segment], str]:
    """Segments up to the end of the last assistant turn, and the rendered text they cover."""
    stops = stop_strings(tokenizer)
    segments: list[Segment] = []
    done = ""  # rendered text already assigned to segments
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prefix = _apply(tokenizer, messages[:i], tools, generation_prompt=True)
        full = _apply(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not prefix.startswith(done):
            raise _not_prefix(i, "the prompt of this turn does not start with the previous turns")
        if not full.startswith(prefix):
            raise _not_prefix(i, "this assistant turn does not extend its own prompt")
        body = full[len(prefix) :]
        found = first_stop(body, stops)
        if found is None:
            raise UserError(
                f"the chat template does not end assistant turns with '{' or '.join(stops)}' (message {i}); "
                "set `model.template` or fix the tokenizer's eos_token"
            )
        generated = body[: found[0] + len(found[1])]
        segments.append(Segment(_encode(tokenizer, prefix[len(done) :]), False, i - 1))
        segments.append(Segment(_encode(tokenizer, generated), True, i))
        done = prefix + generated
    return segments, done


def _with_tail(tokenizer: Any, messages: list[dict], tools: list | None, generation_prompt: bool) -> list[Segment]:
    segments, done = _turn_segments(tokenizer, messages, tools)
    text = _apply(tokenizer, messages, tools, generation_prompt=generation_prompt)
    if not text.startswith(done):
        raise _not_prefix(len(messages), "the whole conversation does not extend its turns")
    if text[len(done) :]:
        segments.append(Segment(_encode(tokenizer, text[len(done) :]), False, -1))
    return segments


def render_segments(tokenizer: Any, messages: list[dict], tools: list | None = None) -> list[Segment]:
    """Split a rendered conversation into glue and assistant segments (see module doc)."""
    return _with_tail(tokenizer, messages, tools, generation_prompt=False)


def render_prompt(tokenizer: Any, messages: list[dict], tools: list | None = None) -> list[int]:
    """Token ids of a conversation plus the assistant generation prompt (what a rollout continues).

    Built from the same segments as training, so these ids are a prefix of the trained sequence.
    """
    return [t for segment in _with_tail(tokenizer, messages, tools, generation_prompt=True) for t in segment.ids]


def render_sft(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None = None,
    train_on: str = "assistant",
    cutoff_len: int | None = None,
    truncation: str = "right",
    train_from: int = 0,
) -> dict[str, list[int]] | None:
    """input_ids and labels (IGNORE_INDEX where no loss) for SFT; None if the example must be dropped.

    train_on: ``assistant`` every assistant turn, ``last_assistant`` only the final one, ``all``
    every token; turns before message ``train_from`` are never trained (a prompt-completion row's prompt).
    A row longer than cutoff_len is shortened as ``render.fit.sft_item`` says (or dropped with ``drop``).
    """
    from rlfactory.render.fit import sft_item

    segments = render_segments(tokenizer, messages, tools)
    return sft_item(segments, train_on, cutoff_len, truncation, train_from)[0]


def render_continuation(
    tokenizer: Any, messages: list[dict], continuation: list[dict], tools: list | None = None
) -> tuple[list[int], list[int], list[bool]]:
    """(prompt_ids, response_ids, response_mask) for ``messages`` continued by ``continuation``.

    Used by preference stages: the response is the chosen/rejected turn(s); the mask marks the
    tokens the policy produced (tool results inside a multi-turn response are not trained).
    """
    prompt_ids = render_prompt(tokenizer, messages, tools)
    ids: list[int] = []
    mask: list[bool] = []
    for segment in render_segments(tokenizer, messages + continuation, tools):
        ids += segment.ids
        mask += [segment.trainable] * len(segment.ids)
    if ids[: len(prompt_ids)] != prompt_ids:
        raise _not_prefix(len(messages), "the response does not extend the rendered prompt")
    return prompt_ids, ids[len(prompt_ids) :], mask[len(prompt_ids) :]
