"""The Run and Queue tabs update when something changed, not on a timer.

Why: every Gradio event costs the browser ~50-250 ms of script on this page (Gradio's front end walks its whole
component tree for each one; a CDP profile of the idle Queue tab spent most of its time in core's node lookup),
so a ``gr.Timer`` ticking every 1-5 s kept an idle page at 5-10 % of a core. Instead, a few lines of the page's
first script (:data:`WATCH_SCRIPT`) ask ``<page>/atelier/changes`` — a plain request, no Gradio event — what the
shown tab would display now, as one short signature, and click the tab's hidden refresh button only when it
differs from the last one. The signature is computed by the same code that renders the tab (``parts`` of
``webui.tabs.run``, the queue's table), so nothing that would change the page is missed: a new step, sample or
log line, a run that ended or died, another run started from the CLI, a job queued in another browser. A click
that opens a watched tab asks at once, so the tab shows what is current when it opens, not up to a tick later.

What moves with every step of a running run (the status line, the loss and learning-rate charts, the log) has a
signature of its own: on a step alone the script writes the step, the progress bar and the status line into the
shown status itself and clicks the refresh at most every EVERY_STEP_MS, so watching a run costs the browser a Gradio
event every few seconds instead of one or two a second (with the queue's progress line, throttled the same way).
`bench/idle_page.py --live`: the browser at 91 % of a core while the demo trained, 43 % with this and Gradio's run
history off, 27 % with each event's progress on one component (webui.app.progress_on_few; docs/performance.md).
A new sample, another state, a warning or the saved file still refresh at once.

The request is answered behind the page's login (Gradio's session cookie), like the TensorBoard route.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.routing import Route

PATH = "/atelier/changes"
ACTIVE_POLL_MS = 1000  # a run is active: ask once a second
IDLE_POLL_MS = 3000  # nothing runs: a request every 3 s costs the browser next to nothing (no Gradio event)
AFTER_CLICK_MS = 11000  # after Stop / Sample now / Backup now: refresh on every ask (see webui.tabs.run)
EVERY_STEP_MS = 5000  # what changes with each step (loss chart, log) is refreshed at most this often

# view name -> function(query params) -> (signature parts, active?[, more of the answer: "tsig" and "status"])
Watcher = Callable[[Dict[str, str]], Tuple[Any, ...]]


def signature(parts: Any) -> str:
    return hashlib.sha1(repr(parts).encode("utf-8", "replace")).hexdigest()[:16]


def logged_in(app: Any, request: Any) -> bool:
    """The same check as Gradio's own routes: no login configured, or a valid session cookie."""
    if not getattr(app, "auth", None):
        return True
    cookie_id = getattr(app, "cookie_id", "")
    token = request.cookies.get(f"access-token-{cookie_id}") or \
        request.cookies.get(f"access-token-unsecure-{cookie_id}")
    return bool(getattr(app, "tokens", {}).get(token))


def mount(app: Any, watchers: Dict[str, Watcher]) -> None:
    """Add ``GET /atelier/changes?view=run|queue&…`` to the served app, first in line."""

    async def changes(request: Request) -> JSONResponse:
        if not logged_in(app, request):
            return JSONResponse({"error": "not logged in"}, status_code=401)
        params = dict(request.query_params)
        watch = watchers.get(params.get("view", ""))
        if watch is None:
            return JSONResponse({"error": f"unknown view; one of {sorted(watchers)}"}, status_code=400)
        parts, active, *extra = await run_in_threadpool(watch, params)
        answer = {"sig": signature(parts), "active": bool(active)}
        if extra:
            answer.update(extra[0])
        return JSONResponse(answer, headers={"Cache-Control": "no-store"})

    app.router.routes[0:0] = [Route(PATH, changes, methods=["GET"])]


# The page side: for each watched tab shown, ask for its signature; on a change, click its hidden refresh button.
# Selectors are the tabs' elem_ids; the query carries the tab's inputs (the chosen run, the sample order).
WATCH_SCRIPT = """<script>
(() => {
  const views = [
    {view: "run", shown: "#run-status", button: "#run-refresh",
     query: () => ({run: document.querySelector("#run-select input")?.value ?? "",
                    order: document.querySelector("#sample-order input:checked")?.value ?? ""}),
     clicks: ["#stop-btn", "#sample-now-btn", "#backup-now-btn"]},
    {view: "queue", shown: "#queue-table", button: "#queue-refresh", query: () => ({}), clicks: []},
  ];
  const last = {}, lastStep = {}, sentAt = {}, forceUntil = {}, shownAtAsk = {};
  /* the status line of the run shown, written in place: a step is no Gradio event (an event is the dearest thing
     this page does: Gradio's front end re-reads the components events showed progress on, see progress_on_few) */
  const writeStatus = (s) => {
    const el = document.querySelector("#run-status .atl-status");
    if (!el || el.dataset.run !== s.run || el.dataset.state !== s.state || Number(el.dataset.step) > s.step) return;
    el.dataset.step = String(s.step);
    const fill = el.querySelector(".atl-bar > div"), line = el.querySelector(".atl-line");
    if (fill) fill.style.width = s.pct + "%";
    if (line) line.innerHTML = s.line;
  };
  let active = false, timer = 0, asking = false, again = false;
  const visible = (sel) => { const el = document.querySelector(sel); return !!el && el.offsetParent !== null; };
  /* a watched tab just opened (the Runs tab clicked): ask now, not at the next tick up to IDLE_MS later */
  const poke = () => {
    if (!views.some((v) => visible(v.shown) && !shownAtAsk[v.view])) return;
    if (asking) { again = true; return; }
    clearTimeout(timer);
    ask();
  };
  document.addEventListener("click", (e) => {
    for (const v of views) {
      if (v.clicks.some((sel) => e.target.closest?.(sel))) forceUntil[v.view] = performance.now() + AFTER_CLICK;
    }
    for (const ms of [50, 300]) setTimeout(poke, ms);  /* the tab's content is drawn a moment after the click */
  }, true);
  async function ask() {
    asking = true;
    let anyActive = false;
    for (const v of views) {
      shownAtAsk[v.view] = visible(v.shown);
      if (!shownAtAsk[v.view]) { continue; }
      const params = new URLSearchParams({view: v.view, ...v.query()});
      try {
        let root = (window.gradio_config && window.gradio_config.root) || "";  /* --root-path, proxies */
        if (root && !root.endsWith("/")) root += "/";
        const base = new URL(root || ".", document.baseURI);
        const r = await fetch(new URL("atelier/changes?" + params, base), {credentials: "same-origin",
                                                                         cache: "no-store"});
        if (!r.ok) continue;
        const {sig, active: on, tsig, status} = await r.json();
        anyActive = anyActive || on;
        const now = performance.now(), forced = now < (forceUntil[v.view] || 0);
        const button = document.querySelector(v.button);
        if (sig !== last[v.view] || forced) {
          if (button) { last[v.view] = sig; lastStep[v.view] = tsig; sentAt[v.view] = now; button.click(); }
        } else if (tsig !== lastStep[v.view]) {
          if (status) writeStatus(status);
          if (button && now - (sentAt[v.view] || 0) >= EVERY_STEP_MS) {
            lastStep[v.view] = tsig; sentAt[v.view] = now; button.click();
          }
        }
      } catch (err) { /* the server restarts or the network hiccups: ask again next time */ }
    }
    active = anyActive;
    asking = false;
    timer = setTimeout(ask, again ? 0 : active ? ACTIVE_MS : IDLE_MS);
    again = false;
  }
  timer = setTimeout(ask, 500);
  window.atelierChangeWatch = {active: () => active, last};
})();
</script>""".replace("AFTER_CLICK", str(AFTER_CLICK_MS)).replace("ACTIVE_MS", str(ACTIVE_POLL_MS)) \
    .replace("EVERY_STEP_MS", str(EVERY_STEP_MS)) \
    .replace("IDLE_MS", str(IDLE_POLL_MS))


__all__ = ["PATH", "WATCH_SCRIPT", "logged_in", "mount", "signature"]
