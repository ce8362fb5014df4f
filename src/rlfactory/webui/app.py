"""The Gradio app: the Start tab (examples, see ``gallery_tab``), Train, Monitor, Chat, Export, Evaluate, and the
server launch.

Paths in the page (examples/, data/, outputs/) are relative to the workspace (the directory the WebUI
starts in, or ``--workspace``), as for the CLI; the page reads and writes only inside it (``workspace``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

CSS = """
.rf-example { margin: 0 0 10px 0; border: 1px solid var(--border-color-primary); border-radius: 6px; }
.rf-example-head { font-size: 12px; padding: 4px 8px; background: var(--background-fill-secondary); }
.rf-tokens { white-space: pre-wrap; word-break: break-word; margin: 0; padding: 6px 8px; font-size: 12px; }
.rf-tokens span { color: var(--body-text-color-subdued); }
mark.trained { background: #c7f0c2; color: #14401a; padding: 0; border-radius: 2px; }
.rf-preview-head { font-size: 13px; margin-bottom: 6px; }
.rf-error { color: #b00020; white-space: pre-wrap; }
.rf-progress { height: 14px; background: var(--background-fill-secondary); border-radius: 7px; overflow: hidden; }
.rf-progress-bar { height: 100%; background: var(--color-accent); transition: width 0.5s; }
.rf-progress-text { font-size: 13px; margin-top: 4px; }
"""


def build_app() -> Any:
    """The Blocks app (not launched)."""
    import gradio as gr

    from rlfactory import __version__
    from rlfactory.webui.chat_tab import ChatTab, ExportTab
    from rlfactory.webui.evaluate_tab import EvaluateTab
    from rlfactory.webui.gallery_tab import GalleryTab
    from rlfactory.webui.monitor_tab import MonitorTab
    from rlfactory.webui.train_tab import TrainTab

    with gr.Blocks(title="rlfactory", analytics_enabled=False) as app:
        gr.Markdown(f"## rlfactory {__version__} · LLM post-training: pt, sft, rm, dpo, kto, orpo, ppo, grpo")
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab("Start", id="gallery", elem_id="tab-gallery"):
                gallery = GalleryTab()
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                train = TrainTab()
            with gr.Tab("Monitor", id="monitor", elem_id="tab-monitor"):
                monitor = MonitorTab()
            with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_page:
                chat = ChatTab()
            with gr.Tab("Export", id="export", elem_id="tab-export") as export_page:
                export = ExportTab()
            with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate") as evaluate_page:
                evaluate = EvaluateTab()
        train.wire(tabs, monitor)
        gallery.wire(tabs, monitor, train)
        monitor.wire()
        chat.wire()
        export.wire()
        evaluate.wire()
        # lists of runs are read when a page opens, not when the app was built; a run going on is reattached
        app.load(monitor.on_refresh, None, [monitor.run, monitor.runs])
        reattach = [*train.inputs, *train.stage_groups.values(), train.message, monitor.run, tabs]
        app.load(lambda: [*train.on_reattach(), _reattached_tab()], None, reattach)  # a run going on: its form
        app.load(train.model_picker.on_refresh, None, train.model_picker.pick)
        app.load(evaluate.on_load, None, evaluate.reattach_outputs())  # its list, and an evaluation going on
        # Chat and Export list runs trained since: when a run's row changes (it finished), on "refresh runs",
        # and when their tab opens
        for page, tab in ((chat_page, chat), (export_page, export), (evaluate_page, evaluate)):
            if tab is not evaluate:
                app.load(tab.on_refresh, None, tab.path)
            monitor.runs.change(tab.on_refresh, None, tab.path, show_progress="hidden")
            monitor.refresh_btn.click(tab.on_refresh, None, tab.path)
            page.select(tab.on_refresh, None, tab.path)
    return app


def _reattached_tab() -> Any:
    """The page opens on Start, or on Train when a run is going on (``TrainTab.on_reattach`` fills its form)."""
    import gradio as gr

    from rlfactory.webui import runner

    return gr.Tabs(selected="train") if runner.live_runs() else gr.skip()


def serve(
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    credentials: tuple[str, str] | None = None,
    app: Any = None,
) -> None:
    """Build (unless ``app`` is given: webui/app.py builds it first, for Gradio's reload mode) and serve the app
    until interrupted, from the configured workspace (``webui.launch`` checks the arguments first); every request
    passes through ``security.Guard``."""
    from starlette.middleware import Middleware

    from rlfactory.webui import security, workspace

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.chdir(workspace.current().root)  # relative paths in the page (outputs/, examples/) mean the workspace
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = app or build_app()
    app.queue(default_concurrency_limit=4)
    _patient_localhost_check()
    app.launch(
        server_name=host,
        server_port=port,
        share=share,
        auth=credentials,
        ssr_mode=False,
        show_error=True,
        css=CSS,
        footer_links=["gradio"],
        app_kwargs={"middleware": [Middleware(security.Guard)]},
    )


def _patient_localhost_check(seconds: float = 60) -> None:
    """Gradio's launch checks that its own local URL answers (``gradio.networking.url_ok``) and refuses to start
    otherwise; that check gives up after one 3 s request times out, which the first request of a busy machine can
    exceed (seen with load average 8 on 2 cores). Keep asking for up to ``seconds`` instead: a server that never
    answers still fails the same way. Gradio offers no setting for this, hence the wrapper."""
    import time

    from gradio import networking

    once = getattr(networking.url_ok, "__wrapped__", networking.url_ok)

    def url_ok(url: str) -> bool:
        deadline = time.monotonic() + seconds
        while not once(url):
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True

    url_ok.__wrapped__ = once  # type: ignore[attr-defined]
    networking.url_ok = url_ok
