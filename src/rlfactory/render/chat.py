"""Messages -> token ids + loss masks, through the tokenizer's own chat template.

One rendering path for training and rollout (DESIGN principle 2). A conversation is cut into
*segments*: text the template adds around messages (never trained) and the assistant turns
(trained: the content, tool calls and the end-of-turn token, exactly what the policy generates).
Segment boundaries are found by rendering growing prefixes of the conversation, so masks are
computed from the template itself, not guessed. Each segment is tokenized on its own: the prompt
of a rollout is exactly the prefix segments, and the sampled tokens are the assistant segment,
so training tokens equal generated tokens (token-in, token-out).

Templates that rewrite history (Qwen3 strips the reasoning of past turns, Mistral moves the system
prompt and the tool schemas to the last user message, GPT-OSS closes past answers with ``<|end|>``)
are not prefix-stable: the prompt of a later turn does not start with the earlier turns as they were
trained. Such a conversation is cut into *contexts*: a new context starts at every turn whose prompt
rewrites what came before, with that prompt exactly as the template renders it at that turn. Every
assistant turn is then trained once, in the context the template gives it when it is generated.

Every render is read back (``render.roundtrip``): a template that drops a message's text, a tool call
or a tool schema is refused, never trained.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlfactory.errors import UserError
from rlfactory.render.roundtrip import check_kept, check_tools, check_turn

IGNORE_INDEX = -100


@dataclass
class Segment:
    ids: list[int]
    trainable: bool  # produced by the model (an assistant turn)
    message_index: int  # index of the message this segment ends, -1 for trailing glue


def template_name(tokenizer: Any) -> str:
    """How messages name the template (set by the model loader: ``model.template`` or the model's own)."""
    return getattr(tokenizer, "template_name", None) or "the tokenizer's chat template"


def _template_hint(message: str) -> str:
    if "Tool call IDs" in message:
        return (
            "; this template needs every tool call to carry an `id` of 9 letters or digits and each tool result "
            "the same `tool_call_id`: add them to the rows, or set `model.template` to one without ids"
        )
    if "alternate" in message or "roles are supported" in message:
        return (
            "; this template takes only alternating user/assistant turns (no tool messages): set `model.template` "
            "to one that renders tools (e.g. chatml, gemma_tools, or a .jinja file)"
        )
    return "; fix the rows or set `model.template` (a named template, a TRL template name or a .jinja file)"


def _apply(tokenizer: Any, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
    """The template's text; its errors (``raise_exception``, undefined names) become one clear UserError."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=getattr(tokenizer, "render_template", None),  # standard TRL rows: render.plain
        )
    except (TemplateError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"{template_name(tokenizer)} cannot render this conversation: {message}{_template_hint(message)}"
        ) from None


@contextmanager
def for_row(example: dict[str, Any]) -> Iterator[None]:
    """Prefix a rendering error with the row it came from (``dataset:row``)."""
    try:
        yield
    except UserError as exc:
        source = example.get("source")
        raise (UserError(f"{source}: {exc}") if source else exc) from None


_END_MARK = "\u2063END\u2063"  # invisible separator: no template transforms it


def _infer_end_of_turn(tokenizer: Any) -> str:
    """The first special token the template writes after an assistant's text (eos when none): Gemma closes turns
    with ``<end_of_turn>``, not with its eos ``<eos>``; a template from a file or TRL says nothing else about it."""
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _END_MARK}]
    try:
        after = _apply(tokenizer, messages, None, generation_prompt=False).partition(_END_MARK)[2]
    except UserError:
        return tokenizer.eos_token
    specials = set(tokenizer.all_special_tokens)
    specials |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found = [(after.find(s), -len(s), s) for s in specials if s and s in after]
    return min(found)[2] if found else tokenizer.eos_token


def end_of_turn(tokenizer: Any) -> str:
    """The string that closes an assistant turn: set by a named template, else read off the template (cached)."""
    explicit = getattr(tokenizer, "end_of_turn", None)
    if explicit:
        return explicit
    template = getattr(tokenizer, "chat_template", None)
    cached = getattr(tokenizer, "_rlfactory_end_of_turn", None)
    if cached is None or cached[0] != (template, tokenizer.eos_token):
        cached = ((template, tokenizer.eos_token), _infer_end_of_turn(tokenizer) if template else tokenizer.eos_token)
        tokenizer._rlfactory_end_of_turn = cached
    return cached[1]


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


def _not_prefix(tokenizer: Any, i: int, what: str) -> UserError:
    return UserError(
        f"{template_name(tokenizer)} is not usable at message {i} ({what}), so trained tokens cannot be located "
        "exactly. Set `model.template` to a named template (e.g. chatml), a TRL template name or a .jinja file"
    )


def _turn_body(prefix: str, full: str) -> str | None:
    """The text the template writes for a turn: what ``full`` (the conversation up to and with the turn) adds after
    ``prefix`` (the prompt of the turn, with the generation prompt). Usually ``full`` starts with ``prefix``. Some
    templates render earlier messages differently once a turn follows (Mistral v0.3 writes the system prompt only
    into a user message that is the last message): then the turn starts after the longest ending of the prompt
    found in ``full``; the turn must still hold the message's text and calls (read back by the caller)."""
    if full.startswith(prefix):
        return full[len(prefix) :]
    low, high = 0, len(prefix)  # the longest suffix of prefix that occurs in full (occurrence is monotone)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if prefix[-mid:] in full else (low, mid - 1)
    if low < min(len(prefix), 8):
        return None
    return full[full.rfind(prefix[-low:]) + low :]


def render_contexts(
    tokenizer: Any, messages: list[dict], tools: list | None = None, generation_prompt: bool = False
) -> list[list[Segment]]:
    """The conversation as one or more token sequences (contexts; see module doc), every message read back.

    One context for a prefix-stable template. The last context ends with the whole conversation as the template
    renders it (plus the generation prompt when asked)."""
    stops = stop_strings(tokenizer)
    contexts: list[list[Segment]] = []
    current: list[Segment] = []
    done = ""  # rendered text already assigned to the current context's segments
    checked = 0  # messages before this index have been read back
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        prefix = _apply(tokenizer, messages[:i], tools, generation_prompt=True)
        full = _apply(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if not contexts and not current:
            check_tools(template_name(tokenizer), tools, prefix)
        check_kept(template_name(tokenizer), messages, range(checked, i), prefix)
        body = _turn_body(prefix, full)
        if body is None:
            raise _not_prefix(tokenizer, i, "this assistant turn does not follow its own prompt")
        if not prefix.startswith(done):  # the template rewrites history here: a new context
            contexts.append(current)
            current, done = [], ""
        found = first_stop(body, stops)
        if found is None:
            raise UserError(
                f"{template_name(tokenizer)} does not end assistant turns with '{' or '.join(stops)}' (message {i}); "
                "set `model.template` or fix the tokenizer's eos_token"
            )
        generated = body[: found[0] + len(found[1])]
        check_turn(template_name(tokenizer), message, i, generated)
        checked = i + 1
        current.append(Segment(_encode(tokenizer, prefix[len(done) :]), False, i - 1))
        current.append(Segment(_encode(tokenizer, generated), True, i))
        done = prefix + generated
    text = _apply(tokenizer, messages, tools, generation_prompt=generation_prompt)
    if not contexts and not current:
        check_tools(template_name(tokenizer), tools, text)
    check_kept(template_name(tokenizer), messages, range(checked, len(messages)), text)
    if not text.startswith(done):
        contexts.append(current)
        current, done = [], ""
    if text[len(done) :]:
        current.append(Segment(_encode(tokenizer, text[len(done) :]), False, -1))
    return [context for context in [*contexts, current] if context]


def _ids(segments: list[Segment]) -> list[int]:
    return [t for segment in segments for t in segment.ids]


def render_segments(tokenizer: Any, messages: list[dict], tools: list | None = None) -> list[Segment]:
    """The whole conversation as the template renders it, cut into glue and assistant segments (the last context:
    with a template that rewrites history, the turns it rewrote are glue there, trained in their own context)."""
    return render_contexts(tokenizer, messages, tools)[-1]


def render_prompt(tokenizer: Any, messages: list[dict], tools: list | None = None) -> list[int]:
    """Token ids of a conversation plus the assistant generation prompt (what a rollout continues).

    Built from the same segments as training, so these ids are a prefix of the trained sequence.
    """
    return _ids(render_contexts(tokenizer, messages, tools, generation_prompt=True)[-1])


def render_sft_outcomes(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None = None,
    train_on: str = "assistant",
    cutoff_len: int | None = None,
    truncation: str = "right",
    train_from: int = 0,
) -> list[tuple[dict[str, list[int]] | None, str]]:
    """(input_ids + labels, outcome) for SFT, one per context (one for a prefix-stable template); the item is
    None where it was dropped, and the outcome (``kept``, ``shortened`` or why it was dropped) says so.

    train_on: ``assistant`` every assistant turn, ``last_assistant`` only the final one, ``all`` every token
    (of the whole conversation as the template renders it: the last context); turns before message
    ``train_from`` are never trained (a prompt-completion row's prompt). A row longer than cutoff_len is
    shortened as ``render.fit.sft_item`` says (or dropped with ``drop``).
    """
    from rlfactory.render.fit import sft_item

    contexts = [
        c
        for c in render_contexts(tokenizer, messages, tools)
        if any(s.trainable and s.message_index >= train_from for s in c)
    ]
    if not contexts:
        raise UserError("the conversation has no assistant turn after its first message: nothing to train")
    if train_on != "assistant":
        contexts = contexts[-1:]
    return [sft_item(segments, train_on, cutoff_len, truncation, train_from) for segments in contexts]


def render_sft(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None = None,
    train_on: str = "assistant",
    cutoff_len: int | None = None,
    truncation: str = "right",
    train_from: int = 0,
) -> list[dict[str, list[int]] | None]:
    """``render_sft_outcomes`` without the outcomes: one item per context, None where dropped."""
    outcomes = render_sft_outcomes(tokenizer, messages, tools, train_on, cutoff_len, truncation, train_from)
    return [item for item, _ in outcomes]


def render_continuation(
    tokenizer: Any, messages: list[dict], continuation: list[dict], tools: list | None = None
) -> tuple[list[int], list[int], list[bool]]:
    """(prompt_ids, response_ids, response_mask) for ``messages`` continued by ``continuation``.

    Used by preference stages: the response is the chosen/rejected turn(s); the mask marks the
    tokens the policy produced (tool results inside a multi-turn response are not trained).
    """
    prompt_ids = render_prompt(tokenizer, messages, tools)
    contexts = render_contexts(tokenizer, messages + continuation, tools)
    ids: list[int] = []
    mask: list[bool] = []
    context = next((c for c in reversed(contexts) if any(s.trainable for s in c)), contexts[-1])
    for segment in context:
        ids += segment.ids
        mask += [segment.trainable] * len(segment.ids)
    turns = sum(m["role"] == "assistant" for m in continuation)
    trained = sum(s.trainable and s.message_index >= len(messages) for s in context)
    if ids[: len(prompt_ids)] != prompt_ids or trained != turns:
        raise UserError(
            f"{template_name(tokenizer)} rewrites the earlier turns of this response once later messages follow "
            f"(message {len(messages)} on), so a response of several assistant turns is not one sequence; "
            "give responses of one assistant turn, or set `model.template` to a prefix-stable template (e.g. chatml)"
        )
    return prompt_ids, ids[len(prompt_ids) :], mask[len(prompt_ids) :]


def check_example(tokenizer: Any, example: dict[str, Any]) -> int:
    """Render one canonical example as its stage would and read it back; the number of contexts it trains in.
    Raises UserError naming the row (``config check`` runs this on a sample of rows)."""
    messages, tools = example["messages"], example.get("tools")
    with for_row(example):
        if "chosen" in example:
            for side in ("chosen", "rejected"):
                render_continuation(tokenizer, messages, example[side], tools)
            return len(render_contexts(tokenizer, messages + example["chosen"], tools))
        return len(render_contexts(tokenizer, messages, tools, generation_prompt=messages[-1]["role"] != "assistant"))
