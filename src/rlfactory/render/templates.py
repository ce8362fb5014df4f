"""Chat templates ``model.template`` can name, for tokenizers that ship none or to replace the shipped one.

Three kinds of value: a name of the templates below, a ``.jinja`` file, or the name of a template TRL ships
(``trl/chat_templates/``: qwen3, llama3_1, gemma3, gptoss, ... and their ``_training`` variants). The
tokenizer's own template is preferred; these exist so base models can be fine-tuned into chat
models. Each is a Jinja template in the Hugging Face ``chat_template`` format plus its end-of-turn
string (what generation stops on and what closes every trained assistant turn). transformers renders
with ``trim_blocks``, so a newline right after a block tag is written as an expression.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlfactory.errors import UserError, did_you_mean


@dataclass(frozen=True)
class NamedTemplate:
    jinja: str
    end_of_turn: str | None  # None: read off the template (``render.chat.end_of_turn``)


_CHATML = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    'Reply with <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if loop.first and message.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% if tools and messages[0].role != 'system' %}"  # schemas need a system turn to live in
    "<|start_header_id|>system<|end_header_id|>\n\nTools: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message.role == 'tool' else message.role %}"
    "<|start_header_id|>{{ role }}<|end_header_id|>\n\n"
    "{% if message.role == 'system' and tools %}Tools: {{ tools | tojson }}\n\n{% endif %}"
    "{{ message.content }}"
    "{% for call in message.tool_calls or [] %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Gemma turns with tools (Gemma's own template allows only alternating user/model turns): the system text and
# the tool schemas open the first user turn, calls are Hermes-style blocks, results come back as a user turn.
_GEMMA_TOOLS = (
    "{{ bos_token }}"
    "{% set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<start_of_turn>user\n"
    "{% if loop.index0 == (1 if system else 0) %}"
    "{% if system %}{{ system }}{{ '\n\n' }}{% endif %}"
    "{% if tools %}# Tools\n\nYou may call functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    'Reply with <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    "{{ '\n\n' }}{% endif %}{% endif %}"
    "{{ message.content }}<end_of_turn>\n"
    "{% elif message.role == 'assistant' %}<start_of_turn>model\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}"
    "{% if not loop.first or message.content %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<end_of_turn>\n"
    "{% elif message.role == 'tool' %}<start_of_turn>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

TEMPLATES: dict[str, NamedTemplate] = {
    "chatml": NamedTemplate(_CHATML, "<|im_end|>"),
    "llama3": NamedTemplate(_LLAMA3, "<|eot_id|>"),
    "gemma_tools": NamedTemplate(_GEMMA_TOOLS, "<end_of_turn>"),
}


def trl_templates() -> dict[str, Path]:
    """TRL's shipped templates by name (file stem); empty without trl. Found without importing trl (slow)."""
    from importlib.util import find_spec

    spec = find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    return {path.stem: path for path in sorted(folder.glob("*.jinja"))}


def _read(path: Path, name: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"model.template '{name}': cannot read the template file ({exc})") from None


def get_template(name: str) -> NamedTemplate:
    """A named template, a .jinja file (path as given, relative to the working directory) or a TRL template."""
    if name in TEMPLATES:
        return TEMPLATES[name]
    path = Path(name).expanduser()
    if name.endswith((".jinja", ".j2", ".jinja2")) or path.is_file():
        if not path.is_file():
            raise UserError(f"model.template '{name}': no such template file")
        return NamedTemplate(_read(path, name), None)
    shipped = trl_templates()
    if name in shipped:
        return NamedTemplate(_read(shipped[name], name), None)
    known = [*TEMPLATES, *shipped]
    raise UserError(
        f"unknown model.template '{name}'{did_you_mean(name, known)}; choices: {', '.join(TEMPLATES)}, a .jinja "
        f"file, or a template TRL ships ({', '.join(shipped) or 'trl is not installed'})"
    )
