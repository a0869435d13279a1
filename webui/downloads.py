"""What a run offers for download, and a zip of a run for people who cannot reach the server's disk
(a share link, a cloud pod, Colab).

Files are served by Gradio's file route, which asks for the login like every other route. The run
folders are registered as static paths (``gr.set_static_paths``), so a multi-GB fine-tune is streamed
from where it lies instead of being copied into Gradio's cache first; the workspace is already an
allowed path, so this widens nothing. Zips are written under ``<workspace>/downloads/`` (atomically,
and reused while nothing in the run changed). Backups are left out: they are for resuming on this
machine, and can be tens of GB.
"""

from __future__ import annotations

import os
import time
import zipfile
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple

from webui import runner
from webui.imagefiles import skipped_md
from webui.mdtext import md_escape

DOWNLOADS = "downloads"
ZIP_SKIP = ("backups", "control", "tensorboard")  # resume state, UI requests; event logs stay (loss curves)
STORED = (".safetensors", ".ckpt", ".pt", ".png", ".jpg", ".jpeg", ".webp", ".zip")  # incompressible


def downloads_dir(workspace: str | os.PathLike) -> Path:
    return Path(workspace) / DOWNLOADS


def result_file(outputs: Iterable[str]) -> Optional[Path]:
    """The newest saved result that is a single file (a LoRA, an embedding, a checkpoint); None when the
    result is a folder (a diffusers fine-tune: take the zip) or nothing was saved yet."""
    for path in reversed(list(outputs)):
        p = Path(path)
        if p.is_file():
            return p
    return None


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def link_leaving(path: Path, folder: Path) -> Optional[str]:
    """Why ``path`` (in ``folder``) stays out of a zip, or None: a link to nothing, a looping one, or one whose target
    lies outside ``folder`` (a link in a run folder must not pack a file from anywhere on the disk)."""
    if not path.is_symlink():
        return None
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return "a link to nothing (or a loop)"
    top = folder.resolve()
    return None if real == top or top in real.parents else "a link leading outside the run folder"


def _members(run_dir: Path, outputs: Iterable[str],
             left_out: Optional[List[Tuple[str, str]]] = None) -> List[Tuple[Path, str]]:
    """(file, name in the zip): the run folder without backups/UI state, plus results saved outside it. Links that
    lead outside the folder they are in go to ``left_out`` as (name in the zip, reason)."""
    out: List[Tuple[Path, str]] = []
    dropped: List[Tuple[str, str]] = []
    for p in sorted(run_dir.rglob("*")):  # rglob does not enter linked folders; they are links, judged below
        rel = p.relative_to(run_dir)
        if rel.parts[0] in ZIP_SKIP or any(part.startswith(".") for part in rel.parts) \
                or p.name.endswith(".tmp") or p.name in ("trainer.lock",):
            continue
        why = link_leaving(p, run_dir)
        if why:
            dropped.append((rel.as_posix(), why))
        elif p.is_file():
            out.append((p, rel.as_posix()))
    inside = {f for f, _ in out}
    for path in outputs:  # general.output_dir elsewhere: put the result in the zip anyway
        p = Path(path)
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file() or q.is_symlink()) \
            if p.is_dir() else []
        for f in files:
            name = f"results/{f.name if f == p else f'{p.name}/{f.relative_to(p).as_posix()}'}"
            why = link_leaving(f, p.parent if f == p else p)
            if why:
                dropped.append((name, why.replace("the run folder", "its result folder")))
            elif f not in inside and f.is_file():
                out.append((f, name))
    if left_out is not None:
        left_out.extend(dropped)
    return out


def zip_run(workspace: str | os.PathLike, run_dir: str | os.PathLike, outputs: Iterable[str] = (),
            left_out: Optional[List[Tuple[str, str]]] = None) -> Path:
    """``<workspace>/downloads/<run>.zip`` with the run's config, logs, events, samples and results; the links it
    leaves out (they lead outside the run folder) are added to ``left_out`` as (name, reason)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {run_dir} does not exist")
    members = _members(run_dir, outputs, left_out)
    folder = downloads_dir(workspace)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{runner.slug(run_dir.name) or 'run'}.zip"
    newest = max((f.stat().st_mtime for f, _ in members), default=0.0)
    if target.exists() and target.stat().st_mtime >= newest:
        try:
            with zipfile.ZipFile(target) as z:
                if sorted(z.namelist()) == sorted(name for _, name in members):
                    return target  # nothing changed since it was made
        except (OSError, zipfile.BadZipFile):
            pass
    tmp = folder / f".{target.name}.{os.getpid()}.{time.time_ns()}.tmp"
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            for f, name in members:
                method = zipfile.ZIP_STORED if f.suffix.lower() in STORED else zipfile.ZIP_DEFLATED
                z.write(f, name, compress_type=method)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def zip_for_page(workspace: str | os.PathLike, run_dir: Path, outputs: Iterable[str],
                 allowed: Callable[[str], bool]) -> Tuple[Path, str]:
    """The page's "Zip this run": :func:`zip_run` with only the results inside the page's folders (``allowed``;
    the run's events name them, and a run started elsewhere may have saved anywhere), and the message that says
    what was zipped and names every file left out with the reason."""
    left_out: List[Tuple[str, str]] = []
    kept = []
    for out in outputs:
        (kept.append(out) if allowed(out) else
         left_out.append((f"results/{Path(out).name}", "outside the folders this page may use")))
    path = zip_run(workspace, run_dir, kept, left_out)
    message = f"Zipped **{md_escape(run_dir.name)}** (backups left out)."
    return path, message + ("\n\n" + skipped_md(left_out) if left_out else "")


__all__ = ["DOWNLOADS", "downloads_dir", "human_size", "link_leaving", "result_file", "zip_for_page", "zip_run"]
