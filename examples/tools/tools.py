"""User tools for the examples in this folder (referenced as `examples/tools/tools.py:<function>`).

A tool is a plain typed function with a Google-style docstring: rlfactory derives its JSON schema exactly as
`transformers.utils.get_json_schema` does, i.e. as `apply_chat_template(tools=[fn])` will at inference.
Raise on bad input: the message becomes the tool result the model reads.
"""

from __future__ import annotations


def unit_price(total: float, count: int) -> str:
    """Price of one item when `count` items cost `total` together.

    Args:
        total: The total price of all items.
        count: How many items.
    """
    if count <= 0:
        raise ValueError("count must be positive")
    return f"{total / count:.2f}"
