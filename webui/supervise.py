"""A tiny parent for the trainer that writes down how it ended.

``python -m webui.supervise EXIT_JSON -- python -m trainer train ...``

The UI starts this in a new session (its own process group) and the trainer becomes its child in
the same group. When the trainer exits — normally, with an error, or killed by the OS — this writes
``{"returncode": ...}`` to EXIT_JSON. Without it the exit code of a detached trainer would be lost
whenever the UI restarts, and a run killed by the out-of-memory killer could not be explained.

A stop is asked of the trainer through ``control/stop`` (``trainer.host.procs``); stop signals that reach
the whole group (Ctrl+C, a hang-up, a console closing) are ignored here (a no-op handler, not SIG_IGN,
so the trainer does not inherit "ignored") and this keeps waiting for the trainer. Only the signals
the platform has are touched (no SIGHUP on Windows). Pure stdlib.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

from trainer.host.procs import ignore_stop_signals


def main(argv: List[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m webui.supervise EXIT_JSON -- COMMAND ...", file=sys.stderr)
        return 2
    exit_path, cmd = Path(argv[0]), argv[2:]
    ignore_stop_signals()
    started = time.time()
    try:
        proc = subprocess.Popen(cmd)
    except OSError as exc:
        _write(exit_path, {"returncode": 127, "error": f"could not start {cmd[0]}: {exc}",
                           "started": started, "time": time.time()})
        return 127
    returncode = proc.wait()
    _write(exit_path, {"returncode": returncode, "pid": proc.pid, "started": started, "time": time.time()})
    return 0 if returncode == 0 else 1


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
