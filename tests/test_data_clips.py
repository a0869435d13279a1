"""Clips as data (issue 30, must have 1): probing, resampling to the model's frame rate by timestamps, the frame
extraction modes, frame-count and aspect buckets, windowed decoding, the dataset report, the bad-input messages and
the video batches with their cache keys. Tiny clips are made here with PyAV; frame ``i`` is painted a flat colour that
encodes ``i``, so a decoded frame says which frame it is. The family is a VideoSpec given to the data path (no video
family needs to be registered)."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from trainer.config.schema import AtelierConfig
from trainer.data import clips, frames
from trainer.data.clips import DecodeStats, probe_clip, read_frames, resample
from trainer.data.report import build_report, format_report
from trainer.errors import ConfigError
from trainer.families import VideoSpec

ROOT = Path(__file__).resolve().parent.parent
WAN = VideoSpec(frame_multiple=4, fps=16.0, max_frames=81)


def colour(i: int) -> tuple:
    return ((i % 16) * 16 + 8, (i // 16) * 16 + 8, 128)


def frame_number(rgb) -> int:
    """The frame a decoded pixel was painted as (tolerates the codec's few levels of error)."""
    r, g = int(rgb[0]), int(rgb[1])
    return r // 16 + 16 * (g // 16)


def make_clip(path: Path, n: int, fps: int = 30, pts_ms=None, codec: str = "mpeg4", size=(16, 16),
              paint=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if codec == "mpeg4":
            stream.options = {"qscale": "1", "g": "8"}  # near-lossless, a keyframe every 8 frames (seekable)
        if pts_ms is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(n):
            arr = np.zeros((size[1], size[0], 3), np.uint8)
            arr[:] = (paint or colour)(i)
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            if pts_ms is not None:
                frame.pts, frame.time_base = pts_ms[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def decoded(path: Path, info, indices) -> list:
    return [frame_number(a[a.shape[0] // 2, a.shape[1] // 2]) for a in read_frames(path, info, indices)]


def concept(**kw):
    base = dict(target_frames="33", frame_extraction="head", frame_stride=1, frame_sample=1, max_frames=0)
    return SimpleNamespace(**{**base, **kw})


# --------------------------------------------------------------------------------------------
# probing, resampling, decoding
# --------------------------------------------------------------------------------------------

def test_probe_names_frames_rate_size_and_bad_files(tmp_path):
    size, problem, info = probe_clip(make_clip(tmp_path / "a.mp4", 60, fps=30, size=(32, 16)))
    assert problem is None and size == (32, 16)
    assert (info.frames, info.fps, info.variable) == (60, 30.0, False)
    assert info.duration == pytest.approx(2.0)
    _, _, vfr = probe_clip(make_clip(tmp_path / "v.mp4", 6, pts_ms=[0, 33, 66, 150, 183, 300]))
    assert vfr.variable and vfr.frames == 6
    (tmp_path / "empty.mp4").write_bytes(b"")
    assert probe_clip(tmp_path / "empty.mp4")[1].startswith("zero-length")
    (tmp_path / "junk.webm").write_bytes(b"\x1aE\xdf\xa3 not a clip at all" * 20)
    assert probe_clip(tmp_path / "junk.webm")[1].startswith("unreadable")
    gif = tmp_path / "g.gif"
    pics = [Image.new("RGB", (16, 16), colour(i)) for i in range(4)]
    pics[0].save(gif, save_all=True, append_images=pics[1:], duration=100, loop=0)
    _, problem, ginfo = probe_clip(gif)
    assert problem is None and ginfo.frames == 4 and ginfo.fps == pytest.approx(10.0, rel=0.05)


def test_resampling_30_to_16_fps_takes_frames_by_timestamp(tmp_path):
    path = make_clip(tmp_path / "a.mp4", 30, fps=30)
    _, _, info = probe_clip(path)
    indices = resample(info, 16.0)
    assert indices == [0, 1, 3, 5, 7, 9, 11, 13, 15, 16, 18, 20, 22, 24, 26, 28]  # floor(k * 30 / 16)
    assert decoded(path, info, indices) == indices
    slow = make_clip(tmp_path / "slow.mp4", 4, fps=8)  # slower than the model: frames repeat
    _, _, sinfo = probe_clip(slow)
    assert resample(sinfo, 16.0) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_variable_frame_rate_is_resampled_by_its_timestamps(tmp_path):
    path = make_clip(tmp_path / "v.mp4", 6, pts_ms=[0, 33, 66, 150, 183, 300])
    _, _, info = probe_clip(path)
    # ticks at 0, 62.5, 125, 187.5, 250, 312.5 ms: the frame shown at each is the last one started
    assert resample(info, 16.0) == [0, 1, 2, 4, 4]
    assert decoded(path, info, [0, 1, 2, 4, 4]) == [0, 1, 2, 4, 4]


@pytest.mark.parametrize("codec, ext", [("mpeg4", ".mp4"), ("libx264", ".mkv")])
def test_a_late_window_of_a_long_clip_is_decoded_without_holding_the_clip(tmp_path, codec, ext):
    path = make_clip(tmp_path / f"long{ext}", 200, fps=16, codec=codec)
    _, _, info = probe_clip(path)
    stats = DecodeStats()
    got = read_frames(path, info, list(range(180, 189)), stats)
    assert [frame_number(a[8, 8]) for a in got] == list(range(180, 189))
    assert stats.held_peak == 9 and stats.kept == 9  # only the window's frames are converted and held
    assert stats.seeks == 1 and stats.decoded <= 189  # stopped after frame 188
    if codec == "mpeg4":  # a keyframe every 8 frames: decoding starts at the one before frame 180
        assert stats.decoded <= 9 + 8


# --------------------------------------------------------------------------------------------
# extraction modes and buckets
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, want", [
    (dict(frame_extraction="head", target_frames="5,9"), [(0, 5), (0, 9)]),
    (dict(frame_extraction="chunk", target_frames="5"), [(0, 5), (5, 5), (10, 5), (15, 5)]),
    (dict(frame_extraction="slide", target_frames="9", frame_stride=4), [(0, 9), (4, 9), (8, 9), (12, 9)]),
    (dict(frame_extraction="uniform", target_frames="5", frame_sample=4), [(0, 5), (5, 5), (10, 5), (16, 5)]),
    (dict(frame_extraction="full"), [(0, 21)]),
    (dict(frame_extraction="full", max_frames=12), [(0, 9)]),
    (dict(frame_extraction="head", target_frames="33"), []),
])
def test_extraction_modes_take_musubis_windows(kw, want):
    assert frames.windows(21, concept(**kw), WAN) == want


def test_slide_windows_decode_the_frames_they_name(tmp_path):
    path = make_clip(tmp_path / "a.mp4", 48, fps=16)
    _, _, info = probe_clip(path)
    sources = resample(info, 16.0)
    assert sources == list(range(48))
    for start, count in frames.windows(len(sources), concept(frame_extraction="slide", target_frames="9",
                                                             frame_stride=16), WAN):
        assert decoded(path, info, sources[start:start + count]) == list(range(start, start + count))


def test_frame_counts_and_extraction_are_checked_naming_the_field(tmp_path, monkeypatch):
    cfg = OmegaConf.merge(OmegaConf.structured(AtelierConfig),
                          {"data": {"concepts": [{"path": str(tmp_path), "target_frames": "17,16"}]}})
    monkeypatch.setattr(frames, "video_spec", lambda c: WAN)
    with pytest.raises(ConfigError) as err:
        frames.check_clip_settings(cfg)
    assert err.value.key == "data.concepts.0.target_frames" and "13 or 17" in str(err.value)
    cfg.data.concepts[0].target_frames = "17,x"
    with pytest.raises(ConfigError, match="'x' is not a frame count"):
        frames.check_clip_settings(cfg)
    cfg.data.concepts[0].target_frames = "1,17,81"
    frames.check_clip_settings(cfg)


def test_a_clip_concept_on_an_image_family_is_refused_in_one_line(tmp_path):
    make_clip(tmp_path / "clips" / "a.mp4", 5)
    cfg = OmegaConf.merge(OmegaConf.structured(AtelierConfig),
                          {"model": {"family": "sd15"}, "data": {"concepts": [{"path": str(tmp_path / "clips")}]}})
    with pytest.raises(ConfigError) as err:
        frames.check_clip_settings(cfg)
    assert err.value.key == "data.concepts.0.path"
    assert str(tmp_path / "clips") in str(err.value) and "a.mp4" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# the dataset report and the batches
# --------------------------------------------------------------------------------------------

def _cfg(tmp_path: Path, *concepts: dict, batch_size: int = 1, **data):
    data = {"resolution": "64", "bucket_step": 8, "max_upscale": 0.0, **data, "concepts": list(concepts),
            "cache_dir": str(tmp_path / "cache")}
    return OmegaConf.merge(OmegaConf.structured(AtelierConfig),
                           {"general": {"workspace": str(tmp_path), "seed": 1},
                            "training": {"batch_size": batch_size}, "data": data})


def _mixed_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mixed"
    make_clip(folder / "walk.mp4", 30, fps=30, size=(32, 16))          # 16 frames at 16 fps
    (folder / "walk.txt").write_text("a walk")
    make_clip(folder / "short.mp4", 4, fps=16)                          # 4 frames: shorter than 5
    make_clip(folder / "jitter.mp4", 6, pts_ms=[0, 33, 66, 150, 183, 300])
    (folder / "empty.mov").write_bytes(b"")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50)
    Image.new("RGB", (16, 16), colour(3)).save(folder / "still.png")
    (folder / "still.txt").write_text("a still")
    return folder


def test_the_report_names_each_clip_its_windows_and_every_skip(tmp_path):
    folder = _mixed_folder(tmp_path)
    cfg = _cfg(tmp_path, {"path": str(folder), "target_frames": "5,9", "frame_extraction": "head"})
    rep = build_report(cfg, video=WAN)
    text = format_report(rep)
    assert "clip walk.mp4 (concept 0): 30 frames at 30 fps (1.00 s, 32x16); 16 frames at 16 fps" in text
    assert "  window: start 0, 5 frames, bucket 80x48x5f" in text
    assert "  window: start 0, 9 frames, bucket 80x48x9f" in text
    assert "clip jitter.mp4 (concept 0): 6 frames at variable fps" in text
    assert "variable frame rate: resampled by timestamps" in text
    skipped = {s["file"]: s["reason"] for s in rep["concepts"][0]["skipped"]}
    assert skipped["short.mp4"] == ("too short: 4 frames at 16 fps (0.25 s, 16x16) are 4 frames at the model's "
                                    "16 fps, fewer than the smallest bucket of 5 frames "
                                    "(data.concepts.0.target_frames)")
    assert skipped["empty.mov"].startswith("zero-length") and skipped["broken.mp4"].startswith("unreadable")
    assert "skipped: short.mp4: too short" in text
    assert {b["size"] for b in rep["buckets"]} >= {"64x64x1f", "80x48x5f", "80x48x9f"}  # the still: one frame
    cfg.data.variable_frame_rate = "skip"
    rep = build_report(cfg, video=WAN)
    assert any(s["file"] == "jitter.mp4" and "variable frame rate" in s["reason"]
               for s in rep["concepts"][0]["skipped"])


def test_an_image_family_reads_the_same_folder_as_before(tmp_path):
    folder = _mixed_folder(tmp_path)
    rep = build_report(_cfg(tmp_path, {"path": str(folder)}))  # no model: not a video family
    assert rep["total_images"] == 1 and rep["clips"] == [] and rep["buckets"][0]["size"] == "64x64"


class FakeWanVae:
    """Pools pixels 8x8 and keeps frames 0, 4, 8 … (a 4k+1 VAE); records what it was given."""

    def __init__(self):
        self.shapes: list = []

    def __call__(self, pixels):
        import torch
        import torch.nn.functional as F
        self.shapes.append(tuple(pixels.shape))
        b, c, f, h, w = pixels.shape
        pooled = F.avg_pool2d(pixels[:, :, ::4].permute(0, 2, 1, 3, 4).reshape(-1, c, h, w).float(), 8)
        mean = pooled.reshape(b, -1, c, h // 8, w // 8).permute(0, 2, 1, 3, 4).contiguous()
        return {"mean": mean, "std": torch.full_like(mean, 0.1)}


@pytest.mark.parametrize("cached", [True, False])
def test_video_batches_hold_one_bucket_of_5d_latents(tmp_path, cached):
    import torch

    from trainer.data.pipeline import DataPipeline

    folder = tmp_path / "c"
    make_clip(folder / "a.mp4", 32, fps=16)
    make_clip(folder / "b.mp4", 32, fps=16)
    (folder / "a.txt").write_text("a clip")
    (folder / "b.txt").write_text("b clip")
    Image.new("RGB", (16, 16), colour(0)).save(folder / "still.png")
    Image.new("L", (16, 16), 255).save(folder / "a-masklabel.png")
    cfg = _cfg(tmp_path, {"path": str(folder), "target_frames": "9", "frame_extraction": "chunk"},
               batch_size=2, masks=True, cache_latents=cached)
    pipe = DataPipeline(cfg, warn=lambda m: None, video=WAN)
    vae = FakeWanVae()
    pipe.prepare(vae, fingerprint="wan-test", vae_dtype="fp32")
    batches = pipe.epoch_batches(0)
    assert {b.size for b in batches} == {(64, 64, 9)}  # the still (one frame) has no partner: never a batch
    assert len(batches) == 3  # six windows (3 per clip), two a batch
    batch = pipe.batch(batches[0], 0)
    assert batch["latent_dist"]["mean"].shape == (2, 3, 3, 8, 8) and batch["frames"] == 9
    assert set(batch["captions"]) <= {"a clip", "b clip"}  # same-name .txt, as for images
    assert batch["mask"].shape == (2, 1, 3, 8, 8) and torch.allclose(batch["mask"], torch.ones(2, 1, 3, 8, 8))
    assert (2, 3, 9, 64, 64) in vae.shapes  # pixel clips [B, 3, F, H, W]
    assert set(vae.shapes) <= {(2, 3, 9, 64, 64), (1, 3, 1, 64, 64)}  # the still is cached as a one-frame clip
    first = next(it for it in pipe.items if it.path.name == "a.mp4" and it.window.start == 9)
    if cached:  # one entry per window: the key holds the window's frames and rate
        other = next(it for it in pipe.items if it.path.name == "a.mp4" and it.window.start == 0)
        size, params = (64, 64), pipe.variant_params(first, 0)
        keys = {pipe.cache.entry_path(it, *pipe._entry(it, size, params)) for it in (first, other)}
        assert len(keys) == 2 and all(k.is_file() for k in keys)
        entry = pipe.cache.get(first, *pipe._entry(first, size, params))
        # frames 9, 13, 17 of the clip, painted with their numbers, survive the fake VAE's frame stride
        got = [frame_number(((entry["mean"][:2, f, 4, 4] + 1) * 127.5).round().tolist()) for f in range(3)]
        assert got == [9, 13, 17]
    else:
        assert torch.isfinite(batch["latent_dist"]["mean"]).all()


@pytest.mark.parametrize("cached", [True, False])
def test_a_mask_clip_masks_each_frame(tmp_path, cached):
    import torch

    from trainer.data.pipeline import DataPipeline

    folder = tmp_path / "c"
    for name in ("a", "b"):
        make_clip(folder / f"{name}.mp4", 18, fps=16)
    white_from_16 = lambda i: (255, 255, 255) if i >= 16 else (0, 0, 0)  # noqa: E731
    make_clip(folder / "a-masklabel.mp4", 18, fps=16, paint=white_from_16)
    cfg = _cfg(tmp_path, {"path": str(folder), "target_frames": "9", "frame_extraction": "slide",
                          "frame_stride": 9}, batch_size=2, masks=True, cache_latents=cached)
    pipe = DataPipeline(cfg, warn=lambda m: None, video=WAN)
    assert sorted(it.path.name for it in pipe.items) == ["a.mp4", "a.mp4", "b.mp4", "b.mp4"]  # the mask trains not
    assert pipe.report.concepts[0].masks_found == 1
    pipe.prepare(FakeWanVae(), fingerprint="wan-test", vae_dtype="fp32")
    seen = {}
    for plan in pipe.epoch_batches(0):
        batch = pipe.batch(plan, 0)
        for row, index in enumerate(plan.indices):
            item = pipe.items[index]
            seen[(item.path.name, item.window.start)] = batch["mask"][row, 0, :, 4, 4]
    # latent frame 0 is the window's first frame, then groups of four: frames 10-13 and 14-17 (16 and 17 white)
    assert torch.allclose(seen[("a.mp4", 9)], torch.tensor([0.0, 0.0, 0.5]), atol=0.05)
    assert torch.allclose(seen[("a.mp4", 0)], torch.zeros(3), atol=0.05)
    assert torch.allclose(seen[("b.mp4", 9)], torch.ones(3))


def test_clip_modules_stay_torch_free(tmp_path):
    folder = _mixed_folder(tmp_path)
    code = ("import sys; from omegaconf import OmegaConf; from trainer.config.schema import AtelierConfig;"
            "from trainer.data.report import build_report; from trainer.families import VideoSpec;"
            "cfg = OmegaConf.merge(OmegaConf.structured(AtelierConfig), {'data': {'resolution': '64', "
            "'max_upscale': 0, "
            f"'concepts': [{{'path': {str(folder)!r}, 'target_frames': '5'}}]}}}});"
            "r = build_report(cfg, video=VideoSpec()); assert r['clips'], r;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert clips.VIDEO_EXTENSIONS  # the module imports without av until a clip is read
