"""Start-up trims of a fresh `python -m trainer train` process (trainer/startup.py): bitsandbytes is
kept out when nothing in the config uses it (it drags in torch._inductor through diffusers' quantizer
registry and peft), and stays importable when an 8-bit optimizer needs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.startup import unneeded_packages

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import sys
from trainer.config import load_config
from trainer.startup import skip_unused_imports
cfg = load_config(None, ["training.optimizer.name=%s"], preset="demo")
print("skipped", skip_unused_imports(cfg))
import diffusers, peft
from diffusers import UNet2DConditionModel, StableDiffusionPipeline
import peft.tuners.lora
from diffusers.utils import is_bitsandbytes_available
print("bnb imported", sys.modules.get("bitsandbytes") is not None, "diffusers sees bnb", is_bitsandbytes_available())
print("inductor", "torch._inductor.compile_fx" in sys.modules)
"""


@pytest.mark.parametrize("name,skipped", [("adamw", ["bitsandbytes"]), ("prodigy", ["bitsandbytes"]),
                                          ("adamw8bit", []), ("lion8bit", [])])
def test_only_configs_without_8bit_optimizers_skip_bitsandbytes(name, skipped):
    cfg = load_config(None, [f"training.optimizer.name={name}"], preset="demo")
    assert unneeded_packages(cfg) == skipped


def _probe(optimizer: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE % optimizer], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), **env), timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(__import__("importlib").util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_a_fresh_process_imports_diffusers_and_peft_without_bitsandbytes():
    out = _probe("adamw")
    assert "skipped ['bitsandbytes']" in out
    assert "bnb imported False diffusers sees bnb False" in out and "inductor False" in out
    out = _probe("adamw8bit")  # an 8-bit optimizer: untouched
    assert "skipped []" in out and "bnb imported True diffusers sees bnb True" in out
    out = _probe("adamw", ATELIER_IMPORT_ALL="1")  # the escape hatch
    assert "skipped []" in out and "bnb imported True" in out


def test_gc_is_paused_for_start_up_and_resumed_once():
    import gc

    from trainer import startup
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
