"""FLUX.1 Kontext [dev]: the Flux.1 dev transformer that edits an image, trained on pairs (a target, the control
image it was edited from, an instruction as caption).

The transformer's inputs are built as ``diffusers.FluxKontextPipeline`` (0.42.1) builds them, which is the ground
truth here:

- the control image's latents are the VAE posterior's mode (``retrieve_latents(..., sample_mode="argmax")``: the
  mean), normalised like the target's, ``(z − shift_factor) · scaling_factor``, packed 2×2 like the target and put
  *after* the target's tokens in the image sequence;
- their position ids are those of their own latent grid with the first coordinate set to 1 (the pipeline's
  ``image_ids[..., 0] = 1``); the target's keep 0;
- guidance is embedded as in Flux.1 dev, and the prediction is cut back to the target's tokens
  (``noise_pred[:, : latents.size(1)]``); the timestep shift follows the target's token count alone
  (``image_seq_len = latents.shape[1]``), as training's shift does.

The anchors' trainers agree on the sequence layout, the ids and the cut, and differ elsewhere:

- musubi-tuner (``flux_kontext_train_network.py``, 30c658c4) and ai-toolkit (``extensions_built_in/
  diffusion_models/flux_kontext``, 27a03a91) encode the control with a *sample* of the posterior (musubi's
  ``DiagonalGaussian(sample=True)``, ai-toolkit's ``latent_dist.sample()``); Atelier uses the mean, as the pipeline
  does at inference (the cached posterior's ``mean``: no noise the model never sees when it is used).
- ai-toolkit resizes every control to its target's size and copies the target's ids (it cannot take another size);
  musubi buckets the control with its target by default (``no_resize_control`` keeps its own size) and gives it
  ids of its own grid. Atelier renders the control at its target's bucket (``data.control_resolution`` empty) or
  at a budget with the target's aspect, and gives it its own grid's ids, as the pipeline and musubi do.
- Both feed guidance 1.0 while training (musubi fixed, ai-toolkit ``cfg_scale``'s default); diffusers'
  ``train_dreambooth_lora_flux_kontext.py`` feeds ``--guidance_scale`` (default 3.5), as its Flux.1 dev trainer and
  kohya's do. Atelier's ``model.guidance_scale`` defaults to 3.5 for Kontext as for Flux.1 dev (docs/families.md
  says why); 1.0 is a setting away.

Samples: the pipeline scales any ``width × height`` to ``max_area`` (default 1024²) and, with ``_auto_resize``, the
control to the nearest of its preferred ~1 MP sizes. Training saw the control at its target's size, so a sample's
control is fitted (centre crop to the aspect, then resized) to the sample's own ``width × height``, with
``max_area = width · height`` and ``_auto_resize = False``: the sample is drawn at the size asked, from the control
at the size training gave it (ai-toolkit's sampler does the same; musubi samples with ``resize_to_prefered=False``).
With ``data.control_resolution`` set, training's controls had that budget instead; samples keep the sample's size.

ComfyUI (comfyanonymous/ComfyUI 3cd7b32f, 2026-01-07): model detection tells Kontext from Flux.1 dev by nothing
(the same keys and shapes: ``image_model: flux``, ``guidance_embed``), its ``ReferenceLatent`` conditioning puts the
reference after the image tokens with index 1 and no offset for the first reference (``comfy/ldm/flux/model.py``),
and ``comfy/lora.py`` maps LoRA keys for every ``model_base.Flux`` alike: a Kontext LoRA uses Flux.1's keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from diffusers import FluxKontextPipeline
from PIL import Image, ImageOps

from trainer.errors import ConfigError
from trainer.families.common.packed_ids import latent_image_ids

VARIANT = "flux-kontext"


def control_latents(batch: Dict[str, Any], vae_config: Any, device: Any) -> torch.Tensor:
    """The batch's control latents for the denoiser: the first control folder's posterior mean [B, 16, h', w'],
    normalised as the pipeline normalises the encoded image. Raises ValueError when the batch has none."""
    controls = batch.get("control_latents") or []
    if not controls:
        raise ValueError("FLUX.1 Kontext trains on pairs, but this batch has no control images: give every concept "
                         "one control folder (data.concepts.N.control_paths) whose images pair with its own by name.")
    mean = controls[0]["mean"].to(device)
    shift = getattr(vae_config, "shift_factor", None) or 0.0
    return (mean - shift) * vae_config.scaling_factor


def pack_with_control(packed: torch.Tensor, img_ids: torch.Tensor, control: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The target's packed tokens [B, N, 64] and ids [N, 3] followed by the control's, as ``FluxKontextPipeline``
    concatenates them (``torch.cat([latents, image_latents], dim=1)``; ids with their first coordinate 1)."""
    b, c, h, w = control.shape
    if h % 2 or w % 2:
        raise ValueError(f"Flux packs 2×2 latent patches: control latents of {h}×{w} must be even")
    tokens = FluxKontextPipeline._pack_latents(control, b, c, h, w)
    ids = latent_image_ids(h // 2, w // 2, control.device, img_ids.dtype)
    ids[..., 0] = 1
    return torch.cat([packed, tokens.to(packed.dtype)], dim=1), torch.cat([img_ids, ids], dim=0)


def sample_control(sample_prompt: Any, multiple: int) -> Optional[Dict[str, Any]]:
    """``FluxKontextPipeline`` arguments for one sample prompt: its first control image (a path, relative to the
    current folder) fitted to the sample's size (floored to ``multiple``, as the pipeline floors it), that size as
    ``max_area`` and no resize to the pipeline's preferred sizes (see the module docstring). None without one."""
    paths = [str(p) for p in (getattr(sample_prompt, "control_images", None) or []) if str(p).strip()]
    if not paths:
        return None
    asked_w, asked_h = int(sample_prompt.width), int(sample_prompt.height)
    width, height = asked_w // multiple * multiple, asked_h // multiple * multiple
    try:
        with Image.open(Path(paths[0]).expanduser()) as img:
            image = ImageOps.fit(img.convert("RGB"), (width, height), Image.Resampling.LANCZOS)
    except OSError as exc:
        raise ConfigError(f"sampling.prompts control image '{paths[0]}' could not be read ({exc}). Give the image "
                          "the sample edits.", key="sampling.prompts", value=paths[0]) from None
    # max_area of the size asked: the pipeline's sqrt(max_area · aspect) gives that width back, then floors it
    return {"image": image, "max_area": asked_w * asked_h, "_auto_resize": False}
