"""Atelier's web UI: ``build_app(workspace)`` makes the page, ``main(argv)`` serves it.

The page is arranged by what a user does, in four tabs: *Train* (Quick start, then the config form generated from
``trainer.config``, the common settings first and the expert ones on its Advanced tab), *Runs* (the live run on
top, then the history, compare and the queue), *Data* (concepts, captions and masks) and *Tools* (convert, merge,
resize, sample). The UI process talks to the trainer only
through the config module, the ``python -m trainer`` CLI and the run folder, so it never imports
torch or diffusers and its first paint is fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import gradio as gr
import httpx
from gradio import networking, routes
from jinja2 import ChoiceLoader, DictLoader, TemplateNotFound
from starlette.middleware import Middleware

from trainer.config.load import PRESETS_DIR, preset_names
from trainer.host.paths import Confinement
from webui import changes, devices, family_parts, optimizer_memory, runner
from webui.context import AppContext
from webui.downloads import DOWNLOADS
from webui.filebrowser import FileBrowser, Roots
from webui.form import DATA_TABS, Form, load_outputs, load_updates
from webui.login import LoginGate, RateLimitedAuth
from webui.tabs import config_bar, extras, queue, quickstart, run, runs, tools
from webui.tensorboard import mount, stop_with_this_process

DEFAULT_WORKSPACE = runner.REPO_ROOT / "workspace"
SHARE_NO_AUTH_FLAG = "--share-without-auth-i-understand-anyone-with-the-link-can-run-code"

START_HERE = ("**Start here:** make the choices of **Quick start** below (or pick a **Preset** — `demo` trains a "
              "built-in tiny model offline in about a minute; `sd15-lora`, `sdxl-lora-16gb`, `flux-lora-24gb`… start "
              "from a real model — then check the settings below and your images on the **Data** tab), press "
              "**Check settings**, then **Start training**. Progress, samples and the result's download are on the "
              "**Runs** tab.")

CSS = """
.atl-field-error { outline: 2px solid #dc2626; border-radius: 8px; }
.atl-field-warning { outline: 2px solid #d97706; border-radius: 8px; }
.atl-field-error [data-testid="block-info"], .atl-field-warning [data-testid="block-info"],
.atl-field-error .info, .atl-field-warning .info { white-space: pre-line; }
.atl-status { padding: 10px 14px; border: 1px solid var(--border-color-primary); border-radius: 10px; }
.atl-bar { height: 10px; background: var(--neutral-200); border-radius: 5px; margin: 8px 0; overflow: hidden; }
.atl-bar > div { height: 100%; background: var(--color-accent); transition: width .5s; }
.atl-badge { padding: 2px 8px; border-radius: 999px; font-weight: 600; color: white; background: #6b7280; }
.atl-running, .atl-starting { background: #2563eb; } .atl-stopping { background: #d97706; }
.atl-finished { background: #16a34a; } .atl-stopped { background: #7c3aed; }
.atl-failed, .atl-died { background: #dc2626; }
.atl-note { margin-top: 6px; } .atl-err { color: #dc2626; }
.atl-logbox { max-height: 340px; overflow: auto; display: flex; flex-direction: column-reverse; }
.atl-log { font-size: 12px; white-space: pre-wrap; margin: 0; }
.atl-log-warn { color: #b45309; } .atl-log-err { color: #dc2626; font-weight: 600; }
.atl-browse { align-self: center; }
.atl-role { padding: 1px 8px; border-radius: 999px; font-size: 12px; font-weight: 600; color: white;
            background: #6b7280; }
.atl-role-validation { background: #0e7490; } .atl-role-regularisation { background: #7c3aed; }
.atl-role-prior_prediction { background: #b45309; }
.atl-card { padding: 8px 12px; margin-bottom: 8px; border: 1px solid var(--border-color-primary); border-radius: 10px; }
/* help text: Gradio's default grey (187,187,194) on white is 1.9:1; these are >= 7:1 in both themes */
.info-text, [data-testid="block-info"] + .info-text { color: #52525b !important; }
.dark .info-text { color: #a1a1aa !important; }
/* the four task tabs stand out; Train's settings tabs fit one row at 1024 px (Gradio moves what does not fit
   behind a "…" menu) */
#main-tabs > .tab-wrapper button { font-size: 16px; font-weight: 600; }
#train-tabs > .tab-wrapper button { padding-left: 7px; padding-right: 7px; font-size: 13.5px; }
"""


# Gradio's status trackers keep an elapsed-time requestAnimationFrame loop running after their event has ended (a
# tracker unmounted while "pending" never clears its timer flag; docs/performance.md "An idle page"): ~70 callbacks
# a second on an idle page, in every browser tab that shows it. FRAME_LOOP_SCRIPT slows down only *loops* on a page
# nobody touches: a frame requested from inside a frame callback, more than INPUT_ACTIVE_MS after the last pointer,
# key or wheel input, waits LOOP_FRAME_MS first. One-off frames (layout, a plot's redraw) come as usual, and while
# someone moves the pointer or types (painting a mask: the image editor's canvas runs its own loop) every loop runs
# at full speed. It must run before Gradio's modules take their copy of requestAnimationFrame, so
# :func:`install_early_script` puts it first in the served page's <head> (Gradio's own ``head=`` comes too late).
LOOP_FRAME_MS = 500
INPUT_ACTIVE_MS = 3000
FRAME_LOOP_SCRIPT = """<script>
(() => {
  const raf = window.requestAnimationFrame.bind(window), caf = window.cancelAnimationFrame.bind(window);
  const pending = new Map();
  let seq = 0, inFrame = false, lastInput = 0;
  for (const kind of ["pointerdown", "pointermove", "keydown", "wheel", "touchstart"]) {
    window.addEventListener(kind, () => { lastInput = performance.now(); }, {capture: true, passive: true});
  }
  window.requestAnimationFrame = (callback) => {
    const id = ++seq;
    const run = () => pending.set(id, raf((ts) => {
      pending.delete(id);
      inFrame = true;
      try { callback(ts); } finally { inFrame = false; }
    }));
    if (inFrame && performance.now() - lastInput > ACTIVE_MS) {
      pending.set(id, -setTimeout(run, LOOP_MS));  /* a loop re-arming itself on an untouched page */
    } else {
      run();
    }
    return id;
  };
  window.cancelAnimationFrame = (id) => {
    const handle = pending.get(id);
    if (handle === undefined) return;
    pending.delete(id);
    if (handle < 0) clearTimeout(-handle); else caf(handle);
  };
  window.atelierLoopFrameMs = LOOP_MS;
})();
</script>""".replace("LOOP_MS", str(LOOP_FRAME_MS)).replace("ACTIVE_MS", str(INPUT_ACTIVE_MS))


def install_early_script(script: str) -> bool:
    """Put ``script`` first in the <head> of the page Gradio serves (its index and share templates), before its
    module scripts run. Gradio renders the page from a Jinja template (``gradio.routes.templates``); this puts a
    copy with the script in front of its loader. False when a Gradio version serves no such template."""
    env = getattr(getattr(routes, "templates", None), "env", None)
    if env is None:
        return False
    original = getattr(env, "_atelier_original_loader", None) or env.loader
    sources = {}
    for name in ("frontend/index.html", "frontend/share.html"):
        try:
            text = original.get_source(env, name)[0]
        except TemplateNotFound:
            continue
        if "<head>" in text:
            sources[name] = text.replace("<head>", "<head>\n{% raw %}" + script + "{% endraw %}", 1)
    if not sources:
        return False
    env._atelier_original_loader = original
    env.loader = ChoiceLoader([DictLoader(sources), original])
    env.cache.clear() if env.cache is not None else None
    return True


def progress_on_few(demo: gr.Blocks) -> None:
    """Each event shows its progress on at most one component. Gradio's page, after every status message of any
    event, re-sends the loading status of every component some event has shown progress on since the page loaded,
    finding each one by a search of the whole component tree (~880 components here) and re-reading everything inside
    it. An event shows progress on all its outputs unless told otherwise, and the page's load event has the form's
    244 fields and the tab bar (the whole page) as outputs: each later event paid 0.3-0.45 s of script on a 2-core
    machine. An event whose progress is hidden now shows it on nothing; one that shows it, on the one component
    named where it is wired, else on its first output. (Events wired inside a ``gr.render`` are not here; they name
    their component where they are wired.)"""
    for fn in demo.fns.values():
        if fn.show_progress == "hidden":
            fn.show_progress_on = []
        elif fn.show_progress_on is None and len(fn.outputs) > 1:
            fn.show_progress_on = list(fn.outputs[:1])


def build_app(workspace: Optional[str | os.PathLike] = None, browse_roots: Sequence[str | os.PathLike] = (),
              manager: Optional[runner.RunManager] = None, start_scheduler: bool = True) -> gr.Blocks:
    """The whole page for one workspace. ``manager`` lets tests plug in a fake trainer."""
    workspace = Path(workspace or os.environ.get("ATELIER_WORKSPACE") or DEFAULT_WORKSPACE).expanduser().resolve()
    manager = manager or runner.RunManager(workspace)
    home = [h for h in (Path.home().resolve(),) if h != Path(h.anchor)]  # a home that is "/" would open the whole disk
    roots = Roots([workspace, *home, *browse_roots, PRESETS_DIR])  # where images and models usually are
    if manager.confinement is None:  # what the page starts stays in the page's folders (the presets read-only)
        manager.confinement = Confinement([workspace, *home, *browse_roots], read_only=[PRESETS_DIR])
    browser = FileBrowser(roots)
    ctx = AppContext(workspace=workspace, manager=manager, roots=roots, browser=browser)
    # results, samples and zips are streamed from where they lie, not copied into Gradio's cache (a fine-tune is
    # GBs); both folders are inside the workspace, which is served (behind the login) anyway
    gr.set_static_paths([str(runner.runs_root(workspace)), str(workspace / DOWNLOADS)])
    with gr.Blocks(title="Atelier") as demo:
        gr.Markdown("### Atelier — train text-to-image models", elem_id="title")
        ctx.form = Form(browser)
        gpus, _ = devices.detect_gpus()
        ctx.components["run_select"] = run.make_run_select(ctx)
        form_extras = extras.extras(ctx)
        with gr.Tabs(elem_id="main-tabs") as tabs:
            ctx.components["tabs"] = tabs
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                gr.Markdown(START_HERE, elem_id="start-here")
                quickstart.build(ctx, round(gpus[0].memory_mib / 1024) if gpus else None)
                config_bar.build(ctx)
                with gr.Tabs(elem_id="train-tabs") as train_tabs:
                    ctx.components["train_tabs"] = train_tabs
                    ctx.form.build(extras=form_extras, only=lambda tab: tab not in DATA_TABS)
            # the live run and everything about runs; its id is "run": Start, Resume and Watch select it
            with gr.Tab("Runs", id="run", elem_id="tab-runs") as runs_tab:
                run.build(ctx)
                with gr.Accordion("Run history: every run, its results, resume, compare", open=True,
                                  elem_id="runs-history"):
                    runs.build(ctx)
                with gr.Accordion("Queue: jobs waiting to run", open=True, elem_id="runs-queue"):
                    queue.build(ctx)
            with gr.Tab("Data", id="data", elem_id="tab-dataset"):
                with gr.Tabs(elem_id="data-tabs") as data_tabs:
                    ctx.components["data_tabs"] = data_tabs
                    ctx.form.build(extras=form_extras, only=lambda tab: tab in DATA_TABS)
                    with gr.Tab("Captions and masks", id="captions", elem_id="tab-captions"):
                        tools.build_data(ctx)
            with gr.Tab("Tools", id="tools", elem_id="tab-tools"):
                tools.build(ctx)
        browser.build()
        for wire in ctx.after_build:
            wire()
        config_bar.wire(ctx)
        optimizer_memory.wire(ctx)  # per-optimizer settings remembered; only the chosen one's fields shown
        ctx.handlers["method_tabs"] = ctx.form.wire_method_tabs()  # LoRA / Embedding follow training.method
        ctx.handlers["family_parts"] = family_parts.wire(ctx.form)  # the form follows the model's family
        refresh_runs, runs_outputs = ctx.components["runs_refresh"]
        # opening Runs takes 1-4 s in the browser on a loaded 2-core machine (the server's part: ~50 ms): the table
        # shows that it is being refreshed (docs/performance.md "Clicks on the page")
        runs_tab.select(refresh_runs, None, runs_outputs, show_progress="minimal",
                        show_progress_on=runs_outputs[:1]).then(
            *ctx.components["runs_details"], show_progress="hidden")
        # Start shows the Runs tab without a select event: its history then lists the new run too
        ctx.components["start_event"].then(refresh_runs, None, runs_outputs, show_progress="hidden")

        form = ctx.form
        # a reload lands where the user was: the top tab, and the sub-tab of Train and of Data
        remembered = {"tab": tabs, "train_tab": train_tabs, "data_tab": data_tabs}
        outs = load_outputs(form) + [ctx["preset"], *remembered.values(), ctx["quickstart"]]

        tab_ids = {key: {b.label: b.id for b in demo.blocks.values()
                         if isinstance(b, gr.Tab) and b.id and getattr(b, "parent", None) is bar}
                   for key, bar in remembered.items()}

        def remember(key: str) -> Callable[[gr.SelectData], None]:
            def remember_tab(evt: gr.SelectData) -> None:
                """A reload lands on the tab the user was on (the page keeps no state of its own)."""
                tab = tab_ids[key].get(str(evt.value))
                if tab:
                    config_bar.write_ui_state(ctx, **{key: tab})
            return remember_tab

        for key, bar in remembered.items():
            ctx.handlers["remember_" + key] = remember(key)
            bar.select(ctx.handlers["remember_" + key], None, None, show_progress="hidden", queue=False)

        def shown_tabs(state: dict) -> List[Any]:
            """The remembered tabs as updates; a tab this page no longer has is not asked for (a workspace from
            before the page was arranged by task remembers a settings tab as the top one: it opens inside Train
            or Data)."""
            state = dict(state)
            old = state.get("tab")
            for key in ("train_tab", "data_tab"):
                if old in tab_ids[key].values():
                    state.update({"tab": "train" if key == "train_tab" else "data", key: old})
            if old in ("runs", "queue"):
                state["tab"] = "run"
            return [gr.Tabs(selected=state[key]) if state.get(key) in tab_ids[key].values() else gr.skip()
                    for key in remembered]

        def on_load() -> List[Any]:
            """A new page (or a reload) shows the autosaved draft, the preset it came from, and the tabs the
            user was on."""
            values = config_bar.load_draft(ctx)
            state = config_bar.read_ui_state(ctx)
            preset = state.get("preset") if state.get("preset") in preset_names() else None
            presets = gr.Dropdown(choices=preset_names(), value=preset)
            shown = shown_tabs(state)
            if values is None:
                return [gr.skip()] * len(load_outputs(form)) + [presets, *shown, gr.skip()]
            return load_updates(form, values) + [presets, *shown, quickstart.folded(preset)]

        ctx.handlers["on_load"] = on_load
        # The page says when the load above has been applied: until then its tab updates may still switch the
        # tabs (the page's tests wait for this before they click one; a hand is slower than the first load).
        demo.load(on_load, None, outs, show_progress="hidden").then(
            None, None, None, js="() => { document.documentElement.dataset.atelierLoaded = '1'; }")
        demo.load(refresh_runs, None, runs_outputs, show_progress="hidden")
    progress_on_few(demo)
    if start_scheduler:
        manager.start_scheduler()
    demo.atelier = ctx  # type: ignore[attr-defined]  # tests and main() reach the context here
    return demo


LISTEN_NO_AUTH_WARNING = ("atelier: WARNING: --listen without --auth serves this page to every machine that can "
                          "reach this one, with no password; anyone on the network can start training runs and "
                          "read the workspace. Add --auth USER:PASS (or --auth-file FILE).")


def serve(demo: gr.Blocks, *, host: str = "127.0.0.1", port: Optional[int] = 7860, share: bool = False,
          auth: Optional[List[tuple]] = None, root_path: Optional[str] = None, inbrowser: bool = False,
          prevent_thread_lock: bool = False, quiet: bool = False) -> Any:
    """Launch with the settings the page needs (CSS, served run folders)."""
    ctx: AppContext = demo.atelier  # type: ignore[attr-defined]
    # Gradio 6 embeds the description of every endpoint (with server paths as defaults and choices) in the page it
    # serves, *before* login too (routes.py main(): gradio_api_info is rendered whatever the auth), and caches one
    # copy for all. For this page that is 2.9 MB (166 events, the form's ones with a few hundred inputs each) that
    # every page load sent and the browser parsed. The page's own events work without it (a page behind a login
    # has always been served without it), so the page describes no endpoints, with a login or without.
    demo.get_api_info = lambda all_endpoints=False: {"named_endpoints": {}, "unnamed_endpoints": {}}
    networking.url_ok = _patient_url_ok  # see below: a busy machine must not refuse to serve
    demo.queue(default_concurrency_limit=4)
    calm_queue(demo)
    install_early_script(FRAME_LOOP_SCRIPT + changes.WATCH_SCRIPT)
    message = "Atelier: sign in with the user and password given to --auth." if auth else None
    with contextlib.redirect_stdout(_OwnHint(sys.stdout)):  # Gradio's hint for a public link, in our words
        result = demo.launch(
            server_name=host, server_port=port, share=share, auth=RateLimitedAuth(auth).login if auth else None,
            root_path=root_path,
            # part of the app from its first request: routes Gradio serves without a login refuse one, and the login
            # check knows each client's address (webui/login.py)
            app_kwargs={"middleware": [Middleware(LoginGate, share=share, auth_message=message or "")]},
            # Gradio 6's run history copies every event's inputs and outputs into the browser's localStorage (a JSON
            # read and rewrite of up to 100 past calls per status message): with this form's hundreds of inputs, about
            # 11 % of a core in the browser's storage process and 15-20 % in the page while a run was shown
            # (docs/performance.md). Off: nothing of the form (paths, prompts) is kept in the browser either.
            run_history=False,
            inbrowser=inbrowser, prevent_thread_lock=True, quiet=quiet, show_error=True,
            allowed_paths=[str(p) for p in ctx.roots.paths], css=CSS,
            auth_message=message)
    changes.mount(demo.server_app, {"run": ctx.handlers["watch_run"], "queue": ctx.handlers["watch_queue"]})
    board = ctx.components.get("tensorboard")
    if board is not None:  # <page>/tensorboard/, behind the same login
        mount(demo.server_app, board)
    if not prevent_thread_lock:
        if board is not None:
            stop_with_this_process(board)  # SIGTERM / SIGHUP too, not only Ctrl-C
        try:
            demo.block_thread()
        finally:
            if board is not None:
                board.stop()
    return result


#: Gradio's own hint when it serves no public link, which speaks to a Python author
GRADIO_SHARE_HINT = "* To create a public link, set `share=True` in `launch()`."
SHARE_HINT = "* For a link other machines can open (a cloud pod, Colab): python3 launch.py --share --auth USER:PASS"


class _OwnHint:
    """Standard output while Gradio starts the server: everything passes, except Gradio's hint for a public link,
    which is given with launch.py's flags."""

    def __init__(self, out: Any):
        self.out = out

    def write(self, text: str) -> int:
        self.out.write(text.replace(GRADIO_SHARE_HINT, SHARE_HINT))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, encoding … of the real stream
        return getattr(self.out, name)


def calm_queue(demo: gr.Blocks, free_poll_s: float = 0.02, progress_poll_s: float = 0.1) -> None:
    """Gradio's event queue polls for work every 1 ms on Linux (10 ms for progress) even when nothing happens:
    2.3 % of a core for an idle page, with no browser open. Every 20 ms (100 ms for progress) costs a tenth of
    that and adds at most 20 ms before an event starts. (Private attributes of gradio.queueing.Queue: left
    alone when a Gradio version has none.)"""
    q = getattr(demo, "_queue", None)
    if q is not None and hasattr(q, "sleep_when_free"):
        q.sleep_when_free = max(float(q.sleep_when_free), free_poll_s)
    if q is not None and hasattr(q, "progress_update_sleep_when_free"):
        q.progress_update_sleep_when_free = max(float(q.progress_update_sleep_when_free), progress_poll_s)


def _patient_url_ok(url: str) -> bool:
    """Gradio checks that its own page answers before it serves, with one 3-second request that gives up on the
    first timeout; on a busy machine (a pod that is caching latents, a test run) that fails and launch refuses to
    start ("When localhost is not accessible, a shareable link must be created"). Ask for up to 30 s instead."""

    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.head(url, timeout=5, verify=False).status_code in (200, 401, 301, 302, 303, 307, 308):
                return True
        except (httpx.ConnectError, httpx.TimeoutException, ConnectionError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m webui", description="Atelier web UI.")
    p.add_argument("--workspace", default=None,
                   help=f"Folder for runs, queue and caches (default: $ATELIER_WORKSPACE or {DEFAULT_WORKSPACE}).")
    p.add_argument("--listen", action="store_true", help="Serve on 0.0.0.0 (all interfaces) instead of 127.0.0.1.")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="Also open a public gradio.live link (needs --auth).")
    p.add_argument(SHARE_NO_AUTH_FLAG, dest="share_without_auth", action="store_true",
                   help="Allow --share with no password. Anyone with the link can run code on this machine.")
    p.add_argument("--auth", action="append", default=[], metavar="USER:PASS",
                   help="Require a login (repeat for several users).")
    p.add_argument("--auth-file", default=None, help="A file of USER:PASS lines.")
    p.add_argument("--root-path", default=None, help="URL prefix when served behind a reverse proxy.")
    p.add_argument("--inbrowser", action="store_true", help="Open the page in the default browser.")
    p.add_argument("--browse-root", action="append", default=[], metavar="FOLDER",
                   help="Another folder the file browser may show (repeatable; the workspace and your home "
                        "folder always are).")
    return p.parse_args(argv)


def auth_pairs(items: Sequence[str], auth_file: Optional[str]) -> List[tuple]:
    """USER:PASS strings (and lines of a file) as (user, password) pairs; ValueError when malformed."""
    lines = list(items)
    if auth_file:
        text = Path(auth_file).expanduser().read_text(encoding="utf-8")
        lines += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    pairs = []
    for item in lines:
        user, sep, password = item.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"auth entry {item.split(':')[0]!r}… must look like user:password")
        pairs.append((user, password))
    return pairs


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        creds = auth_pairs(args.auth, args.auth_file)
    except (OSError, ValueError) as exc:
        print(f"atelier: {exc}", file=sys.stderr)
        return 2
    if args.share and not creds and not args.share_without_auth:
        print("atelier: refusing to --share without a password: anyone who gets the public link could run "
              "code on this machine through the trainer.\n"
              "  Add --auth USER:PASS (or --auth-file FILE), or, if you really mean it, pass\n"
              f"  {SHARE_NO_AUTH_FLAG}", file=sys.stderr)
        return 2
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if args.listen and not creds:
        print(LISTEN_NO_AUTH_WARNING, file=sys.stderr)
    demo = build_app(args.workspace, args.browse_root)
    ctx: AppContext = demo.atelier  # type: ignore[attr-defined]
    active = ctx.manager.active_runs()
    print(f"Atelier: workspace {ctx.workspace}" + (f"; reattached to running {active[0].name}" if active else ""))
    serve(demo, host="0.0.0.0" if args.listen else "127.0.0.1", port=args.port, share=args.share,
          auth=creds, root_path=args.root_path, inbrowser=args.inbrowser)
    return 0


__all__ = ["build_app", "serve", "main", "parse_args", "auth_pairs", "CSS"]
