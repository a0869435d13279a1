"""Inpainting models (9-channel UNets) on the tiny inpainting variants: detection and loading, random
masks, LoRA runs that sample with an inpainting pipeline, and a masked run whose loss reaches the
model's prediction only inside the mask."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image

from trainer.__main__ import main as cli
from trainer.config import load_config
from trainer.events import read_events

ROOT = Path(__file__).resolve().parent.parent
DEMO_DATA = ROOT / "presets" / "demo-data"


from conftest import train_quiet  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def ws(tiny_workspace) -> Path:
    from trainer.models.tiny import ensure_tiny_model
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

    from trainer.models.base import load_model
    from trainer.models.sd_configs import detect_family
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


def test_single_file_inpainting_needs_a_config_folder(ws):
    from trainer.models.base import ModelLoadError, load_model
    cfg = load_config(preset="demo", overrides=[f"model.path={ws / 'models' / 'tiny-sd-inpaint.safetensors'}"])
    with pytest.raises(ModelLoadError, match="model.config_path"):
        load_model(cfg.model, str(ws))


def test_random_masks_are_deterministic_and_varied():
    from trainer.models.inpaint import random_masks
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
    assert not [e for e in events if e["type"] == "warning" and "cached latents" in e["message"]]
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


def test_sdxl_inpaint_lora_with_cached_latents_warns_and_trains(ws):
    run = train_quiet(ws, "xlinp", "demo-sdxl", "model.path=builtin:tiny-sdxl-inpaint", "training.max_steps=2",
                 "sampling.prompts=[{prompt: 'a red square', steps: 2, width: 64, height: 64}]",
                 "sampling.every_n_epochs=0")
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "finished", events[-1]
    assert [e for e in events if e["type"] == "warning" and "cached latents" in e["message"]]
    assert [e for e in events if e["type"] == "sample"]


def test_masked_inpaint_training_reaches_the_prediction_only_inside_the_mask(ws, masked_data, tmp_path):
    """``loss`` masked (unmasked_weight 0, never unmasked) with data masks: the gradient of the loss
    w.r.t. the model's prediction is zero wherever the mask is zero, and not inside it — so an
    optimizer step moves the prediction only through the masked region's error."""
    from trainer.loop import Trainer
    cfg = load_config(preset="demo", overrides=[
        f"general.workspace={ws}", "general.tensorboard=false", "model.path=builtin:tiny-sd-inpaint",
        f"data.concepts.0.path={masked_data}", "data.masks=true", "data.cache_latents=false",
        "model.inpainting_mask=data", "loss.unmasked_weight=0", "loss.unmasked_probability=0",
        "training.max_steps=1", "sampling.prompts=[]"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainer.setup()
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
        trainer._forward_loss(batch).backward()
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
