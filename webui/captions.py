"""The caption editor of the Tools tab: a folder's images with their ``<image>.txt`` captions, edited in place;
search and replace across the folder; how often each tag occurs. For a concept with control folders (an edit
pair: the caption is the instruction), the image's control images show beside it, and an image without one is
named. Torch-free; writes atomically.

An opened folder is kept as a :class:`FolderView` (its listing, every caption, the tag counts and the shown tiles),
so saving one caption writes that file and updates its tile and the tag counts from the old and new text: at 50k
images a save costs what one file costs, not a re-listing of the folder. The view is checked against the folder's
own mtime (a file added, removed or renamed by anything else makes the next action re-open the folder), and
Replace-in-all first re-reads the captions whose file changed since (a stat each), then rewrites only the captions
that change.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
import threading
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import gradio as gr
from gradio.utils import get_upload_folder
from PIL import Image

from trainer.config.load import PRESETS_DIR
from trainer.data.concepts import MASK_SUFFIX, pair_listing
from trainer.data.dataset import gc_paused
from trainer.io import atomic_write_bytes
from webui.context import AppContext
from webui.imagefiles import UnreadableImage, grey_tile, open_rgb, page_images, skipped_md
from webui.pairs import concept_of_folder, image_with_controls, thumb
from webui.pathlist import resolve_path, split_lines
from webui.schema_widgets import table_from_widget

EXTENSION = ".txt"
SHOWN = 200          # tiles in the grid
VIEWS_KEPT = 4       # opened folders remembered (per page process)


def folder_images(ctx: AppContext, folder: Path) -> Tuple[List[Path], List[Tuple[str, str]]]:
    """``(images, left out)``: the folder's training images (masks are not images to caption), sorted, that the page
    may show, and each entry with an image's name it leaves out with the reason (a folder, a broken link, a link
    of the image, its caption or its mask leading outside the page's folders)."""
    return page_images(folder, ctx.roots.allowed, caption_ext=EXTENSION)


def image_of(ctx: AppContext, folder: Path, name: str) -> Optional[Path]:
    """The image ``name`` of ``folder`` when the folder's listing holds it (no path, no link leading out)."""
    image = folder / (name or "")
    return image if name and image in folder_images(ctx, folder)[0] else None


def caption_file(image: Path) -> Path:
    return image.with_suffix(EXTENSION)


def read_caption(image: Path) -> str:
    try:
        return caption_file(image).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def write_caption(image: Path, text: str) -> None:
    atomic_write_bytes(caption_file(image), (text.strip() + "\n").encode("utf-8"))


def mask_of(image: Path) -> Path:
    return image.with_name(image.stem + MASK_SUFFIX)


def thumbnail(image: Path, size: int = 192) -> Any:
    """A small copy; with a mask, what the mask leaves out (black) is darkened, so masks show in the grid.
    :class:`UnreadableImage` (with the reason) when the image cannot be shown."""
    small = thumb(image, size)
    mask = mask_of(image)
    if mask.exists():
        keep, _ = open_rgb(mask, max(small.size))  # a mask that cannot be read darkens nothing
        if keep is None:
            return small
        keep = keep.convert("L").resize(small.size)
        dark = small.point(lambda v: int(v * 0.3))
        small = Image.composite(small, dark, keep.point(lambda v: 255 if v >= 128 else 0))
    return small


def grid_item(image: Path, size: int = 192) -> Tuple[Any, str]:
    """(the grid's tile for ``image``, "") or (a grey tile, why the image cannot be shown)."""
    try:
        return thumbnail(image, size), ""
    except UnreadableImage as exc:
        return grey_tile(size), str(exc)


def tags_of(text: str, delimiter: str = ",") -> set:
    """The tags of one caption (split at the delimiter, stripped, each once)."""
    return {t.strip() for t in text.split(delimiter) if t.strip()}


def tag_table(counts: Counter) -> List[Tuple[str, int]]:
    """Tags with how many captions hold them, most common first (ties by name)."""
    return sorted(((tag, n) for tag, n in counts.items() if n > 0), key=lambda kv: (-kv[1], kv[0]))


def tag_counts(images: List[Path], delimiter: str = ",") -> List[Tuple[str, int]]:
    """Each tag (caption split at the delimiter) with how many captions hold it, most common first."""
    counts: Counter = Counter()
    for image in images:
        counts.update(tags_of(read_caption(image), delimiter))
    return tag_table(counts)


def tile_label(image: Path, caption: str, why: str = "") -> str:
    """The grid's label under a tile: the caption's start (and "· mask"), or why the image cannot be shown."""
    if why:
        return f"Error: cannot be shown (see above): {why}"[:80]
    return (caption[:60] or "(no caption)") + (" · mask" if mask_of(image).exists() else "")


def _stamp(path: Path) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _read_stamped(path: str) -> Tuple[Optional[Tuple[int, int]], str]:
    """(the caption file's stamp as :func:`_stamp` gives it, its text as :func:`read_caption` gives it), from one
    open: the stamp is that of the file read. ``(None, "")`` when there is no such file."""
    try:
        fh = open(path, "rb", buffering=0)
    except OSError:
        return _stamp(Path(path)), ""  # None, or a file that cannot be opened (read as no caption)
    with fh:
        st = os.fstat(fh.fileno())
        try:
            raw = fh.readall()
        except OSError:  # a folder named like a caption
            raw = b""
    return (st.st_mtime_ns, st.st_size), raw.decode("utf-8", errors="replace").strip()


_TILE_NUMBERS = itertools.count()


def tile_file(tile: Image.Image, folder: Path) -> str:
    """``tile`` written once as a small file the page serves (in Gradio's own upload folder): a grid of file paths
    costs Gradio a few milliseconds to send again, a grid of images an encode of every tile (~140 ms for 200 here),
    so saving one caption re-encodes only its own tile."""
    path = folder / f"{next(_TILE_NUMBERS)}.webp"
    tile.save(path, format="WEBP", quality=90)
    return str(path)


class FolderView:
    """One opened folder as the editor shows it: its images (the page's listing), every caption with its file's
    stamp, the tag counts, and the tiles of the first :data:`SHOWN` images. Edits update it in place."""

    @gc_paused()  # tens of thousands of paths and captions made at once (see trainer.data.dataset.gc_paused)
    def __init__(self, root: Path, allowed: Callable[[Path], bool]):
        self.root = root
        self.allowed = allowed
        self.lock = threading.Lock()
        self.images, self.left_out = page_images(root, allowed, caption_ext=EXTENSION)
        self.by_name: Dict[str, Path] = {i.name: i for i in self.images}
        with os.scandir(root) as listing:  # which captions and masks exist: one listing, not a stat per image
            names = {e.name for e in listing}
        self.stamps: Dict[Path, Optional[Tuple[int, int]]] = {}
        self.captions: Dict[Path, str] = {}
        tags: List[str] = []
        for image in self.images:
            path, stem = os.fspath(image), image.stem
            cap = path[:len(path) - len(image.suffix)] + EXTENSION  # caption_file(image), without pathlib's parsing
            stamp, text = _read_stamped(cap) if stem + EXTENSION in names else (None, "")
            self.stamps[image], self.captions[image] = stamp, text
            if text:
                tags.extend(tags_of(text))
        self.counts: Counter = Counter(tags)
        self.masked = sum(1 for i in self.images if i.stem + MASK_SUFFIX in names and mask_of(i).exists())
        self.shown: Dict[Path, int] = {i: k for k, i in enumerate(self.images[:SHOWN])}
        self.tiles: List[Tuple[Any, str]] = []
        self.unreadable: List[Tuple[str, str]] = []
        folder = Path(get_upload_folder()) / "caption-tiles"
        folder.mkdir(parents=True, exist_ok=True)
        self.tile_folder = Path(tempfile.mkdtemp(dir=folder))
        for image in self.images[:SHOWN]:
            tile, why = grid_item(image)
            if why:
                self.unreadable.append((image.name, why))
            self.tiles.append((tile_file(tile, self.tile_folder), tile_label(image, self.captions[image], why)))
        self.folder_stamp = _stamp(root)

    def close(self) -> None:
        """Remove the view's tile files (the page keeps the copies Gradio served)."""
        shutil.rmtree(self.tile_folder, ignore_errors=True)

    def stale(self) -> bool:
        """Whether anything else added, removed or renamed a file of the folder since the view was made."""
        return _stamp(self.root) != self.folder_stamp

    def image(self, name: str) -> Optional[Path]:
        """The image ``name`` when the listing holds it and it still is what the listing let in: a regular file
        whose links, caption file and mask stay inside the page's folders (checked again, a few stats)."""
        image = self.by_name.get(name or "")
        if image is None or not image.is_file():
            return None
        companions = [image, mask_of(image), caption_file(image)]
        if any((c == image or c.is_symlink() or c.exists()) and not self.allowed(c) for c in companions):
            return None
        return image

    def _set(self, image: Path, text: str) -> None:
        self.counts.subtract(tags_of(self.captions.get(image, "")))
        self.counts.update(tags_of(text))
        self.captions[image] = text
        self.stamps[image] = _stamp(caption_file(image))

    def save(self, image: Path, text: str) -> None:
        """Write one caption and update the view: that caption's tags in the counts, its tile (made again: the
        image or its mask may have changed too) and label."""
        write_caption(image, text)
        with self.lock:
            self._set(image, text.strip())
            if image in self.shown:
                tile, why = grid_item(image)
                self.tiles[self.shown[image]] = (tile_file(tile, self.tile_folder),
                                                 tile_label(image, self.captions[image], why))
            self.folder_stamp = _stamp(self.root)  # our own write renamed a file in

    def refresh(self) -> int:
        """Read again the captions whose file changed since they were read (one stat each); how many."""
        changed = 0
        for image in self.images:
            stamp = _stamp(caption_file(image))
            if stamp != self.stamps.get(image):
                with self.lock:
                    self._set(image, read_caption(image) if stamp is not None else "")
                changed += 1
        return changed

    def replace(self, find: str, replace: str, regex: bool = False) -> List[Path]:
        """Replace ``find`` in every caption (plain text or a regular expression), reading again first the
        captions changed elsewhere; only the captions that change are written. The images whose caption
        changed."""
        if not find:
            return []
        pattern = re.compile(find) if regex else None
        self.refresh()
        changed = []
        for image in self.images:
            old = self.captions[image]
            if not (pattern.search(old) if pattern else find in old):
                continue
            new = pattern.sub(replace, old) if pattern else old.replace(find, replace)
            if new != old:
                self.save(image, new)
                changed.append(image)
        return changed

    def note(self) -> str:
        """The line above the grid: counts, files left out, tiles that cannot be shown."""
        missing = sum(1 for stamp in self.stamps.values() if stamp is None)
        masked = self.masked
        head = f"{len(self.images)} images in `{self.root}`, {missing} without a caption, {masked} with a mask " \
            "(the darkened part of a thumbnail is masked out)" + \
            (f" (showing {SHOWN})" if len(self.images) > SHOWN else "")
        if self.left_out:
            head += "\n\n" + skipped_md(self.left_out)
        if self.unreadable:
            head += "\n\n" + skipped_md(self.unreadable, "image(s) cannot be shown (grey tiles)")
        return head

    def gallery(self) -> List[Tuple[Any, str]]:
        return list(self.tiles)

    def tag_table(self) -> List[Tuple[str, int]]:
        return tag_table(self.counts)


def replace_all(images: List[Path], find: str, replace: str, regex: bool = False) -> List[Path]:
    """Replace ``find`` in every caption (plain text, or a regular expression); the captions changed."""
    if not find:
        return []
    pattern = re.compile(find) if regex else None
    changed = []
    for image in images:
        old = read_caption(image)
        new = pattern.sub(replace, old) if pattern else old.replace(find, replace)
        if new != old:
            write_caption(image, new)
            changed.append(image)
    return changed


def image_folder(ctx: AppContext, text: str) -> Tuple[Optional[Path], str]:
    """(folder, "") when ``text`` is a folder inside the page's folders, else (None, the message)."""
    try:
        path, why = ctx.allowed_path(text, "The folder")
    except (OSError, RuntimeError):  # a link loop, a name the system refuses
        return None, f"Error: `{text}` is not a usable path."
    if why:
        return None, f"Error: {why}"
    if not path or not Path(path).is_dir():
        return None, f"Error: `{text}` is not a folder: pick the folder of your images."
    return Path(path), ""


def read_only_folder(ctx: AppContext, root: Path) -> str:
    """Why the page may not write captions or masks in ``root`` ("" when it may). Atelier's shipped presets
    (``presets/demo-data``) are read, never written: an edit there would change every user's demo and be undone
    by the next update. The message says how to edit a copy instead."""
    presets = PRESETS_DIR.resolve()
    real = root.resolve()
    if real != presets and presets not in real.parents:
        return ""
    return (f"Error: `{root}` is part of Atelier's shipped presets, which this page only reads. Copy the folder into "
            f"the workspace (for example to `{ctx.workspace / root.name}`) and open the copy to edit its captions "
            "or masks.")


def control_summary(ctx: AppContext, root: Path, concepts: List[dict]) -> Tuple[str, str]:
    """(the control folders of the concept whose folder ``root`` is, one a line; a line on how its images pair)."""
    index, concept = concept_of_folder(root, concepts)
    folders = split_lines(concept.get("control_paths")) if index is not None else []
    if not folders:
        return "", ""
    listing = pair_listing(root, folder_images(ctx, root)[0], [Path(resolve_path(f)) for f in folders],
                           recursive=False)
    alone = sorted({name for k in range(len(folders)) for name in listing.targets_without(k)})
    missing = [f for f, found in zip(folders, listing.found) if found is None]
    name = f" ('{concept.get('name')}')" if concept.get("name") else ""
    line = (f"Concept {index}{name} pairs these images with {len(folders)} control folder(s): "
            f"{len(listing.pairs())} of {len(listing.targets)} have their control image(s), shown beside the image "
            "you caption (the caption is the instruction that turns the control into the image).")
    if missing:
        line += " Error: missing folder(s): " + ", ".join(f"`{m}`" for m in missing) + "."
    if alone:
        line += (" Error: without a control (they would not train): " + ", ".join(f"`{a}`" for a in alone[:20])
                 + (f" and {len(alone) - 20} more" if len(alone) > 20 else "") + ".")
    return "\n".join(folders), line


def build(ctx: AppContext) -> None:
    with gr.Accordion("Caption editor", open=False, elem_id="caption-editor"):
        with gr.Row(equal_height=True):
            folder = gr.Textbox(label="Folder of images", elem_id="cap-folder", scale=4)
            load = gr.Button("Open", elem_id="cap-open", scale=1)
        note = gr.Markdown(elem_id="cap-note")
        controls = gr.Textbox(label="Control folders (one a line)", elem_id="cap-controls", lines=1,
                              info="Filled from the concept whose folder this is (Concepts tab): each image shows "
                                   "beside its control image(s), which its caption (the instruction) turns into it.")
        control_note = gr.Markdown(elem_id="cap-control-note")
        with gr.Row():
            gallery = gr.Gallery(columns=5, height=360, elem_id="cap-gallery", allow_preview=False,
                                 label="Click an image to edit its caption", scale=3)
            with gr.Column(scale=2):
                pair = gr.Gallery(columns=3, height=200, elem_id="cap-pair", allow_preview=False, visible=False,
                                  object_fit="contain", label="The image and its control image(s)")
                pair_note = gr.Markdown(elem_id="cap-pair-note")
                current = gr.Textbox(label="Image", interactive=False, elem_id="cap-image")
                caption = gr.Textbox(label="Caption", lines=4, elem_id="cap-text")
                save = gr.Button("Save caption", variant="primary", elem_id="cap-save")
        with gr.Row(equal_height=True):
            find = gr.Textbox(label="Find", elem_id="cap-find")
            repl = gr.Textbox(label="Replace with", elem_id="cap-replace")
            regex = gr.Checkbox(label="Regular expression", value=False, elem_id="cap-regex")
            go = gr.Button("Replace in every caption", elem_id="cap-replace-btn")
        tags = gr.Dataframe(headers=["tag", "captions"], interactive=False, elem_id="cap-tags",
                            label="Tags (split at commas), most common first")

    def where(text: str) -> Tuple[Optional[Path], str]:
        return image_folder(ctx, text)

    views: "OrderedDict[str, FolderView]" = ctx.components.setdefault("caption_views", OrderedDict())

    def view_of(root: Path, fresh: bool = False) -> FolderView:
        """The folder's view: the one kept from the last action unless ``fresh`` or the folder changed since."""
        key = str(root)
        view = views.get(key)
        if view is None or fresh or view.stale():
            if view is not None:
                view.close()
            view = FolderView(root, ctx.roots.allowed)
            views[key] = view
        views.move_to_end(key)
        while len(views) > VIEWS_KEPT:
            views.popitem(last=False)[1].close()
        return view

    def show(text: str) -> List[Any]:
        root, why = where(text)
        if root is None:
            return [why, [], "", "", None]
        view = view_of(root, fresh=True)  # Open reads the folder afresh
        head = view.note()
        if read_only_folder(ctx, root):
            head += "\n\n" + read_only_folder(ctx, root).replace("Error:", "Read-only:", 1)
        return [head, view.gallery(), "", "", view.tag_table() or None]

    def pick(text: str, evt: gr.SelectData) -> List[Any]:
        root, _ = where(text)
        images = view_of(root).images[:SHOWN] if root else []
        i = evt.index if isinstance(evt.index, int) else (evt.index or [0])[0]
        if not 0 <= i < len(images):
            return ["", ""]
        return [images[i].name, read_caption(images[i])]

    def store(text: str, name: str, new: str) -> List[Any]:
        root, why = where(text)
        if root is None or not name:
            return [why or "Click an image first.", gr.skip(), gr.skip()]
        view = view_of(root)
        image = view.image(name)
        if image is None:
            return [f"Error: `{name}` is not an image of this folder.", gr.skip(), gr.skip()]
        if read_only_folder(ctx, root):
            return [read_only_folder(ctx, root), gr.skip(), gr.skip()]
        try:
            view.save(image, new)
        except OSError as exc:
            return [f"Error: could not write `{caption_file(image).name}`: {exc.strerror or exc}", gr.skip(), gr.skip()]
        return [f"Saved `{caption_file(image).name}`.", view.gallery(), view.tag_table() or None]

    def replace(text: str, f: str, r: str, rx: bool) -> List[Any]:
        root, why = where(text)
        if root is None:
            return [why, gr.skip(), gr.skip()]
        if f and read_only_folder(ctx, root):
            return [read_only_folder(ctx, root), gr.skip(), gr.skip()]
        view = view_of(root)
        try:
            changed = view.replace(f, r, bool(rx))
        except re.error as exc:
            return [f"Error: find is not a valid regular expression: {exc}", gr.skip(), gr.skip()]
        except OSError as exc:
            return [f"Error: could not write a caption: {exc}", gr.skip(), gr.skip()]
        return [f"Replaced in {len(changed)} caption(s)." if f else "Type what to find first.", view.gallery(),
                view.tag_table() or None]

    def find_controls(text: str, table: Any) -> List[Any]:
        root, _ = where(text)
        editor = ctx.form.editors.get("data.concepts") if ctx.form else None
        if root is None or editor is None:
            return ["", ""]
        concepts, _ = table_from_widget(editor.spec, table)
        return list(control_summary(ctx, root, concepts))

    def show_pair(text: str, control_text: str, name: str) -> List[Any]:
        root, _ = where(text)
        image = image_of(ctx, root, name) if root is not None else None
        if image is None:
            return [gr.update(value=[], visible=False), ""]
        for folder in split_lines(control_text):
            if not ctx.roots.allowed(resolve_path(folder)):
                return [gr.update(value=[], visible=False),
                        f"Error: `{folder}` is outside the folders this page may show."]
        items, line = image_with_controls(image, root, control_text, ctx.roots.allowed)
        return [gr.update(value=items, visible=bool(items), columns=max(1, len(items))), line]

    ctx.handlers.update(captions_show=show, captions_store=store, captions_replace=replace,
                        captions_controls=find_controls, captions_pair=show_pair)
    opened = load.click(show, [folder], [note, gallery, current, caption, tags])
    picked = gallery.select(pick, [folder], [current, caption])
    picked.then(show_pair, [folder, controls, current], [pair, pair_note], show_progress="hidden")
    controls.input(show_pair, [folder, controls, current], [pair, pair_note], show_progress="hidden",
                   trigger_mode="always_last")
    editor = ctx.form.editors.get("data.concepts") if ctx.form else None
    if editor is not None:
        opened.then(find_controls, [folder, editor.table], [controls, control_note], show_progress="hidden").then(
            show_pair, [folder, controls, current], [pair, pair_note], show_progress="hidden")
    save.click(store, [folder, current, caption], [note, gallery, tags])
    go.click(replace, [folder, find, repl, regex], [note, gallery, tags])


__all__ = ["FolderView", "build", "folder_images", "image_folder", "read_caption", "read_only_folder", "replace_all", "tag_counts",
           "write_caption"]
