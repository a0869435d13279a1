"""The live run, at the top of the Runs tab: progress, the loss chart beside the samples, the LR chart, the log
tail, Stop / Sample now / Backup now / Resume.

The tab shows the run folder (through the shared :class:`~webui.monitor.RunMonitor`), so the page holds no
state of its own: a reload, a second browser or a restarted UI shows the same run. It is refreshed when what it
would show changed (:mod:`webui.changes` asks for :func:`signature` and clicks the hidden refresh button), and
each output is only made and re-sent when its signature changed (``gr.skip()``), which keeps the gallery still; the
signatures are a few numbers and file stats, so asking for them costs the same at step 100 and at step 500,000.
"""

from __future__ import annotations

import html
import re
import time
from pathlib import Path
from typing import Any, List, Optional

import gradio as gr
import pandas as pd

from trainer.events import TERMINAL
from webui import runner
from webui.changes import signature
from webui.context import AUTO, AppContext
from webui.jobqueue import Job
from webui.tabs.config_bar import show_runs
from webui.downloads import human_size, result_file, zip_for_page
from webui.family_parts import run_part_labels
from webui.mdtext import md_escape, md_fence
from webui.monitor import RunView, format_duration, log_tail

STATE_WORDS = {"new": "Not started", "starting": "Starting…", "running": "Running", "stopping": "Stopping…",
               "finished": "Finished", "stopped": "Stopped", "failed": "Failed", "died": "Ended unexpectedly"}
WARN_RE = re.compile(r"warn", re.I)
ERR_RE = re.compile(r"error|traceback|exception|killed|out of memory|\bfailed\b", re.I)


def make_run_select(ctx: AppContext) -> gr.Dropdown:
    """Created unrendered before the tabs, so earlier tabs can point it at a run; rendered here."""
    return gr.Dropdown([AUTO] + ctx.run_names(), value=AUTO, label="Run", elem_id="run-select", scale=3,
                       allow_custom_value=True, render=False)


def build(ctx: AppContext) -> None:
    """The live-run panel. Laid out so that at 1440x900 the status, the loss and the newest samples are in view
    under the tab bar (ai-toolkit's job page: progress, loss and samples of one job on one screen)."""
    with gr.Row(equal_height=True):
        ctx["run_select"].render()
        stop = gr.Button("■ Stop", variant="stop", elem_id="stop-btn", scale=1)
        sample = gr.Button("Sample now", elem_id="sample-now-btn", scale=1)
        backup = gr.Button("Backup now", elem_id="backup-now-btn", scale=1)
        resume = gr.Button("Resume", elem_id="run-resume-btn", scale=1)
    status = gr.HTML(status_html(None), elem_id="run-status")
    action_msg = gr.Markdown(elem_id="run-action-msg")
    with gr.Row():
        loss_plot = gr.LinePlot(x="step", y="value", color="series", title="Loss", elem_id="loss-plot",
                                height=260, scale=1)
        with gr.Column(scale=1):
            gallery = gr.Gallery(label="Samples", columns=4, height=260, elem_id="sample-gallery",
                                 object_fit="contain")
            order = gr.Radio(["newest first", "by prompt"], value="newest first", show_label=False,
                             elem_id="sample-order")
    with gr.Row(equal_height=True, elem_id="run-downloads"):
        download = gr.DownloadButton("⬇ Download result", visible=False, elem_id="download-result", scale=2)
        make_zip = gr.Button("Zip this run (config, logs, samples, result)", elem_id="zip-run-btn", scale=2)
        zip_file = gr.DownloadButton("⬇ Download zip", visible=False, elem_id="download-zip", scale=2)
    lr_plot = gr.LinePlot(x="step", y="value", color="series", title="Learning rate", elem_id="lr-plot",
                          height=220)
    problems = gr.Markdown(elem_id="run-problems")
    log = gr.HTML(elem_id="run-log")
    seen = gr.State({})
    refresh = gr.Button("Refresh", visible="hidden", elem_id="run-refresh")  # clicked by webui.changes' script
    charts_of = gr.State("")  # the run the charts were last emptied for; its change draws them (below)

    outputs = [status, loss_plot, lr_plot, gallery, problems, log, download, stop, action_msg, charts_of, seen,
               ctx["run_select"]]

    def poll(selected: str, sample_order: str, last: dict) -> List[Any]:
        run_dir = ctx.resolve_watched(selected)
        view = ctx.monitor.view(run_dir) if run_dir else None
        new = dict(last or {})
        shown, before = (view.name if view is not None else ""), new.get("charts_of", "")
        new["charts_of"] = shown
        redraw = bool(before) and before != shown  # the charts hold another run's curves: emptied, drawn anew
        out: List[Any] = []
        for name, make, sig in parts(ctx, view, sample_order):  # an output is made only when it is sent
            if name in CHARTS and redraw:
                new.pop(name, None)  # emptied now; drawn by the poll that the change of charts_of starts
                out.append(None)
                continue
            if name == "action":
                clicked = new.get("action")
                if _click_settling(clicked, sig):
                    out.append(make())  # see with_fresh_action: cleared on every tick until the click is old
                    continue
                if isinstance(clicked, tuple) and len(clicked) == 3 and clicked[:2] == sig:
                    out.append(gr.skip())  # the run the click was for still runs: its message stays
                    continue
            if new.get(name) == sig:
                out.append(gr.skip())
            else:
                new[name] = sig
                out.append(make())
        out.append(shown if redraw else gr.skip())
        names = ctx.run_names()
        if new.get("names") != names:
            new["names"] = names
            out += [new, gr.Dropdown(choices=[AUTO] + names)]
        else:
            out += [new, gr.skip()]
        return out

    ctx.handlers["poll"] = poll
    refresh.click(poll, [ctx["run_select"], order, seen], outputs, show_progress="hidden", queue=False)
    # Gradio's native plot keeps the colour domain of the data it was first drawn with and afterwards only swaps
    # the data: switching from an SD run (UNet, text encoder) to a transformer run (Transformer) left the new
    # series undrawn under the old legend. As for the compare chart, the charts are emptied when the run shown
    # changes (by a pick, Start, Resume, or the newest run followed) and drawn anew by a second event, which only
    # a change from one run's curves to another's starts: the first draw of a page and the polls of one run's
    # steps stay one event each.
    charts_of.change(poll, [ctx["run_select"], order, seen], outputs, show_progress="hidden", queue=False)

    def watch(params: dict) -> tuple:
        """What the tab would show for these inputs, as signatures (for webui.changes), whether a run is active
        (the page then asks every second), and what changes with every step apart: its signature and the status
        line, which the page writes into the shown status itself (see webui.changes)."""
        selected = params.get("run") or AUTO
        run_dir = ctx.resolve_watched(selected)
        view = ctx.monitor.view(run_dir) if run_dir else None
        sigs = {name: sig for name, _, sig in parts(ctx, view, params.get("order") or "newest first")}  # none made
        slow = [sig for name, sig in sigs.items() if name not in EVERY_STEP]
        if view is not None:
            slow.append((view.name, view.state, view.message, view.warning_count))
        extra = {"tsig": signature([sigs[name] for name in EVERY_STEP])}
        if view is not None:
            extra["status"] = status_fields(view)
        return (slow, ctx.run_names()), bool(view is not None and view.active), extra

    ctx.handlers["watch_run"] = watch
    # a pick re-sends everything; the charts are emptied first only when the run they show changes
    ctx["run_select"].change(lambda s, o, last: poll(s, o, {"charts_of": (last or {}).get("charts_of", "")}),
                             [ctx["run_select"], order, seen], outputs, show_progress="hidden")
    order.change(lambda s, o, last: poll(s, o, {k: v for k, v in (last or {}).items() if k != "gallery"}),
                 [ctx["run_select"], order, seen], outputs, show_progress="hidden")

    def do_stop(selected: str) -> str:
        run_dir = ctx.resolve_watched(selected)
        return runner.stop(run_dir) if run_dir else "No run to stop."

    def do_action(selected: str, action: str) -> str:
        run_dir = ctx.resolve_watched(selected)
        return runner.request_action(run_dir, action) if run_dir else "No run."

    def do_zip(selected: str) -> List[Any]:
        run_dir = ctx.resolve_watched(selected)
        if run_dir is None:
            return ["No run to zip.", gr.DownloadButton(visible=False)]
        view = ctx.monitor.view(run_dir)
        try:
            path, message = zip_for_page(ctx.workspace, run_dir, view.outputs, ctx.roots.allowed)
        except OSError as exc:
            return [f"Could not write the zip: {exc}", gr.DownloadButton(visible=False)]
        return [message,
                gr.DownloadButton(f"⬇ {path.name} ({human_size(path.stat().st_size)})", value=str(path), visible=True)]

    make_zip.click(do_zip, [ctx["run_select"]], [action_msg, zip_file])
    ctx["run_select"].change(lambda _: gr.DownloadButton(visible=False), [ctx["run_select"]], [zip_file],
                             show_progress="hidden")
    ctx.handlers["zip_run"] = do_zip
    def with_fresh_action(selected: str, message: str, last: dict) -> List[Any]:
        """An action's message, and the poll told that the action line now shows a running run's message: a queued
        click answered after the poll saw the run end would otherwise leave "Stopping…" under a stopped run (the
        poll sends the line again only when its signature changes)."""
        run_dir = ctx.resolve_watched(selected)
        new = dict(last or {})
        if run_dir is not None:
            new["action"] = (run_dir.name, False, time.time())
        return [message, new]

    stop.click(lambda s, last: with_fresh_action(s, do_stop(s), last), [ctx["run_select"], seen], [action_msg, seen])
    sample.click(lambda s, last: with_fresh_action(s, do_action(s, "sample"), last), [ctx["run_select"], seen],
                 [action_msg, seen])
    backup.click(lambda s, last: with_fresh_action(s, do_action(s, "backup"), last), [ctx["run_select"], seen],
                 [action_msg, seen])

    def do_resume(selected: str) -> List[Any]:
        run_dir = ctx.resolve_watched(selected)
        if run_dir is None:
            return [NOTHING_CHOSEN, gr.skip(), gr.skip()]
        return resume_run_dir(ctx, run_dir)

    resume.click(do_resume, [ctx["run_select"]], [action_msg, ctx["run_select"], ctx["tabs"]], concurrency_limit=1)
    ctx.handlers["run_resume"] = do_resume
    ctx.components["run_action_msg"] = action_msg


ACTION_SETTLE_S = 10.0
CHARTS = ("loss", "lr")


# Resume is always clickable (a disabled button does not say why); when there is nothing to resume, the click
# answers why in one line
NOTHING_CHOSEN = "Nothing to resume: no run is chosen (no run yet, or pick one under **Run**)."


def resume_run_dir(ctx: AppContext, run_dir: Path) -> List[Any]:
    """Resume a stopped run from its last backup, into its own folder: [message, run chooser, tabs]. A finished run
    is not trained again (``--resume last`` would train its last stretch once more and overwrite the result)."""
    v = ctx.monitor.view(run_dir)
    name = run_dir.name
    if v.active or runner.process_alive(run_dir):
        return [f"Nothing to resume: **{name}** is still running.", gr.skip(), gr.skip()]
    if v.state == "finished":
        return [f"**{name}** finished at step {v.step}: there is nothing left to resume (to train longer: "
                "\"New run from this config\" with more epochs).", gr.skip(), gr.skip()]
    if not v.backups:
        return [f"Nothing to resume: **{name}** has no backup yet.", gr.skip(), gr.skip()]
    status, _, _ = ctx.manager.submit(Job(name=run_dir.name, kind="resume", run_dir=str(run_dir), resume="last"))
    if status == "started":
        return [f"Resuming **{run_dir.name}** from its last backup.", ctx.watch(run_dir.name), show_runs(ctx)]
    return [f"Another run is in progress: queued the resume of **{run_dir.name}**.", ctx.watch(AUTO),
            show_runs(ctx)]


def _click_settling(seen_action: Any, sig: Any) -> bool:
    """A Stop/Sample/Backup click less than ACTION_SETTLE_S ago, and the run has ended: the click's answer
    (queued) and a poll's (not queued) can reach the page in either order, so a "Stopping…" could land after
    the poll that cleared it; the poll clears the line on every tick until the click is old."""
    ended = sig == "none" or (isinstance(sig, tuple) and bool(sig[-1]))
    return (ended and isinstance(seen_action, tuple) and len(seen_action) == 3
            and time.time() - float(seen_action[2]) < ACTION_SETTLE_S)


def parts(ctx: AppContext, view: Optional[RunView], order: str) -> List[tuple]:
    """(name, function making the value, signature) for each live output. The signatures cost a few numbers and
    file stats (the change check asks for them every second); a value is made only when its signature changed."""
    if view is None:
        none = [("status", lambda: status_html(None)), ("loss", lambda: None), ("lr", lambda: None),
                ("gallery", lambda: []), ("problems", lambda: ""), ("log", lambda: ""),
                ("download", lambda: gr.DownloadButton(visible=False)),
                ("stop", lambda: gr.Button(variant="secondary", interactive=False)), ("action", lambda: "")]
        return [(name, make, "none") for name, make in none]
    sig = (view.name, view.version, view.state)
    return [("status", lambda: status_html(view), (sig, view.step, view.message)),
            ("loss", lambda: loss_frame(view),
             (view.name, view.loss_count, view.loss_points[-1:] if view.loss_points else 0)),
            ("lr", lambda: lr_frame(view), (view.name, view.lr_count)),
            ("gallery", lambda: gallery_items(view, order), (view.name, order, view.samples_key)),
            ("problems", lambda: problems_md(view), (sig, view.message, view.warning_count)),
            ("log", lambda: log_html(log_tail(view.path)), (view.name, log_key(view.path))),
            ("download", lambda: download_button(view, ctx.roots.allowed), (view.name, tuple(view.outputs))),
            # Stop is red and clickable only while there is something to stop
            ("stop", lambda: gr.Button(variant="stop" if view.active else "secondary", interactive=view.active),
             (view.name, view.active)),
            # "Stopping… press Stop again" and the like belong to one run while it runs: cleared when it ends or
            # another run is shown
            ("action", lambda: "", (view.name, view.state in TERMINAL or view.state in ("died", "new")))]


def log_key(run_dir: Path) -> tuple:
    """Size and mtime of the logs the tab shows the end of: they change when a line is written."""
    out = []
    for name in ("train.log", runner.PROCESS_LOG):
        try:
            st = (run_dir / name).stat()
            out.append((st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def download_button(view: RunView, served=lambda p: True) -> Any:
    """The Run tab's result download: the newest saved file. A folder result (diffusers fine-tune), or one
    saved outside the folders this page serves (output.path elsewhere), is taken home as the zip."""
    path = result_file(view.outputs)
    if path is None or not served(path):
        return gr.DownloadButton(visible=False)
    return gr.DownloadButton(f"⬇ Download {path.name} ({human_size(path.stat().st_size)})", value=str(path),
                             visible=True)


# What changes with a run's every step: the page updates the status line in place (webui.changes) and sends Gradio
# the refresh of these at most every few seconds; anything else that changes (a sample, the state, a warning, the
# saved file) is sent at once.
EVERY_STEP = ("status", "loss", "lr", "log", "problems")


def status_fields(view: RunView) -> dict:
    """The parts of status_html that move with each step, for the page to write into the shown status (only when it
    shows the same run in the same state)."""
    pct, line = _status_line(view)
    return {"run": view.name, "state": view.state, "step": view.step, "pct": pct, "line": line}


def _status_line(view: RunView) -> tuple:
    pct = round(100 * view.progress, 1)
    total = view.total_steps or "?"
    bits = [f"step <b>{view.step} / {total}</b>", f"epoch {view.epoch}"]
    if view.loss is not None:
        bits.append(f"loss {view.loss:.4g}")
    if view.it_s:
        bits.append(f"{view.it_s:.2f} it/s")
    if view.active and view.eta_s is not None:
        bits.append(f"ETA {format_duration(view.eta_s)}")
    return pct, " · ".join(bits)


def status_html(view: Optional[RunView]) -> str:
    if view is None:
        return ('<div class="atl-status" data-state="none">No runs yet. Choose a preset, then press '
                '<b>Start training</b>.</div>')
    pct, line = _status_line(view)
    extra = ""
    if view.state == "stopped" and view.backups:
        extra = (f'<div class="atl-note">Backup: <code>{html.escape(Path(view.backups[-1]).name)}</code> — '
                 '<b>Resume</b> continues from it.</div>')
    if view.state in ("failed", "died") and view.message:
        extra = f'<div class="atl-note atl-err">{html.escape(view.message.splitlines()[0])}</div>'
    if view.state == "finished" and view.outputs:
        extra = f'<div class="atl-note">Saved: <code>{html.escape(view.outputs[-1])}</code></div>'
    return (f'<div class="atl-status" data-state="{view.state}" data-step="{view.step}" '
            f'data-total="{view.total_steps}" data-run="{html.escape(view.name)}">'
            f'<span class="atl-badge atl-{view.state}">{STATE_WORDS.get(view.state, view.state)}</span> '
            f'<b>{html.escape(view.name)}</b>'
            f'<div class="atl-bar"><div style="width:{pct}%"></div></div>'
            f'<div class="atl-line">{line}</div>{extra}</div>')


def chart_frames(view: RunView) -> tuple[Optional[pd.DataFrame], Optional[pd.DataFrame]]:
    """Loss (raw + smoothed) and LR frames for gr.LinePlot, from the view's bounded curves (a few hundred points
    whatever the run's length); None while there is no data, because a plot first given an empty frame types its
    colour column wrongly and never draws lines."""
    return loss_frame(view), lr_frame(view)


def loss_frame(view: RunView) -> Optional[pd.DataFrame]:
    if not view.loss_points:
        return None
    rows = [(s, v, "loss") for s, v in view.loss_points] + [(s, v, "smoothed") for s, v in view.smooth_points]
    return pd.DataFrame(rows, columns=["step", "value", "series"])


def lr_frame(view: RunView) -> Optional[pd.DataFrame]:
    """The learning rate of each optimizer group, named as the run's family names the part (a transformer's
    group is "Transformer", not the trainer's slot name "unet")."""
    if not view.lr_points:
        return None
    names = run_part_labels(view.path)
    return pd.DataFrame([(s, v, names.get(g, g)) for s, g, v in view.lr_points], columns=["step", "value", "series"])


def gallery_items(view: RunView, order: str, limit: int = 48) -> List[tuple]:
    samples = list(view.samples)
    if order == "by prompt":
        samples.sort(key=lambda s: (s.prompt_index, -s.step))
    else:
        samples.sort(key=lambda s: (-s.step, s.prompt_index))
    return [(s.path, s.caption) for s in samples[:limit]]


def problems_md(view: RunView) -> str:
    """The Run tab's problem list (Markdown): the failure, what to try, the last warnings. Every message comes from
    the trainer or the run folder and may name files (``photo <1>.png``), so each is escaped to show as it is."""
    lines = []
    if view.state in ("failed", "died") and view.message:
        title = "The run failed" if view.state == "failed" else "The trainer stopped unexpectedly"
        lines.append(f"### Error: {title}\n{md_escape(view.message)}")
        if view.traceback:
            lines.append("<details><summary>Traceback</summary>\n\n" + md_fence(view.traceback[-4000:]) +
                         "\n</details>")
        lines.append("Last log lines are below.")
    if view.advice:
        lines.append(f"**What to try:** {md_escape(view.advice)}")
    for w in view.warnings[-10:]:
        lines.append(f"- Warning: {md_escape(w)}")
    return "\n\n".join(lines)


def log_html(text: str) -> str:
    out = []
    for line in text.splitlines():
        esc = html.escape(line)
        if ERR_RE.search(line):
            out.append(f'<span class="atl-log-err">{esc}</span>')
        elif WARN_RE.search(line):
            out.append(f'<span class="atl-log-warn">{esc}</span>')
        else:
            out.append(esc)
    body = "\n".join(out) or "(no log yet)"
    return ('<details open><summary>Log (last lines)</summary><div class="atl-logbox">'
            f'<pre class="atl-log">{body}</pre></div></details>')
