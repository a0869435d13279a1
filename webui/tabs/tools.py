"""The Tools tab — the model tools (``python -m trainer convert|merge|resize|sample``; the sampled images shown on
the page), the form as YAML, TensorBoard on the workspace — and the Data tab's "Captions and masks" (a dataset check,
captioning and masking a folder, the caption editor, the mask painter). The tools run in a subprocess so that the UI
process never imports torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import gradio as gr

from trainer.config.load import compose_dict, to_yaml
from trainer.data.report import build_report, concept_pairs, format_report
from trainer.data.scanindex import ScanIndex, index_for
from trainer.errors import ConfigError
from trainer.host import procs
from trainer.tools.captioners.vlm import DEFAULT_VLM, STYLES
from trainer.tools.captioners.wd import DEFAULT_WD_TAGGER
from webui import captions, maskpaint, pairs, runner
from webui.context import AppContext, issues_md
from webui.runner import runs_root
from webui.tensorboard import TensorBoard


def dataset_report(cfg: Any, index: Optional[ScanIndex] = None) -> str:
    """The trainer's own dataset report (``python -m trainer data-report``): images and captions per
    concept, the bucket histogram, images that would never train (bucket smaller than the batch),
    small images, duplicates, missing masks and skipped files — before any GPU time is spent. ``index``: the
    remembered scan to use (default: the config's cache folder's)."""
    if not cfg.data.concepts:
        return "No concepts yet (Concepts tab)."
    try:
        text = format_report(build_report(cfg, index=index))
    except ConfigError as exc:
        return f"Error: {exc}"
    flagged = ("never trains" in text or "never trained" in text or "skipped:" in text
               or "warning:" in text)
    head = "Warning: Check the lines marked below." if flagged else "OK: Every image will train."
    return f"{head}\n\n```\n{text}\n```"


def data_config(ctx: AppContext, values: Any) -> Tuple[Optional[Any], str]:
    """The form's config for the dataset report, and what to say above it. When a rule refuses the settings (the
    model takes no control images, say) but every field reads, the report is still made, of the files as they
    are, under the refusal: the images can be checked before the model is chosen."""
    assert ctx.form is not None
    checked = ctx.check(values)
    if checked.cfg is not None:
        return checked.cfg, ""
    refused = "Error: The form has errors:\n" + issues_md(checked.issues, ctx.form)
    _, field_errors = ctx.form.collect(values)
    if field_errors:
        return None, refused
    try:
        cfg = compose_dict(checked.data)
    except ConfigError:
        return None, refused
    return cfg, refused + "\n\nThe report below is of the images as they are; fix the settings before training."


def dataset_check(ctx: AppContext, elem_prefix: str) -> None:
    """A "Check the dataset" button and its report, for the Concepts and Tools tabs: the trainer's text report,
    then each concept's role and control folders, with its pairs side by side and every unpaired file named."""
    assert ctx.form is not None
    form = ctx.form
    btn = gr.Button("Check the dataset", elem_id=f"{elem_prefix}-dataset-btn")
    out = gr.Markdown(elem_id=f"{elem_prefix}-dataset-report")
    entries = gr.State([])

    @gr.render(inputs=[entries])
    def concept_view(items: List[dict]) -> None:
        pairs.render_report(items or [], elem_prefix, ctx.roots.allowed)

    def check(*values: Any, index: Optional[ScanIndex] = None) -> List[Any]:
        cfg, note = data_config(ctx, values)
        if cfg is None:
            return [note, []]
        try:
            text = dataset_report(cfg, index if index is not None else index_for(cfg))
            found = concept_pairs(cfg)
        except (ValueError, TypeError, KeyError, OSError) as exc:  # settings no rule has checked (note says so)
            text, found = f"Error: The report could not be made: {exc}", []
        return [f"{note}\n\n{text}" if note else text, found]

    def run(*values: Any) -> str:
        return check(*values)[0]

    def checking(*values: Any) -> Iterator[List[Any]]:
        """The check on a thread of its own, saying every half second how many files it has looked at (a new or
        changed image is decoded in full; the others come from the scan remembered in the cache folder)."""
        cfg, _ = data_config(ctx, values)
        index = index_for(cfg) if cfg is not None else ScanIndex()
        result: List[Any] = []
        worker = threading.Thread(target=lambda: result.extend(check(*values, index=index)), daemon=True)
        started = time.monotonic()
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
            if worker.is_alive():
                yield [f"Checking the dataset: {index.recalled + index.probed} files looked at, {index.probed} "
                       f"decoded ({time.monotonic() - started:.0f} s) …", gr.skip()]
        yield result if result else ["Error: The check stopped without a report (see the log).", []]

    ctx.handlers[f"{elem_prefix}_dataset_check"] = run
    ctx.handlers[f"{elem_prefix}_dataset_pairs"] = check
    ctx.handlers[f"{elem_prefix}_dataset_checking"] = checking
    # the form's inputs exist only once every tab is built
    ctx.after_build.append(lambda: btn.click(checking, form.inputs, [out, entries]))


def build(ctx: AppContext) -> None:
    """The Tools tab: the model tools first (open), then the form as YAML and TensorBoard."""
    assert ctx.form is not None
    form = ctx.form
    model_tools(ctx)
    with gr.Accordion("The form as YAML", open=False, elem_id="tools-yaml-fold"):
        show = gr.Button("Show the form as YAML", elem_id="tools-yaml-btn")
        out_md = gr.Markdown(elem_id="tools-msg")
        code = gr.Code(language="yaml", label="Config", elem_id="tools-yaml", max_lines=60)
    tensorboard_section(ctx)

    def as_yaml(*values: Any) -> List[Any]:
        checked = ctx.check(values)
        if checked.cfg is None:
            return ["Error: The form has errors:\n" + issues_md(checked.issues, form), ""]
        return [issues_md(checked.issues, form), to_yaml(checked.cfg)]

    show.click(as_yaml, form.inputs, [out_md, code])


def build_data(ctx: AppContext) -> None:
    """The Data tab's "Captions and masks": the dataset check, captioning and masking a folder, the caption editor
    and the mask painter."""
    dataset_check(ctx, "tools")
    dataset_tools(ctx)
    captions.build(ctx)
    maskpaint.build(ctx)


def tensorboard_section(ctx: AppContext) -> None:
    """TensorBoard on every run of the workspace, at <page>/tensorboard/ (also through a share link)."""
    board = ctx.components.setdefault("tensorboard", TensorBoard(runs_root(ctx.workspace)))
    with gr.Row(equal_height=True):
        go = gr.Button("Open TensorBoard", elem_id="tensorboard-btn", scale=1)
        link = gr.HTML("TensorBoard shows every run's curves (each run writes to <code>&lt;run&gt;/tensorboard</code>).",
                       elem_id="tensorboard-link")

    def open_board() -> str:
        problem = board.start()
        if problem:
            return f"Error: {problem}"
        return ('<a href="tensorboard/" target="_blank" rel="noopener" id="tensorboard-open">Open TensorBoard ↗</a> '
                "(every run of this workspace; served by this page, behind its login)")

    ctx.handlers["open_tensorboard"] = open_board
    go.click(open_board, None, [link], concurrency_limit=1)


# --------------------------------------------------------------------------------------------------
# Model tools: the CLI in a subprocess
# --------------------------------------------------------------------------------------------------

MODEL_TOOLS = ("convert", "merge", "resize", "sample")
TOOL_TIMEOUT_S = 3 * 3600
TAIL_LINES = 12


def tool_command(tool: str, model: str = "", loras: str = "", out: str = "", *, to: str = "single-file",
                 dtype: str = "auto", rank: Optional[float] = None, prompt: str = "", steps: Optional[float] = None,
                 seed: Optional[float] = None, count: Optional[float] = None, overwrite: bool = False,
                 workspace: str = "") -> Tuple[List[str], str]:
    """The arguments after ``python -m trainer`` for one tool, or ([], what is missing)."""
    model, out, prompt = (model or "").strip(), (out or "").strip(), (prompt or "").strip()
    lora_list = [ln.strip() for ln in (loras or "").splitlines() if ln.strip()]
    if tool not in MODEL_TOOLS:
        return [], f"pick a tool ({', '.join(MODEL_TOOLS)})"
    if tool == "resize":
        if len(lora_list) != 1:
            return [], "resize takes one LoRA file (in the LoRA box)"
        if not rank:
            return [], "give the new rank"
        argv = ["resize", lora_list[0], "--rank", str(int(rank))]
    else:
        if not model:
            return [], "give the model (a diffusers folder, a .safetensors file, a hub id or builtin:tiny-sd)"
        argv = [tool, model]
        if tool == "convert":
            argv += ["--to", to]
        elif tool == "merge":
            if not lora_list:
                return [], "give at least one LoRA file to merge (one a line, FILE[:WEIGHT])"
            if not out:
                return [], "give the output path"
            argv += lora_list
        else:  # sample
            if not prompt:
                return [], "give a prompt"
            argv += ["--prompt", prompt]
            for lora in lora_list:
                argv += ["--lora", lora]
            for flag, value in (("--steps", steps), ("--seed", seed), ("--count", count)):
                if value is not None and value != "":
                    argv += [flag, str(int(value))]
        if tool in ("convert", "merge") and dtype and dtype != "auto":
            argv += ["--dtype", dtype]
        if workspace:
            argv += ["--workspace", workspace]
    if out:
        argv += ["--out", out]
    if overwrite:
        argv.append("--overwrite")
    return argv, ""


_WROTE = re.compile(r"^wrote (.+?)(?: \([^()]*\))?$")


def stream_tool(argv: List[str], timeout: float = TOOL_TIMEOUT_S, python: str = sys.executable,
                poll_s: float = 1.0) -> Iterator[Dict[str, Any]]:
    """Run ``python -m trainer <argv>`` and yield ``{"rc": None, "tail", "elapsed"}`` while it runs (its last
    output lines), then the result ``{"rc", "tail", "outputs" (paths written)}``. Closing the generator (the
    page's Cancel) kills the tool and what it started."""

    env = runner.child_env()
    with tempfile.TemporaryDirectory(prefix="atelier-tool-") as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen([python, "-m", "trainer", *argv], stdout=out, stderr=err, env=env,
                                        stdin=subprocess.DEVNULL, **procs.detached_popen_kwargs())
        except OSError as exc:
            yield {"rc": None, "tail": f"could not start the tool: {exc}", "outputs": []}
            return
        started, finished = time.time(), False

        def lines() -> Tuple[List[str], List[str]]:
            def read(name: str) -> List[str]:
                with open(name, "rb") as fh:
                    text = fh.read().decode("utf-8", errors="replace").replace("\r", "\n")
                return [ln for ln in text.splitlines() if ln.strip()]
            return read(out_path), [ln for ln in read(err_path) if "it/s]" not in ln]

        try:
            while proc.poll() is None:
                if time.time() - started > timeout:
                    procs.kill_tree(proc.pid, None if procs.is_windows() else proc.pid)
                    proc.wait()
                    finished = True
                    yield {"rc": None, "tail": f"stopped after {timeout:.0f} s", "outputs": []}
                    return
                out_lines, err_lines = lines()
                yield {"rc": None, "tail": "\n".join((out_lines + err_lines)[-TAIL_LINES:]),
                       "elapsed": time.time() - started}
                try:  # the tool's end answers at once; a progress line every poll_s until then
                    proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    pass
            finished = True
            out_lines, err_lines = lines()
        finally:
            if not finished and proc.poll() is None:  # cancelled from the page
                try:
                    procs.kill_tree(proc.pid, None if procs.is_windows() else proc.pid)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
    outputs = []
    for line in out_lines:
        m = _WROTE.match(line.strip())
        if m:
            outputs.append(m.group(1))
        elif argv and argv[0] == "sample" and line.strip().lower().endswith(".png"):
            outputs.append(line.strip())
    yield {"rc": proc.returncode, "tail": "\n".join((out_lines + err_lines)[-TAIL_LINES:]), "outputs": outputs}


def run_tool(argv: List[str], timeout: float = TOOL_TIMEOUT_S, python: str = sys.executable) -> Dict[str, Any]:
    """Run ``python -m trainer <argv>`` to the end: ``{"rc", "tail" (last output lines), "outputs"}``."""
    result: Dict[str, Any] = {}
    for result in stream_tool(argv, timeout, python, poll_s=0.2):
        pass
    return result


def progress_updates(argv: List[str], wrote: Optional[List[str]] = None) -> Iterator[List[Any]]:
    """[message, tail] for the page while a tool runs, then its result; ``wrote`` gets the paths it wrote."""
    cmd = "python -m trainer " + " ".join(_quote(a) for a in argv)
    for result in stream_tool(argv):
        if result.get("rc") is None and "elapsed" in result:
            yield [f"Running `{cmd}` ({result['elapsed']:.0f} s) — **Cancel** stops it.", result["tail"]]
        else:
            if wrote is not None:
                wrote[:] = result.get("outputs") or []
            yield [describe_tool_result(argv, result), result["tail"]]


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def tool_images(outputs: List[str], shown: Callable[[str], bool]) -> List[str]:
    """The images among a tool's outputs that the page may show."""
    return [p for p in outputs if p.lower().endswith(IMAGE_SUFFIXES) and os.path.isfile(p) and shown(p)]


def describe_tool_result(argv: List[str], result: Dict[str, Any]) -> str:
    """Markdown: success or failure, the output path(s)."""
    cmd = "python -m trainer " + " ".join(_quote(a) for a in argv)
    if result["rc"] == 0:
        shown = result["outputs"][:8]
        more = f" (and {len(result['outputs']) - 8} more)" if len(result["outputs"]) > 8 else ""
        paths = ", ".join(f"`{p}`" for p in shown) + more
        return f"OK: Done: `{cmd}`" + (f"\n\nWrote {paths}" if paths else "")
    last = (result["tail"].splitlines() or ["(no output)"])[-1]
    return f"Error: `{cmd}` failed: {last}"


def _quote(arg: str) -> str:
    return f'"{arg}"' if (not arg or any(c.isspace() for c in arg)) else arg


def run_controls(prefix: str, label: str) -> Tuple[Any, Any, Any, Any]:
    """Run and Cancel buttons, the message and the tool's last output lines (``<prefix>-run`` …)."""
    with gr.Row():
        go = gr.Button(label, elem_id=f"{prefix}-run", scale=3)
        cancel = gr.Button("Cancel", variant="stop", elem_id=f"{prefix}-cancel", scale=1)
    msg = gr.Markdown(elem_id=f"{prefix}-msg")
    tail = gr.Code(label="Last output lines", language=None, interactive=False, elem_id=f"{prefix}-tail")
    return go, cancel, msg, tail


def model_tools(ctx: AppContext) -> None:
    """The "Model tools" section: one small form for convert / merge / resize / sample."""
    with gr.Group(elem_id="tools-model"):
        gr.Markdown("### Model tools\nConvert a model between a diffusers folder and one `.safetensors` file, merge "
                    "LoRAs into it, lower a LoRA's rank, or draw images with it (and LoRAs). Runs "
                    "`python -m trainer <tool>`; every family the trainer knows.")
        with gr.Row():
            tool = gr.Radio(list(MODEL_TOOLS), value="convert", label="Tool", elem_id="tools-model-tool")
            to = gr.Dropdown(["single-file", "diffusers"], value="single-file", label="Convert to",
                             elem_id="tools-model-to")
            dtype = gr.Dropdown(["auto", "fp32", "fp16", "bf16"], value="auto", label="dtype",
                                elem_id="tools-model-dtype")
        model = gr.Textbox(label="Model (folder, .safetensors, hub id or builtin:tiny-sd)", elem_id="tools-model-path")
        loras = gr.Textbox(label="LoRA files, one a line, FILE[:WEIGHT] (resize: the one LoRA)", lines=2,
                           elem_id="tools-model-loras")
        with gr.Row():
            rank = gr.Number(label="Resize: new rank", value=None, precision=0, elem_id="tools-model-rank",
                             visible=False)
            prompt = gr.Textbox(label="Sample: prompt", elem_id="tools-model-prompt", visible=False)
            steps = gr.Number(label="Steps (empty = the model's own)", value=None, precision=0,
                              elem_id="tools-model-steps", visible=False)
            seed = gr.Number(label="Seed", value=42, precision=0, elem_id="tools-model-seed", visible=False)
            count = gr.Number(label="Images", value=1, precision=0, elem_id="tools-model-count", visible=False)
        with gr.Row():
            out = gr.Textbox(label="Output (file or folder; empty = next to the input)", elem_id="tools-model-out")
            overwrite = gr.Checkbox(label="Overwrite", value=False, elem_id="tools-model-overwrite")
        go, cancel, msg, tail = run_controls("tools-model", "Run the tool")
        images = gr.Gallery(label="Sampled images", columns=4, height=300, object_fit="contain",
                            elem_id="tools-model-images", visible=False)

    # each tool shows its own fields (the widgets keep their values while hidden)
    fields = {"to": to, "dtype": dtype, "model": model, "loras": loras, "rank": rank, "prompt": prompt,
              "steps": steps, "seed": seed, "count": count, "images": images}
    uses = {"convert": ("to", "dtype", "model"), "merge": ("dtype", "model", "loras"), "resize": ("loras", "rank"),
            "sample": ("model", "loras", "prompt", "steps", "seed", "count", "images")}

    def pick_tool(name: str) -> List[Any]:
        return [gr.update(visible=key in uses.get(name, ())) for key in fields]

    tool.change(pick_tool, [tool], list(fields.values()), show_progress="hidden")
    ctx.handlers["tools_model_pick"] = pick_tool

    confine = ctx.allowed_path

    written: Dict[str, List[str]] = {}  # page session -> what its last tool run wrote

    def run(tool_v, to_v, dtype_v, model_v, loras_v, rank_v, prompt_v, steps_v, seed_v, count_v, out_v,
            overwrite_v, request: gr.Request = None) -> List[Any]:
        model_v, why = confine(model_v, "The model")
        lines = []
        for line in (loras_v or "").splitlines():
            if line.strip():
                file, weight = line.strip(), ""
                head, sep, tail = file.rpartition(":")
                if sep and head and tail.replace(".", "", 1).lstrip("-").isdigit():
                    file, weight = head, f":{tail}"
                file, why_lora = confine(file, "The LoRA")
                why = why or why_lora
                lines.append(file + weight)
        loras_v = "\n".join(lines)
        if (out_v or "").strip():
            out_v, why_out = confine(out_v, "The output")
            why = why or why_out
        wrote = written.setdefault(getattr(request, "session_hash", None) or "", [])
        wrote.clear()
        if why:
            yield [f"Error: {why}", ""]
            return
        argv, missing = tool_command(tool_v, model_v, loras_v, out_v, to=to_v, dtype=dtype_v, rank=rank_v,
                                     prompt=prompt_v, steps=steps_v, seed=seed_v, count=count_v,
                                     overwrite=bool(overwrite_v), workspace=str(ctx.workspace))
        if not argv:
            yield [f"Error: {tool_v}: {missing}.", ""]
            return
        yield from progress_updates(argv, wrote)

    def sampled(request: gr.Request = None) -> Any:
        """The images the last tool run of this page wrote, shown on the page: a share link's user cannot open a
        path on the server."""
        shown = tool_images(written.pop(getattr(request, "session_hash", None) or "", []), ctx.roots.allowed)
        return gr.Gallery(value=shown or None, visible=bool(shown))

    ctx.handlers.update(tools_model_run=run, tools_model_images=sampled)
    go.click(lambda: gr.Gallery(value=None, visible=False), None, [images], queue=False, show_progress="hidden")
    job = go.click(run, [tool, to, dtype, model, loras, rank, prompt, steps, seed, count, out, overwrite], [msg, tail])
    job.then(sampled, None, [images], show_progress="hidden")
    cancel.click(lambda: "Cancelled: the tool was stopped; nothing half-written is left (outputs are renamed "
                 "into place only when complete).", None, [msg], cancels=[job])


MASK_METHODS = {"what the prompt names (CLIPSeg)": "clipseg", "the subject: remove the background (SAM)": "subject"}
# the page's captioner choice → the model used when the Model box is empty ("" = the command's default, BLIP)
CAPTIONERS = {"WD tagger: booru tags (ONNX)": DEFAULT_WD_TAGGER,
              "vision-language model: sentences (Qwen2.5-VL, Qwen3-VL, JoyCaption)": DEFAULT_VLM,
              "the model given (BLIP when empty), Florence-2": ""}
# after a caption run: the folder opens in the caption editor below (a click on its Open button, in the browser)
OPEN_IN_EDITOR_JS = """(tool, folder) => {
  if (tool !== 'caption' || !folder) return;
  const box = document.querySelector('#cap-folder textarea, #cap-folder input');
  const open = document.querySelector('#cap-open');
  if (!box || !open) return;
  box.value = folder;
  box.dispatchEvent(new Event('input', {bubbles: true}));
  const editor = document.querySelector('#caption-editor');
  const closed = editor && editor.querySelector('.label-wrap:not(.open)');
  if (closed) closed.click();
  setTimeout(() => open.click(), 300);
}"""


def caption_flags(*, style: str = "", max_new_tokens: Optional[float] = None, four_bit: bool = False,
                  control: str = "", character_threshold: Optional[float] = None, mcut: bool = False,
                  ratings: bool = False, exclude: str = "", append: bool = False, yes: bool = False) -> List[str]:
    """The caption command's options the page sets (tagger, vision-language model, batch)."""
    argv: List[str] = []
    if control.strip():
        argv += ["--style", "edit", "--control", control.strip()]
    elif style:
        argv += ["--style", style]
    if max_new_tokens:
        argv += ["--max-new-tokens", str(int(max_new_tokens))]
    if four_bit:
        argv.append("--load-in-4bit")
    if character_threshold:
        argv += ["--character-threshold", f"{float(character_threshold):g}"]
    argv += (["--use-mcut"] if mcut else []) + (["--rating-tags"] if ratings else [])
    if exclude.strip():
        argv += ["--exclude-tags", exclude.strip()]
    return argv + (["--append"] if append else []) + (["--yes"] if yes else [])


def dataset_command(tool: str, folder: str, *, model: str = "", prefix: str = "", suffix: str = "",
                    overwrite: bool = False, recursive: bool = False, prompt: str = "",
                    threshold: Optional[float] = None, invert: bool = False,
                    method: str = "clipseg", extra: Optional[List[str]] = None) -> Tuple[List[str], str]:
    """The arguments after ``python -m trainer`` for caption/mask, or ([], what is missing); ``extra``: more of
    the caption command's options (:func:`caption_flags`)."""
    if tool not in ("caption", "mask"):
        return [], "pick caption or mask"
    if not folder:
        return [], "give the folder of images"
    argv = [tool, folder]
    if model.strip():
        argv += ["--model", model.strip()]
    if tool == "caption":
        argv += (["--prefix", prefix] if prefix.strip() else []) + (["--suffix", suffix] if suffix.strip() else [])
        argv += list(extra or [])
    else:
        prompts = [p.strip() for p in prompt.split(",") if p.strip()]
        if method == "subject":
            argv += ["--method", "subject"]  # the thing at each image's centre: no prompt
        elif not prompts:
            return [], "give what to mask (a text prompt, e.g. 'dog'; several separated by commas)"
        else:
            for text in prompts:
                argv += ["--prompt", text]
        if invert:
            argv.append("--invert")
    if threshold:
        argv += ["--threshold", f"{float(threshold):g}"]
    if recursive:
        argv.append("--recursive")
    if overwrite and "--append" not in argv:
        argv.append("--overwrite")
    return argv, ""


def dataset_tools(ctx: AppContext) -> None:
    """Caption a folder of images, or make masks from a text prompt (python -m trainer caption|mask)."""
    with gr.Accordion("Dataset tools: captions and masks", open=False, elem_id="tools-dataset"):
        gr.Markdown("Write `<image>.txt` captions with a WD tagger (booru tags), a vision-language model "
                    "(sentences; edit pairs: the change from each control image to its image) or BLIP/Florence-2, or "
                    "`<image>-masklabel.png` masks (white = train) from a text prompt with CLIPSeg, or around "
                    "each image's subject with Segment Anything (background removal). Images that have a file "
                    "are skipped unless *Overwrite* or *Append* is ticked, so running again resumes a stopped run. "
                    "The model is downloaded on first use; the captions open in the caption editor below.")
        with gr.Row():
            tool = gr.Radio(["caption", "mask"], value="caption", label="Tool", elem_id="tools-data-tool")
            recursive = gr.Checkbox(label="Sub-folders too", value=False, elem_id="tools-data-recursive")
            overwrite = gr.Checkbox(label="Overwrite", value=False, elem_id="tools-data-overwrite")
            append = gr.Checkbox(label="Caption: append to existing captions", value=False,
                                 elem_id="tools-data-append")
        folder = gr.Textbox(label="Folder of images (a concept's folder)", elem_id="tools-data-folder")
        captioner = gr.Radio(list(CAPTIONERS), value=next(iter(CAPTIONERS)), label="Caption with",
                             elem_id="tools-data-captioner")
        model = gr.Textbox(label="Model (hub id or folder; empty = the captioner's default)",
                           placeholder=DEFAULT_WD_TAGGER, elem_id="tools-data-model")
        with gr.Row():
            prefix = gr.Textbox(label="Caption: prefix (e.g. the trigger word)", elem_id="tools-data-prefix")
            suffix = gr.Textbox(label="Caption: suffix", elem_id="tools-data-suffix")
            method = gr.Radio(list(MASK_METHODS), value=next(iter(MASK_METHODS)), label="Mask: keep",
                              elem_id="tools-data-method")
            prompt = gr.Textbox(label="Mask: what to keep (e.g. dog)", elem_id="tools-data-prompt")
            threshold = gr.Number(label="Threshold (empty = default)", value=None, elem_id="tools-data-threshold")
            invert = gr.Checkbox(label="Mask: invert", value=False, elem_id="tools-data-invert")
        with gr.Accordion("Captioner options", open=False, elem_id="tools-data-options"):
            with gr.Row():
                character = gr.Number(label="Tagger: character threshold (empty = the threshold)", value=None,
                                      elem_id="tools-data-character")
                mcut = gr.Checkbox(label="Tagger: MCut thresholds", value=False, elem_id="tools-data-mcut")
                ratings = gr.Checkbox(label="Tagger: rating tag first", value=False, elem_id="tools-data-ratings")
                exclude = gr.Textbox(label="Tagger: never write these tags (commas)", elem_id="tools-data-exclude")
            with gr.Row():
                style = gr.Dropdown(list(STYLES), value="detailed", label="Vision-language: style",
                                    elem_id="tools-data-style")
                new_tokens = gr.Number(label="Vision-language: longest caption in tokens (empty = the style's)",
                                       value=None, precision=0, elem_id="tools-data-tokens")
                four_bit = gr.Checkbox(label="Vision-language: 4-bit (CUDA)", value=False, elem_id="tools-data-4bit")
                yes = gr.Checkbox(label="Start a large model on the CPU anyway", value=False, elem_id="tools-data-yes")
            control = gr.Textbox(label="Edit pairs: folder of the images before the edit (paired by name; sets the "
                                       "edit style)", elem_id="tools-data-control")
        go, cancel, msg, tail = run_controls("tools-data", "Run")

    def run(tool_v, folder_v, model_v, prefix_v, suffix_v, prompt_v, threshold_v, invert_v, recursive_v,
            overwrite_v, method_v=next(iter(MASK_METHODS)), captioner_v="", append_v=False, character_v=None,
            mcut_v=False, ratings_v=False, exclude_v="", style_v="", tokens_v=None, four_bit_v=False, yes_v=False,
            control_v="") -> List[Any]:
        confine = ctx.allowed_path
        folder_v, why = confine(folder_v, "The folder")
        model_v, why_model = confine(model_v, "The model")
        control_v, why_control = confine(control_v, "The control folder") if (control_v or "").strip() else ("", "")
        if why or why_model or why_control:
            yield [f"Error: {why or why_model or why_control}", ""]
            return
        if tool_v == "caption" and not (model_v or "").strip():
            model_v = CAPTIONERS.get(captioner_v or "", "")
        vlm = tool_v == "caption" and captioner_v and CAPTIONERS.get(captioner_v) == DEFAULT_VLM
        extra = caption_flags(style=style_v if vlm else "", max_new_tokens=tokens_v if vlm else None,
                              four_bit=bool(four_bit_v) and bool(vlm), control=control_v or "",
                              character_threshold=character_v, mcut=bool(mcut_v), ratings=bool(ratings_v),
                              exclude=exclude_v or "", append=bool(append_v), yes=bool(yes_v))
        argv, missing = dataset_command(tool_v, folder_v, model=model_v, prefix=prefix_v or "", suffix=suffix_v or "",
                                        overwrite=bool(overwrite_v), recursive=bool(recursive_v),
                                        prompt=prompt_v or "", threshold=threshold_v, invert=bool(invert_v),
                                        method=MASK_METHODS.get(method_v, "clipseg"), extra=extra)
        if not argv:
            yield [f"Error: {tool_v}: {missing}.", ""]
            return
        yield from progress_updates(argv)

    ctx.handlers["tools_dataset_run"] = run
    job = go.click(run, [tool, folder, model, prefix, suffix, prompt, threshold, invert, recursive, overwrite, method,
                         captioner, append, character, mcut, ratings, exclude, style, new_tokens, four_bit, yes,
                         control], [msg, tail])
    job.then(None, [tool, folder], None, js=OPEN_IN_EDITOR_JS)
    captioner.change(lambda c: gr.update(placeholder=CAPTIONERS.get(c) or "Salesforce/blip-image-captioning-base"),
                     [captioner], [model])
    cancel.click(lambda: "Cancelled: the tool was stopped (files it finished are kept).", None, [msg], cancels=[job])
