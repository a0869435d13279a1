"""Shared fixtures: one workspace with the tiny models built once per test session, and the helpers several test
files use (training in-process, loading a tiny model the way training does).

The fast tier (`pytest -m "not slow"`, under 3 minutes) is decided in the test files: a module that trains through
the CLI, starts processes or drives a browser says ``pytestmark = pytest.mark.slow``; single slower tests elsewhere
carry ``@pytest.mark.slow`` themselves."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Tuple

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"


@pytest.fixture(scope="session")
def tiny_workspace(tmp_path_factory) -> Path:
    """A workspace whose models/ holds the tiny models (SD, SD2, SDXL) in both layouts."""
    from trainer.families.common.sd_kit.tiny import ensure_tiny_model
    ws = tmp_path_factory.mktemp("ws")
    for kind in ("tiny-sd", "tiny-sd2", "tiny-sdxl"):
        ensure_tiny_model(kind, ws / "models")
    return ws


@pytest.fixture()
def peft_strict():
    """Turn peft's partial-load warning into an error so a dropped LoRA key fails loudly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*inconsistency was discovered.*")
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared, busy CPU torch's thread pool makes each
    small op ~20x slower (measured: 5 s vs 0.2 s per tiny generation). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``; the thread count is restored after them."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_quiet(ws: Path, run: str, preset: str, *settings: str) -> Path:
    """Train ``preset`` in-process into ``<ws>/runs/<run>`` (no TensorBoard, no backups, fp32 result)
    with extra ``key=value`` settings; asserts success and returns the run folder."""
    from trainer.__main__ import main as cli
    args = ["train", "--preset", preset, "--no-progress"]
    for s in (f"general.workspace={ws}", f"general.run_name={run}", "general.tensorboard=false",
              "backup.every_n_epochs=0", "output.dtype=fp32", *settings):
        args += ["--set", s]
    assert cli(args) == 0
    return ws / "runs" / run


@pytest.fixture(scope="session")
def sks_data(tmp_path_factory) -> Path:
    """The demo shapes with the placeholder in every caption ('a <sks> square on …')."""
    import shutil
    data = tmp_path_factory.mktemp("sks-data")
    for img in DEMO_DATA.glob("*.png"):
        shutil.copy(img, data / img.name)
        caption = img.with_suffix(".txt").read_text().strip()
        (data / img.with_suffix(".txt").name).write_text(caption.replace("a ", "a <sks> ", 1))
    return data


# trainer is imported inside the helpers, as in train_quiet: this file loads for every session, and only the tests
# that load a model should pay for torch and diffusers.
def _tiny_config(path: Any, settings: Tuple[str, ...]) -> Any:
    from trainer.config.checks import load_config
    return load_config(None, [f"model.path={path}", *settings])


def preset_family(preset: str, cfg: Any) -> str:
    """The registered family a composed preset ``cfg`` trains: its ``model.family``, or its built-in tiny model's."""
    from trainer.families import info_for, tiny_models
    model = cfg.model
    if str(model.family) != "auto":
        return info_for(str(model.family)).name
    assert str(model.path).startswith("builtin:"), f"{preset}: model.family auto and no built-in model"
    return tiny_models()[str(model.path).removeprefix("builtin:")][0].name


def load_tiny(ws: Path, path: Any, *settings: str) -> Any:
    """Load the model at ``path`` (a tiny model's folder or file, or ``builtin:<name>``) as training does: the config
    of ``model.path`` plus ``key=value`` settings, the whole of it handed to ``load_model`` (each part in its
    ``parts.*.dtype``, text encoders switched off by ``parts.*.enabled`` left out)."""
    from trainer.families.sources import load_model
    return load_model(_tiny_config(path, settings), str(ws))


def load_tiny_fp32(ws: Path, path: Any, *settings: str) -> Any:
    """Like :func:`load_tiny`, but ``load_model`` sees the ``model`` section alone: every part in fp32, every text
    encoder on, nothing kept in CPU RAM (``parts.*`` settings are not read)."""
    from trainer.families.sources import load_model
    return load_model(_tiny_config(path, settings).model, str(ws))


@pytest.fixture(scope="module")
def ui_app(tmp_path_factory):
    """(workspace, AppContext) of a page built without its queue scheduler, one per test module (torch-free)."""
    from webui.app import build_app
    ws = tmp_path_factory.mktemp("ws")
    demo = build_app(ws, start_scheduler=False)
    yield ws, demo.atelier
    demo.close()


def picture(path: Path, seed: int, size: Tuple[int, int] = (96, 64)) -> Path:
    """An image with structure in two corners (so a flip, a crop or another picture shows in its latents), its
    colours drawn from ``seed``; written to ``path``."""
    from PIL import Image, ImageDraw
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, (20 * seed % 255, 40, 90))
    draw = ImageDraw.Draw(img)
    draw.rectangle([2, 2, 30, 20], fill=(250, 10 * seed % 255, 10))
    draw.ellipse([size[0] - 40, size[1] - 30, size[0] - 4, size[1] - 4], fill=(10, 200, 30))
    img.save(path)
    return path


def transformer_inputs(model: Any, x: Any, sigma: Any, cond: Any) -> dict:
    """The keyword inputs of the transformer's call in ``model.predict(x, sigma, cond)`` (a forward pre-hook, no
    gradient): what a family hands its transformer, to compare with what the pipeline or trainer hands it."""
    import torch
    seen: dict = {}
    handle = model.transformer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            model.predict(x, sigma, cond)
    finally:
        handle.remove()
    return seen


def denoiser_calls(module: Any) -> Tuple[list, Any]:
    """Every call of ``module`` (a family's transformer, UNet or prior) from now on, as dicts of its positional
    ``args``, its keyword ``kwargs`` and its first output ``out``; and a function that removes the hooks. A pipeline's
    own call, caught this way, is the reference a family's ``predict`` must reproduce."""
    calls: list = []

    def first(out: Any) -> Any:
        out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
        return out.detach().clone()

    pre = module.register_forward_pre_hook(lambda m, a, kw: calls.append({"args": a, "kwargs": dict(kw)}),
                                           with_kwargs=True)
    post = module.register_forward_hook(lambda m, a, out: calls[-1].update(out=first(out)))

    def remove() -> None:
        pre.remove()
        post.remove()
    return calls, remove


def pytest_collection_modifyitems(config, items):
    """The slow tier first (in its own order), then the fast one: with several workers the long browser, training and
    several-process tests start early and the short ones fill in at the end, so both workers finish together
    instead of one waiting on a minute-long test collected last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
