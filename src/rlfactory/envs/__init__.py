"""Environments of the multi-turn agent loop: what answers an assistant turn (tools, a simulated user)."""
