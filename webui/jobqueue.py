"""The job queue: configs waiting to run one after another, kept in ``<workspace>/queue.json``.

The file is the truth (re-read on every operation) so a UI restart, or a second UI process on the
same workspace, sees the same queue. Writes are atomic (temp file, then rename).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional


@dataclass
class Job:
    """One queued run. ``kind`` is ``new`` (config_yaml → a new run folder) or ``resume``
    (continue ``run_dir`` from ``resume``: ``last`` or a backup folder)."""
    name: str
    config_yaml: str = ""
    kind: str = "new"
    run_dir: str = ""
    resume: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    added: float = field(default_factory=time.time)

    def describe(self) -> str:
        return f"resume {Path(self.run_dir).name} ({self.resume})" if self.kind == "resume" else "new run"


class JobQueue:
    """A list of :class:`Job` on disk with add / remove / move / pop."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.RLock()

    def list(self) -> List[Job]:
        with self._lock:
            if not self.path.exists():
                return []
            try:
                raw = json.loads(self.path.read_text(encoding="utf-8") or "[]")
            except (OSError, json.JSONDecodeError):
                return []
            known = set(Job.__dataclass_fields__)
            return [Job(**{k: v for k, v in item.items() if k in known}) for item in raw
                    if isinstance(item, dict) and "name" in item]

    def _save(self, jobs: List[Job]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps([asdict(j) for j in jobs], indent=1), encoding="utf-8")
        os.replace(tmp, self.path)

    def add(self, job: Job) -> Job:
        with self._lock:
            jobs = self.list()
            jobs.append(job)
            self._save(jobs)
            return job

    def remove(self, job_id: str) -> bool:
        with self._lock:
            jobs = self.list()
            kept = [j for j in jobs if j.id != job_id]
            self._save(kept)
            return len(kept) != len(jobs)

    def move(self, job_id: str, delta: int) -> None:
        """Move a job ``delta`` places (negative = towards the front)."""
        with self._lock:
            jobs = self.list()
            idx = next((i for i, j in enumerate(jobs) if j.id == job_id), None)
            if idx is None:
                return
            new = max(0, min(len(jobs) - 1, idx + delta))
            jobs.insert(new, jobs.pop(idx))
            self._save(jobs)

    def pop_next(self) -> Optional[Job]:
        with self._lock:
            jobs = self.list()
            if not jobs:
                return None
            job = jobs.pop(0)
            self._save(jobs)
            return job
