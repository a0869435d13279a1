"""What a run started from the page may touch: every path a config carries (links resolved) inside the page's
folders, plain run and result names, paths a file system takes, and every file of a data folder used or named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from trainer.config.checks import load_config
from trainer.config.fields import all_keys, field_info
from trainer.config.paths import WRITTEN, config_paths, outside
from trainer.config.schema import DataConfig
from trainer.data import probe
from trainer.data.concepts import scan_concepts
from trainer.errors import ConfigError
from trainer.host.paths import Confinement, confine

ROOT = Path(__file__).resolve().parent.parent


def _img(path: Path, size=(16, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


def _scan(folder: Path, recursive: bool = False):
    data = OmegaConf.merge(OmegaConf.structured(DataConfig),
                           {"concepts": [{"path": str(folder), "recursive": recursive}]})
    warnings: list = []
    items, report = scan_concepts(data, warn=warnings.append)
    return items, report, warnings


def test_every_path_field_of_the_schema_is_listed():
    """The rule covers the schema's path fields by their ui hint, list fields and list items included: a path field
    added later is confined without a change here."""
    path_keys = [k for k in all_keys() if field_info(k)[0].metadata.get("ui") in ("path", "paths")]
    assert {"model.path", "data.concepts.path", "data.concepts.control_paths", "sampling.prompts.control_images",
            "sampling.prompts.image", "lora.init_weights", "output.path", "data.cache_dir"} <= set(path_keys)
    overrides = ["data.concepts=[{path: c0, control_paths: [k0, k1]}]",
                 "sampling.prompts=[{prompt: x, image: i0, mask: m0, control_images: [s0]}]"]
    for key in path_keys:
        if not key.startswith(("data.concepts.", "sampling.prompts.")) and field_info(key)[1] is str:
            overrides.append(f"{key}=/p/{key}")
    cfg = OmegaConf.merge(load_config(preset="demo"), OmegaConf.from_dotlist(overrides))
    listed = {cp.key: cp for cp in config_paths(cfg)}
    for key in path_keys:
        if not key.startswith(("data.concepts.", "sampling.prompts.")):
            assert key in listed and listed[key].text == f"/p/{key}", key
            assert listed[key].write == (key in WRITTEN), key
    for key, text in {"data.concepts.0.path": "c0", "data.concepts.0.control_paths.1": "k1",
                      "sampling.prompts.0.image": "i0", "sampling.prompts.0.mask": "m0",
                      "sampling.prompts.0.control_images.0": "s0"}.items():
        assert listed[key].text == text and not listed[key].write, key


def test_paths_outside_the_folders_are_named_links_resolved(tmp_path):
    ws, outer, presets = tmp_path / "ws", tmp_path / "outer", tmp_path / "presets"
    for d in (ws, outer, presets):
        d.mkdir()
    _img(outer / "a.png")
    (ws / "inside").symlink_to(outer, target_is_directory=True)  # inside by name, outside in fact
    conf = Confinement([ws], read_only=[presets])
    cfg = load_config(preset="demo", overrides=[
        f"general.workspace={ws}", f"data.concepts=[{{path: {ws / 'inside'}, control_paths: [{outer}]}}]",
        f"output.path={presets}/out", "model.path=org/name", f"data.cache_dir={ws}/cache"])
    issues = {i.key: i.message for i in outside(cfg, tmp_path, conf)}
    assert set(issues) == {"data.concepts.0.path", "data.concepts.0.control_paths.0", "output.path"}, issues
    assert f"a link to '{outer}'" in issues["data.concepts.0.path"]
    assert "may write" in issues["output.path"] and str(presets) not in issues["output.path"].split("(")[-1]
    assert "--browse-root" in issues["data.concepts.0.path"]
    # reading the read-only folder is fine; the demo's hub-shaped and builtin model names are no local paths
    cfg = load_config(preset="demo", overrides=[f"general.workspace={ws}", f"data.concepts=[{{path: {presets}}}]"])
    assert outside(cfg, tmp_path, conf) == []


def test_train_from_the_page_touches_nothing_outside_its_folders(tmp_path):
    """The trainer itself refuses (the page passes --allowed-root): no run folder, cache or output appears."""
    ws, outer = tmp_path / "ws", tmp_path / "outer"
    ws.mkdir()
    _img(outer / "data" / "a.png")
    before = sorted(p for p in tmp_path.rglob("*"))
    r = subprocess.run([sys.executable, "-m", "trainer", "train", "--preset", "demo",
                        "--set", f"general.workspace={outer / 'ws'}", "--set", f"data.concepts=[{{path: {outer / 'data'}}}]",
                        "--run-dir", str(ws / "runs" / "r"), "--allowed-root", str(ws)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "general.workspace" in r.stderr and "data.concepts.0.path" in r.stderr and "outside" in r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before
    # a run folder outside the allowed folders is refused the same way
    r = subprocess.run([sys.executable, "-m", "trainer", "validate", "--preset", "demo",
                        "--set", f"general.workspace={ws}", "--allowed-root", str(ws)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "outside" in r.stdout and "data.concepts.0.path" in r.stdout and r.returncode == 1, r.stdout


@pytest.mark.parametrize("key, value, words", [
    ("general.run_name", "../../x", ["plain name", "'/'", "--run-dir"]),
    ("general.run_name", "/abs/run", ["plain name"]),
    ("general.run_name", "a:b*?", ["plain name", "':'", "'*'", "'?'"]),
    ("general.run_name", "CON", ["reserves"]),
    ("general.run_name", "lpt1.txt", ["reserves"]),
    ("general.run_name", "run.", ["dot"]),
    ("output.name", "..", ["plain name"]),
    ("output.name", "x\\\\y", ["plain name"]),
    ("model.path", "x" * 10_000, ["model.path", "10000 characters"]),
    ("model.path", "/a/" + "y" * 300 + "/b", ["model.path", "300 bytes"]),
    ("data.concepts", "[{path: " + "z" * 256 + "}]", ["data.concepts.0.path", "256 bytes"]),
])
def test_names_and_paths_no_system_takes_are_named(key, value, words):
    with pytest.raises(ConfigError) as err:
        load_config(preset="demo", overrides=[f"{key}={value}"])
    msg = str(err.value)
    for w in words:
        assert w in msg, msg
    assert len(msg) < 600


def test_a_folder_names_every_entry_it_does_not_use(tmp_path):
    data, outer = tmp_path / "data", tmp_path / "outer"
    _img(data / "good.png")
    (data / "folder.png").mkdir()
    (data / "dangling.png").symlink_to(tmp_path / "gone.png")
    (data / "loop.png").symlink_to(data / "loop.png")
    os.mkfifo(data / "pipe.png")  # reading it would block the scan forever
    _img(outer / "secret.png")
    (data / "linked.png").symlink_to(outer / "secret.png")
    items, report, warnings = _scan(data)
    skipped = dict(report.concepts[0].skipped)
    assert [it.path.name for it in items] == ["good.png", "linked.png"]  # unconfined (the CLI): a link is followed
    assert set(skipped) == {"folder.png", "dangling.png", "loop.png", "pipe.png"}
    assert "folder named like an image" in skipped["folder.png"] and "recursive" in skipped["folder.png"]
    assert "does not exist" in skipped["dangling.png"] and "loops" in skipped["loop.png"]
    assert "not a regular file" in skipped["pipe.png"]
    assert report.concepts[0].images_found == 6 and all(any(n in w for w in warnings) for n in skipped)
    confine(Confinement([data]))
    try:
        items, report, _ = _scan(data)
    finally:
        confine(None)
    assert [it.path.name for it in items] == ["good.png"]
    assert "outside the folders" in dict(report.concepts[0].skipped)["linked.png"]


def test_linked_sub_folders_are_followed_once(tmp_path):
    data = tmp_path / "data"
    _img(data / "a" / "one.png")
    _img(tmp_path / "elsewhere" / "two.png")
    (data / "b").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (data / "a" / "back").symlink_to(data, target_is_directory=True)  # a loop
    items, report, _ = _scan(data, recursive=True)
    assert sorted(it.path.relative_to(data).as_posix() for it in items) == ["a/one.png", "b/two.png"]
    assert any("loop" in why for _, why in report.concepts[0].skipped)


def test_a_decompression_bomb_is_named_not_decoded(tmp_path, monkeypatch):
    """Between Pillow's limit and twice it Pillow only warns and decodes: Atelier names the file and skips it."""
    big = _img(tmp_path / "big.png", size=(120, 100))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # 12,000 pixels: over the limit, under twice it
    size, problem = probe.probe_image(big)
    assert size == (0, 0) and "too large to open safely" in problem and "12000 pixels" in problem
