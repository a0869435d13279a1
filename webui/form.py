"""The config form: one tab per trainer area, every widget generated from the schema.

:class:`Form` lays the :class:`~webui.schema_widgets.FieldSpec` list out into tabs (``TAB_LAYOUT``
maps sections to tabs, the ones a user sets most first; a section nobody mapped gets a tab of its own; the expert
launch settings — multi-GPU, FSDP, accelerate — and the precision internals share one "Advanced" tab), nested
dataclasses into
accordions, and list-of-dataclass fields into a :class:`ListEditor` (a table plus a row editor with
proper dropdowns). ``form.inputs`` is the ordered component list every handler receives, so
``form.collect(values)`` turns a handler's ``*values`` back into a config dict.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Sequence

import gradio as gr
from omegaconf import DictConfig, ListConfig, OmegaConf

from webui import schema_widgets as sw
from webui.filebrowser import FileBrowser
from webui.number_field import FieldNumber
from webui.pathlist import PATH_LISTS, PathList
from webui.schema_widgets import FieldError, FieldSpec

# (tab title, tab id, key prefixes shown in it) — prefixes not listed get a tab of their own. The order is the
# page's: what a newcomer sets first (the model, how long to train, what to sample) comes first, so the tab a page
# opens on is the Model tab, not the multi-GPU launch settings.
TAB_LAYOUT = [
    ("Model", "model", ("model", "output")),
    ("Training", "training", ("training",)),
    ("Sampling", "sampling", ("sampling",)),
    ("LoRA", "lora", ("lora",)),
    ("Embedding", "embedding", ("embedding",)),
    ("Backup", "backup", ("backup",)),
    ("Loss", "loss", ("loss",)),
    ("EMA", "ema", ("ema",)),
    ("Parts", "parts", ("parts",)),
    ("General", "general", ("general",)),
    ("Concepts", "concepts", ("data.concepts",)),
    ("Data settings", "data", ("data",)),
    ("Advanced", "advanced", ("precision",)),
]
# tabs of the page's Data section (the rest are Train's settings)
DATA_TABS = ("concepts", "data")
# general settings only a multi-GPU or unusual launch needs: they sit on the Advanced tab, not in General
ADVANCED_GENERAL = ("general.dataloader_workers", "general.dist_timeout_s", "general.distributed",
                    "general.accelerate_config")
ADVANCED_HEADS = {"general": ("Multi-GPU and launch", "How the processes start and share the model (FSDP, "
                                                      "accelerate); one GPU needs none of these."),
                  "precision": ("Precision internals", "")}


def is_advanced(key: str) -> bool:
    """Whether a setting belongs on the Advanced tab although its section has a tab of its own."""
    return key in ADVANCED_GENERAL or key.startswith("general.fsdp_")
ROW_WIDTH = 3
# Tabs whose settings apply to one training method: tab id -> what the tab says while they do not apply.
METHOD_TABS = {
    "lora": "LoRA settings apply when **training.method** is `lora` (Training tab).",
    "embedding": "Embedding settings apply when **training.method** is `embedding`, or with "
                 "**embedding.train_alongside** on.",
}


def method_tab_visibility(method: Any, alongside: Any) -> Dict[str, bool]:
    """Which method-specific tabs show their settings for a config."""
    return {"lora": method == "lora", "embedding": method == "embedding" or bool(alongside)}


def _step(spec: FieldSpec) -> float:
    ref = abs(spec.default) if isinstance(spec.default, (int, float)) and spec.default else 0.01
    return 1.0 if ref >= 1 else 10 ** math.floor(math.log10(ref))


def choice_labels(spec: FieldSpec) -> List[tuple]:
    """(label, value) for each choice: "regularisation — class images beside a subject, …", from the help."""
    notes = sw.choice_notes(spec.help, spec.choices or ())
    return [(f"{c} — {notes[c]}" if c in notes else str(c), c) for c in spec.choices or ()]


def make_widget(spec: FieldSpec, value: Any, elem_id: str, browser: Optional[FileBrowser] = None,
                label: Optional[str] = None, explain_choices: bool = False) -> gr.components.Component:
    """The widget of one field: help → info, choices → dropdown (``explain_choices``: each option says what it
    means, from the help), min/max → number bounds."""
    common = dict(label=label or spec.label, info=spec.info(), elem_id=elem_id, interactive=True)
    kind = spec.kind
    if kind == sw.BOOL:
        return gr.Checkbox(value=bool(value), **common)
    if kind == sw.CHOICE:
        choices = choice_labels(spec) if explain_choices else list(spec.choices or ())
        return gr.Dropdown(choices=choices, value=value, **common)
    if kind in (sw.INT, sw.FLOAT):
        return FieldNumber(value=value, minimum=spec.minimum, maximum=spec.maximum,
                           precision=0 if kind == sw.INT else None,
                           step=1 if kind == sw.INT else _step(spec), **common)
    if kind == sw.PATH:
        def factory() -> gr.Textbox:
            return gr.Textbox(value=value, scale=10, **common)
        return browser.path_field(factory, elem_id) if browser else factory()
    if kind in (sw.TEXTAREA, sw.LIST, sw.YAML):
        info = common.pop("info") + (" One item a line." if kind == sw.LIST else "")
        return gr.Textbox(value=value, lines=3, info=info, **common)
    return gr.Textbox(value=value, **common)


def _shown(value: Any) -> Any:
    """A value as the trainer will see it: interpolations (``${atelier_root:}/…``) resolved."""
    if isinstance(value, str) and "${" in value:
        try:
            return str(OmegaConf.create({"v": value}).v)
        except Exception:  # an interpolation that does not resolve: show it as typed
            return value
    return value


# list fields shown as cards (the fields people set; the rest stay in the folded table and the row editor)
CARD_FIELDS: Dict[str, List[str]] = {"data.concepts": ["name", "path", "caption_source", "repeats"],
                                     "sampling.prompts": ["prompt", "seed", "steps", "cfg_scale", "width", "height"]}
# row-editor dropdowns whose options each carry their line of the field's help
EXPLAINED_CHOICES: Dict[str, tuple] = {"data.concepts": ("role",)}


class ListEditor:
    """A list-of-dataclass field: an editable table, and a row editor generated from the item
    dataclass (dropdowns for choices, browse buttons for paths) with add / update / remove."""

    def __init__(self, spec: FieldSpec, browser: Optional[FileBrowser]):
        self.spec = spec
        cols = spec.items
        datatype = ["bool" if c.kind == sw.BOOL else "number" if c.kind in (sw.INT, sw.FLOAT) else "str"
                    for c in cols]
        self.card_keys = CARD_FIELDS.get(spec.key)
        self.card_extra: Optional[Callable[[dict], None]] = None  # more per card (a concept's thumbnails)
        self.table = gr.Dataframe(value=[], headers=[c.key for c in cols], datatype=datatype, type="array",
                                  interactive=True, label=f"{spec.label} — {spec.help}", wrap=True,
                                  elem_id=spec.elem_id, column_count=len(cols), render=False)
        if self.card_keys:  # one card per row, the few fields people set; every field in the table below
            with gr.Column(elem_id=f"{spec.elem_id}-cards"):
                self.render_cards()
        with (gr.Accordion(f"Table: every field of every {spec.label.lower().rstrip('s')}", open=False,
                           elem_id=f"{spec.elem_id}-table-fold") if self.card_keys else nullcontext()):
            self.table.render()
        self.note = gr.Markdown(elem_id=f"{spec.elem_id}-note")
        with gr.Accordion(f"Add or edit one {spec.label.lower().rstrip('s')}", open=False,
                          elem_id=f"{spec.elem_id}-editor") as self.editor_fold:
            # which row Update/Remove act on: none until a table row is clicked (a number field here showed
            # "0" on a fresh page, and Update then silently replaced row 0)
            self.row = gr.State(None)
            self.row_label = gr.Markdown(self._row_text(None), elem_id=f"{spec.elem_id}-row")
            self.items: List[gr.components.Component] = []
            self.path_lists: Dict[str, PathList] = {}  # list-of-path columns: add / browse / remove
            lists = PATH_LISTS.get(spec.key, {}) if browser is not None else {}
            explained = EXPLAINED_CHOICES.get(spec.key, ())
            for chunk in _chunks(list(cols)):
                with gr.Row():
                    for c in chunk:
                        item_id = f"{spec.elem_id}-item-{c.key.replace('_', '-')}"
                        with gr.Column() if c.key in lists else nullcontext():
                            self.items.append(make_widget(c, sw.to_widget(c, c.default), item_id, browser,
                                                          explain_choices=c.key in explained))
                            if c.key in lists:
                                self.path_lists[c.key] = PathList(self.items[-1], c.key, lists[c.key], browser,
                                                                  item_id)
            with gr.Row():
                self.add = gr.Button("Add as new row", variant="primary", elem_id=f"{spec.elem_id}-add")
                self.update = gr.Button("Update row", elem_id=f"{spec.elem_id}-update")
                self.remove = gr.Button("Remove row", variant="stop", elem_id=f"{spec.elem_id}-remove")
        self.table.select(self._select, [self.table], [self.row, self.row_label, *self.items],
                          show_progress_on=[self.row_label])
        self.edits = [  # events that change the table from code (the draft autosave follows them)
            self.add.click(self._add, [self.table, *self.items], [self.table, self.row, self.row_label, self.note],
                           show_progress_on=[self.note]),  # the table is folded away: the note says what was done
            self.update.click(self._update, [self.table, self.row, *self.items], [self.table, self.note],
                              show_progress_on=[self.note]),
            self.remove.click(self._remove, [self.table, self.row], [self.table, self.row, self.row_label, self.note],
                              show_progress_on=[self.note])]
        for plist in self.path_lists.values():
            plist.wire(self.table, self.row, self.write_cell, self.edits)

    def write_cell(self, table: Any, index: Optional[int], column: str, value: Any) -> Optional[List[list]]:
        """The table with one cell of row ``index`` replaced (None when no row is being edited)."""
        rows = self._rows(table)
        if index is None or not 0 <= int(index) < len(rows):
            return None
        rows[int(index)][[c.key for c in self.spec.items].index(column)] = value
        return rows

    def render_cards(self) -> None:
        """The cards above the folded table (gr.render: they follow the table's rows)."""
        keys = [c.key for c in self.spec.items]

        if self.card_keys:
            @gr.render(inputs=[self.table])
            def cards(table: Any) -> None:
                rows = self._rows(table)
                if not rows:
                    gr.Markdown(f"No {self.spec.label.lower()} yet: add one below.",
                                elem_id=f"{self.spec.elem_id}-cards-empty")
                for i, row in enumerate(rows):
                    item = dict(zip(keys, row))
                    with gr.Group(elem_classes=["atl-card"], elem_id=f"{self.spec.elem_id}-card-{i}",
                                  key=f"{self.spec.elem_id}-card-{i}"):
                        with gr.Row(equal_height=True):
                            title_key = self.card_keys[0]  # name (concepts), prompt (sample prompts)
                            title = item.get(title_key) or f"row {i}"
                            gr.Markdown(f"**{i}. {title}**" + ("" if item.get("enabled", True) else " *(off)*"))
                            edit = gr.Button("Edit", size="sm", scale=0, min_width=70,
                                             elem_id=f"{self.spec.elem_id}-card-{i}-edit")
                        gr.Markdown(" · ".join(f"{k.replace('_', ' ')}: `{_shown(item.get(k))}`" for k in self.card_keys
                                               if k != title_key and item.get(k) not in (None, "")))
                        if self.card_extra is not None:
                            self.card_extra(item)
                    edit.click(lambda t, i=i: self._select_index(t, i), [self.table],
                               [self.row, self.row_label, *self.items, self.editor_fold],
                               show_progress_on=[self.row_label])

    def _select_index(self, table: Any, index: int) -> list:
        rows = self._rows(table)
        if index >= len(rows):
            return [gr.skip()] * (3 + len(self.items))
        return [index, self._row_text(index), *rows[index], gr.Accordion(open=True)]

    def _row_text(self, index: Optional[int]) -> str:
        what = self.spec.label.lower().rstrip("s")
        if index is None:
            return (f"No {what} chosen: fill in the fields and press **Add as new row**, or click a row of the "
                    "table to edit it.")
        return f"Editing row **{index}** of the table: **Update row** saves the fields into it."

    def _rows(self, table: Any) -> List[list]:
        items, _ = sw.table_from_widget(self.spec, table)
        return [[sw.to_widget(c, item.get(c.key)) for c in self.spec.items] for item in items]

    def _item(self, values: Sequence[Any]) -> tuple[list, List[FieldError]]:
        row, errors = [], []
        for c, v in zip(self.spec.items, values):
            value, err = sw.from_widget(c, v, f"{self.spec.key}[new].{c.key}")
            if err:
                errors.append(err)
            row.append(sw.to_widget(c, value if not err else v))
        return row, errors

    def _select(self, table: Any, evt: gr.SelectData) -> list:
        rows = self._rows(table)
        r = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        if not isinstance(r, int) or r >= len(rows):
            return [gr.skip()] * (2 + len(self.items))
        return [r, self._row_text(r), *rows[r]]

    def _add(self, table: Any, *values: Any) -> list:
        row, errors = self._item(values)
        if errors:
            return [gr.skip(), gr.skip(), gr.skip(), _error_md(errors)]
        rows = self._rows(table) + [row]
        return [rows, len(rows) - 1, self._row_text(len(rows) - 1), f"Added row {len(rows) - 1}."]

    def _update(self, table: Any, index: Optional[int], *values: Any) -> list:
        rows = self._rows(table)
        if index is None or not 0 <= int(index) < len(rows):
            return [gr.skip(), "Pick a row first (click it in the table)."]
        row, errors = self._item(values)
        if errors:
            return [gr.skip(), _error_md(errors)]
        rows[int(index)] = row
        return [rows, f"Updated row {int(index)}."]

    def _remove(self, table: Any, index: Optional[int]) -> list:
        rows = self._rows(table)
        if index is None or not 0 <= int(index) < len(rows):
            return [gr.skip(), gr.skip(), gr.skip(), "Pick a row first (click it in the table)."]
        del rows[int(index)]
        return [rows, None, self._row_text(None), f"Removed row {int(index)}."]


def _chunks(specs: List[FieldSpec]) -> List[List[FieldSpec]]:
    out: List[List[FieldSpec]] = []
    for s in specs:
        wide = s.kind in (sw.TEXTAREA, sw.LIST, sw.YAML, sw.TABLE)
        if wide or not out or len(out[-1]) >= ROW_WIDTH or out[-1][0].kind in (sw.TEXTAREA, sw.LIST, sw.YAML):
            out.append([s])
        else:
            out[-1].append(s)
    return out


def _error_md(errors: Sequence[FieldError]) -> str:
    return "\n".join(f"- {'Error:' if e.level == 'error' else 'Warning:'} `{e.key}` — {e.message}" for e in errors)


def tab_layout(specs: Sequence[FieldSpec]) -> List[tuple[str, str, List[str]]]:
    """TAB_LAYOUT plus a tab for every section nobody mapped (a new schema section shows up)."""
    layout = [(t, i, list(p)) for t, i, p in TAB_LAYOUT]
    advanced = next(ps for _, i, ps in layout if i == "advanced")
    advanced[0:0] = [s.key for s in specs if is_advanced(s.key)]  # by key: longer than "general", so they win
    known = {p for _, _, ps in layout for p in ps}
    for s in specs:
        if not any(s.key == p or s.key.startswith(p + ".") for p in known):
            layout.append((sw.label_of(s.section), s.section, [s.section]))
            known.add(s.section)
    return layout


def prefix_of(key: str, prefixes: Sequence[str]) -> Optional[str]:
    best = None
    for p in prefixes:
        if (key == p or key.startswith(p + ".")) and (best is None or len(p) > len(best)):
            best = p
    return best


class Form:
    """All config widgets, in schema order, laid out in tabs."""

    def __init__(self, browser: Optional[FileBrowser] = None, schema: Optional[type] = None):
        self.browser = browser
        self.all_specs = sw.all_specs(schema) if schema is not None else sw.all_specs()
        self.specs = [s for s in self.all_specs if not s.hidden]
        self.hidden_specs = [s for s in self.all_specs if s.hidden]
        self.widgets: Dict[str, gr.components.Component] = {}
        self.editors: Dict[str, ListEditor] = {}
        self.tab_of: Dict[str, str] = {}
        # method-specific tabs: their settings are shown only when the method uses them
        self.method_bodies: Dict[str, Any] = {}  # tab id -> (body column, "not used" note)
        self.layout = tab_layout(self.specs)
        self.tab_titles = {tab_id: title for title, tab_id, _ in self.layout}

    # -- building -----------------------------------------------------------------------------
    def build(self, extras: Optional[Dict[str, Callable[[], None]]] = None,
              only: Optional[Callable[[str], bool]] = None) -> None:
        """Create the tabs (call inside ``gr.Tabs``); ``extras[tab_id]()`` adds buttons to a tab; ``only``: which
        tab ids to build here (the page builds Train's tabs in one ``gr.Tabs`` and Data's in another)."""
        extras = extras or {}
        all_prefixes = [p for _, _, ps in self.layout for p in ps]
        for title, tab_id, prefixes in self.layout:
            if only is not None and not only(tab_id):
                continue
            mine = [s for s in self.specs if prefix_of(s.key, all_prefixes) in prefixes]
            with gr.Tab(title, id=tab_id, elem_id=f"tab-{tab_id}"):
                if not hasattr(self, "hidden_state"):  # inside a tab: a bare child of gr.Tabs breaks tabs
                    self.hidden_state = gr.State({s.key: s.default for s in self.hidden_specs})
                body = gr.Column(elem_id=f"tab-body-{tab_id}")
                if tab_id in METHOD_TABS:
                    note = gr.Markdown(METHOD_TABS[tab_id], visible=False, elem_id=f"tab-note-{tab_id}")
                    self.method_bodies[tab_id] = (body, note)
                with body:
                    if "model" in prefixes:  # which family the model is, and its parts (webui/family_parts.py)
                        self.family_note = gr.Markdown("", elem_id="family-parts")
                    groups: Dict[str, List[FieldSpec]] = {}  # settings listed one by one join their section
                    for prefix in prefixes:
                        own = [s for s in mine if prefix_of(s.key, all_prefixes) == prefix]
                        single = len(own) == 1 and own[0].key == prefix and "." in prefix
                        groups.setdefault(own[0].group if single else prefix, []).extend(own)
                    for prefix, own in groups.items():
                        if len(groups) > 1:
                            title_, help_ = ADVANCED_HEADS.get(prefix) or (sw.label_of(prefix.split('.')[-1]),
                                                                           sw.section_help(prefix))
                            gr.Markdown(f"### {title_}\n{help_}")
                        self._build_group(own, prefix)
                for s in mine:
                    self.tab_of[s.key] = tab_id
                if tab_id in extras:
                    extras[tab_id]()

    def wire_method_tabs(self) -> Optional[Callable[..., list]]:
        """Show the LoRA / Embedding settings only while training.method uses them (a note otherwise).
        Hiding is presentation only: the hidden fields keep their values and stay in the config."""
        keys = [k for k in ("training.method", "embedding.train_alongside") if k in self.widgets]
        if "training.method" not in keys or not self.method_bodies:
            return None
        outputs = [c for body, note in self.method_bodies.values() for c in (body, note)]

        def update(method: Any, alongside: Any = False) -> list:
            shown = method_tab_visibility(method, alongside)
            out = []
            for tab_id in self.method_bodies:
                out += [gr.Column(visible=shown[tab_id]), gr.Markdown(visible=not shown[tab_id])]
            return out

        inputs = [self.widgets[k] for k in keys]
        for widget in inputs:
            widget.change(update, inputs, outputs, show_progress="hidden")
        return update

    def _build_group(self, specs: List[FieldSpec], prefix: str) -> None:
        direct = [s for s in specs if s.group == prefix or s.key == prefix]
        nested: Dict[str, List[FieldSpec]] = {}
        for s in specs:
            if s not in direct:
                sub = prefix + "." + s.key[len(prefix) + 1:].split(".")[0]
                nested.setdefault(sub, []).append(s)
        for chunk in _chunks(direct):
            if chunk[0].kind == sw.TABLE:
                editor = ListEditor(chunk[0], self.browser)
                self.editors[chunk[0].key] = editor
                self.widgets[chunk[0].key] = editor.table
                continue
            with gr.Row(equal_height=False):
                for s in chunk:
                    self.widgets[s.key] = make_widget(s, sw.to_widget(s, s.default), s.elem_id, self.browser)
        for sub, sub_specs in nested.items():
            with gr.Accordion(f"{sw.label_of(sub.split('.')[-1])} — {sw.section_help(sub)}", open=True,
                              elem_id="group-" + sub.replace(".", "-")):
                self._build_group(sub_specs, sub)

    # -- values -------------------------------------------------------------------------------
    @property
    def inputs(self) -> List[gr.components.Component]:
        """Widgets in spec order, then the hidden-fields state: every handler's form inputs."""
        return [self.widgets[s.key] for s in self.specs] + [self.hidden_state]

    def values_for(self, cfg: Any) -> List[Any]:
        """Outputs for ``self.inputs`` showing a config (DictConfig or nested dict). Interpolations such
        as ``${atelier_root:}`` stay unresolved, so load → save gives back the same file."""
        if isinstance(cfg, (DictConfig, ListConfig)):
            cfg = OmegaConf.to_container(cfg, resolve=False)
        hidden = {s.key: sw.get_path(cfg, s.key) for s in self.hidden_specs}
        return sw.config_to_values(cfg, self.specs) + [hidden]

    def lenient_values_for(self, raw: dict) -> List[Any]:
        hidden = {s.key: sw.get_path(raw, s.key) if sw.get_path(raw, s.key) is not None else s.default
                  for s in self.hidden_specs}
        return sw.lenient_values(raw, self.specs) + [hidden]

    def collect(self, values: Sequence[Any]) -> tuple[dict, List[FieldError]]:
        """A config dict from handler values (``*values`` of ``self.inputs``) and field errors."""
        *widget_values, hidden = values
        data, errors = sw.values_to_dict(self.specs, widget_values)
        for key, value in (hidden or {}).items():
            if value is not None:
                sw.set_path(data, key, value)
        return data, errors

    def raw_dict(self, values: Sequence[Any]) -> dict:
        """What the user typed, valid or not (for the draft autosave)."""
        *widget_values, hidden = values
        data: dict = {}
        for spec, raw in zip(self.specs, widget_values):
            if spec.kind == sw.TABLE:
                value, _ = sw.table_from_widget(spec, raw)
            else:
                value, err = sw.from_widget(spec, raw)
                value = raw if err else value
            sw.set_path(data, spec.key, value)
        for key, value in (hidden or {}).items():
            sw.set_path(data, key, value)
        return data

    # -- problems next to their fields ---------------------------------------------------------
    @property
    def annotated(self) -> List[gr.components.Component]:
        """Outputs of :meth:`annotate`: scalar widgets, then each table's note."""
        return [self.widgets[s.key] for s in self.specs if s.kind != sw.TABLE] + \
            [e.note for e in self.editors.values()]

    def annotate(self, issues: Sequence[FieldError]) -> List[Any]:
        """Updates that put each problem under its field (and clear the old ones)."""
        by_key: Dict[str, List[FieldError]] = {}
        for issue in issues:
            key = issue.key
            if key not in self.widgets:
                table = next((k for k in self.editors if key.startswith(k + ".")), None)
                key = table or key
            by_key.setdefault(key, []).append(issue)
        out: List[Any] = []
        for s in self.specs:
            if s.kind == sw.TABLE:
                continue
            mine = by_key.get(s.key, [])
            level = "error" if any(i.level == "error" for i in mine) else "warning" if mine else ""
            info = s.info() + "".join(f"\n{'Error:' if i.level == 'error' else 'Warning:'} {i.message}" for i in mine)
            out.append(gr.update(info=info, elem_classes=[f"atl-field-{level}"] if level else []))
        for key in self.editors:
            out.append(_error_md(by_key.get(key, [])))
        return out

    def tab_for(self, key: str) -> Optional[str]:
        for k in sorted(self.tab_of, key=len, reverse=True):
            if key == k or key.startswith(k + "."):
                return self.tab_of[k]
        return None


def load_updates(form: Form, values: Sequence[Any]) -> List[Any]:
    """Outputs for ``form.load_outputs``: new values, with old problem notes cleared."""
    out: List[Any] = []
    for spec, value in zip(form.specs, values):
        if spec.kind == sw.TABLE:
            out.append(value)
        else:
            out.append(gr.update(value=value, info=spec.info(), elem_classes=[]))
    out.append(values[len(form.specs)])
    return out + [""] * len(form.editors)


def load_outputs(form: Form) -> List[gr.components.Component]:
    return form.inputs + [e.note for e in form.editors.values()]
