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


# Seconds of wall each of the longest modules takes on the 2-core box inside the whole suite (three workers), from
# `python3 launch.py --tests -v` (the time between a worker's reports). Only the order modules start in comes from
# this: a module missing here is guessed from its tests' count and slow marks.
MODULE_SECONDS = {
    "test_webui_e2e.py": 290, "test_distributed.py": 160, "test_families.py": 190, "test_train.py": 160,
    "test_webui_dataset.py": 110, "test_webui_app.py": 75, "test_startup.py": 55, "test_estimate_vram.py": 55,
    "test_webui_method_tabs.py": 55, "test_methods.py": 48, "test_tools.py": 45, "test_config.py": 44,
    "test_dataset_tools.py": 37, "test_webui_schema.py": 37, "test_export.py": 32, "test_family_cascade.py": 32,
    "test_webui_devices.py": 26, "test_family_wan.py": 25, "test_inpaint.py": 25, "test_webui_runner.py": 24,
    "test_distributed_fused.py": 21, "test_models.py": 19,
}


def _module_seconds(path: str, tests: list) -> float:
    name = path.split("/")[-1]
    if name in MODULE_SECONDS:
        return MODULE_SECONDS[name]
    return sum(3.0 if item.get_closest_marker("slow") else 0.3 for item in tests)


def _worker_count(config) -> int:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return int(workerinput.get("workercount", 1))
    return 1


def pytest_collection_modifyitems(config, items):
    """Each module's tests stay together in their order (a module's fixtures are set up once and its tests may build
    on each other's files); the modules are reordered so the long ones start first. With one process: the longest
    module first. With n pytest-xdist workers under the worksteal scheduler (what `launch.py --tests` runs), which
    hands each worker one contiguous n-th of the collection and lets an idle worker take the tail of a busy one's:
    the long modules are shared out over the n-ths (the longest first, each to the n-th with the fewest seconds) and
    each n-th ends with short modules, so the long ones of all workers run side by side from the start and the short
    ones fill in at the end, instead of one worker finishing a minute-long browser test while the others wait."""
    groups: dict = {}
    for item in items:
        groups.setdefault(item.nodeid.split("::")[0], []).append(item)
    cost = {path: _module_seconds(path, tests) for path, tests in groups.items()}
    ranked = sorted(groups, key=lambda path: -cost[path])  # stable: equal costs keep the collection's order
    n = _worker_count(config)
    if n <= 1:
        items[:] = [item for path in ranked for item in groups[path]]
        return
    long = [path for path in ranked if cost[path] >= 15]
    short = [item for path in groups if path not in long for item in groups[path]]
    lanes, load = [[] for _ in range(n)], [0.0] * n
    for path in long:
        j = min(range(n), key=lambda j: (load[j], j))
        lanes[j].append(path)
        load[j] += cost[path]
    # the sizes worksteal cuts the collection into: each idle worker in turn gets len(pending) // workers_left
    ordered, left, end, rest = [], len(items), 0, iter(short)
    for j, k in enumerate(range(n, 0, -1)):
        size = left // k
        left -= size
        end += size
        ordered += [item for path in lanes[j] for item in groups[path]]
        ordered += [item for _, item in zip(range(end - len(ordered)), rest)]
    ordered += list(rest)
    items[:] = ordered
