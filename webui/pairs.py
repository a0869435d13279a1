"""What an example is, shown on the page: a concept's role (a badge, so a regularisation set is not taken for a
subject), its control folders, and its pairs side by side (target | control 1 | control 2 …) with every unpaired
target or control named.

The pairs come from the trainer's own rule (``trainer.data.concepts.pair_listing``, by file name), through
``trainer.data.report.concept_pairs`` for the dataset report; nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gradio as gr

from trainer.config.schema import ConceptConfig
from trainer.data.concepts import pair_key, pair_listing
from webui.imagefiles import OUTSIDE, UnreadableImage, grey_tile, open_rgb
from webui.pathlist import resolve_path, split_lines
from webui.schema_widgets import choice_notes

PAIR_ROWS = 4       # pairs shown per concept in the report
NAMES_SHOWN = 20    # unpaired files named per concept before "and N more"
THUMB = 192


def role_notes() -> Dict[str, str]:
    """Each role with its line of the schema's help (``data.concepts.role``)."""
    meta = {f.name: f for f in dataclasses.fields(ConceptConfig)}["role"].metadata
    return choice_notes(meta.get("help", ""), meta.get("choices", ()))


def role_badge(role: str) -> str:
    """HTML: a badge naming a role other than train, with what it means ("" for train)."""
    role = str(role or "train")
    if role == "train":
        return ""
    note = role_notes().get(role, "")
    return (f'<span class="atl-role atl-role-{html.escape(role)}" title="{html.escape(note)}">'
            f"{html.escape(role.replace('_', ' '))}</span>" + (f" <small>{html.escape(note)}</small>" if note else ""))


def thumb(path: Path, size: int = THUMB) -> Any:
    """A small copy, so previews stay light even for 8-megapixel photos; :class:`UnreadableImage` (an OSError)
    with the reason when the file cannot be shown."""
    small, why = open_rgb(path, size)
    if small is None:
        raise UnreadableImage(why)
    return small


def _code(text: str) -> str:
    return f"<code>{html.escape(text)}</code>"


def concept_head(entry: dict) -> str:
    """HTML: "concept 1 · edits", its role badge and its control folders."""
    name = entry.get("name") or Path(str(entry.get("path") or "")).name
    parts = [f"<b>concept {entry['index']}</b> · {html.escape(str(name))}", role_badge(entry.get("role", "train"))]
    controls = entry.get("controls") or []
    missing = set(entry.get("missing_folders") or [])
    if controls:
        shown = [_code(c) + (" — does not exist" if c in missing else "") for c in controls]
        parts.append("control folders: " + ", ".join(shown))
    else:
        parts.append("no control folders")
    return '<div class="atl-concept-head">' + " · ".join(p for p in parts if p) + "</div>"


def pair_gallery(entry: dict, rows: int = PAIR_ROWS,
                 allowed: Callable[[Path], bool] = lambda p: True) -> List[Tuple[Any, str]]:
    """The first ``rows`` pairs as gallery items, row by row: target, then each control, with file names; a file
    that cannot be shown, or that ``allowed`` refuses (a link leading outside the page's folders), is a grey tile."""
    items: List[Tuple[Any, str]] = []
    for pair in (entry.get("pairs") or [])[:rows]:
        files = [("target", pair["target"])] + [(f"control {k + 1}", c) for k, c in enumerate(pair["controls"])]
        for what, file in files:
            small, why = open_rgb(Path(file), THUMB) if allowed(Path(file)) else (None, OUTSIDE)
            items.append((small, f"{what}: {Path(file).name}") if small is not None else  # the report says why
                         (grey_tile(THUMB), f"{what}: {Path(file).name} ({'unreadable' if why != OUTSIDE else why})"))
    return items


def _named(entries: Sequence[dict], limit: int = NAMES_SHOWN) -> str:
    shown = ", ".join(f"`{e['file']}`" for e in entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def unpaired_md(entry: dict) -> str:
    """Markdown: the line validate gives for the concept, then every unpaired target and control by folder."""
    lines = []
    if entry.get("error"):
        lines.append(f"Error: {entry['error']}")
    for key, what in (("unpaired_targets", "image(s) with no control of their name in"),
                      ("unpaired_controls", "control(s) with no image of their name in the concept, in")):
        by_folder: Dict[str, List[dict]] = {}
        for e in entry.get(key) or []:
            by_folder.setdefault(e["folder"], []).append(e)
        for folder, files in by_folder.items():
            lines.append(f"- {len(files)} {what} `{folder}`: {_named(files)} — they would not train.")
    if entry.get("controls") and not lines:
        lines.append(f"OK: All {len(entry.get('pairs') or [])} images have their control in every folder.")
    return "\n".join(lines)


def pairs_caption(entry: dict, rows: int = PAIR_ROWS) -> str:
    n = len(entry.get("pairs") or [])
    cols = " | ".join(["target"] + [f"control {k + 1}" for k in range(len(entry.get("controls") or []))])
    return f"{n} pairs ({cols})" + (f", showing {rows}" if n > rows else "")


def render_report(entries: Sequence[dict], elem_prefix: str,
                  allowed: Callable[[Path], bool] = lambda p: True) -> None:
    """The report's per-concept view (call inside ``gr.render``): role and control folders of every concept; for a
    concept with controls, its first pairs side by side (what ``allowed`` refuses greyed) and every unpaired file
    named."""
    for entry in entries:
        with gr.Group(elem_classes=["atl-card"], elem_id=f"{elem_prefix}-pairs-{entry['index']}",
                      key=f"{elem_prefix}-pairs-{entry['index']}"):
            gr.HTML(concept_head(entry), elem_id=f"{elem_prefix}-pairs-{entry['index']}-head")
            if not entry.get("controls"):
                if entry.get("error"):
                    gr.Markdown(f"Error: {entry['error']}")
                continue
            items = pair_gallery(entry, allowed=allowed)
            with gr.Row():
                with gr.Column(scale=1, min_width=240):  # narrow: a pair's tiles stay thumbnails, side by side
                    if items:
                        gr.Gallery(items, columns=1 + len(entry["controls"]), height="auto", object_fit="contain",
                                   allow_preview=False, label=pairs_caption(entry),
                                   elem_id=f"{elem_prefix}-pairs-{entry['index']}-gallery")
                with gr.Column(scale=2):
                    gr.Markdown(unpaired_md(entry), elem_id=f"{elem_prefix}-pairs-{entry['index']}-unpaired")


# --------------------------------------------------------------------------------------------------
# the caption editor: an image with its controls
# --------------------------------------------------------------------------------------------------

def concept_of_folder(folder: Path, concepts: Sequence[dict]) -> Tuple[Optional[int], dict]:
    """(index, concept) of the enabled concept whose folder is ``folder`` ((None, {}) when none is)."""
    for i, concept in enumerate(concepts):
        path = str(concept.get("path") or "")
        if not path or path.startswith("builtin:") or concept.get("enabled") is False:
            continue
        try:
            if Path(resolve_path(path)).resolve() == folder.resolve():
                return i, concept
        except OSError:
            continue
    return None, {}


def controls_of(image: Path, folder: Path, control_folders: Sequence[str]) -> List[Optional[Path]]:
    """The control of ``image`` (an image of ``folder``) in each control folder, by the trainer's pairing rule;
    None where a folder has none (or does not exist)."""
    folders = [Path(resolve_path(c)) for c in control_folders]
    listing = pair_listing(folder, [image], folders, recursive=False)
    key = pair_key(image, folder)
    return [(found or {}).get(key) for found in listing.found]


def image_with_controls(image: Path, folder: Path, control_text: Any,
                        allowed: Callable[[Path], bool] = lambda p: True) -> Tuple[List[Tuple[Any, str]], str]:
    """Gallery items (the image, then each control) and one line: what is missing, or that the pair is whole. A
    file ``allowed`` refuses (a link leading outside the page's folders) is a grey tile, named in the line."""
    folders = split_lines(control_text)
    if not folders:
        return [], ""
    controls = controls_of(image, folder, folders)
    items: List[Tuple[Any, str]] = []
    unreadable = []
    for what, file in [("image", image)] + [(f"control {k + 1}", c) for k, c in enumerate(controls) if c is not None]:
        small, why = open_rgb(file, 256) if allowed(file) else (None, OUTSIDE)
        items.append((small if small is not None else grey_tile(256), f"{what}: {file.name}"))
        if why:
            unreadable.append(f"`{file.name}` cannot be shown: {why}.")
    missing = [folders[k] for k, c in enumerate(controls) if c is None]
    if unreadable:
        return items, "Error: " + " ".join(unreadable)
    if missing:
        where = ", ".join(f"`{m}`" for m in missing)
        return items, (f"Error: `{image.name}` has no control image of its name in {where}: it would not train. Add "
                       f"`{image.stem}` (any image extension) there, or move the image out of the concept.")
    return items, f"The caption is the instruction from {'these controls' if len(controls) > 1 else 'the control'} " \
                  f"to `{image.name}`."


__all__ = ["concept_head", "concept_of_folder", "controls_of", "image_with_controls", "pair_gallery",
           "render_report", "role_badge", "role_notes", "thumb", "unpaired_md"]
