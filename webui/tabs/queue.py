"""The Queue tab: configs waiting to run one after another; reorder and cancel them.

The queue lives in ``<workspace>/queue.json`` and the run manager's scheduler thread starts the
next job when the trainer is idle, with or without a browser open.
"""

from __future__ import annotations

from typing import Any, List, Optional

import gradio as gr
import pandas as pd

from webui.changes import signature
from webui.context import AppContext
from webui.monitor import age, format_duration
from webui.tabs.run import STATE_WORDS


def queue_frame(ctx: AppContext) -> pd.DataFrame:
    rows = [[i + 1, j.name, j.describe(), age(j.added), j.id] for i, j in enumerate(ctx.manager.queue.list())]
    return pd.DataFrame(rows, columns=["#", "name", "what", "added", "id"])


def choices(ctx: AppContext) -> List[tuple]:
    return [(f"{i + 1}. {j.name}", j.id) for i, j in enumerate(ctx.manager.queue.list())]


def now_running(ctx: AppContext) -> str:
    """The running job with its progress (from the run folder's summary: a few numbers), or that none runs; and
    the scheduler's last failure to start a job, until a job starts again."""
    active = ctx.manager.active_runs()
    if active:
        v = ctx.monitor.row(active[0])
        bits = [f"step {v.step} / {v.total_steps or '?'}"]
        if v.total_steps:
            bits[0] += f" ({100 * v.progress:.0f} %)"
        if v.loss is not None:
            bits.append(f"loss {v.loss:.4g}")
        if v.eta_s is not None:
            bits.append(f"ETA {format_duration(v.eta_s)}")
        text = f"Running now: **{v.name}** — {STATE_WORDS.get(v.state, v.state)}, " + " · ".join(bits)
    else:
        text = "Nothing is running."
    if ctx.manager.last_error:
        text += f"\n\nWarning: {ctx.manager.last_error}"
    return text


def build(ctx: AppContext) -> None:
    running = gr.Markdown(now_running(ctx), elem_id="queue-running")
    table = gr.Dataframe(queue_frame(ctx), interactive=False, elem_id="queue-table")
    with gr.Row(equal_height=True):
        # allow_custom_value: the chosen job may leave the queue (started, cancelled in another tab) between the
        # page's last refresh and a click; Gradio would refuse such a value with a server error
        pick = gr.Dropdown(choices(ctx), value=None, label="Job", elem_id="queue-pick", scale=3, allow_custom_value=True)
        up = gr.Button("Move up", elem_id="queue-up", scale=1)
        down = gr.Button("Move down", elem_id="queue-down", scale=1)
        cancel = gr.Button("Cancel job", variant="stop", elem_id="queue-cancel", scale=1)
    msg = gr.Markdown(elem_id="queue-msg")
    refresh_btn = gr.Button("Refresh", visible="hidden", elem_id="queue-refresh")  # clicked by webui.changes
    seen = gr.State(None)

    def refresh(selected: Optional[str], last: Any) -> List[Any]:
        frame = queue_frame(ctx)
        sig = (frame.to_json(), now_running(ctx))
        if sig == last:
            return [gr.skip(), gr.skip(), gr.skip(), last]
        ids = [c[1] for c in choices(ctx)]
        return [sig[1], frame, gr.Dropdown(choices=choices(ctx), value=selected if selected in ids else None), sig]

    refresh_btn.click(refresh, [pick, seen], [running, table, pick, seen], show_progress="hidden", queue=False)
    def watch(params: dict) -> tuple:
        """For webui.changes: the queue and which job runs; the running job's progress, which moves with each step,
        apart (the page refreshes for it at most every few seconds)."""
        active = ctx.manager.active_runs()
        shown = [(row.name, row.state) for row in map(ctx.monitor.row, active[:1])]
        return ((queue_frame(ctx).to_json(), shown, ctx.manager.last_error), bool(active),
                {"tsig": signature(now_running(ctx))})

    ctx.handlers["watch_queue"] = watch

    def gone(job_id: Optional[str]) -> str:
        if not job_id:
            return "Pick a job first."
        return "That job is no longer waiting: it has started (see the Run tab) or was cancelled."

    def move(job_id: Optional[str], delta: int) -> List[Any]:
        queued = {j.id for j in ctx.manager.queue.list()}
        note = ""
        if job_id in queued:
            ctx.manager.queue.move(job_id, delta)
        else:
            note = gone(job_id)
        return refresh(job_id, None) + [note]

    def drop(job_id: Optional[str]) -> List[Any]:
        job = next((j for j in ctx.manager.queue.list() if j.id == job_id), None)
        note = f"Cancelled **{job.name}**." if job is not None and ctx.manager.queue.remove(job.id) else gone(job_id)
        return refresh(None, None) + [note]

    outs = [running, table, pick, seen, msg]
    up.click(lambda j: move(j, -1), [pick], outs)
    down.click(lambda j: move(j, +1), [pick], outs)
    cancel.click(drop, [pick], outs)
    ctx.handlers.update(queue_move=move, queue_drop=drop)
