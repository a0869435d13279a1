"""Lists of paths in a row editor: a concept's control folders, a sample prompt's control images.

The schema gives such a field as a one-path-a-line text box (it stays, and stays editable); :class:`PathList` adds
what a path field has — a Browse button on the page's file browser — plus Add and Remove, each confined to the
folders the page may use. While a row of the table is being edited, an added or removed path is written into that
row at once (its card shows it); for a new row it waits for "Add as new row" like every other field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple

import gradio as gr
from omegaconf import OmegaConf

from webui import runner
from webui.filebrowser import FileBrowser

FOLDER, FILE = "folder", "file"
# list-of-path columns of the row editors: table key -> {column: what each path is}
PATH_LISTS = {"data.concepts": {"control_paths": FOLDER}, "sampling.prompts": {"control_images": FILE}}
WHAT = {"control_paths": "control folder", "control_images": "control image"}


def resolve_path(value: str) -> str:
    """A path as the trainer will see it: interpolations (``${atelier_root:}``) resolved, relative
    paths taken from the project folder (the trainer's working directory)."""
    if "${" in value:
        try:
            value = str(OmegaConf.create({"v": value}).v)
        except Exception:
            return value
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else runner.REPO_ROOT / p)


def split_lines(text: Any) -> List[str]:
    """The paths of a one-a-line text box, or of a list (blank ones dropped)."""
    lines = text if isinstance(text, (list, tuple)) else str(text or "").splitlines()
    return [str(ln).strip() for ln in lines if str(ln or "").strip()]


def path_problem(value: str, kind: str, allowed: Any) -> str:
    """Why ``value`` cannot be added to a list of ``kind`` paths ("" when it can): outside the page's folders,
    missing, or a file where a folder is wanted (and the reverse)."""
    where = resolve_path(value)
    if not allowed(where):
        return (f"`{value}` is outside the folders this page may use; start the UI with `--browse-root FOLDER` to "
                "allow another folder.")
    p = Path(where)
    if not p.exists():
        return f"`{value}` does not exist: check the spelling, or pick it with Browse."
    if kind == FOLDER and not p.is_dir():
        return f"`{value}` is a file; give the folder that holds the images."
    if kind == FILE and not p.is_file():
        return f"`{value}` is a folder; give one image file."
    return ""


def add_path(text: Any, value: Any, kind: str, allowed: Any) -> Tuple[str, str]:
    """(the list with ``value`` appended, message); the list unchanged and the reason when it cannot be added."""
    value = str(value or "").strip()
    paths = split_lines(text)
    if not value:
        return "\n".join(paths), "Type a path or pick one with Browse first."
    problem = path_problem(value, kind, allowed)
    if problem:
        return "\n".join(paths), f"Error: {problem}"
    if value in paths:
        return "\n".join(paths), f"`{value}` is in the list already."
    return "\n".join(paths + [value]), f"Added `{value}` (number {len(paths) + 1})."


def remove_path(text: Any, value: Any) -> Tuple[str, str]:
    """(the list without ``value``, message)."""
    paths = split_lines(text)
    value = str(value or "").strip()
    if value not in paths:
        return "\n".join(paths), "Pick the path to remove first."
    paths.remove(value)
    return "\n".join(paths), f"Removed `{value}`."


class PathList:
    """Add / Browse / Remove for one list-of-paths column of a row editor (``box``: its one-a-line text box)."""

    def __init__(self, box: gr.Textbox, column: str, kind: str, browser: FileBrowser, elem_id: str):
        self.box, self.column, self.kind, self.browser = box, column, kind, browser
        what = WHAT.get(column, kind)
        self.what = what
        with gr.Row(equal_height=True):
            self.new = browser.path_field(lambda: gr.Textbox(label=f"Add a {what}", scale=10, elem_id=f"{elem_id}-new",
                                                             info="Type a path or press Browse, then Add (Browse's "
                                                                  "Use adds it at once)."),
                                          f"{elem_id}-new")
            self.add = gr.Button("Add", size="sm", scale=0, min_width=70, elem_id=f"{elem_id}-add")
        with gr.Row(equal_height=True):
            self.pick = gr.Dropdown(choices=[], value=None, label=f"Remove a {what}", scale=10, interactive=True,
                                    elem_id=f"{elem_id}-pick")
            self.remove = gr.Button("Remove", size="sm", scale=0, min_width=70, elem_id=f"{elem_id}-remove")
        self.note = gr.Markdown(elem_id=f"{elem_id}-note")
        box.change(lambda text: gr.Dropdown(choices=split_lines(text), value=None), [box], [self.pick],
                   show_progress="hidden")

    def adding(self, text: Any, value: Any) -> Tuple[str, str]:
        return add_path(text, value, self.kind, self.browser.roots.allowed)

    def wire(self, table: gr.Dataframe, row: gr.State, write_row: Any, edits: list) -> None:
        """Add / Remove (and Browse's Use) change the list, and the table's row being edited (``write_row(table,
        row, column, text)`` → the new table, or None when no row is chosen)."""

        def apply(result: Tuple[str, str], table_value: Any, index: Optional[int]) -> List[Any]:
            text, message = result
            rows = write_row(table_value, index, self.column, text) if not message.startswith("Error:") else None
            if rows is None:
                if index is None and not message.startswith(("Error:", "Pick", "Type")):
                    message += " Press **Add as new row** to keep it."
                return [text, gr.skip(), message]
            return [text, rows, message + f" Saved into row {int(index)}."]

        def on_add(text: Any, value: Any, table_value: Any, index: Optional[int]) -> List[Any]:
            out = apply(self.adding(text, value), table_value, index)
            return out + ["" if not out[2].startswith(("Error:", "Type")) else gr.skip()]

        def on_remove(text: Any, value: Any, table_value: Any, index: Optional[int]) -> List[Any]:
            return apply(remove_path(text, value), table_value, index)

        outputs = [self.box, table, self.note]
        edits.append(self.add.click(on_add, [self.box, self.new, table, row], outputs + [self.new]))
        edits.append(self.new.submit(on_add, [self.box, self.new, table, row], outputs + [self.new]))
        edits.append(self.remove.click(on_remove, [self.box, self.pick, table, row], outputs))
        # the file browser's "Use" puts the path into the box and adds it at once
        self.browser.follow(self.new, on_add, [self.box, self.new, table, row], outputs + [self.new], edits)
        self.on_add, self.on_remove = on_add, on_remove  # tests call them directly


__all__ = ["PATH_LISTS", "PathList", "add_path", "remove_path", "path_problem", "resolve_path", "split_lines"]
