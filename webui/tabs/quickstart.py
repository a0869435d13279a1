"""Quick start: three choices — which model, what to train, where the images are — fill the whole form
from the right preset (and the GPU's memory tier where a family has several).

The form stays the place for everything else; this only picks the preset and sets ``model.path`` and the
first concept's folder, checking both before anything changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import gradio as gr

from trainer.config.checks import config_from_dict, load_config
from trainer.config.load import preset_names, to_container
from trainer.errors import ConfigError
from trainer.config.preflight import looks_like_hub_id, model_path_problem
from webui.context import AppContext
from webui.form import load_outputs, load_updates

# model kind -> (label, {what to train: preset}); memory tiers: preset name + "-<N>gb" when it exists
KINDS: Dict[str, Tuple[str, Dict[str, str]]] = {
    "demo": ("Demo: the built-in tiny model (offline, a minute on a CPU)", {"LoRA": "demo", "Fine-tune": "demo-learns"}),
    "sd15": ("Stable Diffusion 1.5 (and models based on it)", {"LoRA": "sd15-lora", "Fine-tune": "sd15-finetune"}),
    "sd2": ("Stable Diffusion 2.x (768 px, v-prediction)", {"LoRA": "sd2-lora"}),
    "sdxl": ("SDXL (and Pony, Illustrious, … based on it)",
             {"LoRA": "sdxl-lora", "Fine-tune": "sdxl-finetune", "Embedding": "sdxl-embedding"}),
    "sd15-inpaint": ("SD 1.5 inpainting", {"LoRA": "sd15-inpaint-lora", "Fine-tune": "sd15-inpaint-finetune"}),
    "sdxl-inpaint": ("SDXL inpainting", {"LoRA": "sdxl-inpaint-lora"}),
    "pixart": ("PixArt-Σ / PixArt-α", {"LoRA": "pixart-sigma-lora", "Fine-tune": "pixart-sigma-finetune"}),
    "flux": ("Flux.1 dev / schnell", {"LoRA": "flux-lora-24gb", "Fine-tune": "flux-finetune"}),
    "sd3": ("Stable Diffusion 3.5 (large / medium)", {"LoRA": "sd35-large-lora"}),
    "chroma": ("Chroma", {"LoRA": "chroma-lora"}),
    "zimage": ("Z-Image (Turbo)", {"LoRA": "zimage-lora"}),
    "qwenimage": ("Qwen-Image", {"LoRA": "qwen-image-lora"}),
    "flux2": ("Flux.2 [klein]", {"LoRA": "flux2-klein-lora"}),
    "flux2-dev": ("Flux.2 [dev] (32B; 24 GB and up)", {"LoRA": "flux2-dev-lora"}),
    "cascade": ("Stable Cascade (stage C prior; lite under 16 GB)",
                {"LoRA": "cascade-lora-16gb", "Fine-tune": "cascade-finetune"}),
    "wuerstchen": ("Würstchen 2 (prior)", {"LoRA": "wuerstchen-2-lora"}),
}
TIERS = (8, 12, 16, 24, 32)


def preset_for(kind: str, what: str, card_gib: Optional[float]) -> str:
    """The preset for a model kind and method; a memory-tier preset (``-8gb`` …) when one fits the card."""
    presets = set(preset_names())
    base = KINDS[kind][1][what]
    if card_gib and what == "LoRA":
        stem = base.rsplit("-", 1)[0] if base.endswith("gb") else base
        fitting = [t for t in TIERS if t <= card_gib and f"{stem}-{t}gb" in presets]
        if fitting:
            return f"{stem}-{max(fitting)}gb"
    return base


def fill(kind: str, what: str, model_path: str, images: str, card_gib: Optional[float],
         resolve_path=lambda p: p) -> Tuple[Optional[Any], str, str]:
    """(config, preset, message); config None when a choice is missing or wrong (message says which)."""
    if kind not in KINDS:
        return None, "", "① Pick the model you train on."
    if what not in KINDS[kind][1]:
        return None, "", f"② {KINDS[kind][0]} has no preset for {what}: pick one of {', '.join(KINDS[kind][1])}."
    overrides: List[str] = []
    model_path = (model_path or "").strip()
    if model_path:
        problem = model_path_problem(resolve_path(model_path)) if not looks_like_hub_id(model_path) else None
        if problem:
            return None, "", f"① {problem}"
        overrides.append(f"model.path={model_path}")
    elif kind != "demo":
        return None, "", ("① Give the model: a .safetensors/.ckpt file, a diffusers folder or a hub id "
                          "(org/name) — use Browse for a file on this machine.")
    images = (images or "").strip()
    if not images and kind != "demo":
        return None, "", "③ Give the folder of your images (with a .txt caption next to each image)."
    if images:
        folder = Path(resolve_path(images))
        if not folder.is_dir():
            return None, "", f"③ `{images}` is not a folder on this machine: check it, or pick it with Browse."
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
        return None, "", f"⛔ {exc}"
    return cfg, preset, (f"Filled the form from preset **{preset}**" + (f", model `{model_path}`" if model_path else "")
                         + (f", images `{images}`" if images else "") + ". Check the tabs, then **Check settings** "
                         "and **Start training**.")


def build(ctx: AppContext, card_gib: Optional[float]) -> None:
    with gr.Accordion("Quick start: three choices fill the form", open=True, elem_id="quickstart") as fold:
        ctx.components["quickstart"] = fold  # folded on a reload that restores a draft (a returning user)
        with gr.Row(equal_height=True):
            kind = gr.Dropdown([(label, key) for key, (label, _) in KINDS.items()], value=None,
                               label="① Model you train on", elem_id="qs-kind", scale=2)
            what = gr.Radio(["LoRA", "Fine-tune", "Embedding"], value="LoRA", label="② What to train",
                            elem_id="qs-what", scale=1)
            card = gr.Number(value=card_gib or 24, label="GPU memory (GiB)", minimum=1, maximum=1024,
                             elem_id="qs-card", scale=1)
        model = ctx.browser.path_field(lambda: gr.Textbox(label="① Model file, diffusers folder or hub id",
                                                          scale=10, elem_id="qs-model"), "qs-model") \
            if ctx.browser else gr.Textbox(label="Model", elem_id="qs-model")
        images = ctx.browser.path_field(lambda: gr.Textbox(label="③ Folder of your images", scale=10,
                                                           elem_id="qs-images"), "qs-images") \
            if ctx.browser else gr.Textbox(label="Images", elem_id="qs-images")
        go = gr.Button("Fill the form", variant="primary", elem_id="qs-fill")
        note = gr.Markdown(elem_id="qs-note")

    def methods(k: Optional[str]) -> Any:
        choices = list(KINDS[k][1]) if k in KINDS else ["LoRA", "Fine-tune", "Embedding"]
        return gr.Radio(choices=choices, value=choices[0])

    kind.change(methods, [kind], [what], show_progress="hidden")

    def wire() -> None:
        form = ctx.form
        assert form is not None
        from webui.tabs.config_bar import write_draft, write_ui_state
        from webui.tabs.extras import resolve_path

        def do_fill(k: Optional[str], w: str, path: str, folder: str, gib: Any) -> List[Any]:
            cfg, preset, message = fill(k or "", w, path, folder, float(gib) if gib else None, resolve_path)
            if cfg is None:
                return [gr.skip()] * len(load_outputs(form)) + [gr.skip(), message]
            values = form.values_for(cfg)
            write_draft(ctx, form.raw_dict(values))
            write_ui_state(ctx, preset=preset)
            return load_updates(form, values) + [gr.Dropdown(value=preset), message]

        ctx.handlers["quickstart_fill"] = do_fill
        go.click(do_fill, [kind, what, model, images, card], load_outputs(form) + [ctx["preset"], note])
    ctx.after_build.append(wire)


__all__ = ["KINDS", "build", "fill", "preset_for"]
