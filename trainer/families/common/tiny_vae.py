"""A tiny ``AutoencoderKL`` set by hand to be close to an identity (for the built-in tiny models).

Why: a tiny VAE with random weights turns every image into colour noise and back, so the offline
demo's samples stayed noise however well its tiny denoiser learned, and its latents carried no image
structure to learn. With these weights the encoder is an average pool (each latent pixel holds the mean
colour of its ``f×f`` patch, ``f`` the VAE's downscale) and the decoder a nearest-neighbour upscale, so a
latent *is* a small picture: the demo's samples turn from noise into its shapes and colours as the
denoiser learns, and a test can tell whether they did.

How, in diffusers' own ``AutoencoderKL`` layers (the file keeps the real layout and loads anywhere):

- every ResNet block's second conv and every attention's output projection are zero, so those blocks
  pass their input through (a block that changes width passes it through its 1×1 shortcut);
- a down-sampler's 3×3 stride-2 conv averages its 2×2 patch; an up-sampler's conv is the identity
  after the nearest-neighbour resize;
- the colour channels travel as pairs (+c, −c) at a scale ``s`` = 1e-4, so the closing GroupNorm (whose
  groups hold both halves of a pair: zero group mean) divides by ``sqrt(var + eps)`` with ``var`` far below
  ``eps`` = 1e-6, i.e. by a constant: linear, not a per-image normalisation;
- the norm's affine lifts the pair to ``4 ± c`` where SiLU is nearly linear, and the next conv takes half
  the difference (SiLU's even part cancels), divided by SiLU's slope at 4;
- latent = colour / ``scaling_factor`` + ``shift_factor`` (so scaled latents are the colours in [-1, 1]),
  log-variance −30 (a deterministic encoder); the unused latent channels are zero.
"""

from __future__ import annotations

import math

import torch

_SCALE = 1e-4  # the pairs' size before a closing GroupNorm (var ≤ 1e-8 ≪ eps = 1e-6)
_LIFT = 4.0  # where the pairs sit on SiLU: nearly linear, and coarse enough for bf16 (spacing 1/32)


def _silu_slope(z: float) -> float:
    sig = 1.0 / (1.0 + math.exp(-z))
    return sig + z * sig * (1.0 - sig)


def make_identity_vae(vae) -> None:
    """Set the weights of a diffusers ``AutoencoderKL`` (Down/UpEncoderBlock2D layout, RGB) in place.

    Needs at least 6 channels at both ends and GroupNorm groups of an even number of channels."""

    cfg = vae.config
    colours = 3
    if cfg.in_channels != colours or cfg.out_channels != colours or cfg.latent_channels < colours:
        raise ValueError("make_identity_vae needs an RGB autoencoder with ≥ 3 latent channels")
    scale = float(cfg.scaling_factor or 1.0)
    shift = float(getattr(cfg, "shift_factor", None) or 0.0)
    enc, dec = vae.encoder, vae.decoder
    for norm in (enc.conv_norm_out, dec.conv_norm_out):
        per_group = norm.num_channels // norm.num_groups
        if norm.num_channels < 2 * colours or per_group % 2:
            raise ValueError(f"make_identity_vae: a closing GroupNorm of {norm.num_channels} channels in "
                             f"{norm.num_groups} groups cannot hold (+c, -c) pairs")

    def centre(conv, out_ch: int, in_ch: int, value: float) -> None:
        k = conv.weight.shape[-1] // 2
        conv.weight[out_ch, in_ch, k, k] = value

    def identity(conv) -> None:  # a conv that passes min(in, out) channels through unchanged
        for c in range(min(conv.in_channels, conv.out_channels)):
            centre(conv, c, c, 1.0)

    def pass_through(block) -> None:
        for resnet in getattr(block, "resnets", []):
            if resnet.conv_shortcut is not None:
                identity(resnet.conv_shortcut)
        for down in getattr(block, "downsamplers", None) or []:
            for c in range(down.conv.out_channels):  # stride 2, padded (0, 1, 0, 1): taps 0..1 of 3
                down.conv.weight[c, c, 0:2, 0:2] = 0.25
        for up in getattr(block, "upsamplers", None) or []:
            identity(up.conv)

    def closing(norm) -> None:
        norm.weight.fill_(math.sqrt(norm.eps) / _SCALE)
        norm.bias.fill_(_LIFT)

    gain = 0.5 / _silu_slope(_LIFT)
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        # encoder: RGB → pairs at _SCALE → pooled → lifted → (colour / scale + shift, logvar -30)
        for c in range(colours):
            centre(enc.conv_in, 2 * c, c, _SCALE)
            centre(enc.conv_in, 2 * c + 1, c, -_SCALE)
        for block in list(enc.down_blocks) + [enc.mid_block]:
            pass_through(block)
        closing(enc.conv_norm_out)
        latent = cfg.latent_channels
        for c in range(colours):
            centre(enc.conv_out, c, 2 * c, gain / scale)
            centre(enc.conv_out, c, 2 * c + 1, -gain / scale)
        enc.conv_out.bias[:latent] = shift
        if enc.conv_out.out_channels == 2 * latent:
            enc.conv_out.bias[latent:] = -30.0
        for conv in (getattr(vae, "quant_conv", None), getattr(vae, "post_quant_conv", None)):
            if conv is not None:
                identity(conv)
        # decoder: latent → colour pairs at _SCALE → upscaled → lifted → RGB
        for c in range(colours):
            centre(dec.conv_in, 2 * c, c, _SCALE * scale)
            centre(dec.conv_in, 2 * c + 1, c, -_SCALE * scale)
            dec.conv_in.bias[2 * c] = -_SCALE * scale * shift
            dec.conv_in.bias[2 * c + 1] = _SCALE * scale * shift
        for block in [dec.mid_block] + list(dec.up_blocks):
            pass_through(block)
        closing(dec.conv_norm_out)
        for c in range(colours):
            centre(dec.conv_out, c, 2 * c, gain)
            centre(dec.conv_out, c, 2 * c + 1, -gain)
