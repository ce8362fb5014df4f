"""The WebUI's browser-test kit, shared by every browser test file (test_webui.py, test_webui_evaluate.py,
test_health_ui.py): the app served as a subprocess from a scratch folder, headless Chromium, a page opened on the
Train tab, the form helpers, layout checks measured in the page, and screenshots to docs/images/.

A test module binds the fixtures by name (``app_url, browser, page = kit.app_url, kit.browser, kit.page``: an
assignment, so the linter does not take the tests' parameters for redefined imports); each module gets its own
server (module scope), so pytest-xdist can spread the files over workers.
The browser tests need /usr/bin/chromium (`.ci/run` installs it) and the `webui` + `dev` extras (gradio,
playwright); without them they skip and say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import typing
import urllib.request
from pathlib import Path

import pytest
import yaml
from tests.conftest import ROOT, TINY_MODEL

from rlfactory.webui.security import AUTH_ENV

try:
    from playwright.sync_api import expect
except ImportError:  # the browser tests skip; the others still run
    expect = None

# CI's 2 cores are shared by two test workers, one often training: a page's update can take far longer than
# Playwright's defaults (5 s for an assertion, 30 s for an action) with nothing wrong; a real failure only takes longer
ASSERT_TIMEOUT_MS, ACTION_TIMEOUT_MS = 20_000, 60_000
if expect is not None:
    expect.set_options(timeout=ASSERT_TIMEOUT_MS)

CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
IMAGES = ROOT / "docs" / "images"
RUN_TIMEOUT_MS = 150_000
# a page's first render (the Start tab's cards come from the page load's handler): 30 s ran out once on the 2-core
# machine with a CPU burner on each core beside the suite
PAGE_OPEN_MS = 90_000


# --------------------------------------------------------------------------- the served app and the browser
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the WebUI exited with code {process.returncode}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the WebUI did not answer at {url} within {timeout} s")


def _kill_leftover_runs(workdir: Path) -> None:
    from rlfactory.webui import runner

    for state_file in (workdir / "outputs").rglob(runner.STATE_NAME):
        state = json.loads(state_file.read_text())
        if state.get("status") == "running" and state.get("pid"):
            runner.kill_tree(int(state["pid"]), grace_s=2)


def _browser_stack():
    """The Playwright sync API, or a skip with the reason (only the browser tests need these)."""
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} not found: install it (apt-get install -y chromium) to run the browser tests")
    pytest.importorskip("gradio", reason="the WebUI needs the webui extra (gradio)")
    return pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (dev extra)")


@contextlib.contextmanager
def serve(workdir: Path, *args: str, env: dict | None = None) -> typing.Iterator[str]:
    """`rlfactory webui` on a free loopback port, run from ``workdir``; yields its URL."""
    port = free_port()
    env = {
        **os.environ,
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT / "src"),
        **(env or {}),
    }
    env.pop(AUTH_ENV, None)
    log = open(workdir / "webui.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "rlfactory", "webui", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=workdir,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)
        _kill_leftover_runs(workdir)
        log.close()


HUB_MODEL = "rlfactory-test/tiny-arith-plain"  # the bundled model as a hub model in the cache, without a template


def make_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """A Hugging Face hub cache holding ``source`` as ``repo_id`` at revision main, laid out as huggingface_hub
    writes it (blobs by hash, snapshot links, refs/main), its tokenizer without a chat template. Returns the
    snapshot folder."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(source.iterdir()):
        if file.name in ("chat_template.jinja", "README.md"):
            continue
        data = file.read_bytes()
        if file.name == "tokenizer_config.json":
            config = json.loads(data)
            config.pop("chat_template", None)
            data = json.dumps(config, indent=2).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def app_url(tmp_path_factory: pytest.TempPathFactory):
    """The WebUI served from a scratch folder (examples/ and data/ linked in, so they resolve outside the
    workspace: the WebUI is told it may read them with --allow-read), with a hub cache of its own that holds one
    model (HUB_MODEL)."""
    _browser_stack()
    workdir = tmp_path_factory.mktemp("webui")
    for name in ("examples", "data"):
        (workdir / name).symlink_to(ROOT / name)
    cache = tmp_path_factory.mktemp("hub")
    make_hub_cache(cache, HUB_MODEL, TINY_MODEL)
    allow = ["--allow-read", str(ROOT / "examples"), "--allow-read", str(ROOT / "data")]
    with serve(workdir, *allow, env={"HF_HUB_CACHE": str(cache)}) as url:
        yield url, workdir


@pytest.fixture(scope="module")
def browser():
    sync_api = _browser_stack()
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


def new_context(browser):
    """A fresh browser context with the window size the screenshots use and the patient action timeout."""
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(ACTION_TIMEOUT_MS)
    return context


@pytest.fixture
def page(browser, app_url):
    url, _ = app_url
    context = new_context(browser)
    page = context.new_page()
    page.goto(url)
    expect(page.locator("#gallery-start-sft")).to_be_visible(timeout=PAGE_OPEN_MS)  # the page opens on Start
    page.get_by_role("tab", name="Train").click()
    expect(page.locator("#btn-start")).to_be_visible(timeout=PAGE_OPEN_MS)
    yield page
    context.close()
    # a test that failed mid-run leaves its training running: stopped here, or it trains on beside the module's
    # next tests (a loaded CI run saw one failure cascade into page loads that timed out)
    _kill_leftover_runs(app_url[1])


# --------------------------------------------------------------------------- page helpers
def box(page, elem_id: str):
    """The text/number input inside a Gradio component."""
    return page.locator(f"#{elem_id}").locator("input, textarea").first


def set_field(page, path: str, value) -> None:
    """Fill a field; retry when a late form update (an example still loading) overwrote it."""
    field = box(page, "field-" + path.replace(".", "-"))
    for _ in range(4):
        field.fill(str(value))
        field.press("Tab")
        try:
            expect(field).to_have_value(str(value), timeout=3000)
            return
        except AssertionError:
            page.wait_for_timeout(500)
    expect(field).to_have_value(str(value))


def open_section(page, name: str) -> None:
    section = page.locator(f"#section-{name}")
    if not section.locator("input, textarea").first.is_visible():
        section.locator(".label-wrap").first.click()
    expect(section.locator("input, textarea").first).to_be_visible()


def load_yaml(page, path: str) -> None:
    """Load a YAML into the form and wait until its values are in the fields (not only the message)."""
    chooser = box(page, "load-path")
    chooser.fill(path)
    chooser.press("Enter")
    page.locator("#btn-load").click()
    expect(page.locator("#train-message")).to_contain_text(f"loaded {path}", timeout=20_000)
    output_dir = yaml.safe_load((ROOT / path if not Path(path).is_absolute() else Path(path)).read_text())["output_dir"]
    expect(box(page, "field-output_dir")).to_have_value(output_dir)


def start_run(page) -> None:
    page.locator("#btn-start").click()
    expect(page.locator("#monitor-status")).to_contain_text("running", timeout=60_000)


def shot(page, name: str, height: int | None = None, *, between: tuple | None = None) -> None:
    """Screenshot to docs/images/: the whole page, its top ``height`` pixels, or the band of the page from the top of
    one element to the bottom of another (``between=(first, last)``, two locators; first None: the page's top), the
    page's full width."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    width = page.viewport_size["width"]
    clip = {"x": 0, "y": 0, "width": width, "height": height} if height else None
    if between:
        scroll = page.evaluate("window.scrollY")  # bounding boxes are relative to the viewport; the clip to the page
        first, last = between
        y = max(first.bounding_box()["y"] + scroll - 8, 0) if first is not None else 0
        bottom = last.bounding_box()
        clip = {"x": 0, "y": y, "width": width, "height": bottom["y"] + scroll + bottom["height"] + 8 - y}
    page.screenshot(path=str(IMAGES / name), full_page=True, clip=clip)


# --------------------------------------------------------------------------- layout, measured in the page
def grid_rows(page, elem_id: str):
    """The body rows of a Gradio Dataframe (a virtual grid of role=row elements)."""
    return page.locator(f"#{elem_id} .virtual-row[role=row]")


def grid(page, elem_id: str) -> list[dict[str, str]]:
    """A Gradio Dataframe's rows as {header: cell text}."""
    headers = page.locator(f"#{elem_id} th[role=columnheader]").evaluate_all("hs => hs.map(h => h.title)")
    rows = [row.locator("[role=gridcell]").all_inner_texts() for row in grid_rows(page, elem_id).all()]
    return [dict(zip(headers, (c.strip() for c in cells), strict=True)) for cells in rows]


_LABELS_JS = """chart => {
    const box = chart.getBoundingClientRect();
    const inside = b => b.width > 0 && b.left >= box.left - 1 && b.right <= box.right + 1
        && b.top >= box.top - 1 && b.bottom <= box.bottom + 1 && b.right <= window.innerWidth;
    // the page's legend items, and any legend Vega draws itself (clipped by its svg when too wide)
    const items = [...chart.querySelectorAll('.rf-legend-item, g.role-legend-label text')];
    return items.map(item => [item.textContent.trim(), inside(item.getBoundingClientRect())]);
}"""


def legend_labels(chart) -> tuple[list[str], list[str]]:
    """A chart's legend labels, measured: (those wholly inside the chart's box and the window, those cut off)."""
    labels = chart.evaluate(_LABELS_JS)
    return [text for text, inside in labels if inside], [text for text, inside in labels if not inside]


_COLUMNS_JS = """table => {
    const box = table.getBoundingClientRect();
    return [...table.querySelectorAll('th[role=columnheader]')].map(th => {
        const b = th.getBoundingClientRect();
        return [th.title || th.textContent.trim(), b.width > 0 && b.left >= box.left - 1 && b.right <= box.right + 1];
    });
}"""


def columns_out_of_view(table, headers: typing.Iterable[str]) -> list[str]:
    """Which of a Gradio Dataframe's ``headers`` are not wholly inside the component's box (they would need
    horizontal scrolling), or are missing."""
    shown = dict(table.evaluate(_COLUMNS_JS))
    return [header for header in headers if not shown.get(header)]


def run_state(workdir: Path, output_dir: str) -> dict:
    return json.loads((workdir / output_dir / "webui_run.json").read_text())


def choose(page, elem_id: str, value: str) -> None:
    """Pick a dropdown value by typing it (Enter selects it)."""
    chooser = box(page, elem_id)
    chooser.fill(value)
    chooser.press("Enter")


def blank_form(page, stage: str, dataset: str, output_dir: str) -> None:
    """What a new user types into the blank form first: stage, model, dataset, output_dir."""
    choose(page, "field-stage", stage)
    set_field(page, "model.name_or_path", TINY_MODEL)
    choose(page, "field-data-dataset", dataset)
    set_field(page, "output_dir", output_dir)
