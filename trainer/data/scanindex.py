"""Dataset scans remembered between launches: what probing an image found, kept in the cache folder.

Why: every launch, ``data-report`` and the page's "Check the dataset" decode every image in full
(:func:`trainer.data.probe.probe_image`) and hash every file for duplicate detection; at 50k images that is
half a minute before the model loads, every time, for files that have not changed. The index keeps, per file, the
probe's answer (displayed size, or why the file cannot be used) and its content hash, under a stamp of the file:
size, mtime_ns, ctime_ns and inode (``os.stat``, links followed). A file whose stamp differs is probed again in
full, so the damaged-file checks are as strict as without the index: a file damaged after the first scan has a
new mtime (and usually a new size) and is named again. A file modified in the last two seconds is not remembered
(git's "racy clean" rule: coarse timestamps could let a second edit in the same tick keep size and mtime).

An image's entry also remembers its caption file's lines (``<stem>.txt``, or the concept's caption extension) under
that file's own stamp, so a relaunch reads no caption that did not change: a caption whose size, mtime, ctime or
inode differs is read again (any write changes its ctime), one modified in the last seconds is not remembered, and
one that is not UTF-8 (read with a warning) is read, and warned about, on every launch.

The whole index is also stamped with what the probe's answer depends on besides the file: this module's format,
Pillow's version (its decoders) and Pillow's pixel limit (``Image.MAX_IMAGE_PIXELS``, the "too large" refusal).
Another stamp starts an empty index. The file is ``<cache folder>/scan-index.json``, written atomically
(:mod:`trainer.io`); one that cannot be read or parsed is ignored (logged) and rebuilt by the next scan, never an
error. Entries are keyed by the file's absolute path (``os.path.abspath``: no ``resolve()`` per file; the stamp,
taken through links, tells a link that now points elsewhere). Standard library and Pillow only (no torch).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from stat import S_ISREG
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import PIL
from PIL import Image

from trainer.data import probe
from trainer.data.cache import cache_folder, file_sha256, remember_sha256
from trainer.data.captions import Warn, caption_ext, read_caption_file
from trainer.io import atomic_write_bytes

log = logging.getLogger(__name__)

INDEX_FORMAT = 1          # bump when an entry's layout or the probe's rules change: old indexes are then ignored
INDEX_NAME = "scan-index.json"
RACY_SECONDS = 2.0        # a file modified this recently may change again within the same timestamp tick
MAX_ENTRIES = 500_000     # entries of folders this scan did not read are dropped beyond this many

Probed = Tuple[Tuple[int, int], Optional[str]]
# an entry: [size, mtime_ns, ctime_ns, inode, width, height, problem or None, sha256 or ""]
# and, once its caption file was read: + [[caption extension, size, mtime_ns, ctime_ns, inode], "its lines\n..."]
_STAMP = slice(0, 4)
_LENGTHS = (8, 10)


def settings_stamp() -> Dict[str, Any]:
    """What a probe's answer depends on besides the file itself; an index made under another stamp is not used."""
    return {"format": INDEX_FORMAT, "pillow": PIL.__version__, "max_pixels": Image.MAX_IMAGE_PIXELS}


def _file_stamp(st: os.stat_result) -> List[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class ScanIndex(probe.Prober):
    """The remembered probes and hashes of one cache folder (``path`` None: nothing is read or written, every
    file is probed; the scan code is the same either way). Thread-safe for the scan's worker threads.

    ``probed`` and ``hashed`` count the files this process really probed and hashed, ``recalled`` the probes
    answered from the index: what the tests and the page's progress line read."""

    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path is not None else None
        self.entries: Dict[str, list] = {}
        self.used: set = set()
        self.stats: Dict[str, os.stat_result] = {}  # files checked by this process, as they were then
        self.folders: set = set()   # folders scanned this time: their entries not used are files gone
        self.dirty = False
        self.probed = 0
        self.hashed = 0
        self.recalled = 0
        self.captions_read = 0      # caption files this process read (the others came from the index)
        self._lock = threading.Lock()

    # -- reading and writing ------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Optional[Path]) -> "ScanIndex":
        """The index stored at ``path``, or an empty one when there is none, it is damaged, or it was made under
        another :func:`settings_stamp` (then rebuilt on the next :meth:`save`)."""
        index = cls(path)
        if path is None or not Path(path).is_file():
            return index
        try:
            data = json.loads(Path(path).read_bytes())
            if not isinstance(data, dict) or data.get("stamp") != settings_stamp():
                log.info("dataset scan index %s was made by another version or setting: scanning afresh", path)
                return index
            entries = data.get("entries")
            if not isinstance(entries, dict):
                raise ValueError("no entries")
            index.entries = {k: v for k, v in entries.items() if type(v) is list and len(v) in _LENGTHS}  # noqa: E721
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            log.warning("dataset scan index %s cannot be read (%s): scanning afresh, it is rebuilt", path, exc)
            index.entries = {}
        return index

    def save(self) -> None:
        """Write the index when something changed (atomically). Entries of the folders scanned this time that the
        scan did not use (files removed or renamed) are dropped; entries of other folders (another dataset using
        the same cache) are kept up to :data:`MAX_ENTRIES`. A folder that cannot be written is logged, not
        raised: remembering the scan is an optimisation."""
        if self.path is None:
            return
        prefixes = tuple(f.rstrip(os.sep) + os.sep for f in self.folders)
        with self._lock:
            gone = [k for k in self.entries if k not in self.used and prefixes and k.startswith(prefixes)]
            for k in gone:
                del self.entries[k]
            if gone:
                self.dirty = True
            if len(self.entries) > MAX_ENTRIES:
                others = [k for k in self.entries if k not in self.used]
                for k in others[:len(self.entries) - MAX_ENTRIES]:
                    del self.entries[k]
            if not self.dirty:
                return
            blob = json.dumps({"stamp": settings_stamp(), "entries": self.entries}, separators=(",", ":"))
        try:
            atomic_write_bytes(self.path, blob.encode("utf-8"))
            self.dirty = False
        except OSError as exc:
            log.info("could not write the dataset scan index %s (%s): the next launch scans again", self.path, exc)

    # -- looking up -------------------------------------------------------------------------------------------

    def scanning(self, folder: Path) -> None:
        """Tell the index that ``folder`` is scanned whole now (see :meth:`save`)."""
        self.folders.add(_key(folder))

    def _current(self, path: Path) -> Tuple[str, Optional[os.stat_result], Optional[list]]:
        """(key, stat, the entry when its stamp matches the file now). A file already checked by this process is
        not stat'ed again (the hash of duplicate detection follows the probe within the same scan)."""
        key = _key(path)
        seen = self.stats.get(key)
        if seen is not None:
            return key, seen, self.entries.get(key)
        try:
            st = os.stat(path)
        except OSError:
            return key, None, None
        entry = self.entries.get(key)
        if entry is not None and entry[_STAMP] == _file_stamp(st) and _sound(entry):
            self.used.add(key)
            self.stats[key] = st
            return key, st, entry
        return key, st, None

    def probe(self, path: Path) -> Probed:
        """:func:`trainer.data.probe.probe_image`'s answer for ``path``: remembered when the file's stamp is
        unchanged, else the file is probed in full (and remembered unless it changed in the last seconds)."""
        key, st, entry = self._current(path)
        if entry is not None:
            self.recalled += 1
            return (entry[4], entry[5]), entry[6]
        size, problem = probe.probe_image(Path(path))  # looked up at call time (tests count the calls)
        with self._lock:
            self.probed += 1
            if st is not None and not _racy(st):
                self.entries[key] = _file_stamp(st) + [int(size[0]), int(size[1]), problem, ""]
                self.used.add(key)
                self.stats[key] = st
                self.dirty = True
        return size, problem

    def probe_all(self, paths: Sequence[Path], pool: Executor) -> List[Probed]:
        """:meth:`probe` of every path in order: the remembered ones here (a stat each), the rest on ``pool``."""
        out: List[Optional[Probed]] = []
        todo: List[int] = []
        for k, path in enumerate(paths):
            _, _, entry = self._current(path)
            out.append(((entry[4], entry[5]), entry[6]) if entry is not None else None)
            if entry is None:
                todo.append(k)
            else:
                self.recalled += 1
        for k, found in zip(todo, pool.map(self.probe, [paths[k] for k in todo])):
            out[k] = found
        return out  # type: ignore[return-value]

    def captions(self, image: Path, extension: str, warn: Warn) -> Optional[List[str]]:
        """The caption candidates of ``image`` (None: no caption file): remembered in the image's entry while the
        caption file's stamp is unchanged, else the file is read (and remembered unless it changed in the last
        seconds or reading it warned). The caption of an image the index holds no entry for this time (one
        modified in the last seconds) is read as without an index."""
        key = _key(image)
        entry = self.entries.get(key) if key in self.used else None
        if entry is None:
            return super().captions(image, extension, warn)
        ext = caption_ext(extension)
        text = os.fspath(image)
        cap = text[:len(text) - len(os.path.splitext(text)[1])] + ext  # image.with_name(stem + ext), without pathlib
        try:
            st = os.stat(cap)
        except (OSError, ValueError):
            return None
        if not S_ISREG(st.st_mode):
            return None
        stamp = [ext] + _file_stamp(st)
        if len(entry) == 10 and entry[8] == stamp and type(entry[9]) is str:  # noqa: E721
            return entry[9].split("\n") if entry[9] else []  # a caption's lines hold no line break
        warned: List[str] = []
        lines = read_caption_file(Path(cap), warned.append)
        for message in warned:
            warn(message)
        with self._lock:
            self.captions_read += 1
            if not warned and not _racy(st):
                entry[8:] = [stamp, "\n".join(lines)]
                self.dirty = True
        return lines

    def remembered_sha256(self, path: Path) -> Optional[str]:
        """The remembered sha256 of an unchanged file, or None (then :meth:`sha256` reads the file)."""
        _, st, entry = self._current(path)
        if st is None or entry is None or not entry[7]:
            return None
        remember_sha256(st, entry[7])
        return entry[7]

    def sha256(self, path: Path) -> str:
        """The sha256 of the file's bytes ("" when it cannot be read): remembered when the file's stamp is
        unchanged (and then handed to the latent cache's memo, so caching does not hash it again)."""
        key, st, entry = self._current(path)
        if st is None:
            return ""
        if entry is not None and entry[7]:
            remember_sha256(st, entry[7])
            return entry[7]
        try:
            digest = file_sha256(Path(path))
        except OSError:
            return ""
        with self._lock:
            self.hashed += 1
            if entry is not None:  # stamp unchanged since the probe remembered it
                entry[7] = digest
                self.dirty = True
        return digest


def _sound(entry: list) -> bool:
    """Whether a matching entry holds what a probe gives (a hand-edited index may hold anything)."""
    return (type(entry[4]) is int and type(entry[5]) is int and (entry[6] is None or type(entry[6]) is str)  # noqa: E721
            and type(entry[7]) is str)  # noqa: E721


def _key(path: Path) -> str:
    """The file's absolute path as a string (a scan's paths are absolute already: no normalising per file)."""
    text = os.fspath(path)
    return text if text.startswith("/") or os.path.isabs(text) else os.path.abspath(text)


def _racy(st: os.stat_result) -> bool:
    return time.time() - st.st_mtime < RACY_SECONDS


def index_path(cfg: Any) -> Path:
    """Where the scan index of a run config lives: ``<cache folder>/scan-index.json``."""
    return cache_folder(cfg) / INDEX_NAME


def index_for(cfg: Any) -> ScanIndex:
    """The scan index of a run config's cache folder (an empty, unsaved one when the config names none)."""
    try:
        return ScanIndex.load(index_path(cfg))
    except (AttributeError, KeyError, TypeError):  # a config without general/data sections (tests, tools)
        return ScanIndex()


def hashes(index: ScanIndex, paths: Iterable[Union[str, Path]], workers: int) -> List[str]:
    """Each file's sha256 through the index ("" for a file that cannot be read), in order: the remembered ones
    here, the others read on ``workers`` threads."""
    paths = list(paths)
    out = [index.remembered_sha256(p) for p in paths]
    todo = [k for k, digest in enumerate(out) if digest is None]
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            for k, digest in zip(todo, pool.map(index.sha256, [paths[k] for k in todo])):
                out[k] = digest
    return out  # type: ignore[return-value]


__all__ = ["INDEX_FORMAT", "INDEX_NAME", "ScanIndex", "hashes", "index_for", "index_path", "settings_stamp"]
