"""The run folder: ``<workspace>/runs/<name>/`` with its events, samples, backups and control files, the
run's log, and the config made shareable for the files a run writes."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, List

from trainer.host.paths import is_absolute_path, path_name
from trainer.io import remove_stale_temps
from trainer.run_summary import SummaryWriter

log = logging.getLogger("atelier")


def portable_paths(node: Any, workspace: str) -> Any:
    """The config with absolute paths made shareable: relative to the workspace inside it, the last
    component alone (``…/name``) outside it."""
    if isinstance(node, dict):
        return {k: portable_paths(v, workspace) for k, v in node.items()}
    if isinstance(node, list):
        return [portable_paths(v, workspace) for v in node]
    if isinstance(node, str) and is_absolute_path(node):  # also C:\… and \\server\share written on Windows
        p = Path(node).expanduser()
        if not (os.path.isabs(node) or node.startswith("~")):  # another system's path: never this machine's
            return f"…/{path_name(node)}"
        try:
            ws, real = Path(workspace).expanduser().resolve(), p.resolve()
            return Path(os.path.relpath(real, ws)).as_posix() if real == ws or ws in real.parents else f"…/{p.name}"
        except (OSError, ValueError):
            return f"…/{path_name(node)}"
    return node


class RunFolder:
    def __init__(self, path: Path, main: bool = True):
        self.path = Path(path)
        self.main = main  # several processes: only rank 0 writes events and answers control requests
        for sub in ("samples", "backups", "control"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self.events = SummaryWriter(self.path / "events.jsonl", enabled=main, reserve=True)
        if main:  # a save killed half-way (kill -9, power loss) left temporaries: this trainer holds the folder
            for folder in (self.path, self.path / "backups", self.path / "samples"):
                for name in remove_stale_temps(folder):
                    log.info("removed %s, left by an interrupted save", folder / name)

    @property
    def backups(self) -> Path:
        return self.path / "backups"

    def control_requested(self, what: str) -> bool:
        """The UI asks for 'sample' or 'backup' now by creating control/<what>."""
        f = self.path / "control" / what
        if self.main and f.exists():
            try:
                f.unlink()
            except OSError:
                pass
            return True
        return False


def list_backups(run_dir: Path) -> List[Path]:
    folder = Path(run_dir) / "backups"
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and (p / "state.json").exists()
                   and not p.name.startswith(".")), key=lambda p: p.name)


def setup_logging(run_dir: Path, rank: int = 0) -> None:
    logger = logging.getLogger("atelier")
    logger.setLevel(logging.INFO)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    if rank == 0:  # several processes: rank 0 writes train.log, the others log warnings to stderr
        fh = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    if rank:
        sh.setLevel(logging.WARNING)
    sh.setFormatter(logging.Formatter(f"%(levelname)s {f'[rank {rank}] ' if rank else ''}%(message)s"))
    logger.addHandler(sh)
    logger.propagate = False
