"""Flux.2's reference images, built for the transformer as ``Flux2Pipeline`` and ``Flux2KleinPipeline`` build them.

What the pipelines do with ``image=`` (one image or a list; diffusers 0.42.1, ``pipeline_flux2.py`` and
``pipeline_flux2_klein.py``, the same code in both):

1. each reference over 1024² px is resized to 1024² px with its own aspect ratio, then centre-cropped to sides that
   are multiples of 16 (the VAE's 8 × the 2×2 patch); a smaller one keeps its size (``check_image_input`` refuses
   sides under 64 px and aspect ratios over 8:1);
2. it is encoded to the VAE posterior's mode (``sample_mode="argmax"``: the mean), patchified 2×2 into 128 channels
   and normalised by the VAE's BatchNorm statistics, ``(z − running_mean) / sqrt(running_var + eps)`` — as the
   target's latents are (``_encode_vae_image``);
3. its position ids are ``(t, h, w, 0)`` over its own latent grid, with the time axis ``t = 10 + 10·k`` for the
   k-th reference (``_prepare_image_ids``); the target has ``t = 0`` and the text its own ids;
4. the references' tokens (row order, ``_pack_latents``) follow the target's in one sequence, their ids likewise;
5. the transformer's output is cut to the target's tokens.

Training here does 2–5 exactly, on the cached posterior mean of each reference (``batch["control_latents"][k]
["mean"]``, patchified by the family's ``encode_pixels``); a test compares the transformer's inputs with the
pipeline's for one and two references. Samples pass the sample prompt's ``control_images`` to the pipeline as
``image=``, so step 1 there is the pipeline's own.

Reference sizes, where the anchors disagree:

- diffusers' pipelines: every reference at its own size, capped at 1024² px whatever their number (step 1);
- BFL's reference code (``flux2/sampling.py`` ``encode_image_refs``): capped at 2024² px for one reference and 1024²
  px for several;
- musubi-tuner: control images are resized to the target's size unless ``no_resize_control``; its FLUX.2 docs advise
  ``control_resolution = [2024, 2024]`` for one control and ``[1024, 1024]`` for several, with
  ``no_resize_control``, to follow BFL's inference settings;
- ai-toolkit: control images as they are, capped at 1024² px (or at the target's area with ``match_target_res``),
  encoded row by row;
- Atelier follows its data core: every reference rendered at its target's bucket size with the target's crop and
  flip, or at ``data.control_resolution``'s pixel budget with the target's aspect ratio. For targets up to 1024² px
  (the presets) that is within every anchor's limits, and nothing here assumes a reference has its target's size
  (each reference's ids span its own grid). What it changes is the reference's aspect ratio and crop when they
  differ from the target's.

For "each reference at its own size within limits" the core would need: each control image bucketed by its own
aspect ratio under a pixel cap (1024², or 2024² for a single reference), its latents cached at that size, and
batches whose rows share one token layout — rows grouped by (target bucket, each reference's size), or batches of
one — since the rows of a batch are one tensor; and the pair's shared crop and flip would no longer apply to the
references. The family side (this module) would stay as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Sequence, Tuple

import torch
from diffusers import Flux2KleinPipeline
from PIL import Image

from trainer.families.common.packed_ids import flux2_reference_ids


def normalise(vae: Any, mean: torch.Tensor) -> torch.Tensor:
    """A patchified latent [B, 128, h, w] in the transformer's scale: minus the VAE's BatchNorm running mean, over its
    running std (``_encode_vae_image``)."""
    bn = vae.bn
    shift = bn.running_mean.view(1, -1, 1, 1).to(mean)
    scale = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(mean)
    return (mean - shift) / scale


class Flux2Input:
    """The transformer's image input: the noisy target latents [B, 128, h, w] and the normalised reference latents
    that follow them ([B, 128, h_k, w_k] each). ``.to()`` and row slicing (several processes keep their rows) like a
    tensor; ``shape``, ``dtype`` and ``device`` are the target's."""

    def __init__(self, latents: torch.Tensor, references: Sequence[torch.Tensor] = ()):
        self.latents = latents
        self.references = tuple(references)

    def to(self, *args: Any, **kwargs: Any) -> "Flux2Input":
        return Flux2Input(self.latents.to(*args, **kwargs), [r.to(*args, **kwargs) for r in self.references])

    def __getitem__(self, rows: Any) -> "Flux2Input":
        return Flux2Input(self.latents[rows], [r[rows] for r in self.references])

    @property
    def shape(self) -> torch.Size:
        return self.latents.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.latents.dtype

    @property
    def device(self) -> torch.device:
        return self.latents.device


def reference_tokens(references: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The references' tokens [B, N, 128] and position ids [B, N, 4], as ``prepare_image_latents`` builds them: each
    packed in row order, all concatenated, the ids of the k-th on time 10 + 10·k. Every row of a batch has the same
    reference sizes, so the ids of one row serve all."""
    b = references[0].shape[0]
    ids = flux2_reference_ids(references)  # (1, N, 4) on the references' device: the pipeline makes them on the CPU
    tokens = torch.cat([Flux2KleinPipeline._pack_latents(r) for r in references], dim=1)
    return tokens, ids.expand(b, -1, -1)


def load_images(paths: Sequence[Any]) -> List[Image.Image]:
    """A sample prompt's reference images (``sampling.prompts[].control_images``; relative paths from the folder
    Atelier runs in) as RGB images, as ``image=`` takes them."""
    return [Image.open(Path(str(p))).convert("RGB") for p in paths if str(p).strip()]
