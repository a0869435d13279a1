"""``python -m trainer`` with training.compile's backend swapped for aot_eager, for runs launched in a subprocess
(torchrun): AOTAutograd traces forward and backward as inductor gets them, without generating kernels (no C++
compiler, seconds instead of minutes); ``COMPILE_BACKEND=eager`` stops at dynamo's capture (its graphs, breaks and
guards, a few seconds less). At exit each process prints torch's graph counts as one JSON line:
``{"rank": …, "graph_breaks": …, "frames_compiled": …, "graphs": …}``."""

from __future__ import annotations

import json
import os
import sys

from trainer.__main__ import main
from trainer.train import setup
from trainer.train.compile import dynamo_counts

_compile_blocks = setup.compile_blocks


def _aot_eager(model, mode="default", *args, **options):
    return _compile_blocks(model, mode, *args, backend=os.environ.get("COMPILE_BACKEND", "aot_eager"), **options)


if __name__ == "__main__":
    setup.compile_blocks = _aot_eager
    rc = main(sys.argv[1:])
    # one write of the line and its newline: the processes share the pipe, and print() writes the two apart
    sys.stdout.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), **dynamo_counts()}) + "\n")
    sys.stdout.flush()
    sys.exit(rc)
