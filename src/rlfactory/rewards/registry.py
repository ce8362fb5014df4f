"""The reward-function registry object, below every module that registers into it.

Bundled rewards live in several modules (``builtin``, ``agent``); each registers here, and ``builtin``
imports the others, so ``rlfactory.rewards.builtin.REWARD_FUNCTIONS`` is the filled registry. Look names up
through ``builtin``, not this module, which alone holds only what has been imported so far.
"""

from __future__ import annotations

from rlfactory.plugins import Registry

REWARD_FUNCTIONS = Registry("reward function")
