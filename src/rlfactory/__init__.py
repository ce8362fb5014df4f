"""rlfactory: declarative post-training (pt, sft, rm, dpo, kto, orpo, ppo, grpo) for LLMs."""

__version__ = "0.1.0"
