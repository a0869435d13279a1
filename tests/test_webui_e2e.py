"""The whole page in a real browser (Debian's chromium, headless) against the real trainer:
demo preset (1 epoch) → Start → progress to the end and a sample in the gallery; then a second run,
Stop, and the run shown as stopped with a backup. About a minute and a half on an idle 2-core CPU.

The module's tests share one chromium and one served app (``chromium``, ``served``): each test opens a new browser
context (its own cookies and storage) and empties the workspace first (``app``), where the page keeps everything it
remembers, so each meets the page a newcomer would. The test with the login serves its own app."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from webui.app import build_app, serve

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("ATELIER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def show(page, *names: str) -> None:
    """Open tabs by name, the task tab first (Train, Runs, Data, Tools), then a tab inside it. A click on a tab bar
    Gradio is still mounting (a loaded machine's slow frames) can be lost: the tab is clicked until it is selected."""
    for name in names:
        tab = page.get_by_role("tab", name=name, exact=True)
        for _attempt in range(3):
            tab.click()
            drawn(page)
            if tab.get_attribute("aria-selected") == "true":
                break


def drawn(page) -> None:
    """Wait until a tab or fold just opened has been drawn in full. Gradio mounts the components shown for the first
    time, and a few animation frames later sets their props from its own copy of the page: text typed into a field
    before that is replaced (a hand is never that quick; a loaded test machine's frames are slow)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() =>"
                  " requestAnimationFrame(() => setTimeout(r, 0)))))")


def open_fold(page, title: str, exact: bool = False) -> None:
    """Open an accordion by its title and wait until it is drawn."""
    page.get_by_text(title, exact=exact).click()
    drawn(page)


def wait_loaded(page) -> None:
    """The page is built: its task tabs are there and its load event has been applied (it shows the tab the user
    left; a tab clicked before that could be switched back by it, on a busy machine)."""
    page.wait_for_selector("#main-tabs [role=tab]", timeout=60000)
    page.wait_for_selector("html[data-atelier-loaded]", state="attached", timeout=60000)


@pytest.fixture(scope="module")
def chromium():
    """One headless chromium for this module's tests (starting one costs about a second and a half of CPU); each
    test opens its own context in it, with its own cookies and storage, as a fresh browser would have."""
    from playwright.sync_api import sync_playwright
    assert shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), "Debian's chromium is required"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def new_page(browser, height: int = 1000, width: int = 1400, **options):
    """A page in a new context of ``browser`` (nothing shared with the pages before it); closed afterwards."""
    context = browser.new_context(viewport={"width": width, "height": height}, **options)
    try:
        yield context.new_page()
    finally:
        context.close()


@contextlib.contextmanager
def open_page(url: str, height: int = 1000, width: int = 1400, browser=None):
    """A Debian-chromium page on the served app, loaded up to its tabs; closed afterwards. In ``browser`` when
    given (a new context of it), else in a chromium started for this page."""
    if browser is not None:
        with new_page(browser, height, width) as page:
            page.goto(url)
            wait_loaded(page)
            yield page
        return
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        own = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            with open_page(url, height, width, browser=own) as page:
                yield page
        finally:
            own.close()


@contextlib.contextmanager
def logged_in_page(url: str, shots: Path, browser):
    """A page in ``browser`` on an app served with the login ada / s3cret, signed in (downloads accepted); a
    screenshot in ``shots`` when the block fails."""
    with new_page(browser, accept_downloads=True) as page:
        try:
            page.goto(url)
            page.get_by_label("username").fill("ada")
            page.get_by_label("password").fill("s3cret")
            page.get_by_role("button", name="Login").click()
            wait_loaded(page)
            yield page
        except Exception:
            page.screenshot(path=str(shots / "failure.png"), full_page=True)
            raise


def assert_changes_the_tiny_model(*loras: Path) -> None:
    """Each LoRA file loads in diffusers' tiny SD pipeline and changes its image."""
    import torch

    from trainer.families.common.sd_kit.tiny import build_tiny_pipeline
    pipe = build_tiny_pipeline("tiny-sd")
    pipe.set_progress_bar_config(disable=True)

    def image():
        return pipe("a red square", num_inference_steps=2, guidance_scale=1.0, height=64, width=64,
                    generator=torch.Generator().manual_seed(0), output_type="np").images[0]

    before = image()
    for lora in loras:
        pipe.load_lora_weights(str(lora))
        assert abs(image() - before).max() > 1e-3, lora
        pipe.unload_lora_weights()


def stop_runs(ctx) -> None:
    """Let trainers that reported their end exit, and stop any still running."""
    from webui import runner
    ctx.manager.wait_for_ending_runs(30)
    for run_dir in ctx.manager.active_runs():
        runner.stop(run_dir, force=True)


@pytest.fixture
def page_url(tmp_path):
    """(url, AppContext) of the app served on a free port, on a workspace of its own (for other modules' tests)."""
    demo = build_app(tmp_path / "ws")
    _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield url, demo.atelier
    stop_runs(demo.atelier)
    demo.atelier.manager.shutdown()
    demo.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app served once for this module's tests (building and serving the page costs ~2 s of CPU)."""
    demo = build_app(tmp_path_factory.mktemp("e2e") / "ws")
    _, url, _ = serve(demo, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield url, demo.atelier
    demo.atelier.manager.shutdown()
    demo.close()


@pytest.fixture
def app(served):
    """(url, AppContext) of the module's app on an empty workspace: the page keeps all it knows there (the draft,
    the preset and tab a reload lands on, runs, the queue), so each test meets the page a newcomer would."""
    url, ctx = served
    for entry in ctx.workspace.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    yield url, ctx
    stop_runs(ctx)


def set_number(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(value)
    box.press("Tab")


def wait_state(page, states: tuple, timeout: float) -> str:
    """Wait until the live run's status shows one of ``states``; the state."""
    status = page.locator("#run-status .atl-status")
    try:
        page.wait_for_function("(states) => states.includes(document.querySelector('#run-status .atl-status')"
                               "?.getAttribute('data-state'))", arg=list(states), timeout=timeout * 1000,
                               polling=100)
    except Exception:
        raise AssertionError(f"run never reached {states}; status: "
                             f"{status.inner_text() if status.count() else '-'}") from None
    return status.get_attribute("data-state")


def wait_remembered(ctx, **expected: str) -> None:
    """Wait until the page has saved what a reload lands on (each tab choice goes by its own small request)."""
    from webui.tabs.config_bar import read_ui_state
    end = time.time() + 15
    while time.time() < end:
        state = read_ui_state(ctx)
        if all(state.get(k) == v for k, v in expected.items()):
            return
        time.sleep(0.05)
    raise AssertionError(f"the page never saved {expected}; saved: {read_ui_state(ctx)}")


def in_view(page, elem_id: str, height: int) -> bool:
    """Whether the top of an element is on the screen, without scrolling (above the fold)."""
    box = page.locator(f"#{elem_id}").first.bounding_box()
    return box is not None and 0 <= box["y"] < height


def test_demo_run_and_stop_in_the_browser(app, chromium, tmp_path):
    """A newcomer on a 1440x900 screen: demo preset → Start → the live run in view → finished, result downloaded;
    a second run stopped, a reload lands on it, Resume continues it from its backup; then the sample tool draws
    with the first run's LoRA and shows the image on the page."""
    assert shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), "Debian's chromium is required"
    url, ctx = app
    with open_page(url, height=900, width=1440, browser=chromium) as page:
        try:
            assert "Quick start" in page.locator("#start-here").inner_text()  # where to begin, said on the page
            page.locator("#preset-select input").click()
            page.get_by_role("option", name="demo", exact=True).click()
            page.wait_for_function("document.querySelector('#form-messages').innerText.includes('demo')",
                                   timeout=30000)
            show(page, "Training")
            assert page.locator("#cfg-training-epochs input[type=number]").input_value() == "8"
            set_number(page, "cfg-training-epochs", "1")  # 4 steps: keeps the test short

            page.locator("#start-btn").click()
            assert wait_state(page, ("finished", "failed", "died"), 240) == "finished", \
                page.locator("#run-problems").inner_text()
            status = page.locator("#run-status .atl-status")
            assert status.get_attribute("data-step") == status.get_attribute("data-total") == "4"
            page.wait_for_selector("#sample-gallery img", timeout=30000)
            # the live run is in view after Start: status, loss and the samples above the fold
            assert all(in_view(page, e, 900) for e in ("run-status", "loss-plot", "sample-gallery")), \
                page.screenshot(path=str(tmp_path / "fold.png"))
            assert "step 4 · prompt 0" in page.locator("#sample-gallery").inner_text()
            first = status.get_attribute("data-run")
            result = page.locator("#download-result")  # the live run offers the finished LoRA for download
            result.wait_for(state="visible", timeout=30000)
            assert f"{first}.safetensors" in result.inner_text()
            with page.expect_download(timeout=30000) as info:
                result.click()
            info.value.save_as(tmp_path / "result.safetensors")
            assert (tmp_path / "result.safetensors").read_bytes() == \
                (ctx.workspace / "runs" / first / f"{first}.safetensors").read_bytes()

            # the sample tool draws with the first run's LoRA (in its own process, while the second run below
            # trains) and shows the image on the page, not a path
            show(page, "Tools")
            page.locator("#tools-model-tool").get_by_label("sample").check()
            page.locator("#tools-model-path textarea, #tools-model-path input").first.fill("builtin:tiny-sd")
            lora = ctx.workspace / "runs" / first / f"{first}.safetensors"
            page.locator("#tools-model-loras textarea").first.fill(str(lora))
            page.locator("#tools-model-prompt textarea, #tools-model-prompt input").first.fill("a red square")
            set_number(page, "tools-model-steps", "1")
            page.locator("#tools-model-run").click()

            # a second run, stopped halfway: it ends "stopped" with a backup
            show(page, "Train", "Training")
            set_number(page, "cfg-training-max-steps", "100000")
            page.locator("#start-btn").click()
            running_again = (f"(() => {{ const s = document.querySelector('#run-status .atl-status');"
                             f" return s && s.dataset.run !== '{first}' && s.dataset.state === 'running'"
                             f" && Number(s.dataset.step) >= STEP; }})()")
            page.wait_for_function(running_again.replace("STEP", "1"), timeout=180000)
            page.locator("#stop-btn").click()
            assert wait_state(page, ("stopped", "failed", "died"), 120) == "stopped"
            assert "Backup:" in page.locator("#run-status").inner_text()
            page.wait_for_function("document.querySelector('#stop-btn').disabled", timeout=15000)  # nothing to stop
            page.wait_for_function("!document.querySelector('#run-action-msg').innerText.includes('Stopping')",
                                   timeout=15000)  # the message of the ended run is gone
            page.screenshot(path=str(tmp_path / "stopped.png"), full_page=True)

            show(page, "Tools")  # the sample tool's image, drawn meanwhile
            page.wait_for_function("/Done|Error/.test(document.querySelector('#tools-model-msg').innerText)",
                                   timeout=180000)
            assert "Done" in page.locator("#tools-model-msg").inner_text(), page.locator("#tools-model-msg").inner_text()
            page.wait_for_selector("#tools-model-images img", timeout=30000)

            # back on the live run, a reload lands there again, and Resume there continues the stopped run
            show(page, "Runs")
            wait_remembered(ctx, tab="run")
            stopped_at = int(status.get_attribute("data-step"))
            page.reload()
            wait_loaded(page)
            page.wait_for_function("document.querySelector('#tab-runs-button').getAttribute('aria-selected')"
                                   " === 'true'", timeout=30000)
            assert wait_state(page, ("stopped",), 30) == "stopped"
            page.locator("#run-resume-btn").click()
            page.wait_for_function(running_again.replace("STEP", str(stopped_at + 1)), timeout=180000)
            page.locator("#stop-btn").click()
            assert wait_state(page, ("stopped", "failed", "died"), 120) == "stopped"

            table = page.locator("#runs-table")  # the history, below the live run
            page.wait_for_function("document.querySelector('#runs-table').innerText.includes('Stopped')",
                                   timeout=30000)
            assert "Finished" in table.inner_text()

        except Exception:
            try:  # keep the evidence, but never hide the real failure
                page.screenshot(path=str(tmp_path / "failure.png"), full_page=True, timeout=10000)
                print("messages:", page.locator("#form-messages").inner_text(timeout=5000))
            except Exception:
                pass
            raise
    runs = sorted(p.name for p in (ctx.workspace / "runs").iterdir())
    assert len(runs) == 2
    assert len(list((ctx.workspace / "samples").rglob("*.png"))) == 1  # the sample tool's image, in the workspace


def test_a_newcomer_from_an_empty_page_to_a_lora_at_home_compared_and_tidied(chromium, tmp_path):
    """The newcomer path in one go, logged in as through a share link: an empty page; Quick start on a folder of
    images outside the workspace; Check settings names a wrong model path at its field; train; download the LoRA
    (it loads in diffusers and changes the image); compare with an earlier run; take that run home from the Runs
    tab (its LoRA byte for byte, and it changes the image; a zip with config, log and samples) and delete it. The
    same files without the login are refused."""
    import zipfile

    import httpx

    from conftest import DEMO_DATA, train_quiet
    ws = tmp_path / "ws"
    earlier = train_quiet(ws, "earlier", "demo", "training.max_steps=2", "training.learning_rate=0.05",
                          "sampling.at_end=true")  # a run from last week
    kept = tmp_path / "kept.safetensors"  # its LoRA, before the run is deleted below
    shutil.copy(earlier / "earlier.safetensors", kept)
    images = tmp_path / "elsewhere" / "my-shapes"  # outside the workspace: a --browse-root
    images.mkdir(parents=True)
    for f in DEMO_DATA.iterdir():
        shutil.copy(f, images / f.name)
    demo = build_app(ws, browse_roots=[tmp_path / "elsewhere"])
    _, url, _ = serve(demo, port=free_port(), auth=[("ada", "s3cret")], prevent_thread_lock=True, quiet=True)
    try:
        with logged_in_page(url, tmp_path, chromium) as page:
            assert page.locator("#preset-select input").input_value() == ""  # an empty page
            # ① ② ③: the demo model, a LoRA, the images outside the workspace
            page.locator("#qs-kind input").click()
            page.get_by_role("option", name="Demo: the built-in tiny model (offline, under a minute on a CPU)").click()
            page.locator("#qs-images textarea, #qs-images input").first.fill(str(images))
            page.locator("#qs-fill").click()
            page.wait_for_function("document.querySelector('#qs-note').innerText.includes('Filled the form')",
                                   timeout=15000)
            assert page.locator("#preset-select input").input_value() == "demo"
            # a wrong model path is named at its field by Check settings, before anything starts
            page.get_by_role("tab", name="Model", exact=True).click()
            path_box = page.locator("#cfg-model-path textarea, #cfg-model-path input").first
            path_box.fill(str(tmp_path / "missing.safetensors"))
            path_box.press("Tab")
            page.locator("#validate-btn").click()
            page.wait_for_function("document.querySelector('#cfg-model-path').classList.contains('atl-field-error')"
                                   " && document.querySelector('#cfg-model-path').innerText.includes('missing')",
                                   timeout=30000)
            path_box.fill("builtin:tiny-sd")
            path_box.press("Tab")
            page.locator("#validate-btn").click()
            page.wait_for_function("!document.querySelector('#cfg-model-path').classList.contains('atl-field-error')",
                                   timeout=30000)
            show(page, "Training")
            set_number(page, "cfg-training-epochs", "1")  # 4 steps
            page.locator("#start-btn").click()
            assert wait_state(page, ("finished", "failed", "died"), 240) == "finished", \
                page.locator("#run-problems").inner_text()
            status = page.locator("#run-status .atl-status")
            name = status.get_attribute("data-run")
            run_dir = ws / "runs" / name
            assert str(images) in (run_dir / "config.yaml").read_text()  # it trained on the outside folder
            result = page.locator("#download-result")
            result.wait_for(state="visible", timeout=30000)
            with page.expect_download(timeout=30000) as info:
                result.click()
            got = tmp_path / "home.safetensors"
            info.value.save_as(got)
            assert got.read_bytes() == (run_dir / f"{name}.safetensors").read_bytes()
            # compare with last week's run: both losses on one chart, samples side by side
            page.get_by_role("tab", name="Runs", exact=True).click()
            page.locator("#runs-compare").get_by_text("Compare runs").click()
            for run in ("earlier", name):
                page.locator("#compare-pick input").click()
                page.locator("#compare-pick").get_by_role("option", name=run, exact=True).click()
            page.wait_for_function(
                "document.querySelectorAll('#compare-gallery img').length >= 4", timeout=30000)
            captions = page.locator("#compare-gallery").inner_text()
            assert "earlier · step 2" in captions and f"{name} · step 4" in captions
            # both losses are drawn: each run is a series of the chart's legend (a run picked second was once on
            # the axes but never drawn)
            page.wait_for_function("(() => { const t = document.querySelector('#compare-loss').innerText;"
                                   f" return t.includes('earlier') && t.includes('{name}'); }})()", timeout=30000)
            # the earlier run taken home from the history: its LoRA and a zip of the run
            page.mouse.click(5, 5)  # a click beside it closes the compare list
            page.locator("#runs-pick input").click()
            page.locator("#runs-pick").get_by_role("option", name="earlier", exact=True).click()
            button = page.locator("#runs-download-result")
            button.wait_for(state="visible", timeout=30000)
            assert "earlier.safetensors" in button.inner_text()
            with page.expect_download(timeout=30000) as info:
                button.click()
            downloaded = tmp_path / "downloaded.safetensors"
            info.value.save_as(downloaded)
            assert downloaded.read_bytes() == kept.read_bytes()
            page.locator("#runs-zip-btn").click()
            zip_button = page.locator("#runs-download-zip")
            zip_button.wait_for(state="visible", timeout=30000)
            with page.expect_download(timeout=30000) as info:
                zip_button.click()
            info.value.save_as(tmp_path / "run.zip")
            # and tidy up: delete the earlier run (asked first)
            page.locator("#runs-delete").click()
            page.wait_for_function("document.querySelector('#runs-msg').innerText.includes('cannot be undone')",
                                   timeout=15000)
            assert earlier.is_dir()
            page.locator("#runs-delete").click()  # "Delete now"
            page.wait_for_function("document.querySelector('#runs-msg').innerText.includes('Deleted')",
                                   timeout=15000)
            assert not earlier.exists() and run_dir.is_dir()
            assert "earlier" not in page.locator("#runs-table").inner_text()
        with zipfile.ZipFile(tmp_path / "run.zip") as z:
            names = set(z.namelist())
            assert {"config.yaml", "events.jsonl", "train.log", "earlier.safetensors"} <= names
            assert any(n.startswith("samples/") and n.endswith(".png") for n in names)
            assert not any(n.startswith("backups/") for n in names)
            assert z.read("earlier.safetensors") == kept.read_bytes()
        # the file route wants the login like every other route
        (ws / "runs" / "notes.txt").write_text("a file that exists, inside a served folder")
        file_url = f"{url.rstrip('/')}/gradio_api/file={ws / 'runs' / 'notes.txt'}"
        assert httpx.get(file_url, timeout=30).status_code in (401, 403)
    finally:
        demo.atelier.manager.wait_for_ending_runs(30)
        demo.atelier.manager.shutdown()
        demo.close()
    assert_changes_the_tiny_model(got, downloaded)  # the LoRAs taken home have the trained effect


def test_the_prompt_editor_never_overwrites_row_0_unasked_and_a_reload_lands_where_the_user_left(app, chromium):
    """The prompt editor starts with no row chosen and never overwrites row 0 unasked; then a reload lands on the
    preset and the tab the user left, with the Quick start folded for a returning user."""
    url, ctx = app
    with open_page(url, browser=chromium) as page:
        page.locator("#preset-select input").click()
        page.get_by_role("option", name="demo", exact=True).click()
        page.wait_for_function("document.querySelector('#form-messages').innerText.includes('demo')", timeout=30000)
        page.get_by_role("tab", name="Sampling", exact=True).click()
        table = page.locator("#cfg-sampling-prompts-cards")  # one card per prompt (the table is folded)
        page.locator("#cfg-sampling-prompts-card-0").first.wait_for(timeout=15000)
        assert "a red square on a white background" in table.inner_text()
        open_fold(page, "Add or edit one prompt")
        label = page.locator("#cfg-sampling-prompts-row")
        assert "No prompt chosen" in label.inner_text()
        page.locator("#cfg-sampling-prompts-item-prompt textarea").fill("a green triangle")
        page.locator("#cfg-sampling-prompts-update").click()
        page.wait_for_function("document.querySelector('#cfg-sampling-prompts-note').innerText.includes('Pick a row')",
                               timeout=15000)
        assert "a red square on a white background" in table.inner_text()  # row 0 untouched
        assert "a green triangle" not in table.inner_text()
        page.locator("#cfg-sampling-prompts-card-0-edit").click()
        page.wait_for_function("document.querySelector('#cfg-sampling-prompts-row').innerText.includes('Editing row')",
                               timeout=15000)
        assert page.locator("#cfg-sampling-prompts-item-prompt textarea").input_value() == \
            "a red square on a white background"
        assert "Editing row 0" in label.inner_text().replace("*", "")

        wait_remembered(ctx, preset="demo", train_tab="sampling")
        page.reload()
        wait_loaded(page)
        page.wait_for_function("document.querySelector('#preset-select input').value === 'demo'", timeout=30000)
        page.wait_for_function(
            "document.querySelector('#tab-sampling-button').getAttribute('aria-selected') === 'true'", timeout=30000)
        assert not page.locator("#qs-fill").is_visible()  # a returning user's quick start is folded


CONTRAST_JS = """(sel) => {
  const rgb = s => s.match(/[\\d.]+/g).map(Number);
  const lum = c => { const [r, g, b] = c.slice(0, 3).map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
                     return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const bg = e => { for (; e; e = e.parentElement) { const c = rgb(getComputedStyle(e).backgroundColor);
                      if (c.length < 4 || c[3] > 0) return c; } return [255, 255, 255]; };
  return [...document.querySelectorAll(sel)].filter(e => e.offsetParent !== null).slice(0, 40).map(e => {
    const a = lum(rgb(getComputedStyle(e).color)), b = lum(bg(e));
    return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05); });
}"""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_at_1024_px_every_tab_shows_help_text_is_readable_and_only_the_chosen_optimizers_fields(app, chromium,
                                                                                                     theme):
    url, _ = app
    with new_page(chromium, height=800, width=1024) as page:
        page.goto(f"{url}?__theme={theme}")
        page.wait_for_selector("#start-btn", timeout=60000)
        tabs = page.locator("#main-tabs > .tab-wrapper [role=tablist] button[role=tab]").all_inner_texts()
        assert [t.strip() for t in tabs] == ["Train", "Runs", "Data", "Tools"], tabs  # the page by task
        tabs = page.locator("#train-tabs [role=tablist] button[role=tab]").all_inner_texts()
        assert {"Model", "Training", "Embedding", "Advanced"} <= set(tabs), tabs  # none behind a "…" menu
        ratios = page.evaluate(CONTRAST_JS, ".info-text")
        assert ratios and min(ratios) >= 4.5, ratios
        page.get_by_role("tab", name="Training", exact=True).click()
        page.wait_for_selector("#cfg-training-optimizer-beta1", state="visible", timeout=15000)
        shown = page.evaluate("[...document.querySelectorAll('[id^=cfg-training-optimizer-]')]"
                              ".filter(e => e.offsetParent !== null).map(e => e.id)")
        assert "cfg-training-optimizer-d-coef" not in shown  # Prodigy's, not AdamW's
        assert not any(i.startswith("cfg-training-optimizer-relative-step") for i in shown)


def test_quick_start_fills_the_form_from_three_choices(app, chromium):
    url, ctx = app
    model, images = ctx.workspace / "models" / "my-sdxl.safetensors", ctx.workspace / "my-cats"
    model.parent.mkdir(parents=True, exist_ok=True)
    model.write_bytes(b"\0" * 16)
    images.mkdir()
    with open_page(url, browser=chromium) as page:
        page.locator("#qs-kind input").click()
        page.get_by_role("option", name="SDXL (and Pony, Illustrious, … based on it)").click()
        set_number(page, "qs-card", "24")  # the card's memory (this machine has no GPU: the field starts empty)
        page.locator("#qs-model textarea, #qs-model input").first.fill(str(model.with_name("missing.safetensors")))
        page.locator("#qs-images textarea, #qs-images input").first.fill(str(ctx.workspace / "no-such-folder"))
        page.locator("#qs-fill").click()
        page.wait_for_function("document.querySelector('#qs-note').innerText.includes('is not a folder')", timeout=15000)
        note = page.locator("#qs-note").inner_text()
        assert "missing.safetensors" in note  # every wrong input, in one answer
        assert note.count("Error:") == 2 and "④" in note and "⑤" in note and "Nothing was filled" in note, note
        assert page.locator("#preset-select input").input_value() == ""  # nothing filled from a wrong choice
        page.locator("#validate-btn").click()  # checks the form as it is, and says the Quick start was not applied
        page.wait_for_function("document.querySelector('#form-messages').innerText.includes('not applied')",
                               timeout=30000)
        assert "looks good" not in page.locator("#form-messages").inner_text()
        page.locator("#qs-model textarea, #qs-model input").first.fill(str(model))
        page.locator("#qs-images textarea, #qs-images input").first.fill(str(images))
        page.locator("#qs-fill").click()
        page.wait_for_function("document.querySelector('#qs-note').innerText.includes('Filled the form')", timeout=15000)
        # 24 GiB by default: the full preset's own tier (sdxl-lora unchanged), not the largest smaller one
        assert page.locator("#preset-select input").input_value() == "sdxl-lora-24gb"
        page.get_by_role("tab", name="Model", exact=True).click()
        assert page.locator("#cfg-model-path textarea, #cfg-model-path input").first.input_value() == str(model)
        show(page, "Data", "Concepts")
        page.locator("#cfg-data-concepts-card-0").first.wait_for(timeout=15000)
        card = page.locator("#cfg-data-concepts-card-0").first.inner_text()  # (Gradio puts a group's id on two nested divs)
        assert "my-cats" in card and str(images) in card and "0 images" in card  # a card per concept
        page.locator("#cfg-data-concepts-card-0-edit").click()  # its Edit opens the row editor on it
        page.wait_for_function("(document.querySelector('#cfg-data-concepts-row') || {innerText: ''})"
                               ".innerText.includes('Editing row')", timeout=15000)


def write_clip(path: Path, frames: int = 9, size: int = 32, fps: int = 16) -> None:
    """An H.264 MP4 (what a video family's sample is) whose frames go from red to blue."""
    import av
    import numpy as np
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            rgb = np.zeros((size, size, 3), np.uint8)
            rgb[..., 0], rgb[..., 2] = 255 - 255 * i // (frames - 1), 255 * i // (frames - 1)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())


def settled_at(page, seen: list, first: int, rounds: int, within: int):
    """The index in ``seen`` of the first check of the run view from ``first`` on after which ``rounds`` more
    checks go by with no Gradio event (a POST) sent; None when none of the first ``within`` checks is one."""
    def checks() -> list:
        return [i for i in range(first, len(seen)) if "/atelier/changes?view=run" in seen[i][1]]
    for k in range(within):
        end = time.time() + 15
        while len(checks()) < k + rounds + 1:
            assert time.time() < end, seen[first:]
            page.wait_for_timeout(100)
        at = checks()
        if not any(method == "POST" for method, _ in seen[at[k]:at[k + rounds]]):
            return at[k]
    return None


def test_an_untouched_page_slows_frame_loops_its_idle_run_tab_sends_no_gradio_events_and_a_video_run_plays(
        app, chromium):
    """What a page left open costs, on one page left alone on the Runs tab; then a video run appears and plays.

    Gradio's status trackers keep a requestAnimationFrame loop alive after their events (~70 frames a second on an
    idle page). The page's first script slows any loop re-arming itself while nobody touches the page (one frame
    per LOOP_FRAME_MS), and lets it run at the display's pace again on pointer or key input.

    The Run tab has no timer: while nothing changes it asks /atelier/changes (a plain GET) and sends Gradio no
    event (each costs the browser 50-250 ms of script on this page); a run that appears is shown.

    A video family's sample (an MP4 with its first frame as a PNG beside it) is shown as the video, which the
    browser decodes and plays; the PNG is not listed twice."""
    from PIL import Image

    from trainer.events import EventWriter
    from webui.app import INPUT_ACTIVE_MS, LOOP_FRAME_MS
    url, ctx = app
    count_loop = """async (ms) => {
        let n = 0, on = true;
        const tick = () => { n++; if (on) requestAnimationFrame(tick); };
        requestAnimationFrame(tick);
        await new Promise(r => setTimeout(r, ms));
        on = false;
        return n;
    }"""
    with open_page(url, browser=chromium) as page:
        assert page.evaluate("window.atelierLoopFrameMs") == LOOP_FRAME_MS  # ran before Gradio's modules
        seen: list = []
        page.on("request", lambda r: seen.append((r.method, r.url)))
        show(page, "Runs")  # the last input
        touched = time.time()
        # the tab's first checks refresh it (Gradio events, sent a moment after the check that asked for them, and
        # a second check may find the refreshed choices); then the page settles: two checks go by without an event
        page.wait_for_function("window.atelierChangeWatch.last.run !== undefined", timeout=15000)
        first = len(seen)
        page.wait_for_timeout(max(0.0, touched + (INPUT_ACTIVE_MS + 500) / 1000 - time.time()) * 1000)
        idle = page.evaluate(count_loop, 2000)  # no input for INPUT_ACTIVE_MS
        assert idle <= 2000 // LOOP_FRAME_MS + 2, idle
        assert settled_at(page, seen, first, rounds=2, within=4) is not None, seen[first:]

        page.mouse.move(300, 300)
        page.mouse.move(320, 310)
        active = page.evaluate(count_loop, 2000)  # within INPUT_ACTIVE_MS of the moves
        # a painting hand gets the display's pace (~120 frames here; 7 a second is plenty of room on a busy box)
        assert active >= idle + 10, (idle, active)

        # a run of a video family another process started (put in place at once, written beside the runs)
        run = ctx.workspace / "a-video-run"
        (run / "samples").mkdir(parents=True)
        write_clip(run / "samples" / "step000004-p0.mp4")
        Image.new("RGB", (32, 32), (255, 0, 0)).save(run / "samples" / "step000004-p0.png")
        EventWriter(run / "events.jsonl").emit("started", total_steps=4)
        (ctx.workspace / "runs").mkdir(exist_ok=True)
        run.rename(ctx.workspace / "runs" / run.name)
        page.wait_for_function("document.querySelector('#run-status').innerText.includes('a-video-run')",
                               timeout=15000)
        video = page.locator("#sample-gallery video").first
        video.wait_for(state="attached", timeout=15000)
        assert page.locator("#sample-gallery img").count() == 0  # the first-frame PNG is not a second tile
        page.wait_for_function("document.querySelector('#sample-gallery video').readyState >= 2", timeout=15000)
        assert video.evaluate("v => v.duration") == pytest.approx(9 / 16, abs=0.1)
        video.evaluate("v => { v.muted = true; return v.play(); }")
        page.wait_for_function("document.querySelector('#sample-gallery video').currentTime > 0", timeout=15000)


def test_the_mask_painter_saves_what_was_painted(app, chromium):
    import numpy as np
    from PIL import Image
    url, ctx = app
    data = ctx.workspace / "cats"
    data.mkdir(parents=True)
    Image.new("RGB", (200, 150), (120, 60, 30)).save(data / "a.png")
    with open_page(url, height=1400, browser=chromium) as page:
        show(page, "Data", "Captions and masks")
        open_fold(page, "Mask painter")
        page.locator("#mask-folder textarea, #mask-folder input").first.fill(str(data))
        page.locator("#mask-open").click()
        page.wait_for_function("document.querySelector('#mask-note').innerText.includes('Editing')", timeout=20000)
        for _attempt in range(3):  # on a busy machine the editor may still be drawing the image at the first
            time.sleep(1.0)        # stroke, which then paints nothing (an all-black mask is saved): draw again
            canvas = page.locator("#mask-editor canvas").first
            canvas.wait_for(state="visible", timeout=20000)  # the editor is drawn a moment after the note
            box = canvas.bounding_box()
            cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            page.mouse.move(cx - 40, cy)
            page.mouse.down()
            page.mouse.move(cx + 40, cy, steps=10)  # a stroke across the middle of the image
            page.mouse.up()
            time.sleep(0.5)
            saved = data / "a-masklabel.png"
            saved.unlink(missing_ok=True)
            page.locator("#mask-save").click()
            page.wait_for_function("document.querySelector('#mask-note').innerText.includes('Saved')", timeout=20000)
            for _ in range(200):  # the note may still say Saved from the try before: wait for the file itself
                if saved.exists():
                    break
                time.sleep(0.1)
            if (np.asarray(Image.open(saved)) == 255).any():
                break
    mask = np.asarray(Image.open(data / "a-masklabel.png"))
    assert mask.shape == (150, 200) and set(np.unique(mask)) == {0, 255}  # the image's size, black and white
    assert mask[75, 100] == 255 and mask[0, 0] == 0 and mask[149, 199] == 0  # painted the middle, not the corners
    assert 0.01 < (mask == 255).mean() < 0.5

