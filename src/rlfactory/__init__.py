"""rlfactory: declarative post-training (sft, rm, dpo, kto, orpo, ppo, grpo) for LLMs."""

__version__ = "0.1.0"
