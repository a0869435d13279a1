"""Path strings from any operating system, read on any operating system.

A config written on Windows (``C:\\Users\\me\\data``, ``\\\\nas\\share\\models``) may be read on Linux (a
cloud pod, a shared preset) and the other way round, so the few places that take a path string
apart — the last component for a run name, "is this absolute?" before a path leaves the machine in
a file's metadata — must not lean on the running system's ``os.path``. Torch-free, stdlib only.
"""

from __future__ import annotations

import os
import re
from pathlib import PureWindowsPath

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
