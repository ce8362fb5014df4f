"""The WebUI: a Gradio dashboard to configure, launch, watch and use runs of every stage.

``rlfactory webui`` (``pip install 'rlfactory[webui]'``). The app lives inside the package so that an installed
rlfactory can start it; the repository's top-level ``webui/app.py`` builds this same app for Gradio's own entry
points (``gradio webui/app.py`` reload mode while editing the page, ``python webui/app.py`` for hosting).

Modules without Gradio hold the logic and are unit-testable on their own:
``schema_form`` (config JSON schema -> form fields -> YAML), ``runner`` (launch/stop ``rlfactory train``
subprocesses), ``monitor`` (trainer_log.jsonl -> progress, charts, rollouts), ``preview`` (dataset rows
-> rendered tokens with trained tokens highlighted) and ``chat`` (load, chat, merge/export). The Gradio
layer is ``app`` plus one module per tab; Gradio is imported only there.
"""

from __future__ import annotations

from typing import Any


def launch(
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    auth: str | None = None,
    auth_file: str | None = None,
    insecure: bool = False,
    workspace_dir: str | None = None,
    allow_read: list[str] | None = None,
    app: Any = None,
) -> None:
    """Check everything that can be checked before binding (workspace, credentials, exposure, port; a
    UserError for each), then build the app (or take ``app``, built by webui/app.py) and serve it (blocks until
    interrupted)."""
    from rlfactory.webui import security, workspace

    workspace.configure(workspace_dir, allow_read)
    credentials = security.load_auth(auth, auth_file)
    security.check_exposure(host, share, credentials, insecure)
    security.check_port(host, port)
    from rlfactory.webui.app import serve

    serve(host=host, port=port, share=share, credentials=credentials, app=app)


def launch_from_args(args: Any, app: Any = None) -> None:
    """``launch`` with the options of ``rlfactory webui`` (an argparse namespace): the CLI and webui/app.py."""
    launch(
        host=args.host,
        port=args.port,
        share=args.share,
        auth=args.auth,
        auth_file=args.auth_file,
        insecure=args.insecure,
        workspace_dir=args.workspace,
        allow_read=args.allow_read,
        app=app,
    )
