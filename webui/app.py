"""The WebUI's entry for Gradio's own tools, building the same app as ``rlfactory webui``:

    gradio webui/app.py                   # reload mode: the page rebuilds when a .py file here or in src/ changes
    gradio webui/app.py -- --port 8000    # options after `--`: the same as `rlfactory webui --help`
    python webui/app.py --host 0.0.0.0 --auth-file auth.txt   # hosting (a Space: `app_file: webui/app.py`)

The app itself is the installed package ``rlfactory.webui`` (``rlfactory webui`` starts it without this folder);
this file parses the same options, runs the same checks (workspace, password for a non-loopback address, port)
and serves behind the same guard. Gradio's reload mode imports this file again on every change and takes its
``demo``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if (SRC / "rlfactory").is_dir() and str(SRC) not in sys.path:  # a checkout: its sources, the ones being edited
    sys.path.insert(0, str(SRC))

import gradio as gr  # noqa: E402

from rlfactory.cli import _parser  # noqa: E402  (after the path above)
from rlfactory.errors import UserError  # noqa: E402
from rlfactory.webui import launch_from_args, workspace  # noqa: E402
from rlfactory.webui.app import build_app  # noqa: E402


def _fail(exc: UserError) -> None:
    print(f"error: {exc}", file=sys.stderr)  # as the CLI says it: one line, exit code 2
    sys.exit(2)


ARGS = _parser().parse_args(["webui", *sys.argv[1:]])
try:
    workspace.configure(ARGS.workspace, ARGS.allow_read)
except UserError as exc:
    _fail(exc)
os.chdir(workspace.current().root)  # the page's relative paths mean the workspace, as under `rlfactory webui`
demo = build_app()  # the name `gradio webui/app.py` looks for

if __name__ == "__main__" and gr.NO_RELOAD:  # reload mode runs this file again: serve once
    try:
        launch_from_args(ARGS, app=demo)
    except UserError as exc:
        _fail(exc)
