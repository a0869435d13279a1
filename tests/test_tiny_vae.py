"""The built-in tiny models' VAEs are a near identity (8× average pool / nearest upscale), so a sample shows
what the tiny denoiser learned and the demo's latents are small pictures of its images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from conftest import DEMO_DATA

pytestmark = pytest.mark.usefixtures("one_thread")


def demo_images(size: int = 64) -> torch.Tensor:
    arrays = [np.asarray(Image.open(p).convert("RGB").resize((size, size)), dtype=np.float32) / 127.5 - 1
              for p in sorted(DEMO_DATA.glob("*.png"))]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)


@pytest.mark.parametrize("kind", ["tiny-sd", "tiny-sdxl"])
def test_tiny_vae_pools_and_upscales_the_demo_images(tiny_workspace, kind):
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(tiny_workspace / "models" / kind, subfolder="vae")
    x = demo_images()
    pooled = F.avg_pool2d(x, 8)
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
        latents = dist.sample() * vae.config.scaling_factor
        decoded = vae.decode(latents / vae.config.scaling_factor).sample
    assert float(dist.std.max()) < 1e-5  # deterministic: a sample is the mean
    assert (latents[:, :3] - pooled).abs().max() < 0.01  # a latent pixel is the mean colour of its 8×8 patch
    assert latents[:, 3:].abs().max() < 1e-4
    assert (decoded - F.interpolate(pooled, scale_factor=8)).abs().max() < 0.01
    # the shapes are there: a red square's patch is red, the background white
    red = latents[0, :3, 3, 3]
    assert red[0] > 0.5 and red[1] < -0.3 and red[2] < -0.3 and latents[0, :3, 0, 0].min() > 0.5


def test_tiny_vae_survives_bf16_and_the_single_file(tiny_workspace):
    from diffusers import StableDiffusionPipeline
    folder = tiny_workspace / "models" / "tiny-sd"
    single = StableDiffusionPipeline.from_single_file(
        str(tiny_workspace / "models" / "tiny-sd.safetensors"), config=str(folder), local_files_only=True,
        safety_checker=None)
    x = demo_images()
    with torch.no_grad():
        want = F.interpolate(F.avg_pool2d(x, 8), scale_factor=8)
        vae = single.vae
        got = vae.decode(vae.encode(x).latent_dist.mean).sample
        assert (got - want).abs().max() < 0.01
        vae = vae.to(torch.bfloat16)
        got16 = vae.decode(vae.encode(x.to(torch.bfloat16)).latent_dist.mean).sample.float()
    assert (got16 - want).abs().max() < 0.1
