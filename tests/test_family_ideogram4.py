"""Ideogram 4 beyond the family contract: the pipeline's text features and packed transformer call (reversed clock,
negated velocity, a shorter text padding that changes no image token), latents in the pipeline's token order, the
sampler's guidance schedule, the single file back and forth, detection (an fp8 release's keys included), and the LoRA
file read by diffusers' converter and restated as ComfyUI adds it to the fused ``qkv``."""

from __future__ import annotations

import pytest
import torch

from conftest import denoiser_calls, load_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ideogram(tmp_path_factory):
    from trainer.families import build_tiny
    ws = tmp_path_factory.mktemp("ideogram4-ws")
    paths = build_tiny("tiny-ideogram4", ws / "models")
    model = load_tiny(ws, paths["diffusers"])
    model.max_sequence_length = 48  # shorter than the pipeline's padding below (512 by default)
    return ws, paths, model


def test_predict_is_the_pipelines_transformer_call_with_less_padding(ideogram):
    """The pipeline pads the text to 64 tokens here, Atelier to 48: the same features, and the same image tokens out."""
    ws, paths, model = ideogram
    pipe = model.pipeline(None)
    h, w = 4, 6  # non-square: a swapped axis would show
    noise = torch.randn(1, h * w, 32, generator=torch.Generator().manual_seed(0))
    calls, remove = denoiser_calls(model.transformer)
    try:
        with torch.no_grad():
            pipe("a red square", height=h * 4, width=w * 4, latents=noise, num_inference_steps=2, guidance_scale=3.0,
                 max_sequence_length=64, output_type="latent")
            ref = calls[1]["kwargs"]  # the second step: a σ below 1
            sigma = pipe.scheduler.sigmas[1:2]
            assert 0 < float(sigma) < 1
            torch.testing.assert_close(ref["timestep"], 1 - sigma)
            cond = model.batch_condition({"captions": ["a red square"]}, lambda c: c, set())
            n = int(cond.prompt_mask.sum())
            torch.testing.assert_close(cond.prompt_embeds[:, -n:], ref["encoder_hidden_states"][:, 64 - n:64])
            latents = ref["hidden_states"][:, 64:].transpose(1, 2).reshape(1, 32, h, w)
            pred = model.predict(latents, sigma, cond)
    finally:
        remove()
    want = -calls[1]["out"][:, 64:].transpose(1, 2).reshape(1, 32, h, w)
    torch.testing.assert_close(pred, want, atol=1e-5, rtol=1e-5)


def test_latents_are_the_pipelines_tokens_normalised_by_the_vae_batchnorm(ideogram):
    """What the pipeline decodes (tokens × BatchNorm std + mean, unpatchified) gives back the posterior's mean."""
    ws, paths, model = ideogram
    pixels = torch.rand(1, 3, 16, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1
    dist = model.encode_pixels(pixels)
    latents = model.sample_latents({"mean": dist["mean"], "std": torch.zeros_like(dist["std"])})
    vae = model.vae
    tokens = latents.flatten(2).transpose(1, 2)
    bn_mean = vae.bn.running_mean.view(1, 1, -1)
    bn_std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).view(1, 1, -1)
    z = (tokens * bn_std + bn_mean).view(1, 4, 6, 2, 2, 8).permute(0, 5, 1, 3, 2, 4).reshape(1, 8, 8, 12)
    with torch.no_grad():
        mean = vae.encode(pixels).latent_dist.mean
    torch.testing.assert_close(z, mean, atol=1e-5, rtol=1e-5)


def test_samples_take_the_pipelines_guidance_schedule_at_its_defaults(ideogram, monkeypatch):
    import diffusers
    ws, paths, model = ideogram
    seen = []
    monkeypatch.setattr(diffusers.Ideogram4Pipeline, "__call__", lambda self, *a, **kw: seen.append(kw))
    pipe = model.pipeline(None)
    pipe("a", guidance_scale=7.0, num_inference_steps=48, negative_prompt="blurry")
    pipe("a", guidance_scale=2.5, num_inference_steps=10)
    assert seen[0]["guidance_scale"] is None and "guidance_schedule" not in seen[0]  # the pipeline's own schedule
    assert "negative_prompt" not in seen[0]
    assert seen[1]["guidance_scale"] == 2.5 and seen[1]["guidance_schedule"] is None
    assert model.unconditional_transformer.device == torch.device("cpu")
