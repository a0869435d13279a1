"""What every tab shares: the workspace, the run manager, the form, and form validation.

Kept apart from ``app.py`` so tab modules can import it without an import cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

import gradio as gr
from omegaconf import OmegaConf

from trainer.config.checks import check_config
from trainer.config.load import PRESETS_DIR, to_yaml
from trainer.config.paths import outside
from trainer.config.preflight import looks_like_hub_id
from trainer.config.schema import GeneralConfig
from trainer.errors import ConfigError, every_error
from trainer.host.paths import path_name
from webui import runner
from webui.filebrowser import FileBrowser, Roots
from webui.form import Form
from webui.monitor import RunMonitor
from webui.schema_widgets import FieldError

AUTO = "(follow the current run)"


@dataclass
class Checked:
    """The result of validating the form: a config when it has no errors, and every issue."""
    data: dict
    cfg: Any = None
    issues: List[FieldError] = field(default_factory=list)

    @property
    def errors(self) -> List[FieldError]:
        return [i for i in self.issues if i.level == "error"]

    @property
    def ok(self) -> bool:
        return self.cfg is not None and not self.errors


@dataclass
class AppContext:
    workspace: Path
    manager: runner.RunManager
    roots: Roots
    monitor: RunMonitor = field(default_factory=RunMonitor)
    form: Optional[Form] = None
    browser: Optional[FileBrowser] = None
    components: dict = field(default_factory=dict)   # shared components by name (tabs, messages, …)
    handlers: dict = field(default_factory=dict)     # event functions by name (tests call them directly)
    after_build: list = field(default_factory=list)  # wiring that needs every form widget (run once built)

    def __getitem__(self, name: str) -> Any:
        return self.components[name]

    @property
    def draft_path(self) -> Path:
        return self.workspace / "ui-draft.yaml"

    # -- validation ---------------------------------------------------------------------------
    def check(self, values: Sequence[Any]) -> Checked:
        """Field checks, schema validation and the cross-field rules, all collected."""
        assert self.form is not None
        data, errors = self.form.collect(values)
        result = Checked(data=data, issues=list(errors))
        try:  # every problem at once: the fields the form could not read, then the config's own (keys, rules, files)
            cfg, issues = check_config(data=data)
        except ConfigError as exc:  # a preset that cannot be read
            result.issues += [FieldError(e.key or "", str(e)) for e in every_error(exc)]
            return result
        result.cfg = None if errors else cfg
        if result.cfg is not None and self.manager.confinement is not None:  # the trainer refuses them too
            issues = outside(self.as_run(cfg), runner.REPO_ROOT, self.manager.confinement) + issues
        named = {e.key for e in errors}  # a field the form could not read is named once, by the form
        result.issues += [FieldError(i.key, i.message, i.level) for i in issues if i.key not in named]
        return result

    def allowed_path(self, text: str, what: str) -> tuple[str, str]:
        """(absolute path, "") for a path the tools may use: inside the page's folders (relative = the workspace);
        hub ids and ``builtin:`` names pass as they are; else ("", the message naming ``what``)."""
        text = (text or "").strip()
        if not text or text.startswith("builtin:") or looks_like_hub_id(text):
            return text, ""
        path = Path(text).expanduser()
        path = (path if path.is_absolute() else self.workspace / path).resolve()
        if not self.roots.allowed(path):
            where = ", ".join(f"`{r}`" for r in self.roots.paths)
            return "", (f"{what} `{text}` is outside the folders this page may use ({where}); start the UI with "
                        "`--browse-root FOLDER` to allow another folder.")
        return str(path), ""

    def as_run(self, cfg: Any) -> Any:
        """The config a run starts with: the form's, with the UI's workspace filled in when the form still has the
        default (relative) one, so caches land next to the runs."""
        if cfg.general.workspace == GeneralConfig.workspace and \
                self.workspace != (runner.REPO_ROOT / cfg.general.workspace).resolve():
            cfg = OmegaConf.create(OmegaConf.to_container(cfg))
            cfg.general.workspace = str(self.workspace)
        return cfg

    def run_config_yaml(self, cfg: Any) -> str:
        """The YAML a run starts with (:meth:`as_run`), from a config :meth:`check` already built (building it again
        cost half a second of every Start and Add to queue)."""
        return to_yaml(self.as_run(cfg))

    def run_name(self, cfg: Any) -> str:
        if cfg.general.run_name:
            return runner.slug(cfg.general.run_name)
        model = path_name(str(cfg.model.path)).split(":")[-1] or "run"  # C:\models\x.safetensors, org/name, builtin:x
        model = model.rsplit(".", 1)[0] if model.endswith((".safetensors", ".ckpt")) else model
        return runner.slug(f"{model}-{cfg.training.method}-{time.strftime('%Y%m%d-%H%M%S')}")

    # -- runs ---------------------------------------------------------------------------------
    def run_dir(self, name: str) -> Optional[Path]:
        """A run of this workspace by its name; anything else (a path, ``..``) is no run."""
        if not name or name == AUTO or name in (".", "..") or Path(name).name != name or "\\" in name:
            return None
        path = runner.runs_root(self.workspace) / name
        return path if path.is_dir() else None

    # -- files the page may read and write ----------------------------------------------------------
    def confined(self, path: str, write: bool = False) -> tuple[Optional[Path], str]:
        """``(path, "")`` for a file the page may read (``write``: create or replace), else ``(None, why)``.

        Every handler that takes a path from the page goes through here: relative paths are read from the
        workspace; the result must lie below an allowed root (the workspace, each ``--browse-root``, and,
        to read only, Atelier's presets) after links are resolved; a missing file is told apart from a
        forbidden one."""
        text = (path or "").strip()
        if not text:
            return None, "Type a path first."
        p = Path(text).expanduser()
        p = p if p.is_absolute() else self.workspace / p
        try:
            real = p.resolve()
        except (OSError, RuntimeError):
            return None, f"`{text}` is not a usable path."
        presets = PRESETS_DIR.resolve()
        if not self.roots.allowed(real) or (write and (real == presets or presets in real.parents)):
            where = ", ".join(f"`{r}`" for r in self.roots.paths if not (write and r == presets))
            return None, (f"`{text}` is outside the folders this page may {'write' if write else 'read'} "
                          f"({where}). Start the UI with `--browse-root FOLDER` to allow another folder.")
        if not write and not real.is_file():
            return None, f"`{text}` does not exist{' (it is a folder)' if real.is_dir() else ''}."
        if write and real.is_dir():
            return None, f"`{text}` is a folder; give a file name ending in .yaml."
        return real, ""

    def resolve_watched(self, name: Optional[str]) -> Optional[Path]:
        """A chosen run, or (AUTO) the running one, else the newest."""
        chosen = self.run_dir(name or "")
        if chosen:
            return chosen
        active = self.manager.active_runs()
        if active:
            return active[0]
        dirs = runner.list_run_dirs(self.workspace)
        return dirs[0] if dirs else None

    def run_names(self) -> List[str]:
        return [d.name for d in runner.list_run_dirs(self.workspace)]

    def watch(self, name: str = AUTO) -> Any:
        """An update for the Run tab's run chooser that shows ``name`` (AUTO = follow)."""
        return gr.Dropdown(choices=[AUTO] + self.run_names(), value=name)


def issues_md(issues: Sequence[FieldError], form: Optional[Form] = None) -> str:
    """A list of problems that names each field (and its tab) for the message area. Each is led by the word
    "Error:" or "Warning:", not an emoji mark: a browser without an emoji font draws those as empty boxes."""
    lines = []
    for i in sorted(issues, key=lambda x: x.level != "error"):
        icon = "Error:" if i.level == "error" else "Warning:"
        where = ""
        if form is not None and i.key:
            tab = form.tab_for(i.key)
            where = f" ({form.tab_titles.get(tab, tab)} tab)" if tab else ""
        key = f"`{i.key}`{where} — " if i.key else ""
        lines.append(f"- {icon} {key}{i.message}")
    return "\n".join(lines)
