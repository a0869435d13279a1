"""Inpainting models (9-channel UNets) on the tiny inpainting variants: detection and loading (single
files without model.config_path too), random masks, exact masked-image latents with the latent cache
(cached == uncached, for data, random and both masks; invalidation; several processes), LoRA runs that
sample with an inpainting pipeline, and a masked run whose loss reaches the model's prediction only
inside the mask."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image

from trainer.config.checks import load_config
from trainer.events import read_events

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"


from conftest import train_quiet  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # see conftest.py


@pytest.fixture(scope="module")
def ws(tiny_workspace) -> Path:
    from trainer.families.common.sd_kit.tiny import ensure_tiny_model
    for kind in ("tiny-sd-inpaint", "tiny-sdxl-inpaint"):
        ensure_tiny_model(kind, tiny_workspace / "models")
    return tiny_workspace


@pytest.fixture(scope="module")
def masked_data(tmp_path_factory) -> Path:
    """The demo shapes, each with a mask whose left half is white (focus / repaint)."""
    data = tmp_path_factory.mktemp("masked-data")
    for img in sorted(DEMO_DATA.glob("*.png")):
        shutil.copy(img, data / img.name)
        shutil.copy(img.with_suffix(".txt"), data / img.with_suffix(".txt").name)
        w, h = Image.open(img).size
        mask = Image.new("L", (w, h), 0)
        mask.paste(255, (0, 0, w // 2, h))
        mask.save(data / f"{img.stem}-masklabel.png")
    return data




def test_tiny_inpaint_models_are_detected_and_load_as_inpainting(ws):
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

    from trainer.families.sources import load_model
    from trainer.families.common.sd_kit.sd_configs import detect_family
    for kind, family, pipe_cls in (("tiny-sd-inpaint", "sd15", StableDiffusionInpaintPipeline),
                                   ("tiny-sdxl-inpaint", "sdxl", StableDiffusionXLInpaintPipeline)):
        assert detect_family(ws / "models" / kind) == f"{family}-inpaint"
        assert detect_family(ws / "models" / f"{kind}.safetensors") == f"{family}-inpaint"
        cfg = load_config(preset="demo", overrides=[f"model.path=builtin:{kind}"])
        model = load_model(cfg.model, str(ws))
        assert model.inpainting and model.family == family and model.unet.config.in_channels == 9
        assert type(model.pipeline("euler")) is pipe_cls
    # the text-to-image models are not inpainting ones
    assert not load_model(load_config(preset="demo").model, str(ws)).inpainting


# --------------------------------------------------------------------------------------------------
# single-file inpainting checkpoints load without model.config_path
# --------------------------------------------------------------------------------------------------

@pytest.fixture()
def tiny_shipped_configs(ws, monkeypatch, tmp_path) -> Path:
    """The shipped configs describe the real (GB-sized) models; for tiny checkpoints the same code runs
    on tiny stand-ins: sd15, sd2-base and sdxl folders holding the tiny models' configs (sd2-base made
    epsilon like the real one), in place of trainer/families/common/sd_kit/configs."""
    import json

    from trainer.families.common.sd_kit import sd_configs
    root = tmp_path / "shipped"
    for name, kind in (("sd15", "tiny-sd"), ("sd2-base", "tiny-sd2"), ("sdxl", "tiny-sdxl")):
        src = ws / "models" / kind
        for f in src.rglob("*.json"):
            dst = root / name / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    sched = root / "sd2-base" / "scheduler" / "scheduler_config.json"
    sched.write_text(json.dumps({**json.loads(sched.read_text()), "prediction_type": "epsilon"}))
    monkeypatch.setattr(sd_configs, "CONFIGS_DIR", root)
    return root


def _nine_channel_sd2_file(path: Path) -> tuple:
    """A tiny SD 2 inpainting checkpoint (the tiny SD 2 with a 9-channel UNet) in the original layout."""
    from diffusers import UNet2DConditionModel

    from trainer.families.common.sd_kit.keys import save_single_file_sd
    from trainer.families.common.sd_kit.tiny import build_tiny_pipeline
    pipe = build_tiny_pipeline("tiny-sd2")
    torch.manual_seed(5)
    unet = UNet2DConditionModel.from_config({**pipe.unet.config, "in_channels": 9})
    save_single_file_sd(path, unet, pipe.vae, pipe.text_encoder, family="sd2", dtype="fp32")
    return unet, pipe.vae


def test_single_file_inpainting_checkpoints_load_without_config_path(ws, tiny_shipped_configs, tmp_path):
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

    from trainer.families.sources import load_model
    from trainer.families.common.sd_kit.sd_configs import detect_family
    sd2_file = tmp_path / "tiny-sd2-inpaint.safetensors"
    sd2_unet, _ = _nine_channel_sd2_file(sd2_file)
    cases = [  # (file, detected, family, config used, pipeline, prediction type, weights to compare)
        (ws / "models" / "tiny-sd-inpaint.safetensors", "sd15-inpaint", "sd15", StableDiffusionInpaintPipeline,
         "epsilon", ws / "models" / "tiny-sd-inpaint"),
        (sd2_file, "sd2-inpaint", "sd2", StableDiffusionInpaintPipeline, "epsilon", sd2_unet),
        (ws / "models" / "tiny-sdxl-inpaint.safetensors", "sdxl-inpaint", "sdxl", StableDiffusionXLInpaintPipeline,
         "epsilon", ws / "models" / "tiny-sdxl-inpaint"),
    ]
    workspace = tmp_path / "ws"
    for path, detected, family, pipe_cls, prediction, reference in cases:
        assert detect_family(path) == detected
        cfg = load_config(preset="demo-sdxl" if family == "sdxl" else "demo", overrides=[f"model.path={path}"])
        assert cfg.model.config_path == ""
        model = load_model(cfg.model, str(workspace))
        assert model.source.kind == "single_file"
        assert model.inpainting and model.family == family and model.unet.config.in_channels == 9, detected
        assert model.prediction_type == prediction  # SD 2 inpainting: the 512 epsilon config, not the 768 v one
        assert type(model.pipeline("euler")) is pipe_cls
        # the materialised config is the base's with a 9-channel UNet and the inpainting pipeline class
        folder = workspace / "cache" / "configs" / detected
        assert pipe_cls.load_config(str(folder))["_class_name"] == pipe_cls.__name__
        # every weight is the file's, the 9-channel input conv included
        if isinstance(reference, Path):
            reference = pipe_cls.from_pretrained(reference, local_files_only=True).unet
        want, got = reference.state_dict(), model.unet.state_dict()
        assert want.keys() == got.keys() and got["conv_in.weight"].shape[1] == 9
        assert all(torch.equal(want[k], got[k]) for k in want), detected
    # model.family names base families only; a forced one still finds the inpainting UNet in the file
    forced = load_model(load_config(preset="demo", overrides=[f"model.path={cases[0][0]}", "model.family=sd15"]).model,
                        str(workspace))
    assert forced.inpainting and forced.family == "sd15"
    # a 4-channel file still loads as a text-to-image model
    plain_cfg = load_config(preset="demo", overrides=[f"model.path={ws / 'models' / 'tiny-sd.safetensors'}"])
    plain = load_model(plain_cfg.model, str(workspace))
    assert not plain.inpainting and plain.unet.config.in_channels == 4 and plain.family == "sd15"
    assert type(plain.pipeline("euler")).__name__ == "StableDiffusionPipeline"


# --------------------------------------------------------------------------------------------------
# the latent cache keeps what the masked-image latents need: cached == uncached
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def inpaint_model(ws):
    from trainer.families.sources import load_model
    return load_model(load_config(preset="demo", overrides=["model.path=builtin:tiny-sd-inpaint"]).model, str(ws))


@pytest.fixture()
def varied_masks(tmp_path) -> Path:
    """The demo shapes, each with its own rectangle mask (one image has none)."""
    data = tmp_path / "varied"
    data.mkdir()
    for i, img in enumerate(sorted(DEMO_DATA.glob("*.png"))):
        shutil.copy(img, data / img.name)
        shutil.copy(img.with_suffix(".txt"), data / img.with_suffix(".txt").name)
        if i == 3:
            continue
        w, h = Image.open(img).size
        mask = Image.new("L", (w, h), 0)
        mask.paste(255, (4 * i, 2 * i, 4 * i + 24, 2 * i + 30))
        mask.save(data / f"{img.stem}-masklabel.png")
    return data


def _inpaint_pipeline(model, ws, data, cache: bool, *settings: str):
    from trainer.data.pipeline import DataPipeline
    cfg = load_config(preset="demo", overrides=[
        f"general.workspace={ws}", f"data.cache_dir={data.parent / 'cache'}", f"data.concepts.0.path={data}",
        f"data.cache_latents={str(cache).lower()}", "general.dataloader_workers=0", *settings])
    pipe = DataPipeline(cfg, warn=lambda m: None)
    summary = pipe.prepare(model.encode_pixels, model.fingerprint(), "fp32", inpaint_fn=model.encode_masked_images)
    return pipe, summary


def _inputs(model, pipe, mode: str):
    """The UNet's 9-channel inputs for an epoch's batches, same noise and generator for every pipeline."""
    model.inpainting_mask = mode
    out = []
    for bi, batch in pipe.iter_batches(0, 0, 4):
        gen = torch.Generator().manual_seed(100 + bi)
        noisy = torch.randn(batch["latent_dist"]["mean"].shape, generator=gen)
        out.append((batch, model.inpaint_input(noisy, batch, gen, warn=pytest.fail)))
    return out


@pytest.mark.parametrize("mode", ["data", "random", "both"])
def test_cached_masked_image_latents_equal_uncached(inpaint_model, ws, varied_masks, mode):
    model = inpaint_model
    settings = ("data.masks=true",) if mode != "random" else ()
    cached, summary = _inpaint_pipeline(model, ws, varied_masks, True, *settings)
    assert summary["latents_encoded"] == 8
    fresh, _ = _inpaint_pipeline(model, ws, varied_masks, False, *settings)
    got, want = _inputs(model, cached, mode), _inputs(model, fresh, mode)
    assert len(got) == len(want) == 4
    for (cb, c), (fb, f) in zip(got, want):
        assert cb["captions"] == fb["captions"]
        assert torch.equal(cb["inpaint_pixels"], fb["inpaint_pixels"])  # uint8 in the cache: lossless
        assert ("masked_mean" in cb) == (mode != "random") and "masked_mean" not in fb
        assert c.shape == f.shape and c.shape[1] == 9
        assert torch.equal(c[:, 4:5], f[:, 4:5])  # the same masks
        assert (c[:, 4:5] == 0).any() and (c[:, 4:5] == 1).any()
        torch.testing.assert_close(c[:, 5:], f[:, 5:], rtol=0, atol=1e-5)  # masked-image latents
    # and a different mask really changes them (the comparison is not vacuous)
    if mode == "data":
        assert (got[0][1][:, 5:] - _inputs(model, cached, "random")[0][1][:, 5:]).abs().max() > 1e-3


def test_changed_mask_or_image_re_encodes_the_inpainting_cache(inpaint_model, ws, varied_masks):
    model = inpaint_model
    _, first = _inpaint_pipeline(model, ws, varied_masks, True, "data.masks=true")
    _, again = _inpaint_pipeline(model, ws, varied_masks, True, "data.masks=true")
    assert (first["latents_encoded"], again["latents_encoded"], again["latents_reused"]) == (8, 0, 8)
    # another mask for one image, a repainted other image: just those two are encoded again
    mask = varied_masks / "00-red-square-masklabel.png"
    Image.new("L", Image.open(mask).size, 255).save(mask)
    img = varied_masks / "05-green-circle.png"
    Image.new("RGB", Image.open(img).size, (10, 200, 250)).save(img)
    cached, summary = _inpaint_pipeline(model, ws, varied_masks, True, "data.masks=true")
    assert (summary["latents_encoded"], summary["latents_reused"]) == (2, 6)
    fresh, _ = _inpaint_pipeline(model, ws, varied_masks, False, "data.masks=true")
    for (_, c), (_, f) in zip(_inputs(model, cached, "data"), _inputs(model, fresh, "data")):
        assert torch.equal(c[:, 4:5], f[:, 4:5])
        torch.testing.assert_close(c[:, 5:], f[:, 5:], rtol=0, atol=1e-5)


def test_inpaint_input_splits_over_processes_like_one_process(inpaint_model, ws, varied_masks):
    """Several processes: each has its rows of the global batch (``global_rows``) and draws the random
    masks for all rows from the shared generator; together they build the one-process input."""
    model = inpaint_model
    model.inpainting_mask = "both"
    pipe, _ = _inpaint_pipeline(model, ws, varied_masks, True, "data.masks=true")
    _, batch = next(iter(pipe.iter_batches(0, 0, 1)))
    noisy = torch.randn(batch["latent_dist"]["mean"].shape, generator=torch.Generator().manual_seed(1))
    whole = model.inpaint_input(noisy, batch, torch.Generator().manual_seed(7))
    n = noisy.shape[0]
    for lo in range(n):
        part = {k: (v[lo:lo + 1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        part["latent_dist"] = {k: v[lo:lo + 1] for k, v in batch["latent_dist"].items()}
        part["global_rows"] = (lo, lo + 1, n)
        mine = model.inpaint_input(noisy, part, torch.Generator().manual_seed(7))
        assert mine.shape == whole.shape
        assert torch.equal(mine[lo:lo + 1, :5], whole[lo:lo + 1, :5])
        torch.testing.assert_close(mine[lo:lo + 1, 5:], whole[lo:lo + 1, 5:], rtol=0, atol=1e-5)


def test_random_masks_are_deterministic_and_varied():
    from trainer.families.common.sd_kit.inpaint import random_masks
    a = random_masks(16, 64, 48, torch.Generator().manual_seed(3))
    b = random_masks(16, 64, 48, torch.Generator().manual_seed(3))
    assert a.shape == (16, 1, 64, 48) and torch.equal(a, b)
    assert set(a.unique().tolist()) <= {0.0, 1.0}
    covered = a.mean(dim=(1, 2, 3))
    assert (covered == 1).any() and ((covered > 0) & (covered < 1)).sum() >= 8


def test_inpaint_lora_run_trains_and_samples_with_image_and_mask(ws, masked_data):
    image = masked_data / "00-red-square.png"
    mask = masked_data / "00-red-square-masklabel.png"
    sample = f"[{{prompt: 'a blue circle', steps: 2, width: 64, height: 64, image: '{image}', mask: '{mask}'}}]"
    run = train_quiet(ws, "inp-lora", "demo", "model.path=builtin:tiny-sd-inpaint", "data.cache_latents=false",
                 f"data.concepts.0.path={masked_data}", "data.masks=true", "model.inpainting_mask=both",
                 "training.max_steps=3", f"sampling.prompts={sample}", "sampling.every_n_epochs=0")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished", events[-1]
    losses = [e["loss"] for e in events if e["type"] == "step"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert not [e for e in events if e["type"] == "warning" and "not exact" in e["message"]]
    samples = [p for e in events if e["type"] == "sample" for p in e["paths"]]
    assert samples and all(Path(p).exists() for p in samples)
    # the LoRA loads into diffusers' inpainting pipeline and changes its output
    from diffusers import StableDiffusionInpaintPipeline
    pipe = StableDiffusionInpaintPipeline.from_pretrained(ws / "models" / "tiny-sd-inpaint", local_files_only=True,
                                                          safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)

    def paint():
        return pipe("a blue circle", image=Image.open(image).convert("RGB"), mask_image=Image.open(mask),
                    num_inference_steps=2, width=64, height=64, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images[0]
    before = paint()
    pipe.load_lora_weights(str(run / "inp-lora.safetensors"))
    assert abs(paint() - before).max() > 1e-5


def test_sdxl_inpaint_lora_with_cached_latents_trains_exactly(ws, tmp_path):
    """With the latent cache on, the cache entries keep the pixels, so no approximation (no warning)."""
    from safetensors import safe_open
    run = train_quiet(ws, "xlinp", "demo-sdxl", "model.path=builtin:tiny-sdxl-inpaint", "training.max_steps=2",
                      f"data.cache_dir={tmp_path / 'cache'}", "data.cache_latents=true",
                      "sampling.prompts=[{prompt: 'a red square', steps: 2, width: 64, height: 64}]",
                      "sampling.every_n_epochs=0")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished", events[-1]
    assert not [e for e in events if e["type"] == "warning" and "not exact" in e["message"]]
    assert [e for e in events if e["type"] == "sample"]
    entries = sorted((tmp_path / "cache" / "latents").glob("*/*.safetensors"))
    assert len(entries) == 8
    with safe_open(str(entries[0]), framework="pt") as f:
        assert set(f.keys()) == {"mean", "std", "pixels_u8"}
        assert f.get_slice("pixels_u8").get_dtype() == "U8" and f.get_slice("pixels_u8").get_shape() == [3, 64, 64]


def test_masked_inpaint_training_reaches_the_prediction_only_inside_the_mask(ws, masked_data, tmp_path):
    """``loss`` masked (unmasked_weight 0, never unmasked) with data masks: the gradient of the loss
    w.r.t. the model's prediction is zero wherever the mask is zero, and not inside it — so an
    optimizer step moves the prediction only through the masked region's error."""
    from trainer.train.setup import setup
    from trainer.train.state import RunState
    from trainer.train.step import forward_loss
    cfg = load_config(preset="demo", overrides=[
        f"general.workspace={ws}", "general.tensorboard=false", "model.path=builtin:tiny-sd-inpaint",
        f"data.concepts.0.path={masked_data}", "data.masks=true", "data.cache_latents=false",
        "model.inpainting_mask=data", "loss.unmasked_weight=0", "loss.unmasked_probability=0",
        "training.max_steps=1", "sampling.prompts=[]"])
    trainer = RunState(cfg, tmp_path / "run", progress=False)
    setup(trainer)
    _, batch = next(iter(trainer.data.iter_batches(0, 0, 1)))
    model = trainer.model
    seen = {}
    original_predict = model.predict

    def predict(noisy, timesteps, cond):
        seen["input"] = noisy.detach()
        pred = original_predict(noisy, timesteps, cond)
        pred.retain_grad()
        seen["pred"] = pred
        return pred

    model.predict = predict
    try:
        forward_loss(trainer, batch).backward()
    finally:
        model.predict = original_predict
    grad = seen["pred"].grad.abs().sum(dim=1, keepdim=True)  # [B, 1, h, w]
    mask = batch["mask"]
    assert (grad[mask == 0] == 0).all()
    assert (grad[mask == 1] > 0).all()
    # the UNet's mask channel is the image's own mask (left half), binarised
    unet_mask = seen["input"][:, 4:5]
    assert torch.equal(unet_mask, (mask > 0.5).float().to(unet_mask.dtype))


def test_inpaint_finetune_saves_an_inpainting_diffusers_folder(ws):
    run = train_quiet(ws, "inp-ft", "demo", "model.path=builtin:tiny-sd-inpaint", "data.cache_latents=false",
                 "training.method=finetune", "training.max_steps=1", "output.format=diffusers",
                 "sampling.prompts=[]")
    from diffusers import StableDiffusionInpaintPipeline
    pipe = StableDiffusionInpaintPipeline.from_pretrained(run / "inp-ft", local_files_only=True)
    original = StableDiffusionInpaintPipeline.from_pretrained(ws / "models" / "tiny-sd-inpaint", local_files_only=True)
    assert pipe.unet.config.in_channels == 9
    got, orig = pipe.unet.state_dict(), original.unet.state_dict()
    assert any(not torch.equal(got[k], orig[k]) for k in got)
