"""``rlfactory train`` on several processes: start them through torchrun, as LLaMA-Factory's CLI does.

With ``distributed.num_processes`` (or ``nnodes``) above 1, the command re-runs itself under
``torch.distributed.run`` (the library behind ``torchrun``): one ``python -m rlfactory train <same arguments>``
per process, each of which finds ``WORLD_SIZE`` set and trains (Accelerate reads the launcher's environment).
Inside a launched process (``torchrun -m rlfactory train``, ``accelerate launch -m rlfactory train``) nothing is
started: the launcher's processes are used as they are. One node: ``--standalone`` (a free local port). Several
nodes: a static rendezvous at ``master_addr:master_port`` with this node's ``node_rank``; the same command runs on
every node.

Checks that need no model (config, datasets, tokenizer, output dirs) run here once, before any process starts,
so bad input gives one message and exit code 2.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rlfactory.errors import UserError

if TYPE_CHECKING:
    from rlfactory.config.schema import DistributedConfig, PipelineConfig, RunConfig


def inside_launcher() -> bool:
    """This process was started by torchrun / accelerate launch (or a cluster launcher that sets the same)."""
    return "WORLD_SIZE" in os.environ or "LOCAL_RANK" in os.environ


def num_processes(dist: DistributedConfig) -> int:
    """Processes on this node: the number given, or for ``auto`` the visible GPUs (1 without any)."""
    if dist.num_processes != "auto":
        return int(dist.num_processes)
    import torch

    return max(1, torch.cuda.device_count())


def torchrun_argv(dist: DistributedConfig, train_args: list[str]) -> list[str]:
    """The arguments of ``torchrun`` that start ``python -m rlfactory train <train_args>`` on this node."""
    nodes = ["--standalone", "--nnodes=1"]
    if dist.nnodes > 1 or dist.master_port is not None:
        nodes = [f"--nnodes={dist.nnodes}", f"--node_rank={dist.node_rank}"]
        nodes += [f"--master_addr={dist.master_addr or '127.0.0.1'}", f"--master_port={dist.master_port}"]
    return [*nodes, f"--nproc_per_node={num_processes(dist)}", "-m", "rlfactory", "train", *train_args]


def cpu_threads_per_process(nproc: int) -> int | None:
    """``OMP_NUM_THREADS`` for each of ``nproc`` processes on this node: this machine's usable cores shared out, or
    None when the user set it. torchrun sets 1 when it is unset, which slowed each GPU's step of dpo LoRA by 8%
    against 16 threads (4 H200s, docs/BENCHMARKS.md): the CPU side of a step runs on torch's intra-op threads too."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, nproc))


def preflight(config: RunConfig | PipelineConfig) -> None:
    """What every process would check before loading a model, done once here: raises UserError."""
    from rlfactory.config.schema import PipelineConfig
    from rlfactory.engine import run_dir
    from rlfactory.engine.shared import check_strategy
    from rlfactory.stages.check import check_config

    check_config(config)
    runs = config.stages if isinstance(config, PipelineConfig) else [config]
    for run in runs:
        check_strategy(run)
        if run_dir.skips_finished(run.output_dir, run.resume_from_checkpoint, len(runs) > 1) is not None:
            continue
        resume_from = run_dir.resolve_resume(run.output_dir, run.resume_from_checkpoint)
        run_dir.check_output_dir(run.output_dir, run.overwrite_output_dir, resume_from)


def close_process_group(finished: bool = True) -> None:
    """At the end of a launched run: leave the process group cleanly.

    ``finished`` (all stages done, on every rank): every rank reaches a barrier before any leaves, as a rank that
    tore the group down while another was still in its last collective aborted that one. Otherwise (the run stops
    with an error or a signal, maybe on this rank alone) a gloo group is torn down here without waiting for the
    others: that joins gloo's worker threads before the interpreter ends. Left to the interpreter's exit, a worker
    that releases the last collective's tensor takes the GIL during finalization and the rank aborts
    ("terminate called without an active exception"; its native stack: ProcessGroupGloo::runLoop ->
    TensorImpl::decref_pyobject -> PyEval_AcquireThread -> pthread_exit). An NCCL group is left to the exit:
    destroying it could wait on a collective that a peer never joins.

    A group of one process (vLLM's in-process engine sets one up in a single-process run) has no peer to wait
    for: no barrier there. On an NCCL group the barrier was the group's first collective, so it created an NCCL
    communicator at the very end of the run; on an H200 with the colocated vLLM engine that hung a one-GPU grpo
    run after its model was saved (2 of 2 adapter-sync bench runs, docs/BENCHMARKS.md, twentieth session)."""
    import sys

    torch = sys.modules.get("torch")  # not imported: nothing was set up
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        gloo = torch.distributed.get_backend() == "gloo"
        if finished and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        elif not gloo:
            return
        _close_vllm_groups(sys.modules.get("vllm.distributed.parallel_state"))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if gloo:
            # DDP keeps the group's C++ object alive past destroy_process_group (torch 2.13: about ten references
            # remain once a DDP model existed), so its worker threads are never joined; one that drops a finished
            # collective's tensors after the main thread has begun finalizing aborts the rank as above (seen once
            # in CI on a loaded 2-core machine, two-node sft). A moment for them to finish while the interpreter
            # is alive; a cost of 0.2 s at the end of a CPU run of several processes.
            import time

            time.sleep(0.2)


def _close_vllm_groups(parallel_state: Any) -> None:
    """A colocated vLLM engine's process groups (vLLM's ``parallel_state``, when the run imported it), before the
    default group they were made from. Left to vLLM, its engine's exit handler destroys them after ours is gone
    and every vLLM run ended with "ValueError: Invalid process group specified" and a traceback (vLLM 0.32, one
    process and two); vLLM's own teardown then finds nothing left to do. Its environment teardown also destroys
    the default group."""
    if parallel_state is None:
        return
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def maybe_launch(config: RunConfig | PipelineConfig, train_args: list[str]) -> int | None:
    """Start the run's processes and return their exit code, or None when this process should train itself."""
    from rlfactory.config.schema import PipelineConfig

    dist = config.stages[0].distributed if isinstance(config, PipelineConfig) else config.distributed
    if inside_launcher() or num_processes(dist) * dist.nnodes == 1:
        return None
    preflight(config)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = torchrun_argv(dist, train_args)
    threads = cpu_threads_per_process(num_processes(dist))
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # torchrun keeps a value it finds, and passes it on
    print(f"launching: torchrun {' '.join(argv)} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})", flush=True)
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        # the processes printed their own errors (a UserError once, from rank 0): only the exit code is passed on
        codes = [failure.exitcode for failure in exc.failures.values()]
        return 2 if 2 in codes else max(1, *codes)
    except KeyboardInterrupt:
        return 130
    except SignalException as exc:
        # torchrun passed SIGTERM/SIGINT on to every process, which saved a checkpoint and said so (rank 0)
        return 128 + int(exc.sigval)
    except RuntimeError as exc:  # e.g. the rendezvous timed out waiting for the other nodes
        raise UserError(f"distributed: the processes could not start together: {str(exc).splitlines()[0]}") from None
    return 0
