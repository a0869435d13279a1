"""Start-up trims of a fresh `python -m trainer train` process (trainer/host/startup.py): bitsandbytes is
kept out when nothing in the config uses it (it drags in torch._inductor through diffusers' quantizer
registry and peft), and stays importable when an 8-bit optimizer needs it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config.checks import load_config
from trainer.host.startup import unneeded_packages

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None

# One fresh process answers both start-up trims, in the train command's order (skip_unused_imports, then
# speed_up_imports, then the optimizer check that imports diffusers):
# three processes for the two tests below instead of six (each imports torch, diffusers, transformers and peft).
PROBE = """
import os, sys
from trainer.config.checks import load_config
from trainer.host.startup import start_train_imports
cfg = load_config(None, ["training.optimizer.name=%s"], preset="demo")
skipped, patched = start_train_imports(cfg, True)  # the train command's order: trims, then the optimizer check
print("skipped", skipped)
print("patched", patched)
print("checked after the trims", "diffusers" in sys.modules)
import diffusers, peft
from diffusers import UNet2DConditionModel, StableDiffusionPipeline
import peft.tuners.lora
from diffusers.utils import is_bitsandbytes_available
print("bnb imported", sys.modules.get("bitsandbytes") is not None, "diffusers sees bnb", is_bitsandbytes_available())
print("inductor", "torch._inductor.compile_fx" in sys.modules)
import transformers, transformers.models
from transformers import CLIPTextModel
from transformers.utils import import_utils as iu
info = iu.create_import_structure_from_path.cache_info()
print("maxsize", info.maxsize, "misses", info.misses)
models = os.path.join(os.path.dirname(transformers.__file__), "models")
fresh = getattr(iu.create_import_structure_from_path, "__wrapped__")(models)
ref = iu.spread_import_structure(fresh)
used = iu.define_import_structure(os.path.join(models, "__init__.py"))
print("same", used == ref, len(ref))
"""


def _start_probe(optimizer: str, cache_home: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE % optimizer], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(cache_home), **env))


def _probe_output(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the probe ran over 180 s: {err[-2000:]}") from None
    assert proc.returncode == 0, err[-2000:]
    return out


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Three fresh processes sharing one cache folder: AdamW with an empty import cache, an 8-bit optimizer with the
    cache the first wrote, and AdamW with the escape hatch. The escape hatch neither reads nor writes the cache, so it
    runs beside the other two (the fixture waits for two processes' imports instead of three)."""
    cache = tmp_path_factory.mktemp("cache")
    off = _start_probe("adamw", cache, ATELIER_IMPORT_ALL="1")
    try:
        first = _probe_output(_start_probe("adamw", cache))
        written = sorted(p.name for p in (cache / "atelier").glob("transformers-*-import-structure.json"))
        eight_bit = "adamw8bit" if HAS_BNB else "adamw"  # the cache test reads the second alone
        second = _probe_output(_start_probe(eight_bit, cache))
    except BaseException:
        off.kill()
        off.communicate()
        raise
    return dict(first=first, written=written, second=second, off=_probe_output(off))


@pytest.mark.parametrize("name,skipped", [("adamw", ["bitsandbytes"]), ("prodigy", ["bitsandbytes"]),
                                          ("adamw8bit", []), ("lion8bit", [])])
def test_only_configs_without_8bit_optimizers_skip_bitsandbytes(name, skipped):
    cfg = load_config(None, [f"training.optimizer.name={name}"], preset="demo")
    assert unneeded_packages(cfg) == skipped


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
def test_a_fresh_process_imports_diffusers_and_peft_without_bitsandbytes(probes):
    out = probes["first"]
    assert "skipped ['bitsandbytes']" in out and "checked after the trims True" in out
    assert "bnb imported False diffusers sees bnb False" in out and "inductor False" in out
    out = probes["second"]  # an 8-bit optimizer: untouched
    assert "skipped []" in out and "bnb imported True diffusers sees bnb True" in out
    out = probes["off"]  # the escape hatch
    assert "skipped []" in out and "bnb imported True" in out


def test_gc_is_paused_for_start_up_and_resumed_once():
    import gc

    from trainer.host import startup
    assert gc.isenabled()
    try:
        startup.pause_gc()
        assert not gc.isenabled()
        startup.resume_gc()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        startup.resume_gc()  # idempotent: the loop calls it after every step
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


# --- import-time caches (speed_up_imports) -----------------------------------------------------------
def _misses(out: str) -> int:
    return int(out.split("misses ")[1].split()[0])


def test_transformers_scans_its_models_folder_once_and_then_reads_the_disk_cache(probes):
    first = probes["first"]
    assert "patched True" in first and "maxsize None" in first and "same True" in first
    # one scan of ~550 folders (without the fix: two, each missing the 128-entry cache every time)
    assert 500 < _misses(first) < 700, first
    assert probes["written"]
    second = probes["second"]  # a new process: the structure comes from disk, no folder is read
    assert "same True" in second and _misses(second) < 50, second
    off = probes["off"]  # the escape hatch leaves transformers alone
    assert "patched False" in off and "maxsize 128" in off and _misses(off) > 1000


def _fake_transformers(tmp_path: Path):
    from types import SimpleNamespace
    pkg = tmp_path / "site" / "transformers"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "utils" / "import_utils.py").write_text("")
    (pkg / "models" / "clip").mkdir(parents=True)
    (pkg / "models" / "clip" / "modeling_clip.py").write_text("__all__ = ['CLIPTextModel']\n")
    calls = []

    def define(module_path, prefix=None):
        calls.append((str(module_path), prefix))
        return {frozenset({"torch"}): {"clip.modeling_clip": {"CLIPTextModel"}}}

    return SimpleNamespace(__file__=str(pkg / "utils" / "import_utils.py")), pkg / "models", define, calls


def test_the_models_structure_cache_is_rebuilt_when_a_file_changes_and_survives_a_bad_cache(tmp_path, monkeypatch):
    from trainer.host import startup
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    module, models, define, calls = _fake_transformers(tmp_path)
    want = {frozenset({"torch"}): {"clip.modeling_clip": {"CLIPTextModel"}}}
    assert startup._disk_cached_structure(module, define)(models) == want and len(calls) == 1
    assert startup._disk_cached_structure(module, define)(models) == want and len(calls) == 1  # from disk
    assert startup._disk_cached_structure(module, define)(str(models / "__init__.py"), "models") == want
    assert len(calls) == 2  # another prefix is another entry
    (models / "clip" / "modeling_clip.py").write_text("__all__ = ['CLIPTextModel', 'CLIPModel']\n")
    assert startup._disk_cached_structure(module, define)(models) == want and len(calls) == 3  # rescanned
    other = tmp_path / "elsewhere"
    other.mkdir()
    startup._disk_cached_structure(module, define)(other)  # other folders are never cached
    startup._disk_cached_structure(module, define)(other)
    assert len(calls) == 5
    cache = next((tmp_path / "cache" / "atelier").glob("transformers-*-import-structure.json"))
    cache.write_text("{not json")
    assert startup._disk_cached_structure(module, define)(models) == want and len(calls) == 6
    assert startup._disk_cached_structure(module, define)(models) == want and len(calls) == 6  # rewritten
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")  # the cache folder cannot be made: no cache, same results
    assert startup._disk_cached_structure(module, define)(models) == want and len(calls) == 7
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # never a cache relative to the current folder
    monkeypatch.setenv("HOME", "")
    assert startup._cache_dir() == "" and startup._disk_cached_structure(module, define) is None


def test_packages_distributions_is_cached_until_a_distribution_is_installed(tmp_path, monkeypatch):
    from trainer.host import startup
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site)])
    calls = []

    def original():
        calls.append(1)
        return {"PIL": ["pillow"], "yaml": ["PyYAML"]}

    assert startup._cached_packages_distributions(original)() == original() and len(calls) == 2
    assert startup._cached_packages_distributions(original)() == {"PIL": ["pillow"], "yaml": ["PyYAML"]}
    assert len(calls) == 2  # a new process reads it from disk
    (site / "newpkg-1.0.dist-info").mkdir()  # pip installed something
    startup._cached_packages_distributions(original)()
    assert len(calls) == 3
    monkeypatch.setattr(sys, "path", [str(site), str(tmp_path)])  # another sys.path: its own entry
    startup._cached_packages_distributions(original)()
    monkeypatch.setattr(sys, "path", [str(site)])
    startup._cached_packages_distributions(original)()
    assert len(calls) == 4  # the first sys.path's entry was kept
