"""Every path a config carries, and the rules on them all: a path the operating system can take, run and result names
that stay plain names, and confinement to a set of folders (what a run started from the page may touch), judged on
the paths after links are resolved. Torch-free.

The schema marks its path fields (``ui="path"``, lists ``ui="paths"``); :data:`WRITTEN` names the ones the run
writes into. Relative paths are read from the folder the trainer runs in, as the trainer reads them.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from trainer.config.fields import inner_type
from trainer.config.preflight import looks_like_hub_id
from trainer.config.schema import AtelierConfig
from trainer.errors import ConfigError, Issue
from trainer.host.paths import Confinement

#: Path fields the run creates or writes into (the rest it only reads).
WRITTEN = frozenset({"general.workspace", "model.cache_dir", "data.cache_dir", "output.path"})

#: Fields that name one file or folder inside a folder the run chooses (never a path).
PLAIN_NAMES = {"general.run_name": "the run folder's name under <workspace>/runs/ (give --run-dir to the CLI for "
                                   "a folder elsewhere)",
               "output.name": "the result's file or folder name inside output.path"}

_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
_FORBIDDEN = '<>:"/\\|?*'
MAX_PATH_CHARS = 4096
MAX_NAME_BYTES = 255


@dataclass(frozen=True)
class ConfigPath:
    key: str    # dotted, with list indices: data.concepts.0.control_paths.1
    text: str   # as written
    write: bool


def _get(node: Any, name: str) -> Any:
    if node is None:
        return None
    try:
        return node.get(name) if hasattr(node, "get") else getattr(node, name, None)
    except Exception:  # an interpolation that does not resolve: the config's own check names it
        return None


def _walk(cls: type, node: Any, prefix: str, out: List[ConfigPath]) -> None:
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        tp = inner_type(hints[fld.name])
        value = _get(node, fld.name)
        ui = fld.metadata.get("ui")
        if dataclasses.is_dataclass(tp):
            _walk(tp, value, key + ".", out)
        elif typing.get_origin(tp) in (list, List):
            item_tp = typing.get_args(tp)[0]
            for i, item in enumerate(value or []):
                if dataclasses.is_dataclass(item_tp):
                    _walk(item_tp, item, f"{key}.{i}.", out)
                elif ui == "paths" and str(item or "").strip():
                    out.append(ConfigPath(f"{key}.{i}", str(item).strip(), False))
        elif ui == "path" and str(value or "").strip():
            unindexed = ".".join(p for p in key.split(".") if not p.isdigit())
            out.append(ConfigPath(key, str(value).strip(), unindexed in WRITTEN))


def config_paths(cfg: Any) -> List[ConfigPath]:
    """Every non-empty path of a config (model files, concept and control folders, caption files, masks, sample
    images, caches, the workspace, the output folder), with its key and whether the run writes there."""
    out: List[ConfigPath] = []
    _walk(AtelierConfig, cfg, "", out)
    return out


def local_path(text: str, base: Path) -> Optional[Path]:
    """The file or folder a path field names on this machine, or None for what is no local path: a ``builtin:``
    model, a hub id (``org/name`` that is no folder here)."""
    text = text.strip()
    if not text or text.startswith("builtin:"):
        return None
    p = Path(os.path.expanduser(text))
    p = p if p.is_absolute() else base / p
    if looks_like_hub_id(text) and not _exists(p):
        return None
    return p


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):
        return False


def path_text_problem(key: str, text: str) -> str:
    """Why no operating system takes ``text`` as a path ("" when it can): a NUL character, a name over 255 bytes,
    a path over 4096 characters. Checked before the path reaches the file system."""
    if "\0" in text:
        return f"{key} holds a NUL character, which no file name can; retype the path."
    if len(text) > MAX_PATH_CHARS:
        return (f"{key} is {len(text)} characters long, more than any file system takes ({MAX_PATH_CHARS}); "
                "give the real path.")
    longest = max((part for part in text.replace("\\", "/").split("/")), key=lambda s: len(s.encode()), default="")
    if len(longest.encode()) > MAX_NAME_BYTES:
        return (f"{key} has a name of {len(longest.encode())} bytes ('{longest[:40]}...'); file systems take at "
                f"most {MAX_NAME_BYTES}. Shorten it.")
    return ""


def plain_name_problem(key: str, value: str) -> str:
    """Why ``value`` cannot be the one file or folder name ``key`` gives ("" when it can), on any system."""
    value = str(value or "")
    if not value:
        return ""
    what = PLAIN_NAMES.get(key, "a file or folder name")
    bad = sorted({c for c in value if c in _FORBIDDEN or ord(c) < 32})
    if value in (".", "..") or bad:
        shown = " ".join(repr(c) for c in bad) if bad else repr(value)
        return (f"{key} = {value!r} is not a plain name ({shown}): it is {what}. Use letters, digits, '-', '_' and "
                f"'.', without any of {_FORBIDDEN}.")
    if value.split(".")[0].strip().upper() in _WINDOWS_RESERVED:
        return f"{key} = {value!r} is a name Windows reserves for a device ({value.split('.')[0]}); pick another."
    if value[-1] in " .":
        return f"{key} = {value!r} ends in {'a space' if value[-1] == ' ' else 'a dot'}, which Windows drops; remove it."
    if len(value.encode()) > 200:
        return f"{key} is {len(value.encode())} bytes long; keep it under 200."
    return ""


def check_path_fields(cfg: Any) -> None:
    """Every path a file system can take and every plain name plain; raises ConfigError naming the field."""
    for cp in config_paths(cfg):
        problem = path_text_problem(cp.key, cp.text)
        if problem:
            raise ConfigError(problem, key=cp.key, value=cp.text[:200])
    for key in PLAIN_NAMES:
        section, name = key.split(".")
        problem = plain_name_problem(key, _get(_get(cfg, section), name))
        if problem:
            raise ConfigError(problem, key=key, value=str(_get(_get(cfg, section), name))[:200])


def outside(cfg: Any, base: Path, confinement: Confinement) -> List[Issue]:
    """An error for every path of ``cfg`` outside ``confinement`` (reads under its roots, writes under its writable
    roots), judged after links are resolved."""
    out: List[Issue] = []
    for cp in config_paths(cfg):
        p = local_path(cp.text, base)
        if p is None or confinement.allows(p, write=cp.write):
            continue
        try:
            real = p.resolve()
        except (OSError, RuntimeError, ValueError):
            real = p
        via = f" (a link to '{real}')" if real != Path(os.path.abspath(p)) else ""
        verb = "write" if cp.write else "read"
        out.append(Issue(cp.key, f"{cp.key} = '{cp.text}'{via} is outside the folders this run may {verb} "
                                 f"({confinement.describe(cp.write)}). Move it into one of them, or start the UI with "
                                 "--browse-root FOLDER to allow another folder.", level="error"))
    return out
