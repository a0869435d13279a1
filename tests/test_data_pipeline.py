"""Data pipeline, issue 4: captions, buckets, multi-resolution, masks, augmentations, caches,
background loading, the dataset report and bad input. No model: a fake VAE pools pixels by 8."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from trainer.config.checks import config_from_dict
from trainer.config.schema import AtelierConfig
from trainer.errors import ConfigError
from trainer.data.augment import AugmentParams, AugmentSettings, draw_params
from trainer.data.buckets import (assign_bucket, generate_buckets, nearest_bucket, parse_resolution,
                                  plan_epoch)
from trainer.data.captions import CaptionOptions, CaptionProcessor
from trainer.errors import DataError

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _img(path: Path, size=(64, 64), color=(200, 30, 30), mode="RGB", **save) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path, **save)
    return path


def _cfg(tmp_path: Path, *concepts: dict, batch_size: int = 1, workers: int = 0, seed: int = 3, **data):
    node = OmegaConf.structured(AtelierConfig)
    data = {"resolution": "64", "bucket_step": 8, **data, "concepts": list(concepts),
            "cache_dir": str(tmp_path / "cache")}
    return OmegaConf.merge(node, {"general": {"workspace": str(tmp_path), "seed": seed,
                                              "dataloader_workers": workers},
                                  "training": {"batch_size": batch_size}, "data": data})


def _pipeline(cfg, warnings=None):
    from trainer.data.pipeline import DataPipeline
    return DataPipeline(cfg, warn=(warnings.append if warnings is not None else lambda m: None))


class FakeVae:
    """mean = 8x8 average of the pixels (3 channels + their mean); counts encoded images."""

    def __init__(self):
        self.encoded = 0
        self.shapes: list = []

    def __call__(self, pixels):
        import torch
        import torch.nn.functional as F
        self.encoded += pixels.shape[0]
        self.shapes.append(tuple(pixels.shape))
        pooled = F.avg_pool2d(pixels.float(), 8)
        mean = torch.cat([pooled, pooled.mean(1, keepdim=True)], dim=1)
        return {"mean": mean, "std": torch.full_like(mean, 0.1)}


class FakeText:
    def __init__(self, offset: float = 0.0):
        self.encoded: list = []
        self.offset = offset

    def __call__(self, captions):
        import torch
        self.encoded += list(captions)
        out = torch.zeros(len(captions), 4, 8)
        for i, c in enumerate(captions):
            out[i, 0, 0] = len(c) + self.offset
            out[i, 1, :] = sum(map(ord, c)) % 97
        return out


def _shapes(path: Path, size=(96, 64), mask: bool = True) -> Path:
    """White shapes on black (an off-centre rectangle and a small square) and the same shapes as
    its mask, so image brightness and mask must coincide after any geometric transform."""
    img = Image.new("RGB", size, (0, 0, 0))
    m = Image.new("L", size, 0)
    w, h = size
    for draw, fill in ((ImageDraw.Draw(img), (255, 255, 255)), (ImageDraw.Draw(m), 255)):
        draw.rectangle((w // 6, h // 5, w // 2, h * 3 // 4), fill=fill)
        draw.rectangle((w * 3 // 4, h // 10, w * 3 // 4 + w // 8, h // 10 + h // 6), fill=fill)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    if mask:
        m.save(path.with_name(path.stem + "-masklabel.png"))
    return path


# --------------------------------------------------------------------------------------------
# captions
# --------------------------------------------------------------------------------------------

def test_caption_dropout_gives_empty_captions_at_the_rate():
    proc = CaptionProcessor()
    opts = CaptionOptions(caption_dropout=0.3)
    rng = random.Random(1)
    out = [proc.process("a, b, c", opts, rng) for _ in range(2000)]
    assert 0.25 < out.count("") / len(out) < 0.35
    assert set(out) == {"", "a, b, c"}  # untouched otherwise: no tag splitting without tag options


def test_tag_shuffle_keeps_first_n_and_uses_the_delimiter():
    proc = CaptionProcessor()
    opts = CaptionOptions(shuffle_tags=True, keep_tags=2, tag_delimiter=",")
    caption = "sks dog,  photo , grass,sun, tree ,sky"
    seen = set()
    for s in range(50):
        out = proc.process(caption, opts, random.Random(s))
        tags = out.split(", ")
        assert tags[:2] == ["sks dog", "photo"]
        assert sorted(tags[2:]) == ["grass", "sky", "sun", "tree"]
        seen.add(out)
    assert len(seen) > 5
    assert proc.process(caption, opts, random.Random(7)) == proc.process(caption, opts, random.Random(7))
    pipe = CaptionOptions(shuffle_tags=True, tag_delimiter="|")
    out = proc.process("a|b|c|d", pipe, random.Random(0))
    assert sorted(out.split("| ")) == ["a", "b", "c", "d"]


def test_tag_dropout_respects_keep_list_keep_first_and_placeholders():
    proc = CaptionProcessor()
    proc.set_placeholder("<emb>", "tok_0 tok_1")
    concept = OmegaConf.create({"shuffle_tags": False, "tag_delimiter": ",", "keep_tags": 1,
                                "tag_dropout": 0.5, "tag_dropout_keep": "red, blue",
                                "caption_dropout": 0.0})
    opts = CaptionOptions.from_concept(concept)
    assert opts.tag_dropout_keep == ("red", "blue") and not opts.deterministic
    counts = Counter()
    for s in range(400):
        tags = proc.process("first, red, a <emb> thing, blue, x, y", opts, random.Random(s)).split(", ")
        assert tags[0] == "first" and {"red", "blue", "a tok_0 tok_1 thing"} <= set(tags)
        assert [t for t in tags if t in ("first", "red", "a tok_0 tok_1 thing", "blue", "x", "y")] == tags
        counts.update(tags)
    assert 140 < counts["x"] < 260 and 140 < counts["y"] < 260
    everything = CaptionOptions(tag_dropout=1.0)
    assert proc.process("x, y", everything, random.Random(0)) == ""


def test_placeholder_hook_string_and_function_and_possible_captions():
    proc = CaptionProcessor()
    proc.set_placeholder("<embedding>", lambda caption: "t0 t1" if "style" in caption else "t0")
    assert proc.process("a <embedding> style", CaptionOptions(), random.Random(0)) == "a t0 t1 style"
    assert proc.process("photo of <embedding>", CaptionOptions(), random.Random(0)) == "photo of t0"
    opts = CaptionOptions(caption_dropout=0.1)
    assert proc.possible_captions(["x <embedding>", "y"], opts) == ["", "x t0", "y"]
    with pytest.raises(ValueError):
        proc.possible_captions(["x"], CaptionOptions(shuffle_tags=True))
    with pytest.raises(ValueError):
        proc.set_placeholder("", "x")


def test_multi_line_caption_and_caption_options_in_the_pipeline(tmp_path):
    d = tmp_path / "c"
    for i in range(4):
        _img(d / f"{i}.png")
        (d / f"{i}.txt").write_text("tag one, tag two, tag three\nother line", encoding="utf-8")
    cfg = _cfg(tmp_path, {"path": str(d), "repeats": 20, "caption_dropout": 0.2, "shuffle_tags": True,
                          "keep_tags": 1}, batch_size=4)
    pipe = _pipeline(cfg)
    pipe.prepare(FakeVae(), "fake", "fp32")
    captions = [c for _, b in pipe.iter_batches(0, 0, 100) for c in b["captions"]]
    assert len(captions) == 80
    assert 0.08 < captions.count("") / 80 < 0.35
    assert any(c == "other line" for c in captions)
    firsts = [c for c in captions if c.startswith("tag one, ")]
    assert len(set(firsts)) > 1  # shuffled behind the kept first tag
    again = _pipeline(cfg)
    again.prepare(FakeVae(), "fake", "fp32")
    assert [c for _, b in again.iter_batches(0, 0, 100) for c in b["captions"]] == captions


# --------------------------------------------------------------------------------------------
# resolution and buckets
# --------------------------------------------------------------------------------------------

def test_parse_resolution_forms_and_errors():
    assert parse_resolution(512) == [(512, 512)]
    assert parse_resolution("768x512") == [(768, 512)]
    assert parse_resolution("384, 448,512 ,512") == [(384, 384), (448, 448), (512, 512)]
    assert parse_resolution("512X768,640") == [(512, 768), (640, 640)]
    for bad in ("", "abc", "512x", "32", "512,,640", "9000"):
        with pytest.raises(ValueError):
            parse_resolution(bad)


def test_resolution_in_config_accepts_int_wxh_and_lists_and_names_bad_keys(tmp_path):
    from trainer.config.checks import cross_field_warnings, load_config
    y = tmp_path / "c.yaml"
    y.write_text("base: demo\ndata:\n  resolution: 512\n", encoding="utf-8")
    assert load_config(y).data.resolution == "512"
    assert load_config(y, ["data.resolution=384,448,512"]).data.resolution == "384,448,512"
    assert load_config(y, ["data.resolution=768x512"]).data.resolution == "768x512"
    cfg = load_config(y, ["data.resolution=64"])
    assert any(i.key.startswith("sampling") for i in cross_field_warnings(load_config(y)))  # 64px samples
    assert not any(i.key.startswith("sampling") for i in cross_field_warnings(cfg))
    with pytest.raises(ConfigError) as err:
        load_config(y, ["data.resolution=huge"])
    assert err.value.key == "data.resolution" and "huge" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(y, ["data.concepts.0.resolution=12x12"])
    assert err.value.key == "data.concepts.0.resolution"


def test_buckets_are_multiples_within_budget_and_aspect():
    buckets = generate_buckets((512, 512), 64, 2.0)
    assert (512, 512) in buckets and (448, 576) in buckets and (576, 448) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0 and w * h <= 512 * 512 and max(w / h, h / w) <= 2.0
    assert (768, 512) in generate_buckets((768, 512), 64, 1.2)  # the target's own shape always
    assert (512, 512) in generate_buckets((500, 500), 64, 2.0)  # snapped
    assert nearest_bucket(1000, 500, buckets) == max(buckets, key=lambda b: b[0] / b[1])
    assert nearest_bucket(600, 600, buckets) == (512, 512)
    # upscale limit: a 200px square would need 2.56x for 512; capped at 2x it gets 384x384
    assert assign_bucket(200, 200, buckets, 64, 0) == (512, 512)
    assert assign_bucket(200, 200, buckets, 64, 2.0) == (384, 384)
    assert assign_bucket(20, 20, buckets, 64, 2.0) is None


def test_bucket_assignment_and_drop_report_on_a_crafted_set(tmp_path):
    from trainer.data.dataset import build_dataset
    d = tmp_path / "c"
    for i in range(4):
        _img(d / f"square{i}.png", (64, 64))
    for i in range(3):
        _img(d / f"wide{i}.png", (96, 64))             # 1.5 -> 80x48
    _img(d / "tall0.png", (64, 96))                    # 1 image in 48x80: never trains with batch 2
    _img(d / "small.png", (40, 40))                    # needs 1.6x; limit 1.25 -> 48x48 bucket, alone
    cfg = _cfg(tmp_path, {"path": str(d)}, batch_size=2, max_upscale=1.25)
    warnings: list = []
    ds = build_dataset(cfg, warnings.append)
    rep = ds.report
    by_name = {it.path.name: b for it, b in zip(ds.items, ds.buckets)}
    assert by_name["square0.png"] == [(64, 64)] and by_name["wide2.png"] == [(80, 48)]
    assert by_name["tall0.png"] == [(48, 80)] and by_name["small.png"] == [(48, 48)]
    hist = {b["size"]: (b["images"], b["trains"]) for b in rep.buckets}
    assert hist == {"48x48": (1, False), "64x64": (4, True), "80x48": (3, True), "48x80": (1, False)}
    assert sorted(Path(p).name for p in rep.dropped) == ["small.png", "tall0.png"]
    assert any("tall0.png" in w and "never train" in w for w in warnings)
    assert [s["file"] for s in rep.small_images] == [str(d / "small.png")]
    assert rep.small_images[0]["bucket"] == "48x48" and rep.small_images[0]["upscale"] == 1.2
    # every epoch: batches come from one bucket and never contain dropped images
    for epoch in range(3):
        batches, leftovers = ds.plan(epoch)
        assert len(batches) == 3 and len(leftovers) == 3  # 2 squares, 1 wide; + a wide, tall, small left
        for b in batches:
            assert {tuple(ds.buckets[i][0]) for i in b.indices} == {b.size}
            assert not {ds.items[i].path.name for i in b.indices} & {"tall0.png", "small.png"}
    assert ds.plan(1) == ds.plan(1) and ds.plan(1)[0] != ds.plan(2)[0]
    out = rep.to_dict()
    assert out["dropped_count"] == 2 and out["batches_per_epoch"] == 3 and out["leftover_per_epoch"] == 3


def test_no_aspect_buckets_crops_everything_to_the_resolution_shape(tmp_path):
    from trainer.data.dataset import build_dataset
    d = tmp_path / "c"
    _img(d / "a.png", (96, 64))
    _img(d / "b.png", (64, 128))
    ds = build_dataset(_cfg(tmp_path, {"path": str(d)}, resolution="80x64", aspect_buckets=False), print)
    assert ds.buckets == [[(80, 64)], [(80, 64)]]


def test_multi_resolution_picks_only_listed_sizes_deterministically(tmp_path):
    d = tmp_path / "c"
    for i in range(6):
        _img(d / f"sq{i}.png", (128, 128), color=(i * 30, 0, 0))
        _img(d / f"wide{i}.png", (192, 128), color=(0, i * 30, 0))
    cfg = _cfg(tmp_path, {"path": str(d), "repeats": 4}, resolution="64,96,128", batch_size=2, seed=11)
    pipe = _pipeline(cfg)
    listed = {t: set(generate_buckets(t, 8, 2.0)) for t in [(64, 64), (96, 96), (128, 128)]}
    allowed = set().union(*listed.values())
    sizes = Counter()
    for epoch in range(3):
        batches = pipe.epoch_batches(epoch)
        assert len(batches) >= 20  # 48 samples: nearly every batch fills
        for b in batches:
            assert b.size in allowed
            sizes[b.size] += 1
    used_targets = {t for t, bs in listed.items() if any(s in bs for s in sizes)}
    assert used_targets == set(listed)  # every listed resolution is used
    assert pipe.epoch_batches(2) == _pipeline(cfg).epoch_batches(2)
    pipe.prepare(FakeVae(), "fake", "fp32")
    for _, batch in pipe.iter_batches(0, 0, 6):
        h, w = batch["latent_dist"]["mean"].shape[-2:]
        assert (w * 8, h * 8) in allowed and len(set(batch["sizes"])) == 1
        assert batch["target_sizes"] == [(h * 8, w * 8)] * 2
        assert set(batch["original_sizes"]) <= {(128, 128), (128, 192)} and len(batch["crop_top_lefts"]) == 2


def test_concept_resolution_override_and_samples_balancing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for i in range(2):
        _img(a / f"{i}.png", (128, 128))
    for i in range(8):
        _img(b / f"{i}.png", (128, 128))
    cfg = _cfg(tmp_path, {"path": str(a), "resolution": "96", "samples": 8}, {"path": str(b), "samples": 8},
               batch_size=2)
    pipe = _pipeline(cfg)
    by_concept = Counter()
    for plan in pipe.epoch_batches(0):
        for i in plan.indices:
            item = pipe.items[i]
            by_concept[item.concept_index] += 1
            assert plan.size == ((96, 96) if item.concept_index == 0 else (64, 64))
    assert by_concept == {0: 8, 1: 8}
    assert [c["repeats"] for c in pipe.report.to_dict()["concepts"]] == [4.0, 1.0]


# --------------------------------------------------------------------------------------------
# masks and augmentations
# --------------------------------------------------------------------------------------------

_CASES = {
    "identity": AugmentParams(),
    "flip": AugmentParams(flip=True),
    "random crop": AugmentParams(shift_x=0.9, shift_y=-0.7),
    "crop jitter": AugmentParams(zoom=1.4, shift_x=-0.8, shift_y=0.6),
    "rotation": AugmentParams(angle=17.0),
    "rotation flip jitter": AugmentParams(angle=-23.5, zoom=1.2, shift_x=0.5, flip=True),
    "colour": AugmentParams(brightness=1.3, contrast=0.7, saturation=1.5, hue=0.2),
    "everything": AugmentParams(flip=True, angle=9.0, zoom=1.3, shift_x=-0.4, shift_y=0.9,
                                brightness=0.8, contrast=1.2, saturation=0.6, hue=-0.3),
}


def _aligned(pixels, mask) -> bool:
    lum = (pixels.mean(0) + 1) / 2          # [H, W] in [0, 1]
    m = mask[0]
    focus, background = lum[m >= 0.9], lum[m <= 0.1]
    return focus.numel() > 20 and background.numel() > 20 and bool(focus.min() > 0.5) \
        and bool(background.max() < 0.35)


@pytest.mark.parametrize("name", list(_CASES))
def test_mask_stays_aligned_with_its_image(tmp_path, name):
    from trainer.data.images import decode, render_sample
    path = _shapes(tmp_path / "shapes.png", (120, 90))
    img, mask = decode(path, path.with_name("shapes-masklabel.png"))
    params = _CASES[name]
    for size in ((64, 48), (48, 64)):
        pixels, m = render_sample(img, mask, size, params)
        assert pixels.shape == (3, size[1], size[0]) and m.shape == (1, size[1], size[0])
        assert _aligned(pixels, m), (name, size)
    if params.flip or params.angle:  # the check can fail: a mask left unflipped/unrotated is caught
        plain, _ = render_sample(img, mask, (64, 48), params)
        _, unmoved = render_sample(img, mask, (64, 48), AugmentParams(zoom=params.zoom, shift_x=params.shift_x,
                                                                      shift_y=params.shift_y))
        assert not _aligned(plain, unmoved)


def test_augmentations_change_the_image_and_draws_are_seeded():
    s = AugmentSettings(random_flip=True, rotation=10, crop_jitter=0.2, brightness=0.2, contrast=0.2,
                        saturation=0.2, hue=0.1)
    draws = [draw_params(s, random.Random(i)) for i in range(200)]
    assert draws[5] == draw_params(s, random.Random(5))
    assert 60 < sum(p.flip for p in draws) < 140
    assert all(-10 <= p.angle <= 10 and 1 <= p.zoom <= 1.2 and 0.8 <= p.brightness <= 1.2
               and -0.1 <= p.hue <= 0.1 for p in draws)
    fixed = draw_params(AugmentSettings(rotation=10, brightness=0.2, random=False), random.Random(0))
    assert (fixed.angle, fixed.brightness, fixed.zoom) == (10.0, 1.2, 1.0)
    off = draw_params(AugmentSettings(), random.Random(0))
    assert off == AugmentParams()
    from trainer.data.augment import crop_top_left  # SDXL crop conditioning: no pixels needed
    assert crop_top_left((120, 90), (64, 48), AugmentParams()) == (0, 0)
    assert crop_top_left((90, 120), (48, 48), AugmentParams(shift_y=1.0)) == (16, 0)
    assert crop_top_left((90, 120), (48, 48), AugmentParams(shift_y=-1.0)) == (0, 0)
    # toggling one augmentation does not change another's draw
    assert draw_params(AugmentSettings(rotation=10), random.Random(3)).angle == \
        draw_params(AugmentSettings(rotation=10, hue=0.1), random.Random(3)).angle


def test_colour_augmentations_act_on_pixels():
    from trainer.data.augment import apply_color
    img = Image.new("RGB", (8, 8), (200, 60, 40))
    assert apply_color(img, AugmentParams(brightness=0.5)).getpixel((1, 1)) == (100, 30, 20)
    grey = apply_color(img, AugmentParams(saturation=0.0)).getpixel((1, 1))
    assert max(grey) - min(grey) <= 1
    r, g, b = apply_color(img, AugmentParams(hue=1 / 3)).getpixel((1, 1))
    assert g > r and g > b  # red rotated a third of the way round is green


def _latent_mask_matches_image(batch) -> None:
    mean, mask = batch["latent_dist"]["mean"], batch["mask"]
    assert mask.shape == (mean.shape[0], 1, *mean.shape[-2:])
    lum = (mean[:, 3:4] + 1) / 2  # the fake VAE's 4th channel: pooled luminance
    assert float((lum - mask).abs().mean()) < 0.04, float((lum - mask).abs().mean())


@pytest.mark.parametrize("cache, variants", [(True, 0), (True, 3), (False, 0)])
def test_masks_reach_the_batch_aligned_through_cache_and_augmentation(tmp_path, cache, variants):
    d = tmp_path / "c"
    for i in range(3):
        _shapes(d / f"s{i}.png", (96 + 8 * i, 64))
    _img(d / "nomask.png", (96, 64), color=(255, 255, 255))
    cfg = _cfg(tmp_path, {"path": str(d), "repeats": 2}, batch_size=2, masks=True, random_flip=True,
               rotation=15, crop_jitter=0.2, cache_latents=cache, augment_variants=variants)
    warnings: list = []
    pipe = _pipeline(cfg, warnings)
    assert any("nomask.png" in w and "no mask" in w for w in warnings)
    assert pipe.report.to_dict()["masks_missing"] == ["nomask.png"]
    vae = FakeVae()
    summary = pipe.prepare(vae, "fake", "fp32")
    assert summary["latents_encoded"] == (4 * variants if cache else 0)
    seen = 0
    for _, batch in pipe.iter_batches(0, 0, 10):
        _latent_mask_matches_image(batch)
        seen += 1
    assert seen == 4
    encoded_in_training = vae.encoded - summary["latents_encoded"]
    assert encoded_in_training == (0 if variants else 8)  # bypass: every sample is encoded per step


def test_mask_with_other_size_is_scaled_or_ignored(tmp_path):
    d = tmp_path / "c"
    _shapes(d / "half.png", (96, 64), mask=False)
    big = Image.new("L", (48, 32), 0)
    ImageDraw.Draw(big).rectangle((8, 6, 24, 24), fill=255)
    big.save(d / "half-masklabel.png")                 # same aspect, half size: scaled
    _img(d / "odd.png", (96, 64))
    Image.new("L", (50, 50), 255).save(d / "odd-masklabel.png")  # other aspect: ignored
    _img(d / "broken.png", (96, 64))
    (d / "broken-masklabel.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    warnings: list = []
    pipe = _pipeline(_cfg(tmp_path, {"path": str(d)}, masks=True), warnings)
    items = {it.path.name: it for it in pipe.items}
    assert items["half.png"].mask is not None and items["odd.png"].mask is None
    assert items["broken.png"].mask is None
    bad = {b["file"] for b in pipe.report.to_dict()["concepts"][0]["masks_bad"]}
    assert bad == {"odd-masklabel.png", "broken-masklabel.png"}
    assert any("odd-masklabel.png" in w and "50x50" in w for w in warnings)
    assert any("broken-masklabel.png" in w for w in warnings)
    pipe.prepare(FakeVae(), "fake", "fp32")
    plans = pipe.epoch_batches(0)
    for (_, batch), plan in zip(pipe.iter_batches(0, 0, 10), plans):
        name = pipe.items[plan.indices[0]].path.name
        mask = batch["mask"][0, 0]
        if name == "half.png":  # the scaled mask still marks the rectangle, not the whole image
            assert 0.1 < float(mask.mean()) < 0.6
        else:
            assert float(mask.min()) == 1.0  # ignored mask: all in focus


# --------------------------------------------------------------------------------------------
# caches
# --------------------------------------------------------------------------------------------

def test_cache_hit_on_unchanged_run_and_recache_of_exactly_the_changed_file(tmp_path):
    d = tmp_path / "c"
    for i in range(4):
        _img(d / f"{i}.png", (96, 64) if i % 2 else (64, 64), color=(i * 50, 10, 10))
        (d / f"{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    _shapes(d / "m.png", (96, 64))
    cfg = _cfg(tmp_path, {"path": str(d), "caption_dropout": 0.1}, random_flip=True, masks=True)
    vae, text = FakeVae(), FakeText()
    first = _pipeline(cfg).prepare(vae, "vae-a", "fp32", encode_text_fn=text)
    assert first["latents_encoded"] == 10 and first["text_encoded"] == 5  # 5 x 2 flips; 4 captions + ""
    # text cache: probe + captions; everything reused on an unchanged run
    again = _pipeline(cfg).prepare(vae, "vae-a", "fp32", encode_text_fn=text)
    assert (again["latents_encoded"], again["latents_reused"]) == (0, 10)
    assert (again["text_encoded"], again["text_reused"]) == (0, 5)

    _img(d / "2.png", (64, 64), color=(1, 2, 3))          # edit one image
    (d / "3.txt").write_text("new words", encoding="utf-8")  # and one caption
    Image.new("L", (96, 64), 255).save(d / "m-masklabel.png")  # and one mask
    vae2, text2 = FakeVae(), FakeText()
    third = _pipeline(cfg).prepare(vae2, "vae-a", "fp32", encode_text_fn=text2)
    assert third["latents_encoded"] == 4 and vae2.encoded == 4  # 2.png and m.png, both flips
    assert [c for c in text2.encoded if "probe" not in c] == ["new words"]

    # a setting that changes latents re-encodes everything; one that does not, nothing
    assert _pipeline(_cfg(tmp_path, {"path": str(d), "caption_dropout": 0.1}, random_flip=True, masks=True,
                          resolution="72")).prepare(FakeVae(), "vae-a", "fp32")["latents_encoded"] == 10
    assert _pipeline(cfg).prepare(FakeVae(), "vae-b", "fp32")["latents_encoded"] == 10
    assert _pipeline(_cfg(tmp_path, {"path": str(d), "caption_dropout": 0.1}, random_flip=True, masks=True,
                          seed=99)).prepare(FakeVae(), "vae-a", "fp32")["latents_encoded"] == 0
    # other text-encoder weights (same fingerprint string) never get stale embeddings
    text3 = FakeText(offset=1.0)
    assert _pipeline(cfg).prepare(FakeVae(), "vae-a", "fp32", encode_text_fn=text3)["text_encoded"] == 5


def test_batches_carry_cached_text_only_for_deterministic_captions(tmp_path):
    d = tmp_path / "c"
    for i in range(2):
        _img(d / f"{i}.png")
        (d / f"{i}.txt").write_text(f"a, b, c{i}\nsecond {i}", encoding="utf-8")
    cfg = _cfg(tmp_path, {"path": str(d), "repeats": 3}, batch_size=2)
    pipe = _pipeline(cfg)
    text = FakeText()
    assert pipe.prepare(FakeVae(), "v", "fp32", encode_text_fn=text)["text_cache"] == "on"
    ref = FakeText()
    for _, b in pipe.iter_batches(0, 0, 10):
        import torch
        torch.testing.assert_close(b["encoder_hidden_states"], ref(b["captions"]))
    shuffled = _pipeline(_cfg(tmp_path, {"path": str(d), "shuffle_tags": True}))
    summary = shuffled.prepare(FakeVae(), "v", "fp32", encode_text_fn=FakeText())
    assert summary["text_cache"].startswith("off")
    assert all("encoder_hidden_states" not in b for _, b in shuffled.iter_batches(0, 0, 10))


def test_caching_resumes_after_interruption_and_variants_are_cached(tmp_path):
    d = tmp_path / "c"
    for i in range(5):
        _img(d / f"{i}.png", color=(i * 40, 0, 0))
    cfg = _cfg(tmp_path, {"path": str(d)}, brightness=0.3, augment_variants=3)
    vae = FakeVae()

    def flaky(pixels):
        if vae.encoded >= 6:
            raise KeyboardInterrupt
        return vae(pixels)

    with pytest.raises(KeyboardInterrupt):
        _pipeline(cfg).prepare(flaky, "v", "fp32")
    progress: list = []
    summary = _pipeline(cfg).prepare(vae, "v", "fp32", progress=lambda *a: progress.append(a))
    assert summary == {**summary, "latents_encoded": 9, "latents_reused": 6}
    assert progress[0] == ("latents", 0, 9) and progress[-1] == ("latents", 9, 9)
    assert len(list((tmp_path / "cache" / "latents").rglob("*.safetensors"))) == 15
    assert not list((tmp_path / "cache").rglob("*.tmp"))


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------

def test_background_loading_matches_and_resume_sees_the_same_batches(tmp_path):
    import torch
    d = tmp_path / "c"
    for i in range(6):
        _img(d / f"{i}.png", (64 + 16 * (i % 2), 64), color=(i * 40, 90, 9))
        (d / f"{i}.txt").write_text(f"x{i}, y, z", encoding="utf-8")
    common = dict(batch_size=2, random_flip=True, crop_jitter=0.1)
    concept = {"path": str(d), "repeats": 2, "shuffle_tags": True}
    runs = []
    for workers in (0, 3):
        pipe = _pipeline(_cfg(tmp_path, concept, workers=workers, **common))
        pipe.prepare(FakeVae(), "v", "fp32")
        runs.append([(bi, b) for bi, b in pipe.iter_batches(1, 0, 100)])
    assert len(runs[0]) == len(runs[1]) >= 4
    for (i, a), (j, b) in zip(*runs):
        assert i == j and a["captions"] == b["captions"]
        torch.testing.assert_close(a["latent_dist"]["mean"], b["latent_dist"]["mean"])
    pipe = _pipeline(_cfg(tmp_path, concept, workers=2, **common))
    pipe.prepare(FakeVae(), "v", "fp32")
    tail = list(pipe.iter_batches(1, 2, 100))  # a resumed run starts mid-epoch
    assert [bi for bi, _ in tail] == [bi for bi, _ in runs[0][2:]]
    for (_, a), (_, b) in zip(tail, runs[0][2:]):
        torch.testing.assert_close(a["latent_dist"]["mean"], b["latent_dist"]["mean"])
    gen = pipe.iter_batches(1, 0, 100)
    next(gen)
    gen.close()  # stopping mid-epoch shuts the loader threads down


def test_images_are_decoded_once_per_epoch_at_most(tmp_path, monkeypatch):
    import trainer.data.images as images
    d = tmp_path / "c"
    for i in range(3):
        _img(d / f"{i}.png", color=(i * 60, 0, 0))
    pipe = _pipeline(_cfg(tmp_path, {"path": str(d), "repeats": 4}, batch_size=2, workers=2, rotation=5))
    pipe.prepare(FakeVae(), "v", "fp32")
    calls = Counter()
    real = images.decode

    def counting(path, *a, **k):
        calls[Path(path).name] += 1
        return real(path, *a, **k)

    monkeypatch.setattr(images, "decode", counting)
    batches = list(pipe.iter_batches(0, 0, 100))
    assert len(batches) == 6
    assert calls == {"0.png": 1, "1.png": 1, "2.png": 1}


def test_validation_concepts_are_not_trained_but_batched(tmp_path):
    train, val = tmp_path / "t", tmp_path / "v"
    for i in range(4):
        _img(train / f"{i}.png")
    for i in range(3):
        _img(val / f"{i}.png", (96, 64) if i else (64, 64), color=(9, 9, i * 70))
        (val / f"{i}.txt").write_text(f"val {i}\nother", encoding="utf-8")
    cfg = _cfg(tmp_path, {"path": str(train)}, {"path": str(val), "role": "validation", "caption_dropout": 1.0},
               batch_size=2, brightness=0.5)
    pipe = _pipeline(cfg)
    assert len(pipe.items) == 4 and len(pipe.validation_items) == 3
    assert all(not pipe.items[i].validation for b in pipe.epoch_batches(0) for i in b.indices)
    summary = pipe.prepare(FakeVae(), "v", "fp32")
    assert summary["latents_encoded"] == 3  # validation images are cached (plain); training renders
    batches = list(pipe.iter_validation())
    assert sorted(len(b["captions"]) for b in batches) == [1, 2]
    assert sorted(c for b in batches for c in b["captions"]) == ["val 0", "val 1", "val 2"]
    rep = pipe.report.to_dict()
    assert rep["concepts"][1]["validation"] and rep["images_per_epoch"] == 4.0
    with pytest.raises(DataError):
        _pipeline(_cfg(tmp_path, {"path": str(val), "role": "validation"}))


# --------------------------------------------------------------------------------------------
# bad input and the report
# --------------------------------------------------------------------------------------------

def test_bad_files_are_skipped_or_handled_and_counted(tmp_path):
    d = tmp_path / "c"
    good = _img(d / "good.png", (64, 64))
    (d / "truncated.png").write_bytes(good.read_bytes()[:40])
    (d / "zero.jpg").write_bytes(b"")
    (d / "notes.jpg").write_text("not an image", encoding="utf-8")
    _img(d / "cut.jpg", (128, 128))
    (d / "cut.jpg").write_bytes((d / "cut.jpg").read_bytes()[:400])
    _img(d / "cmyk.jpg", (64, 64), mode="CMYK", color=(0, 255, 255, 0))
    Image.new("I;16", (64, 64), 30000).save(d / "gray16.png")
    Image.new("RGB", (64, 64), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE).save(d / "pal.png")
    Image.new("RGBA", (64, 64), (0, 0, 255, 100)).save(d / "alpha.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (96, 64), (5, 5, 5)).save(d / "rotated.jpg", exif=exif)  # displays as 64x96
    _img(d / "tiny.png", (3, 3))
    (d / "good.txt").write_bytes("na\u00efve caf\u00e9".encode("cp1252"))
    warnings: list = []
    pipe = _pipeline(_cfg(tmp_path, {"path": str(d)}), warnings)
    names = {it.path.name for it in pipe.items}
    assert names == {"good.png", "cmyk.jpg", "gray16.png", "pal.png", "alpha.png", "rotated.jpg"}
    c = pipe.report.to_dict()["concepts"][0]
    assert c["images_found"] == 11 and c["images_used"] == 6 and c["images_skipped"] == 5
    skipped = {s["file"] for s in c["skipped"]}
    assert skipped == {"truncated.png", "zero.jpg", "notes.jpg", "cut.jpg", "tiny.png"}
    for bad in skipped:
        assert any(bad in w for w in warnings), bad
    assert any("good.txt" in w and "cp1252" in w for w in warnings)
    assert [it.captions for it in pipe.items if it.path.name == "good.png"] == [["na\u00efve caf\u00e9"]]
    rotated = next(b for it, b in zip(pipe.items, pipe.dataset.buckets) if it.path.name == "rotated.jpg")
    assert rotated[0][0] < rotated[0][1]  # portrait bucket: EXIF orientation honoured
    pipe.prepare(FakeVae(), "v", "fp32")
    assert sum(len(b["captions"]) for _, b in pipe.iter_batches(0, 0, 100)) == 6


def test_report_lists_duplicates_small_images_and_runs_without_torch(tmp_path):
    d = tmp_path / "c"
    _img(d / "a.png", (64, 64), color=(1, 2, 3))
    _img(d / "copy of a.png", (64, 64), color=(1, 2, 3))
    _img(d / "b.png", (64, 96))
    _img(d / "little.png", (40, 40))
    cfg = config_from_dict({"base": "demo", "general": {"workspace": str(tmp_path)},
                            "data": {"concepts": [{"path": str(d)}], "resolution": "64", "bucket_step": 8,
                                     "masks": True}})
    from trainer.config.load import save_config
    save_config(cfg, tmp_path / "run.yaml")
    code = ("import sys, json, io, contextlib; from trainer.__main__ import main; buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): rc = main(['data-report', sys.argv[1], '--json'])\n"
            "assert 'torch' not in sys.modules, 'data-report imported torch'\n"
            "print(buf.getvalue())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run.yaml")], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    rep = json.loads(out)
    assert [sorted(Path(p).name for p in g) for g in rep["duplicates"]] == [["a.png", "copy of a.png"]]
    assert [Path(s["file"]).name for s in rep["small_images"]] == ["little.png"]
    assert [Path(p).name for p in rep["dropped"]] == ["b.png"]  # alone in 48x80 with batch size 2
    assert rep["masks_missing_count"] == 4
    text = subprocess.run([sys.executable, "-m", "trainer", "data-report", str(tmp_path / "run.yaml")],
                          cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert "never trained" in text and "b.png" in text and "little.png" in text and "identical files: 1" in text
    assert "48x80" in text and "never trains" in text


@pytest.mark.parametrize("shift_x, shift_y, zoom, flip", [(-0.6, 0.8, 1.5, False), (-0.6, 0.8, 1.5, True),
                                                          (0.9, -0.3, 1.3, True), (-1.0, 0.0, 1.0, True)])
def test_sdxl_crop_offsets_are_where_the_samples_pixels_are(shift_x, shift_y, zoom, flip):
    """SDXL's crop conditioning reports the crop's (top, left) in the resized image — mirrored for a mirrored sample,
    as diffusers' SDXL trainer (flip, then crop) and kohya (offset mirrored) do. A landscape image with different
    horizontal and vertical draws: the sample's pixels are the resized (and mirrored) image cropped at that offset."""
    import numpy as np

    from trainer.data.augment import _layout, apply_geometry, crop_top_left
    img = Image.new("RGB", (150, 100))
    img.putdata([(x, y, (x * y) % 251) for y in range(100) for x in range(150)])
    p = AugmentParams(flip=flip, shift_x=shift_x, shift_y=shift_y, zoom=zoom)
    out, _ = apply_geometry(img, None, (64, 48), p)
    top, left = crop_top_left(img.size, (64, 48), p)
    g = _layout(img.size, (64, 48), p)
    resized = img.resize((g.nw, g.nh), Image.Resampling.LANCZOS)
    if flip:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    assert np.array_equal(np.asarray(out), np.asarray(resized.crop((left, top, left + 64, top + 48))))
    assert top != left
