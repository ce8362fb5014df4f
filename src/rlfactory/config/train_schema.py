"""The training's sections of the schema: data, the optimisation loop, logging, in-run evaluation, several
processes, and the offline stages' own sections (rm, dpo, kto, orpo). ``schema.py`` gathers them into a run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlfactory.config.base import Section, _as_list, _comma_list
from rlfactory.config.online_schema import ToolSpec, _tool_entries


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
        description="Padding-free batches: documents back to back with per-document position ids, so they never "
        "attend to each other and (almost) no pad tokens are computed: a micro-batch in one row with "
        "model.attn_implementation flash_attention_2 / flex_attention (they skip the masked blocks), in rows no "
        "longer than its longest document with sdpa / eager (they compute a row's whole attention). Stage pt always "
        "packs its text into blocks of cutoff_len tokens.",
    )
    share_prompt: bool = Field(
        False,
        description="rm, dpo, orpo: each preference pair's prompt computed once instead of twice: a micro-batch is "
        "one row of prompt, chosen and rejected per pair, the rejected response attending to the prompt's keys "
        "(the same numbers as two rows, with no padding). Needs model.attn_implementation sdpa_varlen (what auto "
        "picks on a CUDA GPU whose torch has the varlen kernel). Saves about a tenth of the peak memory; faster where "
        "prompts are long (docs/BENCHMARKS.md).",
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
    adam_epsilon: float = Field(1e-8, gt=0, allow_inf_nan=False, description="AdamW epsilon (in the denominator).")
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
        "the compile time and a new sequence length can recompile once. Generation by transformers (rollout.backend "
        "hf, evaluation, chat) runs the layers eager: compiling each cache state and length would fill dynamo's cache.",
    )
    cuda_graphs: bool = Field(
        False,
        description="Offline stages, with train.torch_compile on CUDA: replay each compiled layer as a CUDA graph "
        "(torch.compile's reduce-overhead mode), so the host's kernel launches stop setting the pace of a step: "
        "SFT LoRA 1.44x faster on an H200, 1.59x TRL at its fastest (docs/BENCHMARKS.md). Each new batch shape "
        "records its graphs once. Not with gradient checkpointing, DeepSpeed or "
        "FSDP2. Checked against the compiled run's losses on one GPU; under DDP not yet on GPUs.",
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
