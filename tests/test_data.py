"""Data pipeline: concept scanning, captions, epoch order, image loading, latent cache."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from trainer.config.schema import DataConfig
from trainer.errors import ConfigError
from trainer.data.concepts import ImageItem, scan_concepts
from trainer.data.captions import caption_from_filename, pick_caption
from trainer.data.order import epoch_length, epoch_order, item_repeats, sample_rng
from trainer.errors import DataError


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _img(path: Path, color=(200, 30, 30), size=(16, 16), mode="RGB", **save) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path, **save)
    return path


def _cfg(*concepts: dict, **data) -> DataConfig:
    """A validated-shape data section, as the trainer gets it from load_config."""
    node = OmegaConf.structured(DataConfig)
    return OmegaConf.merge(node, {"concepts": list(concepts), **data})  # type: ignore[return-value]


def _scan(*concepts: dict):
    warnings: list[str] = []
    items, report = scan_concepts(_cfg(*concepts), warn=warnings.append)
    assert report.warnings == warnings
    return items, report, warnings


# --------------------------------------------------------------------------------------------
# captions
# --------------------------------------------------------------------------------------------

def test_txt_captions_single_multi_and_missing(tmp_path):
    d = tmp_path / "c"
    _img(d / "a.png")
    (d / "a.txt").write_text("a photo of sks dog\n", encoding="utf-8")
    _img(d / "b.jpg")
    (d / "b.txt").write_text("first caption\n\n  second caption  \nthird caption\n", encoding="utf-8")
    _img(d / "c.webp")  # no caption file
    _img(d / "c-masklabel.png", mode="L", color=255)  # a mask, not a training image
    _img(d / ".hidden.png")
    items, report, warnings = _scan({"path": str(d), "name": "dogs"})

    by_name = {it.path.name: it for it in items}
    assert sorted(by_name) == ["a.png", "b.jpg", "c.webp"]
    assert by_name["a.png"].captions == ["a photo of sks dog"]
    assert by_name["b.jpg"].captions == ["first caption", "second caption", "third caption"]
    assert by_name["c.webp"].captions == [""]
    c = report.concepts[0]
    assert (c.images_found, c.images_used, c.captions_missing) == (3, 3, 1)
    assert len(warnings) == 1 and "c.webp" in warnings[0] and "1 of 3" in warnings[0]

    rng = random.Random(0)
    picks = [pick_caption(by_name["b.jpg"], rng) for _ in range(60)]
    assert set(picks) == {"first caption", "second caption", "third caption"}
    again = random.Random(0)
    assert picks == [pick_caption(by_name["b.jpg"], again) for _ in range(60)]
    assert pick_caption(by_name["a.png"], rng) == "a photo of sks dog"
    d1 = report.to_dict()
    assert d1["total_images"] == 3 and d1["concepts"][0]["captions_missing"] == 1


def test_caption_extension_and_recursive(tmp_path):
    d = tmp_path / "c"
    _img(d / "sub" / "x.png")
    (d / "sub" / "x.caption").write_text("nested", encoding="utf-8")
    items, _, _ = _scan({"path": str(d), "recursive": True, "caption_extension": "caption"})
    assert [it.captions for it in items] == [["nested"]]
    with pytest.raises(DataError, match="recursive"):
        _scan({"path": str(d)})


def test_concept_file_captions(tmp_path):
    d = tmp_path / "c"
    _img(d / "1.png")
    _img(d / "2.png")
    cap = tmp_path / "captions.txt"
    cap.write_text("\ufeffstyle of xyz\n\nxyz painting\n", encoding="utf-8")  # BOM is dropped
    items, report, warnings = _scan({"path": str(d), "caption_source": "concept_file",
                                     "caption_file": str(cap)})
    assert [it.captions for it in items] == [["style of xyz", "xyz painting"]] * 2
    assert warnings == [] and report.concepts[0].captions_missing == 0

    with pytest.raises(DataError) as err:
        _scan({"path": str(d), "caption_source": "concept_file", "caption_file": str(tmp_path / "no.txt")})
    assert err.value.key == "data.concepts.0.caption_file"


@pytest.mark.parametrize("stem, caption", [
    ("a_red_fox_001", "a red fox"),
    ("a red fox (2)", "a red fox"),
    ("red-fox-3", "red-fox"),
    ("fox_01 (2)", "fox"),
    ("r2d2", "r2d2"),
    ("0001", "0001"),
])
def test_caption_from_filename(stem, caption):
    assert caption_from_filename(Path(f"{stem}.png")) == caption


def test_filename_caption_source(tmp_path):
    d = tmp_path / "c"
    _img(d / "sks_dog_on_grass_012.PNG")  # upper-case extension counts
    items, _, warnings = _scan({"path": str(d), "caption_source": "filename"})
    assert items[0].captions == ["sks dog on grass"] and warnings == []


def test_non_utf8_caption_is_read_with_a_warning(tmp_path):
    d = tmp_path / "c"
    _img(d / "a.png")
    (d / "a.txt").write_bytes("caf\u00e9 \u2019quoted\u2019".encode("cp1252"))
    items, _, warnings = _scan({"path": str(d)})
    assert items[0].captions == ["caf\u00e9 \u2019quoted\u2019"]
    assert len(warnings) == 1 and "a.txt" in warnings[0] and "cp1252" in warnings[0]


# --------------------------------------------------------------------------------------------
# bad files and folders
# --------------------------------------------------------------------------------------------

def test_unreadable_images_are_skipped_with_warnings(tmp_path):
    d = tmp_path / "c"
    _img(d / "good.png")
    good = (d / "good.png").read_bytes()
    (d / "truncated.png").write_bytes(good[: len(good) // 2])
    (d / "empty.jpg").write_bytes(b"")
    (d / "text.png").write_text("I am not a picture", encoding="utf-8")
    _img(d / "cut.jpg", size=(64, 64))
    (d / "cut.jpg").write_bytes((d / "cut.jpg").read_bytes()[:300])
    items, report, warnings = _scan({"path": str(d)})

    assert [it.path.name for it in items] == ["good.png"]
    bad = {"truncated.png", "empty.jpg", "text.png", "cut.jpg"}
    c = report.concepts[0]
    assert (c.images_found, c.images_used, c.images_skipped) == (5, 1, 4)
    assert {f for f, _ in c.skipped} == bad
    for name in bad:
        assert any(name in w for w in warnings), name
    assert report.to_dict()["total_skipped"] == 4


def _png_with_idat(path: Path, idat: bytes, size=(32, 32)) -> None:
    """A PNG whose chunk checksums are all valid but whose pixel stream is ``idat``."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", size[0], size[1], 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def test_the_check_decodes_every_image_and_names_what_it_does_not_use(tmp_path):
    """Valid checksums are not enough: a PNG whose pixel stream is broken or missing rows is skipped
    and named (before, the first failed the whole run at caching and the second trained as black);
    a GIF is named as not used; empty caption files and all-black masks are named."""
    import zlib
    d = tmp_path / "c"
    _img(d / "good.png", size=(32, 32))
    (d / "good.txt").write_text("a cat", encoding="utf-8")
    rows = b"".join(b"\x00" + bytes([120, 60, 30]) * 32 for _ in range(32))
    _png_with_idat(d / "whole.png", zlib.compress(rows))
    _png_with_idat(d / "short.png", zlib.compress(rows[: len(rows) // 4]))
    broken = bytearray(zlib.compress(rows))
    broken[8:16] = b"\xff" * 8
    _png_with_idat(d / "broken.png", bytes(broken))
    (d / "blank.txt").write_text("  \n", encoding="utf-8")
    _img(d / "blank.png", size=(32, 32))
    Image.new("RGB", (8, 8)).save(d / "anim.gif")
    _img(d / "good-masklabel.png", mode="L", size=(32, 32), color=0)  # nothing in focus
    _img(d / "whole-masklabel.png", mode="L", size=(32, 32), color=255)
    warnings: list[str] = []
    items, report = scan_concepts(_cfg({"path": str(d)}, masks=True), warn=warnings.append)

    assert sorted(it.path.name for it in items) == ["blank.png", "good.png", "whole.png"]
    c = report.concepts[0]
    reasons = dict(c.skipped)
    assert set(reasons) == {"short.png", "broken.png"}
    assert "rows" in reasons["short.png"] and "8 of 32" in reasons["short.png"]
    assert "damaged" in reasons["broken.png"]
    assert c.unused_files == ["anim.gif"] and any("anim.gif" in w for w in warnings)
    assert c.captions_empty_files == ["blank.txt"] and any("blank.txt" in w for w in warnings)
    assert c.masks_blank == ["good-masklabel.png"]
    assert any("good-masklabel.png" in w and "black" in w for w in warnings)
    from trainer.data.report import format_report
    text = format_report(report.to_dict())
    for name in ("anim.gif", "blank.txt", "good-masklabel.png", "short.png", "broken.png"):
        assert name in text, name


def test_folder_problems_name_the_field(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as err:
        _scan({"path": str(tmp_path / "missing")})
    assert err.value.key == "data.concepts.0.path" and "data.concepts.0.path" in str(err.value)
    assert str(tmp_path / "missing") in str(err.value)

    ok = tmp_path / "ok"
    _img(ok / "a.png")
    with pytest.raises(DataError) as err:  # the second concept is the empty one
        _scan({"path": str(ok)}, {"path": str(tmp_path / "empty")})
    assert err.value.key == "data.concepts.1.path" and "no images" in str(err.value)
    assert isinstance(err.value, ConfigError)

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"")
    with pytest.raises(DataError, match="data.concepts.0.path"):
        _scan({"path": str(tmp_path / "broken")})

    with pytest.raises(DataError) as err:
        _scan({"path": str(ok), "enabled": False})
    assert err.value.key == "data.concepts"


def test_disabled_concepts_keep_config_numbering(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _img(a / "1.png")
    _img(b / "1.png")
    _img(b / "2.png")
    cfg = _cfg({"path": str(a), "enabled": False}, {"path": str(b), "repeats": 3, "loss_weight": 0.5})
    items, report = scan_concepts(cfg, warn=lambda m: None)
    assert {it.concept_index for it in items} == {1}
    assert [it.loss_weight for it in items] == [0.5, 0.5]
    assert item_repeats(items, cfg) == [3.0, 3.0]
    assert report.to_dict()["images_per_epoch"] == 6.0


def test_relative_paths_use_base_dir(tmp_path):
    _img(tmp_path / "imgs" / "a.png")
    items, _ = scan_concepts(_cfg({"path": "imgs"}), warn=lambda m: None, base_dir=tmp_path)
    assert items[0].path == tmp_path / "imgs" / "a.png"


# --------------------------------------------------------------------------------------------
# epoch order
# --------------------------------------------------------------------------------------------

def _items(n: int, concept: int = 0) -> list[ImageItem]:
    return [ImageItem(Path(f"{concept}_{i}.png"), [""], concept, 1.0) for i in range(n)]


def test_epoch_order_is_deterministic_and_counts_repeats():
    items = _items(10)
    e0 = epoch_order(items, 2.0, epoch=0, seed=1)
    assert e0 == epoch_order(items, 2.0, epoch=0, seed=1)
    assert Counter(e0) == {i: 2 for i in range(10)}
    assert e0 != epoch_order(items, 2.0, epoch=1, seed=1)
    assert e0 != epoch_order(items, 2.0, epoch=0, seed=2)
    assert len(e0) == epoch_length(items, 2.0, 0) == 20


def test_fractional_repeats_are_paid_out_over_epochs():
    items = _items(4) + _items(3, concept=1)
    reps = [0.5] * 4 + [1.5] * 3
    seen = Counter()
    for epoch in range(4):
        order = epoch_order(items, reps, epoch, seed=7)
        assert len(order) == epoch_length(items, reps, epoch)
        assert order == epoch_order(items, reps, epoch, seed=7)
        seen.update(order)
    # 4 epochs: repeats 0.5 -> each item twice, repeats 1.5 -> each item 6 times
    assert seen == {**{i: 2 for i in range(4)}, **{i: 6 for i in range(4, 7)}}
    assert epoch_order(items, [0.0] * 7, 0, seed=7) == []
    lengths = [epoch_length(_items(1), 0.3, e) for e in range(10)]
    assert sum(lengths) == 3  # 0.3 exactly, no float drift


def test_sample_rng_depends_on_position():
    a = sample_rng(1, 0, 5).random()
    assert a == sample_rng(1, 0, 5).random()
    assert a != sample_rng(1, 0, 6).random() != sample_rng(1, 1, 5).random()


# --------------------------------------------------------------------------------------------
# image loading
# --------------------------------------------------------------------------------------------

def _pixel(t, x: int, y: int) -> tuple:
    """RGB 0..255 of tensor [3,H,W] in [-1,1]."""
    return tuple(round((float(t[c, y, x]) + 1) * 127.5) for c in range(3))


def _close(a, b, tol=6) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_load_image_modes(tmp_path):
    import torch
    from trainer.data.images import load_image

    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))            # transparent black -> white
    rgba.paste((255, 0, 0, 128), (0, 0, 8, 4))                # half-transparent red -> pink
    rgba.save(tmp_path / "rgba.png")
    t = load_image(tmp_path / "rgba.png", 8, True, False)
    assert t.dtype == torch.float32 and t.shape == (3, 8, 8)
    assert float(t.min()) >= -1 and float(t.max()) <= 1
    assert _close(_pixel(t, 4, 6), (255, 255, 255))
    assert _close(_pixel(t, 4, 1), (255, 127, 127))

    _img(tmp_path / "cmyk.jpg", mode="CMYK", color=(0, 255, 255, 0), quality=95)  # red in CMYK
    assert _close(_pixel(load_image(tmp_path / "cmyk.jpg", 8, True, False), 4, 4), (255, 0, 0), 12)

    Image.new("I;16", (8, 8), 40000).save(tmp_path / "gray16.png")
    with Image.open(tmp_path / "gray16.png") as im:
        assert im.mode.startswith("I")
    expected = round(40000 * 255 / 65535)
    assert _close(_pixel(load_image(tmp_path / "gray16.png", 8, True, False), 2, 2), (expected,) * 3, 1)

    pal = Image.new("RGB", (8, 8), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    pal.save(tmp_path / "pal.png")
    assert _close(_pixel(load_image(tmp_path / "pal.png", 8, True, False), 1, 1), (10, 200, 30), 2)

    pal_t = Image.new("P", (8, 8), 0)
    pal_t.putpalette([0, 0, 0, 0, 0, 255])
    pal_t.paste(1, (0, 0, 8, 4))
    pal_t.save(tmp_path / "pal_t.png", transparency=0)      # index 0 transparent -> white
    t = load_image(tmp_path / "pal_t.png", 8, True, False)
    assert _close(_pixel(t, 3, 1), (0, 0, 255)) and _close(_pixel(t, 3, 6), (255, 255, 255))


def test_load_image_exif_orientation(tmp_path):
    from trainer.data.images import load_image

    stored = Image.new("RGB", (160, 80), (255, 0, 0))         # stored landscape: left red,
    stored.paste((0, 0, 255), (80, 0, 160, 80))               # right blue; big enough for draft()
    exif = Image.Exif()
    exif[0x0112] = 6                                          # "rotate 90° clockwise to display"
    stored.save(tmp_path / "portrait.jpg", exif=exif, quality=95)
    t = load_image(tmp_path / "portrait.jpg", 16, True, False)
    # displayed portrait: red on top, blue at the bottom (unrotated it would be red left / blue right)
    assert _close(_pixel(t, 13, 2), (255, 0, 0), 40)
    assert _close(_pixel(t, 2, 13), (0, 0, 255), 40)

    items, _, _ = _scan({"path": str(tmp_path)})
    assert (items[0].width, items[0].height) == (80, 160)


def test_load_image_upscale_crop_flip(tmp_path):
    from trainer.data.images import load_image

    img = Image.new("RGB", (4, 6), (0, 255, 0))
    img.paste((255, 0, 0), (0, 0, 2, 6))                      # left half red
    img.save(tmp_path / "tiny.png")
    t = load_image(tmp_path / "tiny.png", 32, True, False)
    assert t.shape == (3, 32, 32)
    assert _close(_pixel(t, 2, 16), (255, 0, 0), 20) and _close(_pixel(t, 29, 16), (0, 255, 0), 20)
    f = load_image(tmp_path / "tiny.png", 32, True, True)
    assert _close(_pixel(f, 2, 16), (0, 255, 0), 20)

    tall = Image.new("RGB", (10, 40), (0, 0, 0))
    tall.paste((255, 255, 255), (0, 0, 10, 20))
    tall.save(tmp_path / "tall.png")
    crops = {float(load_image(tmp_path / "tall.png", 10, False, False, random.Random(s)).mean())
             for s in range(8)}
    assert len(crops) > 1  # random crops differ
    assert load_image(tmp_path / "tall.png", 10, True, False).shape == (3, 10, 10)


def test_load_image_error_names_file(tmp_path):
    from trainer.data.images import load_image

    (tmp_path / "bad.png").write_text("nope", encoding="utf-8")
    with pytest.raises(DataError, match="bad.png"):
        load_image(tmp_path / "bad.png", 8, True, False)


# --------------------------------------------------------------------------------------------
# latent cache
# --------------------------------------------------------------------------------------------

class _FakeVae:
    """Avg-pool by 8 to 4 channels; counts encoded images."""

    def __init__(self):
        self.encoded = 0

    def __call__(self, pixels):
        import torch
        import torch.nn.functional as F

        self.encoded += pixels.shape[0]
        pooled = F.avg_pool2d(pixels, 8)
        moments = torch.cat([pooled, pooled.mean(1, keepdim=True)] * 2, dim=1)
        mean, logvar = moments.chunk(2, dim=1)                # views of one tensor, like the real VAE
        return {"mean": mean, "std": logvar.exp()}


def _load(item: ImageItem, variant: int):
    from trainer.data.images import load_image

    return load_image(item.path, 16, True, bool(variant))


def test_latent_cache_encodes_only_what_changed(tmp_path):
    from trainer.data.cache import LatentCache, make_settings_key

    d = tmp_path / "imgs"
    items = [ImageItem(_img(d / f"{i}.png", color=(i * 40, 0, 0)), [""], 0, 1.0) for i in range(3)]
    key = make_settings_key(model="tiny", resolution=16, center_crop=True, vae_dtype="fp32")
    cache = LatentCache(tmp_path / "cache", key)
    vae = _FakeVae()
    calls: list = []
    assert cache.ensure(items, [0, 1], vae, _load, batch_size=4, progress=lambda d, t: calls.append((d, t))) == 6
    assert vae.encoded == 6 and calls[0] == (0, 6) and calls[-1] == (6, 6)
    entry = cache.get(items[1], 0)
    assert set(entry) == {"mean", "std"} and entry["mean"].shape == (4, 2, 2)
    assert float(entry["mean"][0, 0, 0]) == pytest.approx(40 / 127.5 - 1, abs=1e-5)
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    stored = list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert len(stored) == 6 and all(p.parent.name == p.stem[:2] for p in stored)

    assert cache.ensure(items, [0, 1], vae, _load, batch_size=4, progress=None) == 0

    _img(items[2].path, color=(7, 7, 7))  # edit one image
    assert cache.ensure(items, [0], vae, _load, batch_size=4, progress=None) == 1

    other = LatentCache(tmp_path / "cache", make_settings_key(model="tiny", resolution=16,
                                                              center_crop=False, vae_dtype="fp32"))
    assert other.ensure(items, [0], vae, _load, batch_size=2, progress=None) == 3


def test_latent_cache_resumes_after_interruption(tmp_path):
    from trainer.data.cache import LatentCache

    d = tmp_path / "imgs"
    items = [ImageItem(_img(d / f"{i}.png", color=(i * 20, 9, 9)), [""], 0, 1.0) for i in range(5)]
    cache = LatentCache(tmp_path / "cache", "k")
    vae = _FakeVae()

    def flaky(pixels):
        if vae.encoded >= 2:
            raise KeyboardInterrupt
        return vae(pixels)

    with pytest.raises(KeyboardInterrupt):
        cache.ensure(items, [0], flaky, _load, batch_size=2, progress=None)
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    assert cache.ensure(items, [0], vae, _load, batch_size=2, progress=None) == 3
    with pytest.raises(DataError, match="0.png"):
        LatentCache(tmp_path / "cache", "other").get(items[0], 0)


def test_concepts_module_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; import trainer.data.concepts; "
            "assert 'torch' not in sys.modules, 'concepts pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


# --- the event stream stays one whole event a line ---------------------------------------------------------

def test_a_torn_last_event_line_is_repaired_on_open_and_a_failed_write_leaves_no_half_line(tmp_path, monkeypatch):
    import errno
    import os

    import trainer.events as events
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"type": "step", "time": 1, "step": 1}\n{"type": "st')  # a writer died mid-line
    writer = events.EventWriter(path)
    writer.emit("started", total_steps=3)
    assert [e["type"] for e in events.read_events(path)] == ["step", "started"]
    real_write = os.write

    def disk_full(fd, data):  # half the line reaches the disk, then ENOSPC
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(events.os, "write", disk_full)
    with pytest.raises(OSError):
        writer.emit("step", step=2)
    monkeypatch.setattr(events.os, "write", real_write)
    assert path.read_bytes().endswith(b"\n")
    writer.emit("finished", step=3)
    assert [e["type"] for e in events.read_events(path)] == ["step", "started", "finished"]


def test_a_full_disk_still_lets_the_run_record_why_it_ended(tmp_path, monkeypatch):
    """The trainer's writer keeps a small reserve file: when the disk fills, the event that hit it fails
    (the run ends), the reserve is freed, and the error and failed events fit in its place."""
    import errno
    import os

    import trainer.events as events
    path = tmp_path / "events.jsonl"
    writer = events.EventWriter(path, reserve=True)
    reserve = tmp_path / ".events.jsonl.reserve"
    assert reserve.stat().st_size == events.EventWriter.RESERVE_BYTES
    real_write = os.write

    def full_until_space_is_freed(fd, data):
        if reserve.exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(events.os, "write", full_until_space_is_freed)
    with pytest.raises(OSError):
        writer.emit("step", step=1)
    assert not reserve.exists()
    writer.emit("error", message="the disk is full")
    writer.emit("failed", step=1, message="the disk is full")
    assert [e["type"] for e in events.read_events(path)] == ["error", "failed"]
    monkeypatch.setattr(events.os, "write", real_write)
    events.EventWriter(path, reserve=True).emit("finished", step=2)  # a terminal event gives the reserve back
    assert not reserve.exists()
