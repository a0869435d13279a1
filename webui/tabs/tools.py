"""The Tools tab (small on purpose): the form as YAML, a dataset check, and how to open
TensorBoard on the workspace."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

import gradio as gr

from trainer import config as tcfg
from webui.context import AppContext, issues_md
from webui.tabs.extras import concept_images, resolve_path


def dataset_report(cfg: Any) -> str:
    """Images and caption files per concept: the usual reason a first run trains on nothing."""
    lines = ["| concept | images | with caption file | repeats |", "|---|---|---|---|"]
    for i, c in enumerate(cfg.data.concepts):
        label = c.name or c.path or f"#{i}"
        if str(c.path).startswith("builtin:"):
            lines.append(f"| {label} | built in | – | {c.repeats:g} |")
            continue
        path = Path(resolve_path(str(c.path)))
        images = concept_images(str(path), c.recursive)
        ext = c.caption_extension if c.caption_extension.startswith(".") else "." + c.caption_extension
        captions = sum(1 for p in images if p.with_suffix(ext).exists())
        missing = "" if path.is_dir() else " ⛔ folder not found"
        lines.append(f"| {label}{missing} | {len(images)} | {captions} | {c.repeats:g} |")
    return "\n".join(lines) if cfg.data.concepts else "No concepts yet (Concepts tab)."


def build(ctx: AppContext) -> None:
    assert ctx.form is not None
    form = ctx.form
    with gr.Row():
        show = gr.Button("Show the form as YAML", elem_id="tools-yaml-btn")
        check = gr.Button("Check the dataset", elem_id="tools-dataset-btn")
    out_md = gr.Markdown(elem_id="tools-msg")
    code = gr.Code(language="yaml", label="Config", elem_id="tools-yaml", max_lines=60)
    gr.Markdown(f"**TensorBoard:** `tensorboard --logdir {ctx.workspace / 'runs'}` shows every run's "
                "curves (each run writes to `<run>/tensorboard`).")

    def as_yaml(*values: Any) -> List[Any]:
        checked = ctx.check(values)
        if checked.cfg is None:
            return ["⛔ The form has errors:\n" + issues_md(checked.issues, form), ""]
        return [issues_md(checked.issues, form), tcfg.to_yaml(checked.cfg)]

    def dataset(*values: Any) -> List[Any]:
        checked = ctx.check(values)
        if checked.cfg is None:
            return ["⛔ The form has errors:\n" + issues_md(checked.issues, form), gr.skip()]
        return [dataset_report(checked.cfg), gr.skip()]

    show.click(as_yaml, form.inputs, [out_md, code])
    check.click(dataset, form.inputs, [out_md, code])
