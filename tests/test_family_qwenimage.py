"""Qwen-Image beyond the family contract: text features and latents as the pipeline makes them, true CFG in
samples, the transformer as one file, what validate refuses."""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("qwen-ws")
    return ws, build_tiny("tiny-qwen-image", ws / "models")


def test_text_features_latents_and_guidance_are_the_pipelines(qwen):
    ws, paths = qwen
    model = load_tiny(ws, paths["diffusers"])
    caption = "a red square on a white background"
    sampler = model.pipeline(None)
    features, mask = sampler.encode_prompt(caption, device="cpu")
    real = features.shape[1] if mask is None else int(mask.sum())
    cond = model.batch_condition({"captions": [caption]}, lambda c: c, set())
    assert int(cond.prompt_mask[0].sum()) == real
    torch.testing.assert_close(cond.prompt_embeds[0, :real], features[0, :real])
    # the training latent is what the pipeline's decode turns back: z = latent · std + mean
    pixels = torch.rand(1, 3, 64, 64) * 2 - 1
    dist = model.encode_pixels(pixels)
    latent = model.sample_latents(dist, torch.Generator().manual_seed(0))
    c = model.vae.config
    z = latent * torch.tensor(c.latents_std).view(1, -1, 1, 1) + torch.tensor(c.latents_mean).view(1, -1, 1, 1)
    eps = torch.randn(dist["mean"].shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(z, dist["mean"] + dist["std"] * eps, atol=1e-5, rtol=1e-5)
    # cfg_scale drives the pipeline's true CFG
    images = [sampler(caption, guidance_scale=g, num_inference_steps=2, width=64, height=64, output_type="np",
                      generator=torch.Generator().manual_seed(0), **model.sampling_kwargs()).images[0] for g in (1.0, 6.0)]
    assert abs(images[0] - images[1]).max() > 1e-4


def test_the_transformer_alone_loads_and_fine_tunes_save_back_to_it(qwen, tmp_path):
    ws, paths = qwen
    folder = load_tiny(ws, paths["diffusers"])
    with torch.no_grad():
        folder.transformer.transformer_blocks[0].attn.to_k.weight.add_(0.5)
    out = tmp_path / "qwen-ft.safetensors"
    folder.save_single_file(out, "fp32", {})
    again = load_tiny(ws, out, f"model.config_path={paths['diffusers']}")
    assert again.family == "qwen-image"
    for k, v in folder.transformer.state_dict().items():
        torch.testing.assert_close(again.transformer.state_dict()[k], v, msg=k)


def test_edit_pipelines_are_refused(tmp_path):
    import json

    from trainer.errors import ModelLoadError
    folder = tmp_path / "edit"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPipeline"}))
    with pytest.raises(ModelLoadError, match="QwenImageEditPipeline") as err:
        load_tiny(tmp_path, folder)
    assert err.value.key == "model.path"


@pytest.mark.parametrize("setting, key", [("training.train_text_encoder=true", "parts.text_encoder_1.train"),
                                          ("loss.min_snr_gamma=5", "loss.min_snr_gamma")])
def test_validate_refuses_what_qwen_image_cannot_use(setting, key):
    from trainer.config.checks import load_config
    from trainer.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=builtin:tiny-qwen-image", setting])
    assert err.value.key == key, str(err.value)
