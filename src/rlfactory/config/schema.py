"""The one typed schema: every YAML key of every stage is declared (and documented) here.

It is the single source of truth for YAML parsing, ``key.sub=value`` CLI overrides, the JSON
schema behind the WebUI forms and the reference docs (``rlfactory config docs``). Each section
is one class; stage-specific sections are accepted only for their stage. The online stages' sections live in
``online_schema.py``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfactory.config.base import Section, _as_list, _comma_list
from rlfactory.config.health_schema import HealthConfig
from rlfactory.config.online_schema import (
    AgentConfig,
    AlgorithmConfig,
    CriticConfig,
    RewardConfig,
    RolloutConfig,
    ToolSpec,
    _tool_entries,
)

Stage = Literal["pt", "sft", "rm", "dpo", "kto", "orpo", "ppo", "grpo"]


def _non_empty_dir(value: Any) -> Any:
    """An empty output_dir would mean the working directory: the run would fill (or wipe) the project.
    ``~`` is expanded here, so that every later check and write sees the folder the user meant."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("must not be empty; give a folder for this run, e.g. outputs/run")
    return os.path.expanduser(value) if isinstance(value, str) else value


STAGES: tuple[str, ...] = ("pt", "sft", "rm", "dpo", "kto", "orpo", "ppo", "grpo")


# --------------------------------------------------------------------------- shared sections
QUANT_STAGES = ("pt", "sft", "dpo", "kto", "orpo", "grpo")  # the stages QLoRA is wired and tested for


class QuantizationConfig(Section):
    """QLoRA: the frozen base loaded in 4 or 8 bits (bitsandbytes, a CUDA GPU), LoRA adapters trained on top."""

    bits: Literal[4, 8] = Field(4, description="4 (QLoRA's NF4/FP4) or 8 (LLM.int8) bits per base weight.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4 bits: the data type (nf4 as in QLoRA, or fp4).")
    double_quant: bool = Field(True, description="4 bits: also quantize the quantization constants (~0.4 bit/weight).")
    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="4 bits: the dtype the dequantized weights are multiplied in (and the dtype of the rest).",
    )

    @model_validator(mode="after")
    def _four_bit_keys(self) -> QuantizationConfig:
        """8 bits has no data type, double quantization or compute dtype: setting them would change nothing."""
        given = sorted(self.model_fields_set & {"quant_type", "double_quant", "compute_dtype"})
        if self.bits == 8 and given:
            raise ValueError(f"{', '.join(given)}: for bits: 4 only; remove for 8-bit loading")
        return self


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
        description="Chat template to use instead of the tokenizer's own (needed when the tokenizer has none): "
        "a bundled name (chatml, llama3, gemma_tools), a Jinja file (`.jinja`, path relative to the working "
        "directory), or the name of a template TRL ships in trl/chat_templates (e.g. qwen3, llama3_1, gemma3, "
        "gptoss, qwen3_training). Every render is read back: a template that drops a message, tool call or "
        "tool schema is refused; one that rewrites earlier turns trains each turn in its own context.",
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
        description="Liger's fused kernels (RMSNorm, SwiGLU, RoPE; fused linear cross-entropy). auto: its layer "
        "kernels for full/freeze fine-tuning on CUDA when liger-kernel is installed and train.torch_compile is off, "
        "and its fused cross-entropy as the kernel of the preference stages' chunked log-probs on CUDA (off: a "
        "torch loop there).",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code shipped with the checkpoint.")
    quantization: QuantizationConfig | None = Field(
        None,
        description="QLoRA: load the base quantized (keys bits, quant_type, double_quant, compute_dtype; see "
        "`model.quantization` below). Needs finetuning: lora, a CUDA GPU and bitsandbytes (`pip install "
        "'rlfactory[qlora]'`); with rollout.backend vllm the adapter alone is synced (lora_sync: adapter).",
    )

    _as_list_adapters = field_validator("adapter_paths", mode="before")(_as_list)

    @model_validator(mode="after")
    def _quantized(self) -> ModelConfig:
        if self.quantization is None:
            return self
        if self.finetuning != "lora":
            raise ValueError(
                f"model.quantization: a quantized base cannot be trained with finetuning: {self.finetuning} (its "
                "weights are frozen 4/8-bit tensors); use finetuning: lora, or remove model.quantization"
            )
        if self.adapter_paths:
            raise ValueError(
                "model.quantization with model.adapter_paths: merging an adapter into a quantized base rounds it "
                "again; merge first (`rlfactory export ADAPTER --to DIR`) and set model.name_or_path: DIR"
            )
        return self


LORA_INITS = ("gaussian", "orthogonal", "pissa", "olora")
LORA_INITS_REFUSED = {
    "eva": "EVA initialises from activations of training data (peft's initialize_lora_eva_weights); use pissa",
    "corda": "CorDA needs a covariance pass over data first; use pissa",
    "loftq": "LoftQ needs its own quantization config; use model.quantization with true or pissa",
    "lora_ga": "LoRA-GA needs gradient estimates from data first; use pissa",
    "mica": "MiCA freezes B, which the checkpoints do not expect; use pissa",
}


class LoraConfig(Section):
    """LoRA adapters (peft), used when model.finetuning is lora: LoRA, DoRA, rsLoRA, PiSSA/OLoRA initialisation."""

    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: `all-linear` (or `all`) or a list such as [q_proj, v_proj] "
        "(a comma-separated string works too).",
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Extra modules trained in full and saved with the adapter."
    )
    use_dora: bool = Field(
        False,
        description="DoRA: a trained magnitude per output and the LoRA update on the direction (peft use_dora); "
        "slower steps. vLLM cannot serve DoRA adapters: with rollout.backend vllm set rollout.lora_sync: merged.",
    )
    use_rslora: bool = Field(False, description="rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r.")
    init_lora_weights: bool | str = Field(
        True,
        description="How adapters start (peft init_lora_weights): true (B = 0, the model starts unchanged), false "
        "(random A and B, for tests), gaussian, orthogonal (r even), pissa / pissa_niter_N (the top singular "
        "directions of each weight, N fast-SVD iterations; the residual becomes the frozen base), olora (QR of each "
        "weight, likewise). pissa and olora change the base weights: the saved adapter is converted to a plain LoRA "
        "of rank 2r on the original base, a reference policy is a frozen copy, and vllm syncs merged weights.",
    )

    _names_modules = field_validator("modules_to_save", mode="before")(_comma_list)

    @field_validator("init_lora_weights", mode="before")
    @classmethod
    def _init(cls, value: Any) -> Any:
        """The initialisations that need nothing but the weights; peft's data-driven ones are refused by name."""
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "false"):
            return text == "true"
        if text in LORA_INITS or re.fullmatch(r"pissa_niter_\d+", text):
            return text
        if text in LORA_INITS_REFUSED:
            raise ValueError(f"'{value}' is not supported: {LORA_INITS_REFUSED[text]}")
        raise ValueError(
            f"'{value}' is not an initialisation; use true, false, {', '.join(LORA_INITS)} or pissa_niter_N (N >= 0)"
        )

    @model_validator(mode="after")
    def _combinations(self) -> LoraConfig:
        if self.init_lora_weights == "orthogonal" and self.r % 2:
            raise ValueError(f"init_lora_weights: orthogonal needs an even r (r is {self.r})")
        if self.use_dora and self.changes_base():
            raise ValueError(
                f"use_dora with init_lora_weights: {self.init_lora_weights}: the trained adapter could not be "
                "converted back to the original base (DoRA's magnitudes are not a low-rank difference; measured "
                "wrong); use one of the two"
            )
        return self

    def changes_base(self) -> bool:
        """pissa / olora move part of each weight into the adapter: the frozen base is a residual, not the model."""
        return isinstance(self.init_lora_weights, str) and self.init_lora_weights.startswith(("pissa", "olora"))

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear(cls, value: Any) -> Any:
        """`all` (LLaMA-Factory's name) is PEFT's `all-linear`; `q_proj,v_proj` is a list. One name without a comma
        stays a string (PEFT reads a string as a regular expression)."""
        names = _comma_list(value) if isinstance(value, str) and "," in value else value
        if names in ("all", ["all"], ["all-linear"]):
            return "all-linear"
        if isinstance(names, list) and ("all" in names or "all-linear" in names):
            raise ValueError("`all` / `all-linear` stands alone; give either it or a list of module names")
        return names


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
        default_factory=list,
        description="Training dataset name(s) from the registry (dataset_info.yaml or .json): a list, or names "
        "separated by commas.",
    )
    eval_dataset: list[str] = Field(default_factory=list, description="Evaluation dataset name(s).")
    eval_split: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of the training data held out for eval when no eval_dataset."
    )
    dataset_dir: str | None = Field(
        None, description="Folder holding dataset_info.yaml (default: ./data, else the bundled data/)."
    )
    cutoff_len: int = Field(
        1024, ge=8, description="Maximum tokens per example (prompt + response); stage pt: the block length."
    )
    truncation: Literal["right", "drop"] = Field(
        "right",
        description="Examples longer than cutoff_len: `right` shortens them as LLaMA-Factory does (prompt and response "
        "share the budget in proportion to their lengths; the prompt keeps its end, the response its start), `drop` "
        "leaves them out. Either way every shortened or dropped example is counted in the log and by `config check`.",
    )
    train_on: Literal["assistant", "last_assistant", "all"] = Field(
        "assistant",
        description="Which tokens carry loss in SFT: every assistant turn, only the last one, or all tokens.",
    )
    packing: bool = Field(
        False,
        description="Padding-free batches: concatenate a micro-batch into one row with per-document "
        "position ids, so documents never attend to each other and no pad tokens are computed. Stage pt always "
        "packs its text into blocks of cutoff_len tokens.",
    )
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows per dataset.")
    max_bad_rows: int = Field(
        0, ge=0, description="How many malformed rows may be skipped (with a warning) before it is an error."
    )
    shuffle: bool = Field(True, description="Shuffle the training data every epoch (seeded).")

    _as_list_ds = field_validator("dataset", "eval_dataset", mode="before")(_comma_list)


class TrainConfig(Section):
    """Optimisation: steps, batch sizes, learning rate, precision, evaluation and checkpoints."""

    num_epochs: float = Field(1.0, gt=0, description="Passes over the training data (ignored if max_steps).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    per_device_batch_size: int = Field(4, ge=1, description="Micro-batch size per device (memory-bound).")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    learning_rate: float = Field(1e-4, gt=0, allow_inf_nan=False, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr"] = Field(
        "cosine", description="Learning-rate schedule (transformers' get_scheduler)."
    )
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Warmup as a fraction of total steps.")
    warmup_steps: int = Field(0, ge=0, description="Warmup steps (overrides warmup_ratio when > 0).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay (not applied to biases/norms).")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the gradient norm (null: no clipping).")
    skip_nonfinite_steps: int = Field(
        0,
        ge=0,
        description="A non-finite loss or gradient norm stops the run with a message (0, the default; nothing "
        "non-finite is ever saved). N > 0: skip such an update instead (logged as skipped_steps), and stop only "
        "after N skipped in a row.",
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto", description="Autocast precision. auto: bf16 on a GPU that supports it, else none."
    )
    torch_compile: bool = Field(
        False,
        description="torch.compile each decoder layer, in every stage (the policy and critic of ppo/grpo too) and "
        "sft's LM-head chunks on CUDA. Measured 1.5-2.1x faster on an H200 (docs/BENCHMARKS.md); the first steps pay "
        "the compile time and a new sequence length can recompile once. With rollout.backend hf, generation runs "
        "through the compiled layers as well.",
    )
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N steps (and always at the end).")
    save_steps: int | None = Field(None, ge=1, description="Save a resumable checkpoint every N steps.")
    save_total_limit: int | None = Field(2, ge=1, description="Keep only the last K checkpoints.")
    deepspeed: str | None = Field(
        None,
        description='Path to your own DeepSpeed JSON config (used via Accelerate; "auto" values are filled from '
        "this config). Instead of distributed.strategy zero2/zero3/zero3_offload, whose bundled configs it replaces.",
    )


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
        description="ppo/grpo: every N steps (and at the first, and at a step where a health rule fired) write "
        "rollouts/step_<5-digit step>.jsonl (prompts, completions, the response's trained/masked token runs, token "
        "counts, rewards per component, advantages). null: never.",
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
    tools: list[ToolSpec] = Field(
        default_factory=list,
        description="Offline stages (sft, dpo, ...): score through the agent loop with these tools, as ppo/grpo "
        "evaluate with theirs (greedy; the tool results are fed back and the last turn is scored), e.g. after SFT "
        "on tool-call demonstrations. ppo/grpo evaluate with the run's `tools` and `agent`.",
    )
    max_turns: int = Field(3, ge=1, description="With `tools`: assistant turns per conversation at most.")
    parser: str = Field("hermes", description="With `tools`: the tool-call format the model emits (as agent.parser).")

    _tool_list = field_validator("tools", mode="before")(_tool_entries)


STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload", "fsdp2")
SHARDED_STRATEGIES = ("zero3", "zero3_offload", "fsdp2")  # no process holds the whole model after prepare


class DistributedConfig(Section):
    """Several processes (GPUs) on one or more nodes. `rlfactory train` starts them itself through torchrun
    when `num_processes` (or `nnodes`) is above 1; under `torchrun` or `accelerate launch` this section's
    launch keys are not used (the launcher's processes are). A pipeline is launched once: every stage must
    have the same section (put it in `defaults`)."""

    num_processes: int | Literal["auto"] = Field(
        1,
        description="Processes per node, one per GPU. auto: the number of visible GPUs (1 on CPU). The world "
        "size is nnodes x num_processes; train.per_device_batch_size is per process.",
    )
    strategy: Literal["ddp", "zero2", "zero3", "zero3_offload", "fsdp2"] = Field(
        "ddp",
        description="ddp: a full copy per process (DistributedDataParallel). zero2: DeepSpeed ZeRO stage 2 "
        "(optimizer state and gradients sharded). zero3: ZeRO stage 3 (weights sharded too). zero3_offload: "
        "zero3 with weights and optimizer state in host memory. fsdp2: PyTorch FSDP2 (fully_shard) through "
        "Accelerate. The DeepSpeed configs are bundled (rlfactory/engine/deepspeed/*.json; train.deepspeed "
        "takes your own file instead). zero3, zero3_offload and fsdp2 save a normal Hugging Face directory "
        "(full weights gathered, or the adapter).",
    )
    nnodes: int = Field(1, ge=1, description="Nodes (machines) in the run; run the same command on each.")
    node_rank: int = Field(
        0, ge=0, description="This node's index, 0 to nnodes-1 (give it per node: `distributed.node_rank=1`)."
    )
    master_addr: str | None = Field(
        None, description="Address of node 0, reachable from every node. Required when nnodes > 1."
    )
    master_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="A free TCP port on node 0 for the rendezvous. Required when nnodes > 1; on one node a free "
        "port is picked (torchrun --standalone).",
    )

    @field_validator("num_processes")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be at least 1 (or auto: one process per visible GPU)")
        return value

    @model_validator(mode="after")
    def _nodes(self) -> DistributedConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError(
                "nnodes > 1 needs master_addr and master_port (node 0's address and a free port on it), "
                "the same on every node"
            )
        return self


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


STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "pt": (),
    "sft": (),
    "rm": ("rm",),
    "dpo": ("dpo",),
    "kto": ("kto",),
    "orpo": ("orpo",),
    "ppo": ("rollout", "reward", "algorithm", "critic", "agent"),
    "grpo": ("rollout", "reward", "algorithm", "critic", "agent"),
}
# sections left empty unless given: the RL recipe fills ``critic`` when the estimator needs values (a trait)
OPTIONAL_SECTIONS = {"critic"}
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

    stage: Stage = Field(..., description="Which stage to run: pt, sft, rm, dpo, kto, orpo, ppo or grpo.")
    name: str | None = Field(None, description="Run name (pipelines: how later stages refer to this one).")
    output_dir: str = Field("outputs/run", description="Where checkpoints, logs and the final model go.")
    overwrite_output_dir: bool = Field(False, description="Delete an existing run in output_dir first.")
    resume_from_checkpoint: str | None = Field(
        None, description="`auto` (latest checkpoint in output_dir, if any) or a checkpoint directory."
    )
    seed: int = Field(
        42, ge=0, le=2**32 - 1, description="Seed for data order, initialisation and sampling (0 to 2**32 - 1)."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    rm: RMConfig | None = Field(None, description="Stage rm only.")
    dpo: DPOConfig | None = Field(None, description="Stage dpo only.")
    kto: KTOConfig | None = Field(None, description="Stage kto only.")
    orpo: ORPOConfig | None = Field(None, description="Stage orpo only.")
    rollout: RolloutConfig | None = Field(None, description="Stages ppo and grpo only.")
    reward: RewardConfig | None = Field(None, description="Stages ppo and grpo only.")
    algorithm: AlgorithmConfig | None = Field(None, description="Stages ppo and grpo only.")
    critic: CriticConfig | None = Field(
        None,
        description="Stages ppo and grpo: the value model, trained exactly when algorithm.adv_estimator needs "
        "values (gae); its defaults apply when the section is left out.",
    )
    tools: list[ToolSpec] = Field(
        default_factory=list,
        description="ppo/grpo: tools the model may call, run in the agent loop; their schemas go into the chat "
        "template of rows without a `tools` column. Offline stages read schemas from the dataset's tools column.",
    )
    agent: AgentConfig | None = Field(None, description="Stages ppo and grpo only.")

    _tool_list = field_validator("tools", mode="before")(_tool_entries)
    _output_dir = field_validator("output_dir", mode="before")(_non_empty_dir)

    @model_validator(mode="after")
    def _stage_sections(self) -> RunConfig:
        """Fill the stage's own sections with defaults; refuse sections of other stages."""
        own = STAGE_SECTIONS[self.stage]
        for section, cls in SECTION_CLASSES.items():
            value = getattr(self, section)
            if section in own and value is None and section not in OPTIONAL_SECTIONS:
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
        if self.rollout is not None:  # an online stage (its sections were filled above)
            assert self.reward is not None
            if not self.reward.functions and not self.reward.reward_model:
                raise ValueError(
                    f"stage {self.stage} needs a reward source: set reward.functions or reward.reward_model"
                )
            separate_sampler = self.rollout.backend == "vllm" or self.rollout.overlap
            if self.rollout.is_correction != "none" and not separate_sampler:
                raise ValueError(
                    f"rollout.is_correction '{self.rollout.is_correction}' corrects for a separate sampler: it needs "
                    "rollout.backend: vllm or rollout.overlap: true (the hf backend otherwise samples with the policy "
                    "itself); set it to none"
                )
            if self.rollout.overlap and self.rollout.backend != "hf":
                raise ValueError(
                    f"rollout.overlap: true runs with rollout.backend: hf only (not {self.rollout.backend} yet: "
                    "docs/ARCHITECTURE.md 'Overlapped generation' says what it needs); set rollout.overlap: false"
                )
            self._online_rules()
        if self.evaluation.tools and self.rollout is not None:
            raise ValueError(
                f"evaluation.tools: stage {self.stage} evaluates through its own agent loop, with `tools` and "
                "`agent`; remove evaluation.tools"
            )
        if self.evaluation.tools and self.sharded():
            raise ValueError(
                "evaluation.tools: the agent loop's evaluation runs under distributed.strategy ddp or zero2 only "
                "(every process holds the whole model); remove evaluation.tools or change the strategy"
            )
        if self.tools and self.rollout is None:
            raise ValueError(
                f"tools: stage {self.stage} trains on recorded conversations; it reads tool schemas from the "
                "dataset's tools column (columns: {tools: <column>}). Remove `tools:` (it is for ppo/grpo rollouts; "
                "evaluation.tools runs this stage's evaluation with tools)"
            )
        if self.kto is not None and self.train.per_device_batch_size < 2:
            raise ValueError(
                "kto estimates its KL reference point within a micro-batch: set train.per_device_batch_size >= 2"
            )
        self._distributed_rules()
        self._peft_rules()
        self._ignored_settings()
        if self.dpo is not None and self.dpo.ref_model and self.dpo.loss_type in ("simpo",):
            raise ValueError(f"dpo.loss_type '{self.dpo.loss_type}' is reference-free: remove dpo.ref_model")
        return self

    def _ignored_settings(self) -> None:
        """A setting whose whole point would not happen is refused: evaluation every N steps with nothing to
        evaluate on. (Sections that would merely be unused are warnings: see ``unused_sections``.)"""
        if self.train.eval_steps and not self._has_eval_data():
            source = "data.eval_dataset or data.eval_split" if self.rollout is None else "evaluation.dataset"
            raise ValueError(
                f"train.eval_steps is set but there is nothing to evaluate on: set {source}, or remove train.eval_steps"
            )

    def unused_sections(self) -> list[str]:
        """Sections given for another fine-tuning method (``lora:`` with ``finetuning: full``): they change nothing,
        so they are warned about (``config check`` and the start of a run), not refused: a pipeline's ``defaults``
        may carry a lora section for its LoRA stages next to a full one."""
        method = self.model.finetuning
        warnings = []
        for section, default, used_by in ((self.lora, LoraConfig(), "lora"), (self.freeze, FreezeConfig(), "freeze")):
            if method != used_by and section != default:
                name = type(section).__name__.removesuffix("Config").lower()
                warnings.append(
                    f"the `{name}:` section is ignored: model.finetuning is {method}; remove it, or set "
                    f"model.finetuning: {used_by}"
                )
        return warnings

    def _has_eval_data(self) -> bool:
        """Offline stages evaluate on data.eval_dataset / eval_split; ppo/grpo validate on prompts."""
        if self.rollout is not None:
            return self.evaluation.dataset is not None
        return bool(self.data.eval_dataset) or self.data.eval_split > 0

    def sharded(self) -> bool:
        """No process holds the whole model after prepare (zero3, zero3_offload, fsdp2, or a ZeRO-3 JSON)."""
        if self.train.deepspeed:
            try:
                stage = json.loads(Path(self.train.deepspeed).read_text()).get("zero_optimization", {}).get("stage")
            except (OSError, ValueError, AttributeError):
                return False  # build_accelerator reports a missing or bad file
            return stage == 3
        return self.distributed.strategy in SHARDED_STRATEGIES

    def _distributed_rules(self) -> None:
        """The strategy against train.deepspeed, and the dpo/kto reference under a sharded strategy."""
        if self.train.deepspeed and self.distributed.strategy != "ddp":
            raise ValueError(
                f"train.deepspeed ({self.train.deepspeed}) and distributed.strategy {self.distributed.strategy} "
                "both choose the strategy; remove one (strategy ddp with train.deepspeed uses your file)"
            )
        if self.stage == "rm" and self.sharded():
            raise ValueError(
                "stage rm under a sharded strategy (zero3, zero3_offload, fsdp2) is not supported yet: its reward head "
                "is merged into the model after training; use distributed.strategy ddp or zero2"
            )
        section = self.dpo or self.kto
        needs_copy = (
            self.model.finetuning != "lora"
            or (self.dpo is not None and self.dpo.ref_model)
            or self.lora.changes_base()  # the adapter-disabled policy is the residual, not the model
        )
        reference_free = self.dpo is not None and self.dpo.loss_type == "simpo"
        precomputed = self.dpo is not None and self.dpo.precompute_ref_logps
        if section is not None and needs_copy and not reference_free and not precomputed and self.sharded():
            fix = (
                "set dpo.precompute_ref_logps: true (the reference log-probs are computed once before training)"
                if self.dpo is not None
                else "use model.finetuning: lora (the reference is the policy with its adapter disabled)"
            )
            raise ValueError(
                f"stage {self.stage} with a frozen reference copy ({self.model.finetuning} fine-tuning"
                f"{', dpo.ref_model' if self.dpo is not None and self.dpo.ref_model else ''}) under a sharded "
                f"strategy: every process would hold the whole copy; {fix}, or use distributed.strategy ddp/zero2"
            )

    def _peft_rules(self) -> None:
        """QLoRA's stages and strategies, and what vLLM can be sent: the adapter alone for a quantized base (merging
        into 4-bit weights would round them), merged weights for DoRA (vLLM serves no DoRA adapters) and for
        pissa/olora (their adapter belongs to a residual base, not the model vLLM loaded)."""
        quantized, lora = self.model.quantization is not None, self.model.finetuning == "lora"
        if quantized and self.stage not in QUANT_STAGES:
            raise ValueError(
                f"model.quantization is not supported for stage {self.stage} yet (it is for "
                f"{', '.join(QUANT_STAGES)}); remove it"
            )
        if quantized and self.sharded():
            raise ValueError(
                "model.quantization under a sharded strategy (zero3, zero3_offload, fsdp2): bitsandbytes weights are "
                "not sharded here; use distributed.strategy ddp (each GPU holds the 4-bit base) or remove quantization"
            )
        if quantized and self.lora.changes_base():  # peft's pissa_init raises on a bitsandbytes weight
            raise ValueError(
                f"lora.init_lora_weights: {self.lora.init_lora_weights} with model.quantization: the initialisation "
                "splits each full-precision weight into adapter and residual, and a 4/8-bit base has none (peft "
                "refuses PiSSA there; the saved adapter's conversion would read a rounded base); remove one of them"
            )
        if lora and self.lora.changes_base() and self.sharded():
            raise ValueError(
                f"lora.init_lora_weights: {self.lora.init_lora_weights} under a sharded strategy (zero3, "
                "zero3_offload, fsdp2): converting the adapter back to the original base at save needs it whole on "
                "one process; use distributed.strategy ddp or zero2, or init_lora_weights: true"
            )
        if not (lora and self.rollout is not None and self.rollout.backend == "vllm"):
            return
        needs_merged = [
            reason
            for reason, applies in (
                ("lora.use_dora (vLLM serves no DoRA adapters)", self.lora.use_dora),
                (
                    f"lora.init_lora_weights: {self.lora.init_lora_weights} (its adapter belongs to the residual base, "
                    "not to the model vLLM loaded)",
                    self.lora.changes_base(),
                ),
            )
            if applies
        ]
        if quantized and needs_merged:
            raise ValueError(
                f"model.quantization with rollout.backend vllm syncs the adapter alone, which {needs_merged[0]} "
                "rules out; remove one of them, or use rollout.backend: hf"
            )
        if quantized and self.rollout.lora_sync == "merged":
            raise ValueError(
                "rollout.lora_sync: merged with model.quantization: merging into the 4/8-bit base would round the "
                "update away; use rollout.lora_sync: adapter (vLLM serves the adapter on its own copy of the base)"
            )
        if needs_merged and self.rollout.lora_sync == "adapter":
            raise ValueError(
                f"rollout.lora_sync: adapter cannot serve {needs_merged[0]}; set rollout.lora_sync: merged"
            )

    def _online_rules(self) -> None:
        """ppo/grpo: the estimator default per stage (the one thing the two names choose); online stages batch by
        rollout, not by accumulation."""
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

    _output_dir = field_validator("output_dir", mode="before")(_non_empty_dir)

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
            earlier = next((r for r in self.stages[:index] if (r.name or r.stage) == run.model.from_stage), None)
            if run.model.quantization is not None and earlier is not None and earlier.model.finetuning == "lora":
                raise ValueError(
                    f"stages.{index}.model.quantization: stage '{run.model.from_stage}' saves an adapter, which would "
                    "be merged into the quantized base (rounding it); start this stage from a merged export "
                    "of it instead (`rlfactory export`, then model.name_or_path: that folder)"
                )
            seen.append(name)
        launch = self.stages[0].distributed
        for index, run in enumerate(self.stages[1:], start=1):
            if run.distributed != launch:
                raise ValueError(
                    f"stages.{index}.distributed differs from stage 0's: a pipeline is launched once, so every "
                    "stage needs the same distributed section; put it in `defaults`"
                )
        return self
