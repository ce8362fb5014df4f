"""The one typed schema: every YAML key of every stage is declared (and documented) here.

It is the single source of truth for YAML parsing, ``key.sub=value`` CLI overrides, the JSON
schema behind the WebUI forms and the reference docs (``rlfactory config docs``). Each section
is one class; stage-specific sections are accepted only for their stage. The sections live in ``model_schema.py``
(model, lora, freeze, quantization), ``train_schema.py`` (data, train, logging, evaluation, distributed and the offline
stages' own), ``online_schema.py`` (rollout, reward, algorithm, critic, agent) and ``health_schema.py``; this module
gathers them into a run and a pipeline, and every section class can be imported from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfactory.config.base import Section
from rlfactory.config.health_schema import HealthConfig
from rlfactory.config.model_schema import (
    QUANT_STAGES,
    FreezeConfig,
    LoraConfig,
    ModelConfig,
    QuantizationConfig,
)
from rlfactory.config.online_schema import (
    AgentConfig,
    AlgorithmConfig,
    CriticConfig,
    RewardConfig,
    RolloutConfig,
    ToolSpec,
    _tool_entries,
)
from rlfactory.config.train_schema import (
    SHARDED_STRATEGIES,
    DataConfig,
    DistributedConfig,
    DPOConfig,
    EvaluationConfig,
    KTOConfig,
    LoggingConfig,
    ORPOConfig,
    RMConfig,
    TrainConfig,
)

# every section class can be imported from here, as before the sections moved to their own modules
__all__ = [
    "STAGES", "STAGE_SECTIONS", "SECTION_CLASSES", "RunConfig", "PipelineConfig", "ModelConfig", "LoraConfig",
    "FreezeConfig", "QuantizationConfig", "DataConfig", "TrainConfig", "LoggingConfig", "EvaluationConfig",
    "DistributedConfig", "RMConfig", "DPOConfig", "KTOConfig", "ORPOConfig", "RolloutConfig", "RewardConfig",
    "AlgorithmConfig", "CriticConfig", "AgentConfig", "HealthConfig", "ToolSpec",
]  # fmt: skip

Stage = Literal["pt", "sft", "rm", "dpo", "kto", "orpo", "ppo", "grpo"]


def _non_empty_dir(value: Any) -> Any:
    """An empty output_dir would mean the working directory: the run would fill (or wipe) the project.
    ``~`` is expanded here, so that every later check and write sees the folder the user meant."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("must not be empty; give a folder for this run, e.g. outputs/run")
    return os.path.expanduser(value) if isinstance(value, str) else value


STAGES: tuple[str, ...] = ("pt", "sft", "rm", "dpo", "kto", "orpo", "ppo", "grpo")


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
        if self.data.share_prompt and self.stage not in ("rm", "dpo", "orpo"):
            raise ValueError(
                f"data.share_prompt applies to the paired stages rm, dpo and orpo, not to stage "
                f"'{self.stage}'; remove it"
            )
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
            if self.rollout.mismatch_every > 1 and self.rollout.is_correction != "none":
                raise ValueError(
                    f"rollout.is_correction '{self.rollout.is_correction}' weights every step by the sampler's "
                    f"log-probs, but rollout.mismatch_every: {self.rollout.mismatch_every} asks for them on one step "
                    f"in {self.rollout.mismatch_every} only; set rollout.mismatch_every: 1 or is_correction: none"
                )
            if self.rollout.overlap and self.rollout.backend == "vllm" and self.rollout.enable_sleep_mode:
                raise ValueError(
                    "rollout.overlap: true keeps the vLLM engine generating through the update, so it cannot sleep "
                    "then; set rollout.enable_sleep_mode: false (and leave the update room beside the engine with "
                    "rollout.gpu_memory_utilization), or rollout.overlap: false"
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
        self._cuda_graph_rules()
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

    def _cuda_graph_rules(self) -> None:
        """train.cuda_graphs replays the layers train.torch_compile compiled, each whole on every process, on batch
        shapes that repeat (an offline stage's)."""
        if not self.train.cuda_graphs:
            return
        if not self.train.torch_compile:
            raise ValueError(
                "train.cuda_graphs replays the compiled layers as CUDA graphs: set train.torch_compile: true as well, "
                "or remove train.cuda_graphs"
            )
        if self.rollout is not None:
            raise ValueError(
                f"train.cuda_graphs is for the offline stages (sft, pt, rm, dpo, kto, orpo): stage {self.stage}'s "
                "update sees batches of new widths at every step, and each would record new graphs; remove it"
            )
        if self.model.gradient_checkpointing:
            raise ValueError(
                "train.cuda_graphs with model.gradient_checkpointing is not supported (the layers' forward would run "
                "again inside the backward); remove one of them"
            )
        if self.train.deepspeed or self.distributed.strategy != "ddp":
            used = "train.deepspeed" if self.train.deepspeed else f"distributed.strategy {self.distributed.strategy}"
            raise ValueError(
                f"train.cuda_graphs runs under distributed.strategy ddp only, not {used} (DeepSpeed and FSDP2 "
                "gather, reduce and free weights around each layer, outside a captured graph); remove one of them"
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
