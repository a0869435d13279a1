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

:func:`speed_up_imports` removes repeated work from the imports themselves: transformers' double scan
of its ``models`` folder, and two results that only change when packages are installed (that scan and
``importlib.metadata.packages_distributions()``), kept in ``~/.cache/atelier`` (``$XDG_CACHE_HOME``).
``ATELIER_IMPORT_ALL=1`` turns these off too.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import importlib.metadata as md
import json
import os
import sys
from typing import List, Tuple

from trainer.io import atomic_write_bytes
from trainer.optim.registry import OPTIMIZERS


def unneeded_packages(cfg) -> List[str]:
    """Installed packages this run will not use and that are costly to import (torch-free)."""
    names = []
    o = cfg.training.optimizer
    spec = OPTIMIZERS.get(str(o.name))
    uses_bnb = (spec is None or spec.eight_bit or spec.module.split(".")[0] == "bitsandbytes"
                or "bitsandbytes" in str(cfg.training.get("lr_scheduler_class", "") or "")
                or bool(cfg.parts.denoiser.get("nf4", False)))  # NF4 storage quantizes with bitsandbytes
    if not uses_bnb:
        names.append("bitsandbytes")
    return names


# libraries that record at their own import which optional packages are installed (diffusers' and accelerate's
# is_bitsandbytes_available): once one of them is imported, hiding a package from it breaks its later imports
_CHECK_AVAILABILITY = ("diffusers", "accelerate", "peft", "transformers")


def skip_unused_imports(cfg) -> List[str]:
    """Mark :func:`unneeded_packages` as not importable in this process; returns what was skipped."""
    if os.environ.get("ATELIER_IMPORT_ALL", "") not in ("", "0"):
        return []
    if any(lib in sys.modules for lib in _CHECK_AVAILABILITY):
        return []  # they noted at import what is installed, and would import it anyway
    skipped = []
    for name in unneeded_packages(cfg):
        if name not in sys.modules:  # never hide something already in use
            sys.modules[name] = None  # type: ignore[assignment]
            skipped.append(name)
    return skipped


def start_train_imports(cfg, fresh_process: bool) -> Tuple[List[str], bool]:
    """The train path's first torch import, the optimizer check (:func:`trainer.optim.schedule.check_classes`
    imports diffusers), after the trims of a fresh process: once diffusers is imported neither trim can work.
    Raises ConfigError for a config whose optimizer or scheduler cannot be built; returns what was skipped and
    whether transformers' imports were sped up."""
    skipped = skip_unused_imports(cfg) if fresh_process else []
    patched = speed_up_imports() if fresh_process else False
    from trainer.optim.schedule import check_classes  # torch: keeps `--help` and validate torch-free
    check_classes(cfg)
    return skipped, patched


# --- transformers' import structure --------------------------------------------------------------
# ``import transformers`` reads every file under ``transformers/models`` (≈ 550 folders, 1,600 files,
# ≈ 0.5 s on a 2-core machine) to build its lazy import structure, in ``create_import_structure_from_path``,
# an ``lru_cache`` of the default size 128. ``transformers.models`` (imported by peft and by every model
# class) then asks for the same folders again: with 550 keys in a 128-entry cache every one misses and
# the whole scan runs a second time. Two fixes, both applied right after ``transformers.utils.import_utils``
# is executed (before transformers' ``__init__`` uses it):
#
# 1. that function gets an unbounded cache (the same function and results; its cache already shares
#    results between callers), so the second scan is a lookup;
# 2. the structure of the ``models`` folder is kept on disk (JSON, under ``~/.cache/atelier``, one file
#    per transformers install) and reused while no ``.py`` file below it changed (name, size and
#    mtime of every file are compared: ≈ 0.05 s instead of the 0.5 s scan).
_TRANSFORMERS_IMPORT_UTILS = "transformers.utils.import_utils"


def _cache_dir() -> str:
    """``$XDG_CACHE_HOME/atelier``, ``%LOCALAPPDATA%\\atelier`` on Windows, or ``~/.cache/atelier``; "" (no disk
    cache) without a usable home."""
    base = os.environ.get("XDG_CACHE_HOME") or (os.environ.get("LOCALAPPDATA") if os.name == "nt" else "") \
        or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atelier") if os.path.isabs(base) else ""


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: str, data: dict) -> None:
    """Best effort: a read-only home or a full disk just means no cache."""
    try:
        atomic_write_bytes(path, json.dumps(data).encode("utf-8"))
    except Exception:
        pass


def _tree_fingerprint(folder: str) -> str:
    """Names, sizes and mtimes of every ``.py`` file below ``folder``, hashed."""
    h = hashlib.blake2b(digest_size=16)
    stack = [folder]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.name == "__pycache__":
                continue
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            elif e.name.endswith(".py"):
                st = e.stat()
                h.update(f"{e.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _to_json(structure) -> list:
    out = []
    for backends, modules in structure.items():
        if not isinstance(backends, frozenset) or not isinstance(modules, dict):
            raise TypeError("unexpected import structure")
        mods = {}
        for name, objects in modules.items():
            if not isinstance(name, str) or not isinstance(objects, set):
                raise TypeError("unexpected import structure")
            mods[name] = sorted(objects)
        out.append([sorted(backends), mods])
    return out


def _from_json(entries) -> dict:
    return {frozenset(b): {m: set(o) for m, o in mods.items()} for b, mods in entries}


def _disk_cached_structure(module, original):
    """Wrap transformers' ``define_import_structure`` with the on-disk cache for its ``models`` folder
    (None: no cache to be had)."""
    try:
        tf_version = md.version("transformers")
    except Exception:
        return None
    if not _cache_dir():
        return None
    models = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(module.__file__))), "models")
    where = hashlib.blake2b(models.encode(), digest_size=4).hexdigest()  # one file per install (venv)
    path = os.path.join(_cache_dir(), f"transformers-{tf_version}-{where}-import-structure.json")
    fingerprint = []  # computed once per process, when first needed

    def cached(module_path, prefix=None):
        folder = os.path.abspath(str(module_path))
        if os.path.isfile(folder):
            folder = os.path.dirname(folder)
        if folder != models:
            return original(module_path, prefix)
        try:
            if not fingerprint:
                fingerprint.append(_tree_fingerprint(models))
            key = f"{prefix}"
            data = _read_cache(path)
            entries = data.get("entries") if data.get("folder") == models and \
                data.get("fingerprint") == fingerprint[0] and isinstance(data.get("entries"), dict) else {}
            if key in entries:
                return _from_json(entries[key])
        except Exception:
            return original(module_path, prefix)
        result = original(module_path, prefix)
        try:
            entries[key] = _to_json(result)
        except TypeError:  # not the structure this cache was written for: no cache
            return result
        _write_cache(path, {"folder": models, "fingerprint": fingerprint[0], "entries": entries})
        return result

    return functools.lru_cache(maxsize=None)(cached)


def _patch_transformers_import_utils(module) -> bool:
    fn = getattr(module, "create_import_structure_from_path", None)
    inner = getattr(fn, "__wrapped__", None)
    info = getattr(fn, "cache_info", None)
    define = getattr(module, "define_import_structure", None)
    if inner is None or info is None or info().maxsize is None or getattr(define, "__wrapped__", None) is None:
        return False  # not the functions this was written for (or already patched): leave them
    module.create_import_structure_from_path = functools.lru_cache(maxsize=None)(inner)
    cached = _disk_cached_structure(module, define.__wrapped__)
    if cached is not None:
        module.define_import_structure = cached
    return True


# --- importlib.metadata.packages_distributions() ---------------------------------------------------
# diffusers calls it when imported (to map import names to distributions): it opens the RECORD and
# METADATA of every installed distribution, ≈ 0.2 s here. Its result only changes when a distribution
# is installed or removed, which renames or rewrites a ``*.dist-info`` / ``*.egg-info`` folder on
# ``sys.path``; the result is kept on disk, keyed by those folders' names and mtimes.
def _dist_fingerprint() -> str:
    h = hashlib.blake2b(digest_size=16)
    for entry in sys.path:
        h.update(f"{entry}\n".encode())
        try:
            with os.scandir(entry or ".") as it:
                found = sorted((e.name, e.stat().st_mtime_ns) for e in it
                               if e.name.endswith((".dist-info", ".egg-info", ".egg-link", ".pth")))
        except OSError:
            continue
        for name, mtime in found:
            h.update(f" {name} {mtime}\n".encode())
    return h.hexdigest()


def _cached_packages_distributions(original):
    if not _cache_dir():
        return original
    path = os.path.join(_cache_dir(), f"packages-distributions-py{sys.version_info[0]}{sys.version_info[1]}.json")

    @functools.wraps(original)
    def packages_distributions():
        try:
            key = _dist_fingerprint()
            maps = _read_cache(path).get("maps")
            maps = maps if isinstance(maps, dict) else {}
            if isinstance(maps.get(key), dict):
                return {k: list(v) for k, v in maps[key].items()}
        except Exception:
            return original()
        result = original()
        # one entry per sys.path seen (python -m / -c / a script differ in sys.path[0]), newest 8 kept
        maps = {k: v for k, v in list(maps.items())[-7:]}
        maps[key] = {k: list(v) for k, v in result.items()}
        _write_cache(path, {"maps": maps})
        return result

    packages_distributions.atelier_cached = True
    return packages_distributions


class _AfterImport:
    """A one-shot ``sys.meta_path`` finder: lets the normal finders load ``name`` and then calls
    ``patch(module)`` right after the module's own code ran, before anything else uses it."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec
        patch = self.patch

        def exec_module(module):
            run(module)
            try:
                patch(module)
            except Exception:  # a speed-up must never break the import
                pass

        loader.exec_module = exec_module
        return spec


def speed_up_imports() -> bool:
    """Install the import fixes above for this process (before transformers is imported)."""
    if os.environ.get("ATELIER_IMPORT_ALL", "") not in ("", "0"):
        return False
    if not getattr(md.packages_distributions, "atelier_cached", False):
        md.packages_distributions = _cached_packages_distributions(md.packages_distributions)
    if _TRANSFORMERS_IMPORT_UTILS in sys.modules:
        return _patch_transformers_import_utils(sys.modules[_TRANSFORMERS_IMPORT_UTILS])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_TRANSFORMERS_IMPORT_UTILS, _patch_transformers_import_utils))
    return True


# --- garbage collection during start-up ---------------------------------------------------------
# Importing torch/diffusers/transformers creates hundreds of thousands of objects, and the cyclic GC
# runs again and again over all of them (≈ 10 % of the import CPU time here). A fresh training process
# pauses it until its first step is done, then freezes what start-up built (modules, classes, configs:
# kept for the whole run) so later collections skip it.
_gc_paused = False


def pause_gc() -> None:
    global _gc_paused
    if gc.isenabled() and os.environ.get("ATELIER_IMPORT_ALL", "") in ("", "0"):
        gc.disable()
        _gc_paused = True


def resume_gc() -> None:
    """Called once set-up is done (idempotent; does nothing when :func:`pause_gc` did not pause)."""
    global _gc_paused
    if _gc_paused:
        # no gc.collect() first: it takes ~0.5 s over ~700k start-up objects and finds ~14k unreachable
        # ones (RSS unchanged, measured on the demo); they stay frozen with the rest, a few MB at most
        gc.freeze()
        gc.enable()
        _gc_paused = False
