"""A server-side file browser for path fields, limited to allowed roots.

Browsers cannot hand a web page the path of a folder on the training machine (and the machine may
be a remote pod), so path fields get a "browse" button that opens this panel: it lists folders and
files on the server, but only below the allowed roots (the workspace plus folders the user named
with ``--browse-root``), never the whole disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import gradio as gr

MAX_ENTRIES = 400


class Roots:
    """The folders the browser (and thumbnails) may look into."""

    def __init__(self, roots: Sequence[str | os.PathLike]):
        seen: List[Path] = []
        for r in roots:
            p = Path(r).expanduser().resolve()
            if p not in seen:
                seen.append(p)
        self.paths = seen

    def allowed(self, path: str | os.PathLike) -> bool:
        try:
            p = Path(path).expanduser().resolve()
        except (OSError, RuntimeError):
            return False
        return any(p == r or r in p.parents for r in self.paths)

    def start_dir(self, value: str) -> Path:
        """Where to open: the field's folder when it is allowed, else the first root."""
        if value:
            p = Path(value).expanduser()
            for cand in (p, p.parent):
                if cand.is_dir() and self.allowed(cand):
                    return cand.resolve()
        return self.paths[0]

    def listing(self, folder: Path) -> tuple[list, str]:
        """(Radio choices as (label, path), note) for one folder: folders first."""
        if not self.allowed(folder):
            return [], f"{folder} is outside the allowed folders."
        try:
            entries = sorted(folder.iterdir(), key=lambda p: (not p.is_dir(), p.name.lower()))
        except OSError as exc:
            return [], f"Cannot read {folder}: {exc}"
        entries = [p for p in entries if not p.name.startswith(".")]
        note = f"{len(entries)} entries" + (f", showing {MAX_ENTRIES}" if len(entries) > MAX_ENTRIES else "")
        choices = [(("📁 " + p.name + "/") if p.is_dir() else p.name, str(p)) for p in entries[:MAX_ENTRIES]]
        if any(folder.resolve() == r for r in self.paths):
            return choices, note
        return [("⬆ ..", str(folder.parent))] + choices, note


class FileBrowser:
    """One shared panel; every path textbox registers a button that opens it for that textbox."""

    def __init__(self, roots: Roots):
        self.roots = roots
        self.targets: List[gr.Textbox] = []
        self.uses: List[Any] = []
        self._buttons: List[gr.Button] = []
        self.followers: List[tuple] = []

    def path_field(self, textbox_factory: Callable[[], gr.Textbox], elem_id: str) -> gr.Textbox:
        """A textbox plus its browse button, side by side."""
        with gr.Row(equal_height=True, elem_classes=["atl-path-row"]):
            box = textbox_factory()
            button = gr.Button("Browse", size="sm", scale=0, min_width=70, elem_id=f"{elem_id}-browse",
                               elem_classes=["atl-browse"])
        self.targets.append(box)
        self._buttons.append(button)
        return box

    def follow(self, box: gr.Textbox, fn: Callable, inputs: list, outputs: list, sink: list) -> None:
        """Run ``fn(*inputs) -> outputs`` once "Use" has filled ``box`` (a path field of this browser): a list
        of paths adds the chosen one at once. The events made are appended to ``sink``."""
        self.followers.append((box, fn, inputs, outputs, sink))

    def build(self) -> None:
        """Create the panel; call once, after every path field was created."""
        with gr.Sidebar(label="Browse files", open=False, position="right", width=420,
                        elem_id="file-browser") as self.panel:
            self.target = gr.State(-1)
            self.title = gr.Markdown("Choose a file or folder.")
            self.root = gr.Dropdown([str(r) for r in self.roots.paths], value=str(self.roots.paths[0]),
                                    label="Allowed folder", elem_id="browser-root")
            self.folder = gr.Textbox(label="Folder", interactive=False, elem_id="browser-folder")
            self.entries = gr.Radio([], label="Contents", elem_id="browser-entries")
            self.note = gr.Markdown()
            self.chosen = gr.Textbox(label="Selected", elem_id="browser-chosen")
            with gr.Row():
                use = gr.Button("Use selected", variant="primary", elem_id="browser-use")
                use_folder = gr.Button("Use this folder", elem_id="browser-use-folder")
                cancel = gr.Button("Close")
        for i, (box, button) in enumerate(zip(self.targets, self._buttons)):
            button.click(self._opener(i), inputs=[box],
                         outputs=[self.target, self.panel, self.title, self.folder, self.entries, self.note,
                                  self.chosen], show_progress="hidden")
        self.root.input(self._go, [self.root], [self.folder, self.entries, self.note, self.chosen])
        self.entries.input(self._pick, [self.entries], [self.folder, self.entries, self.note, self.chosen])
        self.uses = [use.click(self._use, [self.target, self.chosen], [self.panel, *self.targets]),
                     use_folder.click(self._use, [self.target, self.folder], [self.panel, *self.targets])]
        cancel.click(lambda: gr.Sidebar(open=False), None, [self.panel])
        for box, fn, inputs, outputs, sink in self.followers:
            index = self.targets.index(box)

            def after(target: int, *values: Any, fn: Callable = fn, index: int = index, n: int = len(outputs)) -> Any:
                return fn(*values) if target == index else [gr.skip()] * n
            for use in self.uses:
                sink.append(use.then(after, [self.target, *inputs], outputs, show_progress="hidden"))

    def _opener(self, index: int) -> Callable:
        def open_for(value: str) -> list:
            start = self.roots.start_dir(value or "")
            choices, note = self.roots.listing(start)
            label = self.targets[index].label or "path"
            return [index, gr.Sidebar(open=True), f"Choosing **{label}**", str(start),
                    gr.Radio(choices=choices, value=None), note, value or ""]
        return open_for

    def _go(self, folder: str) -> list:
        path = Path(folder)
        if not self.roots.allowed(path) or not path.is_dir():
            return [gr.skip(), gr.skip(), f"{folder} is not an allowed folder.", gr.skip()]
        choices, note = self.roots.listing(path)
        return [str(path.resolve()), gr.Radio(choices=choices, value=None), note, str(path.resolve())]

    def _pick(self, value: Optional[str]) -> list:
        if not value:
            return [gr.skip()] * 4
        path = Path(value)
        if path.is_dir():
            return self._go(value)
        if not self.roots.allowed(path):
            return [gr.skip(), gr.skip(), "Not allowed.", gr.skip()]
        return [gr.skip(), gr.skip(), gr.skip(), str(path)]

    def _use(self, index: int, value: str) -> list:
        updates: List[Any] = [gr.skip()] * len(self.targets)
        if value and 0 <= index < len(self.targets) and self.roots.allowed(value):
            updates[index] = value
        return [gr.Sidebar(open=False), *updates]
