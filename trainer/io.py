"""Atomic writes for everything Atelier saves (models, backups, exports).

Why: a training run can be stopped (SIGTERM, out of memory, a full disk) in the middle of a save.
A user must never be left with a half-written ``.safetensors`` that replaced a good one. So every
save writes to a temporary name in the *same folder* (same file system, so the final rename is
atomic) and only then ``os.replace``s it onto the real name. On failure the temporary is removed
and the previous file is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import torch


def _temp_name(path: Path, kind: str = "tmp", suffix: str = "") -> Path:
    """A fresh, hidden, not-yet-existing name next to ``path`` (``.name.tmp-XXXXXXXX``).

    Not ``tempfile.mkstemp``/``mkdtemp``: those create 0600/0700 entries, and the renamed result
    would then be unreadable to other users and services (a shared pod, a file server).
    """
    while True:
        candidate = path.parent / f".{path.name}.{kind}-{secrets.token_hex(4)}{suffix}"
        if not candidate.exists():
            return candidate


_TEMP_NAME = None


def remove_stale_temps(folder: str | os.PathLike) -> list:
    """Delete the hidden temporaries (``.name.tmp-XXXXXXXX…``, ``.name.old-XXXXXXXX``) that a process killed
    in the middle of an atomic write left in ``folder``; only safe while no other process writes there
    (a run folder under its trainer lock). Returns the names removed."""
    global _TEMP_NAME
    if _TEMP_NAME is None:
        _TEMP_NAME = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{8}")
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        if _TEMP_NAME.match(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
            removed.append(entry.name)
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_file(path: Path) -> None:
    """Flush a written file to disk so that the rename never exposes an empty file after a crash."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically.

    The temporary keeps ``path``'s suffix, because some writers (``save_file``, ``torch.save``
    callers, PIL) choose a format from it. On an exception the temporary is removed and the
    exception propagates; the previous ``path`` (if any) is left intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path, suffix=path.suffix)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"nothing was written for {path} (expected {tmp.name})")
        _fsync_file(tmp)
        if tmp.is_file():  # some writers (safetensors' save_file) create 0600 files: readable as the umask says
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``path``; on success it takes ``path``'s place.

    Folders cannot be swapped in one atomic step, so: the new folder is written completely under
    ``.name.tmp-XXXX``; then the old folder (if any) is renamed away, the new one renamed in, and
    only then the old one deleted. The window in which ``path`` is missing is two renames long, and
    a crash inside it leaves both complete copies on disk. On an exception the temporary folder is
    removed and the old folder is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old: Path | None = None
    if path.exists():
        old = _temp_name(path, kind="old")
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)  # put the previous version back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_safetensors_atomic(tensors: Mapping[str, "torch.Tensor"], path: str | os.PathLike,
                            metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with an atomic rename and string-only metadata.

    safetensors rejects non-string metadata values with an unhelpful error, so values are
    converted with ``str`` here; tensors are made contiguous (views of a bigger tensor, such as
    slices of a fused qkv weight, are otherwise refused).
    """
    # torch inside: the UI and the CLI's validate import this module without torch
    from safetensors.torch import save_file

    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    data = {k: v.detach().contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(data, str(tmp), metadata=meta or None)


def looks_like_write_failure(exc: BaseException) -> bool:
    """A full disk or a permission problem while writing (OSError, or torch/safetensors' RuntimeError)."""
    text = str(exc)
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS) \
        or path_too_long(exc) or "No space left" in text or "write failed" in text


WINDOWS_PATH_LIMIT = 260  # MAX_PATH: Windows refuses longer paths unless long paths are switched on


def path_too_long(exc: BaseException) -> bool:
    """ENAMETOOLONG, or Windows' ERROR_FILENAME_EXCED_RANGE (206) / a path past MAX_PATH that 'does not exist'."""
    if getattr(exc, "errno", None) == errno.ENAMETOOLONG or getattr(exc, "winerror", None) == 206:
        return True
    name = getattr(exc, "filename", None)
    return getattr(exc, "winerror", None) in (2, 3) and len(str(name or "")) >= WINDOWS_PATH_LIMIT


def write_failure(exc: BaseException, folder: str | os.PathLike | Sequence[str | os.PathLike], what: str,
                  backups: Optional[Sequence[os.PathLike]] = None) -> str:
    """One line for a failed write: a full disk (errno ENOSPC, or torch's "enforce fail … file write failed"
    with little space left) says how much is free where the write failed (the file the error names, else the
    fullest of ``folder``'s folders: a run folder on a small disk beside a large workspace), a permission problem
    names the folder; anything else keeps its first line. ``backups`` (a run's complete backups, oldest first)
    adds what a restart continues from; tools that keep no backups leave it None."""
    candidates = [Path(f) for f in ([folder] if isinstance(folder, (str, os.PathLike)) else folder)]
    named = getattr(exc, "filename", None)
    if named:
        candidates = [Path(str(named)).parent]
    where, free = candidates[0], None
    for candidate in candidates:
        probe = candidate
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            left = shutil.disk_usage(probe).free
        except OSError:
            continue
        if free is None or left < free:
            where, free = candidate, left
    folder = where
    text = str(exc)
    code = getattr(exc, "errno", None)
    after = _after_failure(backups)
    low_space = free is not None and free < 256 * 2**20
    if code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or (low_space and "write failed" in text):
        left = f"{free / 2**20:.0f} MiB free" if free is not None else "no space left"
        return (f"Writing {what} to {folder} failed: the disk is full ({left}). Free some space (old runs, backups, "
                f"caches){after}")
    if path_too_long(exc):
        name = str(getattr(exc, "filename", "") or folder)
        return (f"Writing {what} to {folder} failed: the path is too long ({len(name)} characters: {name}). "
                f"Windows stops at {WINDOWS_PATH_LIMIT} unless long paths are switched on (LongPathsEnabled; "
                "`python launch.py --doctor` says whether they are). Switch them on, or choose a shorter "
                f"general.workspace / run name{after}")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"Writing {what} to {folder} failed: no permission to write there ({exc.strerror}). Make the folder "
                f"writable or choose another general.workspace{after}")
    return f"Writing {what} to {folder} failed: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _after_failure(backups: Optional[Sequence[os.PathLike]]) -> str:
    """The end of a write failure's sentence: what the run continues from, said as it is."""
    if backups is None:
        return "."
    if backups:
        return (f", then continue with --resume last: the last complete backup ({Path(backups[-1]).name}) is "
                "intact.")
    return "; no backup was written yet, so the run starts again from the beginning."

