"""Tools for multi-turn rollouts: declaration and JSON schema (``spec``), bundled tools (``builtin``),
tool-call parsing in the model's own format (``parsers``) and async execution (``execute``)."""
