"""The run history, below the live run on the Runs tab: every run folder with its state, config, outputs, loss
curve and samples; "watch" (shows it in the live panel above), "new run from this config" and "resume"
(``--resume last`` into the same folder); compare runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, List, Optional

import gradio as gr
import pandas as pd

from trainer.config.checks import load_config
from trainer.errors import ConfigError
from webui import runner
from webui.context import AUTO, AppContext
from webui.downloads import DOWNLOADS, human_size, zip_for_page
from webui.form import load_outputs, load_updates
from webui.monitor import age
from webui.tabs.config_bar import show_runs, write_draft
from webui.tabs.run import STATE_WORDS, chart_frames, download_button, gallery_items, resume_run_dir

COLUMNS = ["run", "state", "steps", "last loss", "started", "backups", "outputs"]


def runs_table(ctx: AppContext) -> pd.DataFrame:
    """One row a run, from each run's kept summary (the trainer's, then only the events since): never a whole
    events file once a run has been read, however long it is."""
    rows = []
    for d in runner.list_run_dirs(ctx.workspace):
        v = ctx.monitor.row(d)
        rows.append([v.name, STATE_WORDS.get(v.state, v.state), f"{v.step}/{v.total_steps or '?'}",
                     "" if v.loss is None else f"{v.loss:.4g}", age(v.started_at), len(v.backups),
                     ", ".join(Path(p).name for p in v.outputs)])
    return pd.DataFrame(rows, columns=COLUMNS)


def build(ctx: AppContext) -> None:
    with gr.Row():
        refresh = gr.Button("Refresh", size="sm", scale=0, elem_id="runs-refresh")
    # filled when a page loads and when the tab is chosen (app.py): building the page reads no run
    table = gr.Dataframe(pd.DataFrame([], columns=COLUMNS), interactive=False, elem_id="runs-table", wrap=True)
    with gr.Row(equal_height=True):
        pick = gr.Dropdown(ctx.run_names(), label="Run", elem_id="runs-pick", scale=3)
        watch = gr.Button("Show above", scale=1, elem_id="runs-watch")
        reuse = gr.Button("New run from this config", scale=1, elem_id="runs-reuse")
        resume = gr.Button("Resume", variant="primary", scale=1, elem_id="runs-resume")
    msg = gr.Markdown(elem_id="runs-msg")
    summary = gr.Markdown(elem_id="runs-summary")
    with gr.Row(equal_height=True):
        result_dl = gr.DownloadButton("⬇ Download result", visible=False, elem_id="runs-download-result", scale=2)
        make_zip = gr.Button("Zip this run", elem_id="runs-zip-btn", scale=1)
        zip_dl = gr.DownloadButton("⬇ Download zip", visible=False, elem_id="runs-download-zip", scale=2)
        delete = gr.Button("Delete run…", variant="stop", elem_id="runs-delete", scale=1)
    armed = gr.State("")  # the run a first press of Delete asked about; a second press deletes it
    with gr.Row():
        loss = gr.LinePlot(x="step", y="value", color="series", title="Loss", height=240, elem_id="runs-loss")
        cfg_view = gr.Code(language="yaml", label="config.yaml", elem_id="runs-config", max_lines=30)
    gallery = gr.Gallery(label="Samples", columns=6, height=300, elem_id="runs-gallery")
    with gr.Accordion("Compare runs", open=False, elem_id="runs-compare"):
        chosen = gr.Dropdown(ctx.run_names(), value=[], multiselect=True, label="Runs to compare",
                             elem_id="compare-pick")
        compare_loss = gr.LinePlot(x="step", y="value", color="series", title="Smoothed loss", height=260,
                                   elem_id="compare-loss")
        compare_gallery = gr.Gallery(label="Samples: each prompt's newest sample of each run, side by side",
                                     columns=4, height=360, elem_id="compare-gallery", object_fit="contain")

    def compare(names: Optional[List[str]]) -> List[Any]:
        views = [ctx.monitor.view(d) for d in (ctx.run_dir(n) for n in names or []) if d is not None]
        return [compare_frame(views), compare_samples(views)]

    # the chart is emptied first and then drawn anew: Gradio 6's native plot keeps the colour domain of the data it
    # was first drawn with and only swaps the data after that, so a run picked second was on the axes but never drawn
    chosen.change(lambda: None, None, [compare_loss], show_progress="hidden", queue=False).then(
        compare, [chosen], [compare_loss, compare_gallery], show_progress="hidden")
    ctx.handlers["compare_runs"] = compare

    def refresh_all() -> List[Any]:
        """The table and the run lists as they are now; the last click's message ("Resuming …", "Deleted …")
        goes: it answered that click, and the table and the details now show what came of it."""
        return [runs_table(ctx), gr.Dropdown(choices=ctx.run_names()), gr.Dropdown(choices=ctx.run_names()), ""]

    refresh_event = refresh.click(refresh_all, None, [table, pick, chosen, msg])
    ctx.components["runs_refresh"] = (refresh_all, [table, pick, chosen, msg])

    def details(name: Optional[str]) -> List[Any]:
        run_dir = ctx.run_dir(name or "")
        hidden = gr.DownloadButton(visible=False)
        if run_dir is None:
            return ["", None, "", [], hidden, hidden]
        v = ctx.monitor.view(run_dir)
        text = [f"**{v.name}** — {STATE_WORDS.get(v.state, v.state)}, step {v.step}/{v.total_steps or '?'}",
                f"Folder: `{run_dir}`"]
        if v.message:
            text.append(v.message)
        if v.advice:
            text.append(f"**What to try:** {v.advice}")
        text += [f"- output: `{p}`" for p in v.outputs] + [f"- backup: `{p}`" for p in v.backups]
        try:
            config_text = (run_dir / "config.yaml").read_text(encoding="utf-8")
        except OSError:
            config_text = ""
        loss_df, _ = chart_frames(v)
        return ["\n\n".join(text), loss_df, config_text, gallery_items(v, "newest first", 24),
                download_button(v, ctx.roots.allowed), hidden]

    detail_outputs = [summary, loss, cfg_view, gallery, result_dl, zip_dl]
    pick.change(details, [pick], detail_outputs)
    # the dropdown starts on the newest run (Gradio selects the first choice): show that run's details when the
    # tab opens or the list is refreshed, not only after another run is picked
    ctx.components["runs_details"] = (details, [pick], detail_outputs)

    def zip_picked(name: Optional[str]) -> List[Any]:
        run_dir = ctx.run_dir(name or "")
        if run_dir is None:
            return ["Pick a run first.", gr.DownloadButton(visible=False)]
        try:
            path, message = zip_for_page(ctx.workspace, run_dir, ctx.monitor.view(run_dir).outputs, ctx.roots.allowed)
        except OSError as exc:
            return [f"Could not write the zip: {exc}", gr.DownloadButton(visible=False)]
        return [message,
                gr.DownloadButton(f"⬇ {path.name} ({human_size(path.stat().st_size)})", value=str(path), visible=True)]

    make_zip.click(zip_picked, [pick], [msg, zip_dl])

    def delete_run(name: Optional[str], asked: str) -> List[Any]:
        """First press: say what goes and ask again; second press on the same run: delete its folder (and zip)."""
        run_dir = ctx.run_dir(name or "")
        if run_dir is None:
            return ["Pick a run first.", "", gr.skip(), gr.skip(), gr.Button("Delete run…")]
        v = ctx.monitor.view(run_dir)
        if v.active or runner.process_alive(run_dir):
            return ["This run is still running: stop it first.", "", gr.skip(), gr.skip(), gr.Button("Delete run…")]
        if any(j.run_dir and Path(j.run_dir) == run_dir for j in ctx.manager.queue.list()):
            return ["A queued job resumes this run: cancel it on the Queue tab first.", "", gr.skip(), gr.skip(),
                    gr.Button("Delete run…")]
        if asked != run_dir.name:
            size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
            what = f"{len(v.backups)} backup(s), {len(v.outputs)} result(s), {len(v.samples)} sample(s)"
            return [f"Delete **{run_dir.name}** ({human_size(size)}: {what})? This cannot be undone. Press "
                    "**Delete now** to delete it.", run_dir.name, gr.skip(), gr.skip(), gr.Button("Delete now")]
        try:
            shutil.rmtree(run_dir)
        except OSError as exc:
            return [f"Could not delete {run_dir}: {exc}", "", gr.skip(), gr.skip(), gr.Button("Delete run…")]
        (ctx.workspace / DOWNLOADS / f"{runner.slug(run_dir.name)}.zip").unlink(missing_ok=True)
        return [f"Deleted **{run_dir.name}**.", "", runs_table(ctx), gr.Dropdown(choices=ctx.run_names(), value=None),
                gr.Button("Delete run…")]

    delete.click(delete_run, [pick, armed], [msg, armed, table, pick, delete])
    pick.change(lambda _: ("", gr.Button("Delete run…")), [pick], [armed, delete], show_progress="hidden")
    refresh_event.then(details, [pick], detail_outputs, show_progress="hidden")
    def select_row(evt: gr.SelectData) -> Any:
        return gr.Dropdown(choices=ctx.run_names(), value=evt.row_value[0]) if evt.row_value else gr.skip()

    table.select(select_row, None, [pick])

    def watch_run(name: Optional[str]) -> List[Any]:
        if not ctx.run_dir(name or ""):
            return [gr.skip(), gr.skip()]
        return [ctx.watch(name or AUTO), show_runs(ctx)]

    watch.click(watch_run, [pick], [ctx["run_select"], ctx["tabs"]])

    assert ctx.form is not None
    form = ctx.form

    def reuse_config(name: Optional[str]) -> List[Any]:
        run_dir = ctx.run_dir(name or "")
        n = len(load_outputs(form))
        if run_dir is None:
            return [gr.skip()] * n + ["Pick a run first.", gr.skip()]
        try:
            cfg = load_config(run_dir / "config.yaml")
        except ConfigError as exc:
            return [gr.skip()] * n + [f"Error: {exc}", gr.skip()]
        cfg.general.run_name = ""
        note = f"Loaded the config of **{name}** into the form (run name cleared)."
        values = form.values_for(cfg)
        write_draft(ctx, form.raw_dict(values))
        return load_updates(form, values) + [note, gr.Tabs(selected="train")]

    # wired once the whole form is built (its Data tabs come after this tab)
    ctx.after_build.append(lambda: reuse.click(reuse_config, [pick],
                                               load_outputs(form) + [ctx["messages"], ctx["tabs"]],
                                               show_progress_on=[ctx["messages"]]))

    def resume_run(name: Optional[str]) -> List[Any]:
        run_dir = ctx.run_dir(name or "")
        if run_dir is None:
            return ["Pick a run first.", gr.skip(), gr.skip()]
        return resume_run_dir(ctx, run_dir)

    resume.click(resume_run, [pick], [msg, ctx["run_select"], ctx["tabs"]], concurrency_limit=1)
    ctx.handlers.update(run_details=details, reuse_config=reuse_config, resume_run=resume_run,
                        zip_picked=zip_picked, delete_run=delete_run)


def compare_frame(views: List[Any]) -> Optional[pd.DataFrame]:
    """Each run's smoothed loss on one chart (one colour per run); None while no run has a loss yet."""
    rows = [(s, val, v.name) for v in views for s, val in v.smooth_points]
    return pd.DataFrame(rows, columns=["step", "value", "series"]) if rows else None


def compare_samples(views: List[Any]) -> List[tuple]:
    """Prompt by prompt, the newest sample of every run next to each other, captioned run · step · prompt."""
    newest: dict = {}
    for v in views:
        for smp in v.samples:
            key = (smp.prompt_index, v.name)
            if key not in newest or smp.step > newest[key].step:
                newest[key] = smp
    prompts = sorted({i for i, _ in newest})
    return [(newest[(i, v.name)].path, f"{v.name} · step {newest[(i, v.name)].step} · {newest[(i, v.name)].prompt}")
            for i in prompts for v in views if (i, v.name) in newest]
