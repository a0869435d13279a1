"""Quick start: a few choices — which model, what to train, the GPU's memory, where the images are — fill the
whole form from the right preset (and the GPU's memory tier where a family has several).

The models and their presets come from the family registry (each family's ``info.py`` lists its
:class:`~trainer.families.QuickChoice`); the memory tiers of a preset are the ``<preset>-<N>gb`` files beside it.
The form stays the place for everything else; this only picks the preset and sets ``model.path`` and the
first concept's folder, checking every input before anything changes (all wrong ones are named at once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import gradio as gr

from trainer.config.checks import config_from_dict, load_config
from trainer.config.load import preset_names, to_container
from trainer.config.preflight import looks_like_hub_id, model_path_problem
from trainer.errors import ConfigError
from trainer.families import quick_choices
from trainer.memory.tiers import card_gib as tier_gib
from webui.context import AppContext
from webui.form import load_outputs, load_updates
from webui.tabs.config_bar import write_draft, write_ui_state
from webui.tabs.extras import resolve_path

# what the page calls each method -> training.method (the registry's presets are keyed by the latter)
METHODS: Dict[str, str] = {"LoRA": "lora", "Fine-tune": "finetune", "Embedding": "embedding"}
METHOD_LABELS: Dict[str, str] = {method: label for label, method in METHODS.items()}


def methods_of(kind: str) -> List[str]:
    """The methods a Quick start model has presets for, as the page names them, in the order offered."""
    return [METHOD_LABELS[m] for m in quick_choices()[kind].presets]


def memory_tiers(preset: str) -> Dict[int, str]:
    """A preset's memory tiers: card GiB -> preset, from the ``<stem>-<N>gb`` preset files (``sdxl-lora`` →
    {8: sdxl-lora-8gb, 12: …, 16: …}); a tier preset's own stem counts (``flux-lora-24gb`` → flux-lora-12gb …).

    The name is the tier, read as :func:`trainer.memory.tiers.card_gib` reads a config's ``general.sized_for``;
    each tier preset's ``sized_for`` names the preset itself (a test holds them together), so the files need not
    be opened here."""
    gib = tier_gib(preset)
    stem = preset.removesuffix(f"-{gib}gb") if gib else preset
    return {tier_gib(name): name for name in preset_names()
            if tier_gib(name) and name == f"{stem}-{tier_gib(name)}gb"}


def preset_for(kind: str, what: str, card_gib: Optional[float]) -> str:
    """The preset for a model kind and method; a memory-tier preset (``-8gb`` …) when one fits the card."""
    base = quick_choices()[kind].presets[METHODS[what]]
    if card_gib and METHODS[what] == "lora":
        tiers = memory_tiers(base)
        fitting = [gib for gib in tiers if gib <= card_gib]
        if fitting:
            return tiers[max(fitting)]
    return base


STEPS = "①②③④⑤"  # the page's numbers for the Quick start's inputs, in the order they are laid out


def problems(kind: str, what: str, model_path: str, images: str, resolve_path=lambda p: p) -> List[str]:
    """Every wrong or missing Quick start input, each led by its step's number, in the page's order; [] when all
    are right. All are checked at once: a user with a wrong model and a wrong folder hears of both."""
    choice = quick_choices().get(kind)
    found: List[str] = []
    if choice is None:
        found.append(f"{STEPS[0]} Pick the model you train on.")
    elif what not in methods_of(kind):
        found.append(f"{STEPS[1]} {choice.label} has no preset for {what}: pick one of {', '.join(methods_of(kind))}.")
    model_path = (model_path or "").strip()
    if model_path:
        problem = model_path_problem(resolve_path(model_path)) if not looks_like_hub_id(model_path) else None
        if problem:
            found.append(f"{STEPS[3]} {problem}")
    elif choice is not None and not choice.builtin:
        found.append(f"{STEPS[3]} Give the model: a .safetensors/.ckpt file, a diffusers folder or a hub id "
                     "(org/name) — use Browse for a file on this machine.")
    images = (images or "").strip()
    if images and not Path(resolve_path(images)).is_dir():
        found.append(f"{STEPS[4]} `{images}` is not a folder on this machine: check it, or pick it with Browse.")
    elif not images and choice is not None and not choice.builtin:
        found.append(f"{STEPS[4]} Give the folder of your images (with a .txt caption next to each image).")
    return found


def fill(kind: str, what: str, model_path: str, images: str, card_gib: Optional[float],
         resolve_path=lambda p: p) -> Tuple[Optional[Any], str, str]:
    """(config, preset, message); config None when a choice is missing or wrong (the message names every one)."""
    found = problems(kind, what, model_path, images, resolve_path)
    if found:
        return None, "", ("**Nothing was filled in — the form is as it was.** Fix these, then press "
                          "**Fill the form** again:\n" + "\n".join(f"- Error: {line}" for line in found))
    model_path, images = (model_path or "").strip(), (images or "").strip()
    overrides = [f"model.path={model_path}"] if model_path else []
    preset = preset_for(kind, what, card_gib)
    try:
        cfg = load_config(preset=preset, overrides=overrides)
        if images:  # the first concept is the user's folder (the preset may have none, or the demo's)
            data = to_container(cfg)
            concepts = data["data"]["concepts"] or [{}]
            concepts[0] = {**concepts[0], "path": images, "name": Path(images.rstrip("/\\")).name or "images"}
            data["data"]["concepts"] = concepts
            cfg = config_from_dict(data)
    except ConfigError as exc:
        return None, "", f"**Nothing was filled in — the form is as it was.**\n- Error: {exc}"
    return cfg, preset, (f"Filled the form from preset **{preset}**" + (f", model `{model_path}`" if model_path else "")
                         + (f", images `{images}`" if images else "") + ". Check the tabs, then **Check settings** "
                         "and **Start training**.")


QUICK_TITLE = "Quick start: a few choices fill the form"


def folded(preset: Optional[str], what: str = "") -> Any:
    """The Quick start once the form is set: folded, its title saying what set the form (a returning user, a fill)."""
    said = what or (f"the form holds preset {preset}" if preset else "the form holds your last settings")
    return gr.Accordion(label=f"Quick start (used: {said}; open to choose again)", open=False)


def build(ctx: AppContext, card_gib: Optional[float]) -> None:
    """The Quick start accordion. ``card_gib``: the GPU's memory, None on a machine without one (the field then
    starts empty and the family's base preset is used until the user types their card's size)."""
    with gr.Accordion(QUICK_TITLE, open=True, elem_id="quickstart") as fold:
        ctx.components["quickstart"] = fold  # folded on a reload that restores a draft (a returning user)
        with gr.Row(equal_height=True):
            kind = gr.Dropdown([(c.label, key) for key, c in quick_choices().items()], value=None,
                               label=f"{STEPS[0]} Model you train on", elem_id="qs-kind", scale=2)
            what = gr.Radio(list(METHODS), value="LoRA", label=f"{STEPS[1]} What to train",
                            elem_id="qs-what", scale=1)
            # no minimum: an empty field reaches the server as 0, which Gradio would refuse (0 = no card known)
            card = gr.Number(value=card_gib, maximum=1024, elem_id="qs-card", scale=1,
                             label=f"{STEPS[2]} GPU memory (GiB)" + ("" if card_gib else ": no GPU found here"),
                             info=None if card_gib else "Type your training card's memory to get its memory tier.")
        model = ctx.browser.path_field(lambda: gr.Textbox(label=f"{STEPS[3]} Model file, diffusers folder or hub id",
                                                          scale=10, elem_id="qs-model"), "qs-model") \
            if ctx.browser else gr.Textbox(label=f"{STEPS[3]} Model", elem_id="qs-model")
        images = ctx.browser.path_field(lambda: gr.Textbox(label=f"{STEPS[4]} Folder of your images", scale=10,
                                                           elem_id="qs-images"), "qs-images") \
            if ctx.browser else gr.Textbox(label=f"{STEPS[4]} Images", elem_id="qs-images")
        go = gr.Button("Fill the form", variant="primary", elem_id="qs-fill")
        note = gr.Markdown(elem_id="qs-note")
    # the last Fill's refusal ("" once a fill, a preset or a file set the form): Check settings then says that
    # what it checked is the form as it was, not the Quick start's choices
    failed = gr.State("")
    ctx.components.update(qs_note=note, qs_failed=failed)

    def methods(k: Optional[str]) -> Any:
        choices = methods_of(k) if k in quick_choices() else list(METHODS)
        return gr.Radio(choices=choices, value=choices[0])

    kind.change(methods, [kind], [what], show_progress="hidden")

    def wire() -> None:
        form = ctx.form
        assert form is not None

        def do_fill(k: Optional[str], w: str, path: str, folder: str, gib: Any) -> List[Any]:
            gib = float(gib) if gib and float(gib) > 0 else None
            cfg, preset, message = fill(k or "", w, path, folder, gib, resolve_path)
            if cfg is None:
                return [gr.skip()] * len(load_outputs(form)) + [gr.skip(), gr.skip(), message, gr.skip(), message]
            values = form.values_for(cfg)
            write_draft(ctx, form.raw_dict(values))
            write_ui_state(ctx, preset=preset)
            # the form's old messages ("Settings look good", a refusal) were about the form this fill replaced;
            # the Quick start folds away, its title saying what it set (the note stays inside, for a second look)
            said = f"preset {preset}" + (f", model {path.strip()}" if (path or "").strip() else "") + \
                (f", images {folder.strip()}" if (folder or "").strip() else "")
            return load_updates(form, values) + [folded(preset, said), gr.Dropdown(value=preset), message, message, ""]

        ctx.handlers["quickstart_fill"] = do_fill
        go.click(do_fill, [kind, what, model, images, card],
                 load_outputs(form) + [fold, ctx["preset"], note, ctx["messages"], failed], show_progress_on=[note])
    ctx.after_build.append(wire)


__all__ = ["METHODS", "QUICK_TITLE", "STEPS", "build", "fill", "folded", "memory_tiers", "methods_of", "preset_for", "problems"]
