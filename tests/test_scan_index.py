"""The dataset scan index (``trainer.data.scanindex``): a relaunch probes exactly the new and changed files, a file
damaged after the first scan is still named and skipped, duplicates from the index are those found without it, and
a damaged index is rebuilt. Correctness only (``bench/big_dataset.py`` measures the time)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from PIL import Image

from trainer.config.checks import config_from_dict
from trainer.data import probe
from trainer.data.dataset import build_dataset
from trainer.data.listing import find_images
from trainer.data.scanindex import ScanIndex, index_path

OLD = time.time() - 3600  # older than the index's "modified just now" window


def _image(path: Path, shade: int, size=(64, 64)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (shade, 40, 90)).save(path)
    os.utime(path, (OLD, OLD))
    return path


def _config(tmp_path: Path, folder: Path):
    return config_from_dict({"base": "demo", "general": {"workspace": str(tmp_path / "ws")},
                             "data": {"concepts": [{"path": str(folder)}], "resolution": "64", "bucket_step": 8}})


@pytest.fixture
def probed(monkeypatch):
    """The names of the files really probed (decoded), in a list the test reads."""
    names: list = []
    real = probe.probe_image

    def counting(path):
        names.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(probe, "probe_image", counting)
    return names


def _scan(cfg, index=None):
    return build_dataset(cfg, warn=lambda m: None, index=index)


def test_a_relaunch_probes_exactly_the_new_and_changed_files(tmp_path, probed):
    data = tmp_path / "data"
    for k, name in enumerate("abcd"):
        _image(data / f"{name}.png", 10 * k)
    cfg = _config(tmp_path, data)
    _scan(cfg)
    assert sorted(probed) == ["a.png", "b.png", "c.png", "d.png"]
    assert index_path(cfg).is_file()

    probed.clear()
    assert _scan(cfg).report.total_images == 4 and probed == []  # nothing changed: nothing decoded

    _image(data / "b.png", 200, (64, 96))   # changed (another size and mtime)
    _image(data / "e.png", 99)              # new
    fresh = data / "f.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(fresh)  # modified just now: probed, not remembered
    probed.clear()
    dataset = _scan(cfg)
    assert sorted(probed) == ["b.png", "e.png", "f.png"]
    b = next(it for it in dataset.items + dataset.validation if it.path.name == "b.png")
    assert (b.width, b.height) == (64, 96)  # the new size, not the remembered one
    probed.clear()
    _scan(cfg)
    assert probed == ["f.png"]


def test_a_file_damaged_after_the_first_scan_is_still_named_and_skipped(tmp_path, probed):
    data = tmp_path / "data"
    for k, name in enumerate("abc"):
        _image(data / f"{name}.png", 30 * k)
    cfg = _config(tmp_path, data)
    assert _scan(cfg).report.total_skipped == 0
    for name in ("b.png", "c.png"):  # same size, bytes of the pixel data overwritten
        path = data / name
        st = path.stat()
        raw = bytearray(path.read_bytes())
        raw[60:90] = b"\x00" * 30
        path.write_bytes(bytes(raw))
        assert path.stat().st_size == st.st_size
        if name == "c.png":  # even with its old mtime put back: the ctime tells
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        else:
            os.utime(path, (OLD - 60, OLD - 60))
    probed.clear()
    report = _scan(cfg).report
    assert sorted(probed) == ["b.png", "c.png"]
    skipped = dict(report.concepts[0].skipped)
    assert sorted(skipped) == ["b.png", "c.png"] and all("damaged" in why for why in skipped.values()), skipped
    probed.clear()
    report = _scan(cfg).report  # the damage is remembered as damage: still named on the next launch
    assert probed == [] and sorted(dict(report.concepts[0].skipped)) == ["b.png", "c.png"]


def test_duplicates_from_the_index_are_those_found_without_it(tmp_path):
    data = tmp_path / "data"
    for k, name in enumerate("abcd"):
        _image(data / f"{name}.png", 20 * k)
    (data / "copy of a.png").write_bytes((data / "a.png").read_bytes())
    (data / "zz.png").write_bytes((data / "c.png").read_bytes())
    for p in data.glob("*.png"):
        os.utime(p, (OLD, OLD))
    cfg = _config(tmp_path, data)
    without = _scan(cfg, ScanIndex()).report.duplicates  # nothing remembered, nothing saved
    assert not index_path(cfg).exists()
    cold = _scan(cfg).report.duplicates
    index = ScanIndex.load(index_path(cfg))
    warm = _scan(cfg, index).report.duplicates
    assert index.probed == 0 and index.hashed == 0  # every hash came from the index
    names = [sorted(Path(p).name for p in g) for g in without]
    assert sorted(names) == [["a.png", "copy of a.png"], ["c.png", "zz.png"]]
    assert without == cold == warm


@pytest.mark.parametrize("content", [b"{not json", b"\x00\xff" * 10, b'{"stamp": {"format": -1}, "entries": {}}',
                                     b'{"stamp": null, "entries": []}', b"[]"])
def test_a_damaged_or_foreign_index_is_ignored_and_rebuilt(tmp_path, probed, content):
    data = tmp_path / "data"
    for k, name in enumerate("ab"):
        _image(data / f"{name}.png", 50 * k)
    cfg = _config(tmp_path, data)
    index_path(cfg).parent.mkdir(parents=True)
    index_path(cfg).write_bytes(content)
    assert _scan(cfg).report.total_images == 2 and sorted(probed) == ["a.png", "b.png"]
    stored = json.loads(index_path(cfg).read_text())
    assert sorted(Path(k).name for k in stored["entries"]) == ["a.png", "b.png"]
    probed.clear()
    _scan(cfg)
    assert probed == []


def test_entries_of_a_wrong_shape_are_dropped_and_removed_files_forgotten(tmp_path, probed):
    data = tmp_path / "data"
    for k, name in enumerate("abc"):
        _image(data / f"{name}.png", 50 * k)
    cfg = _config(tmp_path, data)
    _scan(cfg)
    stored = json.loads(index_path(cfg).read_text())
    key_a = next(k for k in stored["entries"] if k.endswith("a.png"))
    stored["entries"][key_a] = ["x"]
    key_b = next(k for k in stored["entries"] if k.endswith("b.png"))
    stored["entries"][key_b][4] = "64"  # its stamp still matches, its width is no number
    stored["entries"][str(tmp_path / "elsewhere" / "z.png")] = [1, 2, 3, 4, 5, 6, None, ""]  # another dataset
    index_path(cfg).write_text(json.dumps(stored))
    (data / "c.png").unlink()
    probed.clear()
    _scan(cfg)
    assert sorted(probed) == ["a.png", "b.png"]
    entries = json.loads(index_path(cfg).read_text())["entries"]
    assert sorted(Path(k).name for k in entries) == ["a.png", "b.png", "z.png"]  # c.png gone, z.png kept


def _captions(dataset) -> dict:
    return {it.path.name: it.captions for it in dataset.items + dataset.validation}


def test_remembered_captions_are_never_stale(tmp_path):
    data = tmp_path / "data"
    for k, name in enumerate("abcd"):
        _image(data / f"{name}.png", 10 * k)
        (data / f"{name}.txt").write_text(f"tag {name}, second\nother line {name}\n", encoding="utf-8")
        os.utime(data / f"{name}.txt", (OLD, OLD))
    (data / "d.txt").write_bytes("caf\xe9 au lait".encode("cp1252"))  # not UTF-8: read with a warning each time
    os.utime(data / "d.txt", (OLD, OLD))
    cfg = _config(tmp_path, data)
    first = _scan(cfg)
    assert _captions(first)["a.png"] == ["tag a, second", "other line a"]
    index = ScanIndex.load(index_path(cfg))
    warnings: list = []
    assert _captions(build_dataset(cfg, warn=warnings.append, index=index)) == _captions(first)
    assert index.captions_read == 1 and any("d.txt" in w and "cp1252" in w for w in warnings)  # d.txt only

    a, b = data / "a.txt", data / "b.txt"
    st = a.stat()
    a.write_text("tag A, second\nother line a\n", encoding="utf-8")  # same size, old mtime put back: ctime tells
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert a.stat().st_size == st.st_size
    b.write_text("", encoding="utf-8")                      # emptied
    os.utime(b, (OLD, OLD))
    (data / "c.txt").unlink()                                # removed
    index = ScanIndex.load(index_path(cfg))
    dataset = build_dataset(cfg, warn=lambda m: None, index=index)
    got = _captions(dataset)
    assert got["a.png"] == ["tag A, second", "other line a"] and got["b.png"] == [""] and got["c.png"] == [""]
    assert dataset.report.concepts[0].captions_missing == 1 and dataset.report.concepts[0].captions_empty == 1
    assert index.captions_read == 3  # a.txt, b.txt and d.txt read; c.txt found missing by its stat


def test_one_listing_finds_images_and_unused_formats_past_broken_links(tmp_path):
    data = tmp_path / "data"
    _image(data / "a.png", 1)
    _image(data / "sub" / "b.png", 2)
    (data / "sub" / "anim.gif").write_bytes(b"GIF89a")
    (data / "loop").symlink_to(data / "loop")        # not named like an image: passed over without a word
    (data / "gone").symlink_to(tmp_path / "nowhere")
    (data / "loop.png").symlink_to(data / "loop.png")
    passed, unused = [], []
    found = find_images(data, True, passed_over=passed, unused=unused)
    assert [p.name for p in found] == ["a.png", "b.png"] and unused == ["sub/anim.gif"]
    assert passed == [("loop.png", "a link that loops back on itself")]
