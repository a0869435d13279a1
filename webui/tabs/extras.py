"""Buttons that live inside generated tabs: Concepts (thumbnails with captions), Sampling
("sample now"), Backup ("backup now", resume from a chosen backup).

They are handed to ``Form.build(extras=...)`` so the schema-generated tabs need no hand-written
field code around them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import gradio as gr

from webui import devices, runner, vram
from webui.context import AUTO, AppContext
from webui.jobqueue import Job
from webui.imagefiles import open_rgb, page_images, skipped_md
from webui.pairs import role_badge
from webui.pathlist import resolve_path, split_lines
from webui.schema_widgets import table_from_widget
from webui.tabs.config_bar import show_runs
from webui.tabs.tools import dataset_check

THUMBS = 24
CARD_THUMBS = 6


def extras(ctx: AppContext) -> Dict[str, Callable[[], None]]:
    return {"general": lambda: general(ctx), "concepts": lambda: concepts(ctx),
            "sampling": lambda: sampling(ctx), "backup": lambda: backup(ctx)}


def general(ctx: AppContext) -> None:
    """Devices: the GPUs nvidia-smi lists, ticked into general.gpu_ids / general.num_processes (one
    process per GPU), and what Start will launch with the current settings."""
    assert ctx.form is not None
    w = ctx.form.widgets
    if not all(k in w for k in ("general.gpu_ids", "general.num_processes")):
        return
    gpus, note = devices.detect_gpus()
    gr.Markdown("### Devices\nTick the GPUs to train on: one training process each. More than one GPU launches "
                "through accelerate (DDP, or FSDP per general.distributed); a config made for one GPU runs "
                "unchanged on several.")
    picker = gr.CheckboxGroup(choices=[g.label for g in gpus], label="GPUs to train on",
                              elem_id="gpu-picker", visible=bool(gpus),
                              value=devices.fields_to_selection(gpus, "", 1))
    gr.Markdown(note or f"{len(gpus)} GPU(s) found by nvidia-smi.", elem_id="gpu-note")
    summary = gr.Markdown(elem_id="launch-summary")
    ctx.components["gpu_picker"] = picker

    def picked(selected: List[str]) -> List[Any]:
        if not selected:  # nothing ticked: leave the fields as they are (the first GPU by default)
            return [gr.update(), gr.update()]
        ids, n = devices.selection_to_fields(selected)
        return [ids, n]

    def from_fields(ids: str, n: Any) -> Any:
        return gr.update(value=devices.fields_to_selection(gpus, ids, int(n or 1))) if gpus else gr.update()

    keys = ["general.num_processes", "general.gpu_ids", "training.batch_size",
            "training.gradient_accumulation_steps", "general.device"]

    def summarise(*values: Any) -> str:
        n, ids, b, a, dev = values
        return devices.launch_summary(int(n or 1), ids or "", b, a, dev or "auto", gpus)
    ctx.handlers["launch_summary"] = summarise

    def wire() -> None:
        if gpus:
            picker.input(picked, [picker], [w["general.gpu_ids"], w["general.num_processes"]])
            for k in ("general.gpu_ids", "general.num_processes"):
                w[k].change(from_fields, [w["general.gpu_ids"], w["general.num_processes"]], [picker],
                            show_progress="hidden")
        if all(k in w for k in keys):
            for k in keys:
                w[k].change(summarise, [w[k2] for k2 in keys], [summary], show_progress="hidden")
    ctx.after_build.append(wire)
    vram_estimate(ctx, gpus)


def vram_estimate(ctx: AppContext, gpus: List[Any]) -> None:
    """Before Start: will it fit? The trainer's estimator on the form's config (in a subprocess, 1-2 min)."""
    gr.Markdown("### Memory\nHow much GPU memory the run will need at its peak, from the trainer's own estimator "
                "(the real model built without weights; takes up to a couple of minutes).")
    with gr.Row(equal_height=True):
        card = gr.Number(value=round(gpus[0].memory_mib / 1024) if gpus else 24, label="GPU memory (GiB)",
                         minimum=1, maximum=1024, elem_id="vram-card", scale=1)
        go = gr.Button("Estimate VRAM", elem_id="vram-estimate-btn", scale=1)
    result = gr.Markdown(elem_id="vram-result")

    def run_estimate(card_gib: Any, *values: Any) -> str:
        checked = ctx.check(values)
        if checked.cfg is None or checked.errors:
            return "Fix the settings first (press **Check settings**): " + "; ".join(
                f"`{e.key}`: {e.message}" for e in checked.errors[:3])
        size = float(card_gib) if card_gib else None
        return vram.describe(vram.estimate(ctx.run_config_yaml(checked.cfg), size), size)

    ctx.handlers["vram_estimate"] = run_estimate

    def wire() -> None:
        assert ctx.form is not None
        go.click(run_estimate, [card, *ctx.form.inputs], [result], concurrency_limit=1)
    ctx.after_build.append(wire)


def concept_images(ctx: AppContext, folder: str, recursive: bool = False,
                   caption_ext: Optional[str] = None) -> Tuple[List[Path], List[Tuple[str, str]]]:
    """``(images, left out)``: the concept's images as the trainer lists them, those the page may show (no link
    of an image, its caption or its mask leading outside the page's folders), and the rest named with why."""
    root = Path(resolve_path(folder))
    if not root.is_dir():
        return [], []
    return page_images(root, ctx.roots.allowed, recursive, caption_ext)


def caption_for(image: Path, source: str, extension: str, file_lines: List[str], index: int) -> str:
    """The caption the trainer would use, to show under each thumbnail."""
    if source == "filename":
        return image.stem
    if source == "concept_file":
        return file_lines[index % len(file_lines)] if file_lines else "(caption file is empty)"
    cap = image.with_suffix(extension if extension.startswith(".") else "." + extension)
    try:
        return cap.read_text(encoding="utf-8", errors="replace").strip() or "(empty caption)"
    except OSError:
        return "(no caption file)"


def concepts(ctx: AppContext) -> None:
    assert ctx.form is not None
    editor = ctx.form.editors.get("data.concepts")
    if editor is None:
        return
    def card_images(item: dict) -> None:
        """A concept card's role (a badge unless it trains), control folders, image count and first thumbnails
        (folders the page may show only)."""
        badge = role_badge(str(item.get("role") or "train"))
        if badge:
            gr.HTML(badge, elem_classes=["atl-card-role"])
        controls = split_lines(item.get("control_paths"))
        if controls:
            gr.Markdown("control folders (**Edit** to add, browse or remove): " + " · ".join(
                f"`{c}`" + control_count(c, bool(item.get("recursive"))) for c in controls),
                elem_classes=["atl-card-controls"])
        path = str(item.get("path") or "")
        if not path or path.startswith("builtin:"):
            return
        folder = resolve_path(path)
        if not ctx.roots.allowed(folder):
            gr.Markdown("*(outside the folders this page may show)*")
            return
        if not Path(folder).is_dir():
            gr.Markdown(f"Error: `{path}` does not exist")
            return
        images, left_out = concept_images(ctx, folder, bool(item.get("recursive")))
        gr.Markdown(f"{len(images)} images" + (f" ({len(left_out)} left out: see the preview)" if left_out else ""),
                    elem_classes=["atl-card-count"])
        shown = [small for small, _ in (open_rgb(p_, 96) for p_ in images[:CARD_THUMBS]) if small is not None]
        if shown:  # an image that cannot be shown is left out here; the preview names it with its reason
            gr.Gallery(shown, columns=CARD_THUMBS, height=110,
                       show_label=False, object_fit="contain", allow_preview=False)

    def control_count(folder: str, recursive: bool) -> str:
        where = resolve_path(folder)
        if not ctx.roots.allowed(where):
            return " (outside the folders this page may show)"
        if not Path(where).is_dir():
            return " — does not exist"
        return f" ({len(concept_images(ctx, where, recursive)[0])} images)"

    editor.card_extra = card_images
    gr.Markdown("### Dataset report\nWhat the trainer will do with every concept's images: buckets, images "
                "that would never train, small images, duplicates, missing masks.")
    dataset_check(ctx, "concepts")
    gr.Markdown("### Preview\nThe images of the concept being edited, with the captions the trainer will use.")
    note = gr.Markdown(elem_id="concept-preview-note")
    gallery = gr.Gallery(columns=6, height=320, elem_id="concept-thumbs", label="Concept images")
    names = [c.key for c in editor.spec.items]
    by = {k: editor.items[i] for i, k in enumerate(names)}
    needed = ["path", "recursive", "caption_source", "caption_extension", "caption_file"]
    if not all(k in by for k in needed):
        return

    def preview(path: str, recursive: bool, source: str, ext: str, cap_file: str) -> List[Any]:
        if not path:
            return ["", []]
        if path.startswith("builtin:"):
            return [f"`{path}` is built into the trainer; nothing to preview.", []]
        path = resolve_path(path)
        if not ctx.roots.allowed(path):
            return [f"`{path}` is outside the folders this UI may show (start the UI with "
                    "`--browse-root FOLDER` to allow it).", []]
        if not Path(path).exists():
            return [f"`{path}` does not exist: check the spelling, or pick the folder with Browse.", []]
        if not Path(path).is_dir():
            return [f"`{path}` is a file; a concept is a folder of images.", []]
        per_image = source not in ("filename", "concept_file")  # captions read next to each image
        images, left_out = concept_images(ctx, path, bool(recursive), (ext or ".txt") if per_image else None)
        lines: List[str] = []
        notes = [skipped_md(left_out)] if left_out else []
        if source == "concept_file" and cap_file and not ctx.roots.allowed(resolve_path(cap_file)):
            notes.append(f"Error: The caption file `{cap_file}` is outside the folders this page may show: its "
                         "captions are not shown.")
        elif source == "concept_file" and cap_file:
            try:
                text = Path(resolve_path(cap_file)).read_text(encoding="utf-8", errors="replace")
                lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            except OSError:
                lines = []
        thumbs, unreadable = [], []
        for i, p in enumerate(images[:THUMBS]):
            small, why = open_rgb(p, 192)
            if small is None:
                unreadable.append((p.name, why))
            else:
                thumbs.append((small, caption_for(p, source, ext or ".txt", lines, i)))
        head = f"{len(images)} images in `{path}`" + (f" (showing {THUMBS})" if len(images) > THUMBS else "")
        notes += [skipped_md(unreadable, "image(s) cannot be shown")] if unreadable else []
        return ["\n\n".join([head, *notes]), thumbs]

    ctx.handlers["concept_preview"] = preview
    inputs = [by[k] for k in needed]
    for k in ("path", "recursive", "caption_source", "caption_extension"):
        by[k].change(preview, inputs, [note, gallery], show_progress="hidden", trigger_mode="always_last")

    def preview_row(table: Any, row: Optional[float]) -> List[Any]:
        """When the table changes (a preset was loaded), preview the edited row, else the first."""
        items, _ = table_from_widget(editor.spec, table)
        if not items:
            return ["No concepts yet: add one below.", []]
        item = items[int(row) if row is not None and 0 <= int(row) < len(items) else 0]
        return preview(str(item.get("path") or ""), bool(item.get("recursive")), str(item.get("caption_source")),
                       str(item.get("caption_extension") or ".txt"), str(item.get("caption_file") or ""))

    editor.table.change(preview_row, [editor.table, editor.row], [note, gallery], show_progress="hidden",
                        trigger_mode="always_last")


def _active_or_watched(ctx: AppContext) -> Optional[Path]:
    active = ctx.manager.active_runs()
    return active[0] if active else None


def now_line(ctx: AppContext, action: str) -> str:
    """What a Sample now / Backup now button of a settings tab would ask, as things are now."""
    run_dir = _active_or_watched(ctx)
    if run_dir is None:
        return f"Nothing is running: a {action} can be asked of a run in progress."
    return f"Asks the run in progress, **{run_dir.name}**, for a {action} at its next step."


def follow_runs(ctx: AppContext, tab: str, btn: Any, msg: Any, action: str) -> None:
    """The button is clickable, and its line says which run it asks, as of the moment its tab is opened (a run
    that started or ended since the page was built is not claimed, nor missed)."""
    assert ctx.form is not None
    title = ctx.form.tab_titles.get(tab, tab)

    def opened(evt: gr.SelectData) -> List[Any]:
        if str(evt.value) != title:
            return [gr.skip(), gr.skip()]
        return [gr.Button(interactive=_active_or_watched(ctx) is not None), now_line(ctx, action)]

    ctx.after_build.append(lambda: ctx["train_tabs"].select(opened, None, [btn, msg], show_progress="hidden",
                                                            queue=False))
    ctx.handlers[f"{tab}_opened"] = opened


def sampling(ctx: AppContext) -> None:
    with gr.Row():
        btn = gr.Button("Sample now", elem_id="sampling-now-btn", scale=0,
                        interactive=_active_or_watched(ctx) is not None)
        msg = gr.Markdown(now_line(ctx, "sample"), elem_id="sampling-now-msg")

    def go() -> str:
        run_dir = _active_or_watched(ctx)
        return runner.request_action(run_dir, "sample") if run_dir else "No run is in progress."

    btn.click(go, None, [msg])
    follow_runs(ctx, "sampling", btn, msg, "sample")


def all_backups(ctx: AppContext) -> List[tuple]:
    out = []
    for d in runner.list_run_dirs(ctx.workspace):
        for b in reversed(runner.list_backups(d)):
            out.append((f"{d.name} / {b.name}", str(b)))
    return out


def backup(ctx: AppContext) -> None:
    with gr.Row():
        btn = gr.Button("Backup now", elem_id="backup-tab-now-btn", scale=0,
                        interactive=_active_or_watched(ctx) is not None)
        msg = gr.Markdown(now_line(ctx, "backup"), elem_id="backup-now-msg")
    gr.Markdown("### Resume from a backup\nContinues that run in its own folder with its own config.")
    with gr.Row(equal_height=True):
        pick = gr.Dropdown(all_backups(ctx), label="Backup", elem_id="backup-pick", scale=3)
        refresh = gr.Button("Refresh", scale=0)
        resume = gr.Button("Resume from this backup", variant="primary", elem_id="backup-resume", scale=1)

    def now() -> str:
        run_dir = _active_or_watched(ctx)
        return runner.request_action(run_dir, "backup") if run_dir else "No run is in progress."

    def do_resume(path: Optional[str]) -> List[Any]:
        if not path or not Path(path).is_dir():
            return ["Pick a backup first.", gr.skip(), gr.skip()]
        run_dir = Path(path).parent.parent
        if runner.process_alive(run_dir):
            return ["That run is still running.", gr.skip(), gr.skip()]
        status, _, _ = ctx.manager.submit(Job(name=run_dir.name, kind="resume", run_dir=str(run_dir),
                                              resume=str(path)))
        if status == "started":
            return [f"Resuming **{run_dir.name}** from `{Path(path).name}`.", ctx.watch(run_dir.name),
                    show_runs(ctx)]
        return ["Another run is in progress: the resume was queued.", ctx.watch(AUTO), show_runs(ctx)]

    btn.click(now, None, [msg])
    follow_runs(ctx, "backup", btn, msg, "backup")
    refresh.click(lambda: gr.Dropdown(choices=all_backups(ctx)), None, [pick])
    resume.click(do_resume, [pick], [msg, ctx["run_select"], ctx["tabs"]], concurrency_limit=1)
