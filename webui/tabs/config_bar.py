"""The bar above the tabs: presets, load/save YAML, validate, start, queue; and the draft autosave.

Every load goes through ``trainer.config.checks.load_config`` (preset ``base:`` chains, unknown keys,
ranges), so a bad file is refused with a message naming the field and the form keeps what the
user typed. Saving writes exactly the validated config, so load → save changes nothing.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path
from typing import Any, List, Optional

import gradio as gr
import yaml

from trainer.config.checks import load_config
from trainer.config.load import preset_names, save_config, to_yaml
from trainer.errors import ConfigError
from webui.context import AUTO, AppContext, issues_md
from webui.form import DATA_TABS, load_outputs, load_updates
from webui.jobqueue import Job


def build(ctx: AppContext) -> None:
    """Create the bar's components (inside the Blocks, above the tabs)."""
    with gr.Row(equal_height=True, elem_id="config-bar"):
        ctx.components["preset"] = gr.Dropdown(preset_names(), value=None, label="Preset",
                                               info="Load a built-in preset into the form.",
                                               elem_id="preset-select", scale=2)
        box = ctx.browser.path_field(lambda: gr.Textbox(label="Config file", scale=10, elem_id="config-path",
                                                        info="A YAML file on the server (relative = workspace)."),
                                     "config-path") if ctx.browser else gr.Textbox(label="Config file")
        ctx.components["config_path"] = box
        with gr.Column(scale=1, min_width=150):
            ctx.components["load_file"] = gr.Button("Load file", size="sm", elem_id="load-file-btn")
            ctx.components["save_file"] = gr.Button("Save to file", size="sm", elem_id="save-file-btn")
        with gr.Column(scale=1, min_width=150):
            ctx.components["upload"] = gr.UploadButton("Upload YAML", file_types=[".yaml", ".yml"], size="sm",
                                                       elem_id="upload-btn")
            ctx.components["download"] = gr.Button("Download YAML", size="sm", elem_id="download-btn")
    with gr.Row(equal_height=True):
        ctx.components["validate"] = gr.Button("Check settings", elem_id="validate-btn", scale=1)
        ctx.components["start"] = gr.Button("▶ Start training", variant="primary", elem_id="start-btn", scale=2)
        ctx.components["enqueue"] = gr.Button("Add to queue", elem_id="enqueue-btn", scale=1)
    ctx.components["download_file"] = gr.File(label="YAML", visible=False, elem_id="download-file")
    ctx.components["messages"] = gr.Markdown(elem_id="form-messages")


QUICK_NOT_APPLIED = ("The Quick start above was **not applied** (see what it names), so the form still holds its "
                     "earlier settings. ")


def wire(ctx: AppContext) -> None:
    """Attach the handlers (after the form and the Run tab exist)."""
    form, c = ctx.form, ctx.components
    assert form is not None
    outs = load_outputs(form) + [c["messages"]]

    def show(cfg: Any, note: str) -> List[Any]:
        values = form.values_for(cfg)
        write_draft(ctx, form.raw_dict(values))
        return load_updates(form, values) + [note]

    def refuse(message: str) -> List[Any]:
        return [gr.skip()] * len(load_outputs(form)) + [f"Error: {message}\n\nThe form was not changed."]

    def load_preset(name: Optional[str]) -> List[Any]:
        if not name:
            return [gr.skip()] * len(outs)
        try:
            shown = show(load_config(preset=name), f"Loaded preset **{name}**.")
            write_ui_state(ctx, preset=name)
            return shown
        except ConfigError as exc:
            return refuse(_named(exc))

    def load_file(path: str) -> List[Any]:
        target, why = ctx.confined(path)
        if target is None:
            return refuse(why)
        try:
            return show(load_config(target), f"Loaded `{target}`.")
        except ConfigError as exc:
            return refuse(_named(exc))

    def upload(file: Any) -> List[Any]:
        if file is None:
            return [gr.skip()] * len(outs)
        try:
            return show(load_config(file), f"Loaded the uploaded file `{Path(file).name}`.")
        except ConfigError as exc:
            return refuse(_named(exc))

    # the wait shows on the message line alone (see submit below)
    c["preset"].input(load_preset, [c["preset"]], outs, show_progress_on=[c["messages"]])
    c["load_file"].click(load_file, [c["config_path"]], outs, show_progress_on=[c["messages"]])
    c["upload"].upload(upload, [c["upload"]], outs, show_progress_on=[c["messages"]])

    def save_file(path: str, *values: Any) -> str:
        target, why = ctx.confined(path, write=True)
        if target is None:
            return f"Error: Not saved: {why}"
        checked = ctx.check(values)
        if checked.cfg is None:
            return "Error: Not saved — fix these first:\n" + issues_md(checked.issues, form)
        save_config(checked.cfg, target)
        return f"Saved `{target}`."

    def download(*values: Any) -> List[Any]:
        checked = ctx.check(values)
        if checked.cfg is None:
            return [gr.File(visible=False), "Error: Fix these first:\n" + issues_md(checked.issues, form)]
        out = Path(tempfile.mkdtemp(prefix="atelier-")) / "atelier-config.yaml"
        out.write_text(to_yaml(checked.cfg), encoding="utf-8")
        return [gr.File(value=str(out), visible=True), "Your YAML is ready below."]

    ctx.handlers["load_file"], ctx.handlers["save_file"] = load_file, save_file
    c["save_file"].click(save_file, [c["config_path"], *form.inputs], [c["messages"]])
    c["download"].click(download, form.inputs, [c["download_file"], c["messages"]])

    checked_outs = form.annotated + [c["messages"]]

    def validate(*values: Any) -> List[Any]:
        checked = ctx.check(values)
        if not checked.issues:
            return form.annotate([]) + ["OK: Settings look good."]
        head = "**Fix these before starting:**" if not checked.ok else "**Settings are valid. Warnings:**"
        return form.annotate(checked.issues) + [head + "\n" + issues_md(checked.issues, form)]

    def validate_shown(*args: Any) -> List[Any]:
        """Check settings as the page calls it: with the last Quick start's refusal, if any. The form then still
        holds what it held before that Quick start, and the message says so instead of a bare "looks good"."""
        *values, quick_refused = args
        out = validate(*values)
        if quick_refused:
            out[-1] = (QUICK_NOT_APPLIED + ("Those settings have no problems." if out[-1].startswith("OK:")
                                            else "What it holds now:\n\n" + out[-1]))
        return out

    # which fields carry a problem note now (indices of form.annotated): the next check re-sends only those and the
    # newly flagged ones, not an update of each of the form's few hundred fields
    flagged = gr.State(frozenset())
    n_notes = len(form.annotated)

    def only_changed(out: List[Any], before: Any) -> List[Any]:
        now = frozenset(i for i, note in enumerate(out[:n_notes]) if _flags(note))
        kept = [note if i in now or i in (before or ()) else gr.skip() for i, note in enumerate(out[:n_notes])]
        return kept + out[n_notes:] + [now]

    failed = c.get("qs_failed") or gr.State("")
    c["validate"].click(lambda *a: only_changed(validate_shown(*a[:-1]), a[-1]), [*form.inputs, failed, flagged],
                        checked_outs + [flagged], show_progress_on=[c["messages"]])
    # the Quick start's note answered its last click: once the form is set or started another way, it is old
    if "qs_note" in c:
        gr.on([c["start"].click, c["enqueue"].click, c["preset"].input, c["load_file"].click, c["upload"].upload],
              lambda: ["", ""], None, [c["qs_note"], failed], show_progress="hidden", queue=False)

    def submit(values: tuple, queue_only: bool) -> List[Any]:
        """Start (or queue) the form's config. Outputs after the field notes: the top tabs, Data's tabs, the message,
        Train's tabs, the run chooser. Refused: the tab of the first problem is shown; started: the live run."""
        checked = ctx.check(values)
        notes = form.annotate(checked.issues)
        if not checked.ok:
            first = checked.errors[0].key if checked.errors else ""
            tab = form.tab_for(first) if first else None
            msg = "**Nothing was started — fix these first:**\n" + issues_md(checked.issues, form)
            if tab is None:
                return notes + [gr.skip(), gr.skip(), msg, gr.skip(), gr.skip()]
            if tab in DATA_TABS:
                return notes + [gr.Tabs(selected="data"), gr.Tabs(selected=tab), msg, gr.skip(), gr.skip()]
            return notes + [gr.Tabs(selected="train"), gr.skip(), msg, gr.Tabs(selected=tab), gr.skip()]
        job = Job(name=ctx.run_name(checked.cfg), config_yaml=ctx.run_config_yaml(checked.cfg))
        warn = ("\n\n**Warnings:**\n" + issues_md(checked.issues, form)) if checked.issues else ""
        if queue_only:
            ctx.manager.queue.add(job)
            return notes + [gr.skip(), gr.skip(), queued_note(ctx, job) + warn, gr.skip(), gr.skip()]
        status, run_dir, job = ctx.manager.submit(job)
        if status == "started" and run_dir is not None:
            return notes + [show_runs(ctx), gr.skip(), f"Started **{run_dir.name}**.{warn}", gr.skip(),
                            ctx.watch(run_dir.name)]
        return notes + [show_runs(ctx), gr.skip(), f"A run is in progress: queued **{job.name}** behind it.{warn}",
                        gr.skip(), ctx.watch(AUTO)]

    submit_outs = checked_outs[:-1] + [c["tabs"], c["data_tabs"], c["messages"], c["train_tabs"], c["run_select"],
                                       flagged]
    # the wait shows on the message line, where the answer comes, not as an overlay on each annotated field
    progress = {"show_progress_on": [c["messages"]], "concurrency_limit": 1}
    c["start_event"] = c["start"].click(lambda *a: only_changed(submit(a[:-1], False), a[-1]),
                                        [*form.inputs, flagged], submit_outs, **progress)
    c["enqueue"].click(lambda *a: only_changed(submit(a[:-1], True), a[-1]), [*form.inputs, flagged], submit_outs,
                       **progress)

    # draft autosave: the form survives a page refresh and a UI restart. Only user edits
    # (.input) and code that edits the form trigger it: .change on every widget would fire a
    # storm of full-form requests each time a preset is loaded.
    def save_draft(*values: Any) -> None:
        write_draft(ctx, form.raw_dict(values))

    ctx.handlers.update(load_preset=load_preset, load_file=load_file, upload=upload, save_file=save_file,
                        download=download, validate=validate, validate_shown=validate_shown, submit=submit,
                        save_draft=save_draft)
    gr.on([w.input for w in form.widgets.values()], save_draft, form.inputs, None,
          trigger_mode="always_last", show_progress="hidden", queue=False)
    for dep in [d for e in form.editors.values() for d in e.edits] + (ctx.browser.uses if ctx.browser else []):
        dep.then(save_draft, form.inputs, None, show_progress="hidden", queue=False)


RUNS_TAB = "run"  # the Runs tab's id: the live run is at its top


def show_runs(ctx: AppContext) -> Any:
    """Select the Runs tab (after Start, Resume, Watch), and remember it: a reload then lands on the live run too
    (a tab chosen by the server sends no select event of its own)."""
    write_ui_state(ctx, tab=RUNS_TAB)
    return gr.Tabs(selected=RUNS_TAB)


def queued_note(ctx: AppContext, job: Job) -> str:
    """Where a job just added waits: its place in the queue and what runs before it (a job added while nothing
    runs is started by the scheduler within a second, so the next one added is again first in the queue)."""
    jobs = ctx.manager.queue.list()
    place = next((i + 1 for i, j in enumerate(jobs) if j.id == job.id), None)
    active = ctx.manager.active_runs()
    if place is None:
        return f"Queued **{job.name}**: it has already started (see the Runs tab)."
    ahead = f"behind the running **{active[0].name}**" if active else "it starts within a few seconds"
    waiting = f" and {place - 1} queued job(s)" if place > 1 and active else ""
    return f"Queued **{job.name}** — position {place} in the queue, {ahead}{waiting}."


_draft_lock = threading.Lock()


def write_draft(ctx: AppContext, raw: dict) -> None:
    """Write ``ui-draft.yaml`` atomically (skipped when nothing changed)."""
    text = yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
    with _draft_lock:
        try:
            if ctx.draft_path.read_text(encoding="utf-8") == text:
                return
        except OSError:
            pass
        tmp = ctx.draft_path.with_name(f"{ctx.draft_path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(ctx.draft_path)


UI_STATE = "ui-state.json"


def read_ui_state(ctx: AppContext) -> dict:
    """What the page was showing (the preset the form came from, the tab), for a reload."""
    try:
        data = json.loads((ctx.workspace / UI_STATE).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_ui_state(ctx: AppContext, **changes: Any) -> None:
    with _draft_lock:
        state = {**read_ui_state(ctx), **changes}
        tmp = ctx.workspace / f"{UI_STATE}.{threading.get_ident()}.tmp"
        try:
            tmp.write_text(json.dumps(state), encoding="utf-8")
            tmp.replace(ctx.workspace / UI_STATE)
        except OSError:
            tmp.unlink(missing_ok=True)


def load_draft(ctx: AppContext) -> Optional[List[Any]]:
    """Form values from ``ui-draft.yaml`` (lenient: invalid bits fall back to defaults), or None."""
    try:
        raw = yaml.safe_load(ctx.draft_path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(raw, dict):
        return None
    assert ctx.form is not None
    return ctx.form.lenient_values_for(raw)


def _flags(note: Any) -> bool:
    """Whether an output of ``Form.annotate`` puts a problem on its field: a field's update with a highlight
    class, or a table's non-empty note."""
    return bool(note.get("elem_classes")) if isinstance(note, dict) else bool(note)


def _named(exc: ConfigError) -> str:
    key = getattr(exc, "key", "")
    return (f"`{key}` — " if key and key not in str(exc) else "") + str(exc)


