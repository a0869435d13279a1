"""Start-up time of a training process.

Most of the seconds before the first step are imports (torch, diffusers, transformers, peft). One of
them buys nothing for most runs: diffusers' quantizer registry and peft's helpers import bitsandbytes
whenever it is installed, and bitsandbytes' ``torch.compile`` decorators pull in ``torch._inductor``
(≈ 1 s on a 2-core machine) — even when no 8-bit optimizer or quantised weight is used.

:func:`skip_unused_imports` marks such a package as absent for this one process (``sys.modules[name]
= None`` is Python's documented way to do that: ``import`` raises ImportError and
``importlib.util.find_spec`` returns None), so diffusers, transformers and peft take their
"not installed" branches, which they all have. It is only applied in a fresh ``python -m trainer
train`` process, only when the config cannot need the package, and only if nothing imported it yet.
``ATELIER_IMPORT_ALL=1`` turns it off.
"""

from __future__ import annotations

import os
import sys
from typing import List


def unneeded_packages(cfg) -> List[str]:
    """Installed packages this run will not use and that are costly to import (torch-free)."""
    from trainer.optim import OPTIMIZERS
    names = []
    o = cfg.training.optimizer
    spec = OPTIMIZERS.get(str(o.name))
    uses_bnb = (spec is None or spec.eight_bit or spec.module.split(".")[0] == "bitsandbytes"
                or "bitsandbytes" in str(cfg.training.get("lr_scheduler_class", "") or ""))
    if not uses_bnb:
        names.append("bitsandbytes")
    return names


def skip_unused_imports(cfg) -> List[str]:
    """Mark :func:`unneeded_packages` as not importable in this process; returns what was skipped."""
    if os.environ.get("ATELIER_IMPORT_ALL", "") not in ("", "0"):
        return []
    skipped = []
    for name in unneeded_packages(cfg):
        if name not in sys.modules:  # never hide something already in use
            sys.modules[name] = None  # type: ignore[assignment]
            skipped.append(name)
    return skipped


# --- garbage collection during start-up ---------------------------------------------------------
# Importing torch/diffusers/transformers creates hundreds of thousands of objects, and the cyclic GC
# runs again and again over all of them (≈ 10 % of the import CPU time here). A fresh training process
# pauses it until its first step is done, then freezes what start-up built (modules, classes, configs:
# kept for the whole run) so later collections skip it.
_gc_paused = False


def pause_gc() -> None:
    global _gc_paused
    import gc
    if gc.isenabled() and os.environ.get("ATELIER_IMPORT_ALL", "") in ("", "0"):
        gc.disable()
        _gc_paused = True


def resume_gc() -> None:
    """Called once set-up is done (idempotent; does nothing when :func:`pause_gc` did not pause)."""
    global _gc_paused
    if _gc_paused:
        import gc
        # no gc.collect() first: it takes ~0.5 s over ~700k start-up objects and finds ~14k unreachable
        # ones (RSS unchanged, measured on the demo); they stay frozen with the rest, a few MB at most
        gc.freeze()
        gc.enable()
        _gc_paused = False
