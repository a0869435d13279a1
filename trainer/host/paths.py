"""Path strings from any operating system, read on any operating system.

A config written on Windows (``C:\\Users\\me\\data``, ``\\\\nas\\share\\models``) may be read on Linux (a
cloud pod, a shared preset) and the other way round, so the few places that take a path string
apart — the last component for a run name, "is this absolute?" before a path leaves the machine in
a file's metadata — must not lean on the running system's ``os.path``. Torch-free, stdlib only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PureWindowsPath

_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")  # C:\ or C:/
_UNC = re.compile(r"^(\\\\|//)[^\\/]+[\\/][^\\/]+")  # \\server\share or //server/share


def is_windows_path(text: str) -> bool:
    """A Windows absolute path: drive letter or UNC share (``\\\\?\\`` long-path prefix included)."""
    return bool(_DRIVE.match(text) or _UNC.match(text))


def is_absolute_path(text: str) -> bool:
    """Absolute on any system: POSIX ``/…``, ``~``-relative, a drive letter or a UNC share."""
    text = str(text)
    return bool(text) and (text.startswith(("/", "~")) or is_windows_path(text) or os.path.isabs(text))


def path_name(text: str) -> str:
    """The last component of a path written with ``/`` or ``\\`` (trailing separators ignored)."""
    text = str(text).rstrip("/\\")
    if is_windows_path(text) or "\\" in text:
        return PureWindowsPath(text).name or text
    return text.rsplit("/", 1)[-1]


__all__ = ["is_absolute_path", "is_windows_path", "path_name"]


# ----------------------------------------------------------------------------------------------
# confinement: the folders a run started from the page may touch
# ----------------------------------------------------------------------------------------------

class Confinement:
    """Folders a process may read (``roots``) and, of those, the ones it may not write (``read_only``). Paths are
    judged after ``resolve()``: a link inside a root that points outside is outside."""

    def __init__(self, roots: "list[str | os.PathLike]", read_only: "list[str | os.PathLike]" = ()):
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        self.read_only = [Path(r).expanduser().resolve() for r in read_only]

    def allows(self, path: "str | os.PathLike", write: bool = False) -> bool:
        try:
            real = Path(path).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):  # a link loop, a name the OS refuses
            return False
        inside = lambda root: real == root or root in real.parents  # noqa: E731
        if write and any(inside(r) for r in self.read_only):
            return False
        return any(inside(r) for r in self.roots + ([] if write else self.read_only))

    def describe(self, write: bool = False) -> str:
        shown = self.roots + ([] if write else self.read_only)
        return ", ".join(f"'{r}'" for r in shown)


_CONFINED: "list[Confinement]" = []


def confine(confinement: "Confinement | None") -> None:
    """Confine this process (``train --allowed-root``, which the page passes): data folders skip files whose links
    lead outside. ``None`` lifts it."""
    _CONFINED[:] = [confinement] if confinement is not None else []


def confinement() -> "Confinement | None":
    return _CONFINED[0] if _CONFINED else None
