"""Command line: ``rlfactory train run.yaml [key.sub=value ...]`` and friends.

Heavy packages (torch, transformers, gradio) are imported inside the commands that need them,
so ``rlfactory --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

from rlfactory import __version__
from rlfactory.errors import RunStopped, UserError

EPILOG = """examples:
  rlfactory train examples/quickstart/sft.yaml
  rlfactory train examples/quickstart/sft.yaml train.learning_rate=3e-4 output_dir=outputs/try2
  rlfactory config check examples/sft/qwen2.5_0.5b_lora.yaml
  rlfactory train llama3_lora_sft.yaml                                 (a LLaMA-Factory YAML: see docs/MIGRATING.md)
  rlfactory convert llama3_lora_sft.yaml -o sft.yaml                   (the same file in rlfactory's schema)
  rlfactory train run.yaml distributed.num_processes=4                 (several GPUs: starts torchrun itself)
  torchrun --nproc_per_node 4 -m rlfactory train run.yaml              (or accelerate launch -m rlfactory ...)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlfactory",
        description="Declarative LLM post-training: pt, sft, rm, dpo, kto, orpo, ppo, grpo from one YAML file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get("RLFACTORY_DEBUG", "0") not in ("", "0", "false"),
        help="on an input error, also print the traceback behind the message (or set RLFACTORY_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser("train", help="run a stage or pipeline YAML")
    train.add_argument("config", help="run or pipeline YAML (see examples/)")
    train.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.learning_rate=1e-4")
    config = sub.add_parser("config", help="check a YAML, print the JSON schema or the reference docs")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser("check", help="validate a YAML (schema, datasets, model path) without training")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    config_sub.add_parser("schema", help="print the JSON schema of a run config")
    convert = sub.add_parser("convert", help="write a LLaMA-Factory run YAML in rlfactory's schema")
    convert.add_argument("config", help="a LLaMA-Factory run YAML (flat keys: model_name_or_path, stage, ...)")
    convert.add_argument("-o", "--output", default=None, help="file to write (default: print to stdout)")
    config_sub.add_parser("docs", help="print the config reference (Markdown)")
    webui = sub.add_parser("webui", help="start the Gradio dashboard (needs the webui extra)")
    webui.add_argument("--host", default="127.0.0.1", help="address to serve on (default: loopback only)")
    webui.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    webui.add_argument(
        "--share",
        type=_yes_no,
        nargs="?",
        const=True,
        default=False,
        help="make a public gradio.live link (true/false)",
    )
    webui.add_argument(
        "--auth",
        default=None,
        help="user:password required to open the page (shows in the process list: prefer --auth-file "
        "or env RLFACTORY_WEBUI_AUTH)",
    )
    webui.add_argument("--auth-file", default=None, metavar="FILE", help="file holding one line user:password")
    webui.add_argument(
        "--workspace",
        default=None,
        metavar="DIR",
        help="the folder the page may read and write in (default: the current directory)",
    )
    webui.add_argument(
        "--allow-read",
        action="append",
        default=[],
        metavar="DIR",
        help="another folder the page may read models, data and YAMLs from (repeatable)",
    )
    webui.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback --host or --share without a password (anyone who can reach it can "
        "read and write the workspace and start runs)",
    )
    export = sub.add_parser("export", help="write a model, adapter or run's result as a HF folder (merged or adapter)")
    export.add_argument("path", help="a model dir, a LoRA adapter dir or a run's output dir")
    export.add_argument("--to", required=True, metavar="DIR", help="the folder to write (new or empty)")
    export.add_argument("--base", default="", help="base model of an adapter (default: the run's or the adapter's)")
    export.add_argument(
        "--template", default="", help="chat template to save (default: the run's, else the tokenizer's)"
    )
    export.add_argument(
        "--adapter-only", action="store_true", help="copy the adapter alone, with tokenizer and template"
    )
    export.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in DIR")
    export.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="also upload DIR to this Hub repo")
    chat = sub.add_parser("chat", help="talk to a model, LoRA adapter or run output dir in the terminal (tools too)")
    chat.add_argument("path", help="a model dir, a LoRA adapter dir or a run's output dir")
    chat.add_argument("--base", default="", help="base model of an adapter (default: the run's, else the adapter's)")
    chat.add_argument("--template", default="", help="chat template: a bundled name or a .jinja file")
    chat.add_argument("--system", default="", help="system prompt (kept by /clear)")
    chat.add_argument(
        "--tools",
        action="append",
        metavar="TOOLS",
        help="tools offered: bundled names or "
        "file.py:function (comma-separated), or a YAML/JSON list as a run's `tools:`; repeatable",
    )
    chat.add_argument("--parser", default="hermes", help="tool-call format the model writes (as agent.parser)")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="tokens per assistant turn at most")
    chat.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    chat.add_argument("--max-turns", type=int, default=4, help="assistant turns per message at most (tool calls)")
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible chat completions endpoint (needs the serve extra or vllm)"
    )
    serve.add_argument("path", help="a model dir, a LoRA adapter dir or a run's output dir")
    serve.add_argument("--backend", choices=["auto", "hf", "vllm"], default="auto", help="auto: vllm if installed")
    serve.add_argument("--host", default="127.0.0.1", help="address to serve on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--api-key", default=None, help="require Authorization: Bearer KEY (shows in ps: prefer env RLFACTORY_API_KEY)"
    )
    serve.add_argument("--parser", default="hermes", help="tool-call format the model writes: hermes, json, harmony")
    serve.add_argument("--served-model-name", default="", help="the model name clients send (default: the folder's)")
    serve.add_argument("--base", default="", help="base model of an adapter (default: the run's or the adapter's)")
    serve.add_argument("--template", default="", help="chat template: a named one, a .jinja file (default: the run's)")
    serve.add_argument(
        "--vllm-args",
        default="",
        help="more arguments for vLLM's server, as one string: --vllm-args='--max-model-len 8192'",
    )
    evaluate = sub.add_parser("eval", help="evaluate a model, adapter, run dir or run YAML: pass@k, maj@k, tools")
    evaluate.add_argument("path", help="a model dir, a LoRA adapter dir, a run's output dir, or a run YAML")
    evaluate.add_argument("--dataset", help="prompt+answer dataset (default: the run's evaluation.dataset)")
    evaluate.add_argument("--dataset-dir", help="folder of dataset_info.yaml (default: the run's, else ./data)")
    evaluate.add_argument("--metric", help="reward function used as the score (default: the run's, else answer_match)")
    evaluate.add_argument("--samples", type=int, default=1, help="completions per prompt (1: greedy; default 1)")
    evaluate.add_argument("--temperature", type=float, help="sampling temperature (default: 0 for 1 sample, else 1.0)")
    evaluate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    evaluate.add_argument("--max-samples", type=int, help="evaluate the first N prompts (default: the run's, else all)")
    evaluate.add_argument(
        "--max-new-tokens", type=int, help="token budget per completion (default: the run's, else 64)"
    )
    evaluate.add_argument("--batch-size", type=int, help="prompts generated at once (default: the run's, else 32)")
    evaluate.add_argument(
        "--tools", nargs="+", help="builtin tool names or file.py:function, run through the agent loop ('none': off)"
    )
    evaluate.add_argument("--backend", default="hf", help="hf (default) or vllm (needs the vllm extra)")
    evaluate.add_argument("--threshold", type=float, default=1.0, help="score counted correct by pass@k and maj@k")
    evaluate.add_argument("--seed", type=int, help="sampling seed (default: the run's, else 0)")
    evaluate.add_argument(
        "--out", help="folder for report.json and samples.jsonl (default: outputs/eval/<model>-<dataset>)"
    )
    plan = sub.add_parser("plan", help="estimate per-GPU peak memory and step time before any weights load")
    plan.add_argument("config", help="run or pipeline YAML")
    plan.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for train")
    plan.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: the visible ones)")
    plan.add_argument("--gpu-memory", type=float, default=None, metavar="GB", help="memory per GPU in GiB")
    plan.add_argument("--gpu-name", default=None, metavar="NAME", help="card to plan for (H100, A100, ...): step time")
    plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    sub.add_parser("env", help="print versions of the stack and GPU info")
    sub.add_parser("version", help="print the rlfactory version")
    return parser


def _yes_no(text: str) -> bool:
    if text.lower() in ("true", "yes", "1", "on"):
        return True
    if text.lower() in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # idle OpenMP threads spin by default; on a busy CPU that made generation 20x slower (measured here)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for noisy in ("transformers", "accelerate", "datasets", "httpx", "matplotlib", "liger_kernel"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _quiet_library_notices()
    if os.environ.get("RANK", "0") != "0":  # a launched process past the first: rank 0 says what every rank would
        logging.getLogger("rlfactory").setLevel(logging.WARNING)  # (once, not once per process); warnings stay
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights", datasets' maps


def _drop_use_return_dict(record: logging.LogRecord) -> bool:
    return "`use_return_dict` is deprecated" not in record.getMessage()


def _quiet_library_notices() -> None:
    """Silence what libraries print, once per process, that a user of ours can neither act on nor needs: Liger's note
    that its optional CuTe-DSL / Ascend backends cannot be imported (the Triton kernels run), transformers' deprecation
    of the ``config.use_return_dict`` that Liger's patched forward reads, and of the ``is_gradient_checkpointing``
    that peft 0.21 reads whenever it wraps or loads an adapter, and torch's advice, at every barrier of a launched
    run, to pass ``device_id`` to ``init_process_group`` (Accelerate creates the group)."""
    import warnings

    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)
    logging.getLogger("transformers.configuration_utils").addFilter(_drop_use_return_dict)
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def cmd_train(args: argparse.Namespace) -> int:
    from rlfactory.config.loader import load_config
    from rlfactory.launch import close_process_group, maybe_launch

    config = load_config(args.config, args.overrides)
    code = maybe_launch(config, [args.config, *args.overrides])
    if code is not None:
        return code
    from rlfactory.stages.pipeline import run_config

    try:
        run_config(config)
    except BaseException:
        close_process_group(finished=False)
        raise
    close_process_group()
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from rlfactory.config import docs
    from rlfactory.config.schema import RunConfig

    if args.config_command == "schema":
        print(json.dumps(RunConfig.model_json_schema(), indent=2))
    elif args.config_command == "docs":
        print(docs.markdown_reference())
    else:
        from rlfactory.config.loader import load_config
        from rlfactory.stages.check import check_config

        config = load_config(args.config, args.overrides)
        for line in check_config(config):
            print(line)
        print(f"{args.config}: OK")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Print or write the converted YAML; the result is validated first, and an existing file is never replaced."""
    from pathlib import Path

    import yaml

    from rlfactory.config.loader import resolve_raw, validate_config

    raw, conversion = resolve_raw(args.config)
    if conversion is None:
        raise UserError(f"{args.config}: not a LLaMA-Factory file (it has no flat `model_name_or_path`); nothing to do")
    validate_config(raw, args.config)
    header = "".join(f"# {line}\n" for line in conversion.notes(args.config))
    text = header + yaml.safe_dump(raw, sort_keys=False)
    if args.output is None:
        print(text, end="")
        return 0
    out = Path(args.output)
    if out.exists():
        raise UserError(f"{out} exists; choose another --output or remove it")
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_webui(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("gradio") is None:  # not imported here: bad arguments are refused at once
        raise UserError("the WebUI needs gradio: pip install 'rlfactory[webui]'")
    from rlfactory.webui import launch_from_args

    launch_from_args(args)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rlfactory.use.export import run_cli

    return run_cli(args)


def cmd_serve(args: argparse.Namespace) -> int:
    import shlex

    from rlfactory.use.serve import ServeOptions, serve

    names = ("host", "port", "backend", "api_key", "parser", "base", "template")
    options = ServeOptions(
        name=args.served_model_name,
        extra=tuple(shlex.split(args.vllm_args)),
        **{name: getattr(args, name) for name in names},
    )
    return serve(args.path, options)


def cmd_eval(args: argparse.Namespace) -> int:
    from rlfactory.use.evaluate import run_command

    return run_command(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from rlfactory.engine.plan_report import plan_command

    return plan_command(args)


def cmd_env(_: argparse.Namespace) -> int:
    from importlib import metadata

    print(f"rlfactory {__version__}")
    print(f"python {sys.version.split()[0]}")
    for package in (
        "torch",
        "transformers",
        "peft",
        "trl",
        "accelerate",
        "datasets",
        "deepspeed",
        "vllm",
        "gradio",
        "pydantic",
    ):
        try:
            print(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            print(f"{package} not installed")
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            print(f"cuda:{i} {props.name} {props.total_memory / 2**30:.0f} GiB (CUDA {torch.version.cuda})")
    else:
        print("cuda: not available (CPU only)")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from rlfactory.use.chat import cmd_chat as chat

    return chat(args)


# How long a process other than rank 0 waits before printing an input error itself (see below).
RANK_ERROR_GRACE_S = 10.0


def _still_running_after_rank_0_had_time_to_print() -> bool:
    """An input error on a process other than rank 0. Every rank usually meets the same one and rank 0 prints it;
    but a rank that exits first makes torchrun stop the others, so on a loaded machine rank 0 was stopped before it
    printed and the user saw no reason at all. So this rank waits: if rank 0 printed and exited, torchrun ends this
    process during the wait; if it is still running after it, the error is its own (rank 0 did not meet it), and
    it prints it. A run stopped on purpose (``RunStopped``) is agreed by all ranks and never waits."""
    try:
        time.sleep(RANK_ERROR_GRACE_S)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: rank 0 says what happened
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "version":
        print(__version__)
        return 0
    _setup_logging()
    handlers = {
        "train": cmd_train,
        "config": cmd_config,
        "convert": cmd_convert,
        "webui": cmd_webui,
        "env": cmd_env,
        "export": cmd_export,
        "chat": cmd_chat,
        "eval": cmd_eval,
        "serve": cmd_serve,
        "plan": cmd_plan,
    }
    try:
        return handlers[args.command](args)
    except UserError as exc:
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0 and (isinstance(exc, RunStopped) or not _still_running_after_rank_0_had_time_to_print()):
            return exc.exit_code  # several processes: the same error once, from rank 0
        if args.debug:  # with the library error behind the message (raised `from None` for users)
            exc.__suppress_context__ = False
            traceback.print_exception(exc, file=sys.stderr)
        print(f"{exc.prefix}{f' (rank {rank})' if rank else ''}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
