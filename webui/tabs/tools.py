"""The Tools tab (small on purpose): the form as YAML, a dataset check, and how to open
TensorBoard on the workspace."""

from __future__ import annotations

from typing import Any, List

import gradio as gr

from trainer import config as tcfg
from webui.context import AppContext, issues_md


def dataset_report(cfg: Any) -> str:
    """The trainer's own dataset report (``python -m trainer data-report``): images and captions per
    concept, the bucket histogram, images that would never train (bucket smaller than the batch),
    small images, duplicates, missing masks and skipped files — before any GPU time is spent."""
    from trainer.data.report import build_report, format_report
    if not cfg.data.concepts:
        return "No concepts yet (Concepts tab)."
    try:
        text = format_report(build_report(cfg))
    except tcfg.ConfigError as exc:
        return f"⛔ {exc}"
    flagged = ("never trains" in text or "never trained" in text or "skipped:" in text
               or "warning:" in text)
    head = "⚠️ Check the lines marked below." if flagged else "✅ Every image will train."
    return f"{head}\n\n```\n{text}\n```"


def dataset_check(ctx: AppContext, elem_prefix: str) -> None:
    """A "Check the dataset" button and its report, for the Concepts and Tools tabs."""
    assert ctx.form is not None
    form = ctx.form
    btn = gr.Button("Check the dataset", elem_id=f"{elem_prefix}-dataset-btn")
    out = gr.Markdown(elem_id=f"{elem_prefix}-dataset-report")

    def run(*values: Any) -> str:
        checked = ctx.check(values)
        if checked.cfg is None:
            return "⛔ The form has errors:\n" + issues_md(checked.issues, form)
        return dataset_report(checked.cfg)

    ctx.handlers[f"{elem_prefix}_dataset_check"] = run
    # the form's inputs exist only once every tab is built
    ctx.after_build.append(lambda: btn.click(run, form.inputs, out))


def build(ctx: AppContext) -> None:
    assert ctx.form is not None
    form = ctx.form
    show = gr.Button("Show the form as YAML", elem_id="tools-yaml-btn")
    out_md = gr.Markdown(elem_id="tools-msg")
    code = gr.Code(language="yaml", label="Config", elem_id="tools-yaml", max_lines=60)
    gr.Markdown(f"**TensorBoard:** `tensorboard --logdir {ctx.workspace / 'runs'}` shows every run's "
                "curves (each run writes to `<run>/tensorboard`).")

    def as_yaml(*values: Any) -> List[Any]:
        checked = ctx.check(values)
        if checked.cfg is None:
            return ["⛔ The form has errors:\n" + issues_md(checked.issues, form), ""]
        return [issues_md(checked.issues, form), tcfg.to_yaml(checked.cfg)]

    show.click(as_yaml, form.inputs, [out_md, code])
    dataset_check(ctx, "tools")
