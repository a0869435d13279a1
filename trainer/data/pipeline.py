"""The loop's one door to the data: which micro-batches an epoch has, and what is in each.

Everything random here (order, caption pick, crop, flip) is a pure function of
(seed, epoch, position), so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from trainer.data.cache import LatentCache, make_settings_key
from trainer.data.concepts import epoch_order, item_repeats, pick_caption, sample_rng, scan_concepts

log = logging.getLogger("atelier")


class DataPipeline:
    """Scans the concepts, caches latents, and yields micro-batches for the loop.

    ``encode_fn`` turns a pixel batch [B,3,H,W] in [-1,1] into the VAE posterior
    ``{"mean", "std"}``; ``fingerprint`` identifies the model weights behind it (cache key).
    """

    def __init__(self, cfg: Any, warn: Callable[[str], None]):
        self.cfg = cfg
        self.data_cfg = cfg.data
        self.seed = int(cfg.general.seed)
        self.batch_size = int(cfg.training.batch_size)
        self.items, self.report = scan_concepts(cfg.data, warn=warn)
        self.repeats = item_repeats(self.items, cfg.data)
        self.cache: Optional[LatentCache] = None
        self.encode_fn: Optional[Callable] = None

    # --- epochs -------------------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> List[List[int]]:
        order = epoch_order(self.items, self.repeats, epoch, self.seed)
        bs = self.batch_size
        return [order[i:i + bs] for i in range(0, len(order), bs)]

    def iter_batches(self, epoch: int, start: int, stop: int):
        """Yield ``(batch_index, batch)`` for micro-batches ``start..stop-1`` of an epoch."""
        batches = self.epoch_batches(epoch)
        for bi in range(start, min(stop, len(batches))):
            yield bi, self.batch(batches[bi], epoch, bi)

    # --- latents ------------------------------------------------------------------------------
    def variants(self) -> List[int]:
        return [0, 1] if self.data_cfg.random_flip else [0]

    def load_pixels(self, item, variant: int, crop_rng=None):
        from trainer.data.images import load_image
        d = self.data_cfg
        return load_image(item.path, d.resolution, d.center_crop, bool(variant), crop_rng)

    def prepare(self, encode_fn: Callable, fingerprint: str, vae_dtype: str) -> None:
        """Attach the encoder; with ``data.cache_latents`` encode every missing latent now."""
        self.encode_fn = encode_fn
        d = self.data_cfg
        if not d.cache_latents:
            return
        cache_dir = Path(d.cache_dir) if d.cache_dir else Path(self.cfg.general.workspace) / "cache"
        key = make_settings_key(model=fingerprint, resolution=d.resolution,
                                crop="center" if d.center_crop else "random-fixed", vae_dtype=vae_dtype)
        self.cache = LatentCache(cache_dir, key)
        t0 = time.time()
        total = len(self.items) * len(self.variants())
        n = self.cache.ensure(
            self.items, self.variants(), encode_fn,
            # with caching, a random crop is drawn once per file (fixed across epochs)
            lambda it, v: self.load_pixels(it, v, None if d.center_crop else sample_rng(self.seed, 0, 0,
                                                                                         f"crop-{it.path}")),
            batch_size=max(1, self.batch_size),
            progress=lambda i, tot: log.info("caching latents %d/%d", i, tot) if tot and (
                i == tot or i % 50 == 0) else None)
        log.info("latent cache: %d encoded, %d reused (%.1fs)", n, total - n, time.time() - t0)

    # --- one micro-batch ----------------------------------------------------------------------
    def batch(self, indices: List[int], epoch: int, batch_index: int) -> Dict[str, Any]:
        """``{"latent_dist": {"mean","std"}, "captions": [...], "loss_weights": tensor[B]}``.

        Optional keys the loop also understands: ``encoder_hidden_states`` (cached text-encoder
        output, used instead of encoding ``captions``)."""
        import torch
        dists, captions, weights = [], [], []
        for j, idx in enumerate(indices):
            item = self.items[idx]
            rng = sample_rng(self.seed, epoch, batch_index * self.batch_size + j)
            captions.append(pick_caption(item, rng))
            variant = 1 if (self.data_cfg.random_flip and rng.random() < 0.5) else 0
            if self.cache is not None:
                dists.append(self.cache.get(item, variant))
            else:
                pixels = self.load_pixels(item, variant, None if self.data_cfg.center_crop else rng)
                dists.append({k: v[0] for k, v in self.encode_fn(pixels[None]).items()})
            weights.append(item.loss_weight)
        dist = {k: torch.stack([d[k] for d in dists]) for k in ("mean", "std")}
        return {"latent_dist": dist, "captions": captions,
                "loss_weights": torch.tensor(weights, dtype=torch.float32)}
