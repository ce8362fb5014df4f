"""Named chat templates for tokenizers that ship none (``model.template``).

The tokenizer's own template is preferred; these exist so base models can be fine-tuned into chat
models. Each is a Jinja template in the Hugging Face ``chat_template`` format plus its end-of-turn
string (what generation stops on and what closes every trained assistant turn). transformers renders
with ``trim_blocks``, so a newline right after a block tag is written as an expression.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfactory.errors import UserError, did_you_mean


@dataclass(frozen=True)
class NamedTemplate:
    jinja: str
    end_of_turn: str


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


def get_template(name: str) -> NamedTemplate:
    if name not in TEMPLATES:
        raise UserError(
            f"unknown model.template '{name}'{did_you_mean(name, TEMPLATES)}; choices: {', '.join(TEMPLATES)}"
        )
    return TEMPLATES[name]
