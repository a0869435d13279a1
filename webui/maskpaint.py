"""The mask painter of the Tools tab: paint over an image in the browser, saved as ``<image>-masklabel.png``
(white = train, black = ignored), the mask ``data.masks`` reads. Torch-free; writes atomically.

The image is the editor's background; the mask is its one layer, shown in translucent white. Painted
pixels are the layer's opaque ones: the saved mask is white there and black elsewhere, at the image's own
size. An existing mask is loaded into the layer, so it can be fixed instead of redrawn.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, List, Optional, Tuple

import gradio as gr
import numpy as np
from PIL import Image

from trainer.data.concepts import MASK_SUFFIX
from trainer.io import atomic_write_bytes
from webui.captions import folder_images, image_folder, image_of, mask_of, read_only_folder
from webui.context import AppContext
from webui.imagefiles import UnreadableImage, open_rgb, reason_for, size_of, skipped_md

PAINT = "rgba(255, 255, 255, 0.75)"


def mask_file(image: Path) -> Path:
    return mask_of(image)


def layer_from_mask(mask_path: Path, size: Tuple[int, int]) -> Any:
    """An RGBA layer: translucent white where the mask is white, transparent elsewhere."""
    with Image.open(mask_path) as m:
        m = m.convert("L").resize(size)
    layer = Image.new("RGBA", size, (255, 255, 255, 0))
    layer.putalpha(m.point(lambda v: 191 if v >= 128 else 0))
    return layer


def mask_from_layers(layers: List[Any], size: Tuple[int, int]) -> Any:
    """White (255) where any layer was painted (alpha > 0), black elsewhere, at ``size``."""
    painted = np.zeros((size[1], size[0]), dtype=bool)
    for layer in layers or []:
        if layer is None:
            continue
        img = layer if isinstance(layer, Image.Image) else Image.open(layer)
        img = img.convert("RGBA").resize(size, Image.NEAREST)
        painted |= np.asarray(img)[..., 3] > 0
    return Image.fromarray(np.where(painted, 255, 0).astype("uint8"), mode="L")


def save_mask(image: Path, layers: List[Any]) -> Path:
    """Write ``image``'s mask from the painted layers; :class:`UnreadableImage` when the image cannot be opened."""
    size, why = size_of(image)
    if size is None:
        raise UnreadableImage(why)
    buf = io.BytesIO()
    mask_from_layers(layers, size).save(buf, format="PNG")
    target = mask_file(image)
    atomic_write_bytes(target, buf.getvalue())
    return target


def build(ctx: AppContext) -> None:
    with gr.Accordion("Mask painter", open=False, elem_id="mask-painter"):
        gr.Markdown("Paint where the model should learn (white = train, unpainted = ignored); saved as "
                    f"`<image>{MASK_SUFFIX}` next to the image, which `data.masks` reads. The eraser fixes mistakes.")
        with gr.Row(equal_height=True):
            folder = gr.Textbox(label="Folder of images", elem_id="mask-folder", scale=3)
            image = gr.Dropdown([], label="Image", elem_id="mask-image", scale=2, allow_custom_value=True)
            load = gr.Button("Open", elem_id="mask-open", scale=1)
        editor = gr.ImageEditor(type="pil", image_mode="RGBA", layers=False, sources=(), elem_id="mask-editor",
                                brush=gr.Brush(colors=[PAINT], default_color=PAINT, color_mode="fixed",
                                               default_size=24),
                                eraser=gr.Eraser(default_size=24), height=520, label="Paint the mask")
        save = gr.Button("Save mask", variant="primary", elem_id="mask-save")
        note = gr.Markdown(elem_id="mask-note")

    def where(text: str) -> Tuple[Optional[Path], str]:
        return image_folder(ctx, text)

    def listing(text: str) -> List[Any]:
        root, why = where(text)
        if root is None:
            return [gr.Dropdown(choices=[], value=None), why]
        images, left_out = folder_images(ctx, root)
        names = [p.name for p in images]
        done = sum(1 for n in names if mask_file(root / n).exists())
        note = f"{len(names)} images, {done} with a mask." if names else f"Error: No images in `{root}`."
        return [gr.Dropdown(choices=names, value=names[0] if names else None),
                note + ("\n\n" + skipped_md(left_out) if left_out else "")]

    def open_image(text: str, name: Optional[str]) -> List[Any]:
        root, why = where(text)
        if root is None or not name:
            return [gr.skip(), why or "Pick an image."]
        path = image_of(ctx, root, name)
        if path is None:
            return [gr.skip(), f"Error: `{name}` is not an image of this folder."]
        background, why = open_rgb(path)
        if background is None:
            return [None, f"Error: `{name}` cannot be opened: {why}."]
        existing = mask_file(path)
        layer = Image.new("RGBA", background.size, (255, 255, 255, 0))
        state = " (no mask yet)"
        if existing.exists():
            try:
                layer, state = layer_from_mask(existing, background.size), " (its mask loaded)"
            except Exception as exc:  # Pillow raises many kinds on a damaged file; paint afresh instead
                state = (f" Error: its mask `{existing.name}` cannot be read ({reason_for(existing, exc)}): painting "
                         "starts blank, and Save mask replaces it")
        return [{"background": background, "layers": [layer], "composite": None}, f"Editing `{name}`{state}"]

    def store(text: str, name: Optional[str], value: Any) -> str:
        root, why = where(text)
        if root is None or not name:
            return why or "Pick an image."
        path = image_of(ctx, root, name)
        if path is None:
            return f"Error: `{name}` is not an image of this folder."
        if read_only_folder(ctx, root):
            return read_only_folder(ctx, root)
        layers = (value or {}).get("layers") or []
        try:
            target = save_mask(path, layers)
        except UnreadableImage as exc:
            return f"Error: `{name}` cannot be opened: {exc}."
        except OSError as exc:
            return f"Error: Could not write the mask: {exc}"
        return f"Saved `{target.name}`."

    ctx.handlers.update(mask_list=listing, mask_open=open_image, mask_store=store)
    folder.submit(listing, [folder], [image, note])
    load.click(listing, [folder], [image, note]).then(open_image, [folder, image], [editor, note])
    image.input(open_image, [folder, image], [editor, note])
    save.click(store, [folder, image, editor], [note])


__all__ = ["build", "layer_from_mask", "mask_file", "mask_from_layers", "save_mask"]
