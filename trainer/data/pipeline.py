"""The loop's one door to the data: which micro-batches an epoch has, and what is in each.

Everything random here (order, bucket resolution, caption pick, caption/tag dropout, tag order,
crop, flip, augmentation, cached variant) is a pure function of (seed, epoch, position), so a
resumed run — or one with another number of loader threads — sees exactly the batches an
uninterrupted run would.

A batch is a dict::

    latent_dist            {"mean", "std"} [B, 4, h, w]  (VAE posterior; the loop samples it)
    captions               list of B strings (after dropout, shuffling, placeholders)
    loss_weights           float32 [B] (the concepts' loss_weight)
    mask                   float32 [B, 1, h, w] in [0, 1] at latent resolution, 1 = focus
                           (only with data.masks; an image without a mask is all ones)
    encoder_hidden_states  [B, 77, D] cached text-encoder output (only when prepare() got an
                           encode_text_fn and captions are cacheable; entries of different lengths
                           are padded with zeros at the end to the batch's longest)
    sizes                  list of B (width, height): the pixel size trained at
    original_sizes         list of B (height, width) of the images as displayed   } SDXL's size and
    crop_top_lefts         list of B (top, left) of the crop in the resized image } crop conditioning
    target_sizes           list of B (height, width) trained at                   } (time ids)
    inpaint_pixels         float32 [B, 3, H, W] in [-1, 1]: the pixels the latents were encoded from,
                           exactly (only for an inpainting model: prepare() got ``inpaint_fn``)
    masked_mean            [B, 4, h, w] VAE mean of each image with its own mask (``mask``) blanked
                           (inpainting with data.masks and cached latents; exact, encoded at cache time)
    control_latents        list, one per control folder, of {"mean", "std"} [B, 4, h', w']: each row's control
                           or reference image, rendered with its target's crop and flip at the control size
                           (the target's bucket, or data.control_resolution's budget with its aspect)
    control_paths          list of B tuples: each row's control image files (for encoders that see the images)
    prior                  bool [B]: rows of prior_prediction concepts (their target is the base model's own
                           prediction; only when such a concept is enabled)
    first_frame            an image-to-video model's batch: what each row's first frame conditions (its
                           ``first_frame_fn`` output: e.g. {"latents", "image_embeds"}), from its own cache entries
                           keyed like the latents (another settings key), or computed from the rendered pixels
    frames                 a video family's batch: the frame count F of its one (width, height, frames) bucket;
                           its latents are 5-D [B, C, f, h, w] (from pixel clips [B, 3, F, H, W] in [-1, 1]) and
                           its mask [B, 1, f, h, w] (a mask image applies to every frame, a mask clip frame by frame)

Latents come from the latent cache (``data.cache_latents``) or, when augmentations are on with
``augment_variants = 0`` (or caching is off), from ``encode_fn`` on freshly rendered pixels. For an
inpainting model the cache also keeps each entry's rendered pixels (uint8, lossless) and, with masks,
the masked image's latents, so cached and uncached runs build the same masked-image latents. Batches
are loaded ``general.dataloader_workers`` ahead in background threads (0 = in the caller's thread);
VAE encoding always happens in the caller's thread. In that uncached mode each image is decoded
at most once per epoch (kept until its last use in the epoch).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from PIL import Image

from trainer.data import images  # decode/render_sample looked up at call time (tests count the decodes)
from trainer.data.augment import AugmentParams, AugmentSettings, crop_top_left, draw_params
from trainer.data.buckets import PlannedBatch, Size, control_budget, control_size
from trainer.data.cache import (
    CacheJob,
    LatentCache,
    TextCache,
    as_text_dict,
    file_sha256,
    make_settings_key,
    map_ahead,
)
from trainer.data.captions import CaptionOptions, CaptionProcessor, Replacement, pick_caption
from trainer.data.concepts import ImageItem
from trainer.data.dataset import build_dataset
from trainer.data.images import mask_to_latent, pixels_to_uint8, uint8_to_pixels
from trainer.data.order import sample_rng, seed_int
from trainer.data.render import DecodeMemo, Renderer, latent_frames, render_clip, shrink
from trainer.data.text_rows import stack_texts
from trainer.errors import DataError
from trainer.families import VideoSpec

log = logging.getLogger("atelier")

ProgressFn = Callable[[str, int, int], None]  # (stage: "latents" | "text", done, total)
_PROBE_CAPTION = "a photo of a cat, atelier text cache probe"
_INPAINT_CACHE = 1  # inpainting entries' extra layout (pixels_u8, masked_mean); bump when it changes
_FIRST_FRAME_CACHE = 1  # image-to-video first-frame entries (what first_frame_fn returns); bump when it changes


class DataPipeline:
    """Scans the concepts, plans bucketed epochs, fills the caches and yields micro-batches.

    ``DataPipeline(cfg, warn)`` scans at once (bad files become warnings through ``warn``; a
    concept without a usable image raises :class:`DataError`); ``report`` is the dataset report.
    Call :meth:`prepare` once the model is loaded, then :meth:`iter_batches` per epoch.
    """

    def __init__(self, cfg: Any, warn: Callable[[str], None], base_dir: Optional[Path] = None,
                 video: Optional[VideoSpec] = None):
        self.cfg = cfg
        self.data_cfg = d = cfg.data
        self.seed = int(cfg.general.seed)
        self.batch_size = int(cfg.training.batch_size)
        self.workers = int(getattr(cfg.general, "dataloader_workers", 0) or 0)
        self.dataset = build_dataset(cfg, warn, base_dir=base_dir, video=video)  # video: the family trains on clips
        self.report = self.dataset.report
        if self.report.batches_per_epoch == 0:
            raise DataError(f"No aspect bucket holds enough images for one batch of {self.batch_size}, so "
                            "nothing would train. Lower training.batch_size, raise the concepts' repeats, or "
                            "turn off data.aspect_buckets.", key="training.batch_size", value=self.batch_size)
        self.items: List[ImageItem] = self.dataset.items
        self.validation_items: List[ImageItem] = self.dataset.validation
        self.repeats = self.dataset.repeats
        self.augment = AugmentSettings.from_config(d)
        self.masks = bool(getattr(d, "masks", False))
        self.captions = CaptionProcessor()
        self.caption_options = {i: CaptionOptions.from_concept(c) for i, c in enumerate(d.concepts)}
        self.cache: Optional[LatentCache] = None
        self.text_cache: Optional[TextCache] = None
        self.encode_fn: Optional[Callable] = None
        self.inpaint_fn: Optional[Callable] = None
        self.first_frame_fn: Optional[Callable] = None  # an image-to-video model's first-frame condition
        self.first_frame_cache: Optional[LatentCache] = None
        self.control_budget = control_budget(d)
        self.step = int(getattr(d, "bucket_step", 64) or 64)
        self.priors = any(it.role == "prior_prediction" for it in self.items)
        self._control_items: Dict[Path, ImageItem] = {}
        self.text_controls = False  # the text encoder sees the control images: cache entries are keyed by them too
        self.text_empty = False  # with text_controls: each example's empty caption cached too, batches carry it

    # --- control images ---------------------------------------------------------------------------
    def control_size(self, size: Size) -> Size:
        """The size a control image of a target at bucket ``size`` is rendered at: the target's, or
        data.control_resolution's pixel budget with the target's aspect ratio."""
        return control_size(size, self.control_budget, self.step)

    def _control_item(self, path: Path) -> ImageItem:
        """A control image as a cache entry's source (its content addresses the entry)."""
        if path not in self._control_items:
            self._control_items[path] = ImageItem(path=path, captions=[], concept_index=-1, loss_weight=0.0)
        return self._control_items[path]

    # --- captions ------------------------------------------------------------------------------
    def set_placeholder(self, placeholder: str, replacement: Replacement) -> None:
        """Replace ``placeholder`` (e.g. ``"<embedding>"``) in every caption by the trained token(s):
        a string, or a function ``caption -> string``. Call before :meth:`prepare`. See
        :mod:`trainer.data.captions`."""
        self.captions.set_placeholder(placeholder, replacement)

    def captions_cacheable(self) -> bool:
        """True when every caption a sample can get is known up front (no tag shuffle/dropout)."""
        used = {it.concept_index for it in self.items + self.validation_items}
        return all(self.caption_options[i].deterministic for i in used)

    def possible_captions(self) -> List[str]:
        out: set = set()
        for it in self.items:
            out.update(self.captions.possible_captions(it.captions, self.caption_options[it.concept_index]))
        for it in self.validation_items:
            out.add(self._validation_caption(it))
        return sorted(out)

    def possible_text_entries(self) -> List[Tuple[str, Tuple[Path, ...]]]:
        """Every (caption, control files) pair a sample can get: the text cache's entries for an encoder that sees
        the control images beside the caption."""
        out: set = set()
        for it in self.items:
            for c in self.captions.possible_captions(it.captions, self.caption_options[it.concept_index]):
                out.add((c, tuple(it.controls)))
            if self.text_empty:
                out.add(("", tuple(it.controls)))
        for it in self.validation_items:
            out.add((self._validation_caption(it), tuple(it.controls)))
        return sorted(out)

    def _validation_caption(self, item: ImageItem) -> str:
        return self.captions.replace_placeholders(item.captions[0] if item.captions else "")

    # --- epochs -------------------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> List[PlannedBatch]:
        """The micro-batches of an epoch (each from one bucket); their number varies a little
        between epochs when batches are left unfilled."""
        return self.dataset.plan(epoch)[0]

    def iter_batches(self, epoch: int, start: int, stop: int) -> Iterator[Tuple[int, Dict[str, Any]]]:
        """Yield ``(batch_index, batch)`` for micro-batches ``start..stop-1`` of an epoch, loading
        ahead in background threads."""
        batches = self.epoch_batches(epoch)
        selected = list(range(start, min(stop, len(batches))))
        memo = None
        if self._renders_pixels():
            memo = DecodeMemo(Counter(i for bi in selected for i in batches[bi].indices))
        loader = lambda bi: self._load(batches[bi], epoch, memo)  # noqa: E731
        ahead = map_ahead(loader, selected, self.workers)
        try:
            for bi, raw in zip(selected, ahead):
                yield bi, self._finish(raw)
        finally:
            ahead.close()  # a loop that stops mid-epoch also stops the loader threads

    def batch(self, plan: Union[PlannedBatch, Sequence[int]], epoch: int, batch_index: int = 0) -> Dict[str, Any]:
        """One micro-batch (see the module docstring). ``plan`` is a :class:`PlannedBatch` from
        :meth:`epoch_batches`, or bare item indices (trained at the first item's first bucket)."""
        if not isinstance(plan, PlannedBatch):
            indices = tuple(plan)
            plan = PlannedBatch(indices, tuple(batch_index * self.batch_size + j for j in range(len(indices))),
                                self.dataset.buckets[indices[0]][0])
        return self._finish(self._load(plan, epoch, None))

    # --- validation -----------------------------------------------------------------------------
    def validation_batches(self) -> List[PlannedBatch]:
        """Validation items grouped by bucket, in batches of at most the batch size (fixed)."""
        groups: Dict[Size, List[int]] = {}
        for i, size in enumerate(self.dataset.validation_buckets):
            groups.setdefault(size, []).append(i)
        out = []
        for size in sorted(groups):
            members = groups[size]
            for k in range(0, len(members), self.batch_size):
                chunk = tuple(members[k:k + self.batch_size])
                out.append(PlannedBatch(chunk, chunk, size))
        return out

    def iter_validation(self) -> Iterator[Dict[str, Any]]:
        """Batches of the validation concepts: centre crop, no augmentation, first caption line,
        no dropout — the same every time, so their loss is comparable across steps. The loop should
        compute it under ``torch.no_grad()`` with its own fixed generator (not the training one)."""
        for plan in self.validation_batches():
            yield self._finish(self._load(plan, -1, None, validation=True))

    # --- caches ---------------------------------------------------------------------------------
    def cache_dir(self) -> Path:
        d = self.data_cfg
        return Path(d.cache_dir) if d.cache_dir else Path(self.cfg.general.workspace) / "cache"

    def _renders_pixels(self) -> bool:
        """Training samples are rendered and encoded per step (no latent cache, or augmentations
        without cached variants)."""
        return self.cache is None or (self.augment.any_beyond_flip and int(self.data_cfg.augment_variants) == 0)

    def n_variants(self) -> int:
        """Cached versions per (image, bucket)."""
        if self.augment.any_beyond_flip:
            return max(1, int(self.data_cfg.augment_variants))
        return 2 if self.augment.random_flip else 1

    def variant_params(self, item: ImageItem, k: int) -> AugmentParams:
        """The fixed transform of cached variant ``k`` of ``item`` (seeded by content, so renaming
        a file keeps its variants)."""
        digest = self._sha(item)
        if self.augment.any_beyond_flip:
            return draw_params(self.augment, random.Random(seed_int("atelier-variant", self.seed, digest, k)))
        shift = (0.0, 0.0)
        if not self.augment.center_crop:  # random crop: drawn once per file when cached
            rng = random.Random(seed_int("atelier-crop", self.seed, digest))
            shift = (round(rng.uniform(-1, 1), 4), round(rng.uniform(-1, 1), 4))
        return AugmentParams(flip=k == 1, shift_x=shift[0], shift_y=shift[1])

    def _sha(self, item: ImageItem) -> str:
        return file_sha256(item.path)

    def _entry(self, item: ImageItem, size: Size, params: AugmentParams) -> Tuple[str, str]:
        """(variant tag, extra key) of a cache entry: bucket size + exact transform, mask hash."""
        extra = f"mask:{file_sha256(item.mask)}" if (self.masks and item.mask is not None) else ""
        window = f"|{item.window.tag()}" if item.window is not None else ""  # a clip's frames and their rate
        return f"{size[0]}x{size[1]}|{params.tag()}{window}", extra

    def _controls_cached(self, item: ImageItem, size: Size, params: AugmentParams) -> List[Dict[str, Any]]:
        csize = self.control_size(size)
        return [self.cache.get(self._control_item(c), *self._entry(self._control_item(c), csize, params))  # type: ignore[union-attr]
                for c in item.controls]

    def _controls_rendered(self, item: ImageItem, size: Size, params: AugmentParams) -> List[Any]:
        csize = self.control_size(size)
        out = []
        for control in item.controls:
            img, _ = images.decode(control, None, self._min_side([(csize, params)]))
            out.append(images.render_sample(img, None, csize, params)[0])
        return out

    def prepare(self, encode_fn: Callable, fingerprint: str, vae_dtype: str,
                encode_text_fn: Optional[Callable[[List[str]], Any]] = None,
                text_fingerprint: Optional[str] = None,
                progress: Optional[ProgressFn] = None,
                inpaint_fn: Optional[Callable] = None, text_controls: bool = False,
                first_frame_fn: Optional[Callable] = None, text_empty: bool = False) -> Dict[str, Any]:
        """Attach the VAE encoder and fill every cache; returns what was encoded and reused.

        ``encode_fn(pixels [B,3,H,W] in [-1,1]) -> {"mean", "std"}``; ``fingerprint`` identifies
        the VAE weights (cache key). With ``data.cache_latents`` every (image, bucket, variant)
        without an entry is encoded now, images decoded in ``general.dataloader_workers`` threads.
        ``encode_text_fn(list_of_captions) -> tensor [B, 77, D]`` (or a dict of tensors): pass it
        only when the text encoder (and its token embeddings) are frozen; with ``data.cache_text``
        and cacheable captions every possible caption is encoded now and batches carry
        ``encoder_hidden_states``. Caching resumes where an interrupted run stopped (entries are
        written atomically). This is all an "only cache" command needs.

        ``inpaint_fn`` (an inpainting model's ``encode_masked_images(pixels, latent_masks)``) makes
        batches carry ``inpaint_pixels`` and cache entries keep what the masked-image latents need:
        the pixels (uint8) and, with data.masks, the masked image's latents (``masked_mean``). Its
        entries are apart from a text-to-image model's (another settings key).

        ``text_controls``: the text encoder sees each example's control images (an edit model's VL encoder):
        the text cache holds every (caption, control files) pair, encoded as ``encode_text_fn(captions,
        controls)``, and batches read the entry of their own pair. ``text_empty`` too (the encoders' own caption
        dropout, drawn at the step): each training example's empty caption with its controls is an entry as well,
        carried by batches as ``empty_text``, so a dropped row never runs the encoder at the step.

        ``first_frame_fn(pixels [B, 3, F, H, W]) -> {name: [B, ...]}`` (an image-to-video model's condition from
        each window's first frame): batches carry its output as ``first_frame``; with cached latents it is cached
        too, in entries of its own beside the latents' (same image, bucket, transform and window; its own settings
        key), so the latents' entries stay those of any model with the same VAE fingerprint.
        """
        d = self.data_cfg
        self.encode_fn = encode_fn
        self.inpaint_fn = inpaint_fn
        self.first_frame_fn = first_frame_fn
        summary: Dict[str, Any] = {"latents_encoded": 0, "latents_reused": 0, "text_encoded": 0,
                                   "text_reused": 0, "text_cache": "off"}
        t0 = time.time()
        report = _progress_logger("latents", progress)
        if d.cache_latents:
            key = dict(model=fingerprint, vae_dtype=vae_dtype)
            if inpaint_fn is not None:
                key["inpaint"] = _INPAINT_CACHE
            self.cache = LatentCache(self.cache_dir(), make_settings_key(**key))
            jobs = self._cache_jobs()
            total = sum(len(j.paths) for j in jobs)
            n = self.cache.run_jobs(jobs, encode_fn, batch_size=max(1, self.batch_size), progress=report,
                                    workers=self.workers,
                                    extras_fn=self._inpaint_extras if inpaint_fn is not None else None)
            summary.update(latents_encoded=n, latents_reused=total - n)
            log.info("latent cache: %d encoded, %d reused (%.1fs)", n, total - n, time.time() - t0)
            if first_frame_fn is not None:  # the same entries' windows again, through the first-frame encoder
                self.first_frame_cache = LatentCache(self.cache_dir(),
                                                     make_settings_key(**key, first_frame=_FIRST_FRAME_CACHE))
                jobs = self._cache_jobs(self.first_frame_cache, controls=False)
                n = self.first_frame_cache.run_jobs(jobs, first_frame_fn, batch_size=max(1, self.batch_size),
                                                    workers=self.workers)
                summary.update(first_frames_encoded=n)
                log.info("first-frame cache: %d encoded", n)
        if encode_text_fn is not None and d.cache_text:
            if not self.captions_cacheable():
                summary["text_cache"] = "off: tag shuffling or tag dropout makes captions vary"
                log.info("text-encoder outputs are not cached: tag shuffling or tag dropout is on")
            else:
                t1 = time.time()
                key = make_settings_key(text=text_fingerprint or fingerprint,
                                        probe=_probe_hash(encode_text_fn, text_controls))
                self.text_cache = TextCache(self.cache_dir(), key)
                self.text_controls = text_controls
                self.text_empty = bool(text_empty and text_controls)
                captions = self.possible_text_entries() if text_controls else self.possible_captions()
                n = self.text_cache.ensure(captions, encode_text_fn, batch_size=16,
                                           progress=_progress_logger("text", progress))
                summary.update(text_encoded=n, text_reused=len(captions) - n, text_cache="on")
                log.info("text cache: %d encoded, %d reused (%.1fs)", n, len(captions) - n, time.time() - t1)
        summary["seconds"] = round(time.time() - t0, 3)
        return summary

    def _inpaint_extras(self, pixels, latent_masks: List[Any], latent_hw: Tuple[int, int]) -> Dict[str, Any]:
        """What an inpainting model's cache entry adds: the pixels (uint8, lossless) and, with
        data.masks, the latents of the image with its own mask blanked — exactly what
        ``inpaint_fn`` makes of a batch's ``inpaint_pixels`` and ``mask`` at training time (an image
        without a mask file gets the all-ones mask the batches give it)."""

        out: Dict[str, Any] = {"pixels_u8": pixels_to_uint8(pixels)}
        if self.masks and self.inpaint_fn is not None:
            masks = torch.stack([m if m is not None else torch.ones(1, *latent_hw) for m in latent_masks])
            out["masked_mean"] = self.inpaint_fn(pixels, masks)
        return out

    def _cache_jobs(self, cache: Optional[LatentCache] = None, controls: bool = True) -> List[CacheJob]:
        """The entries ``cache`` (the latent cache by default) needs: every (item, bucket, variant) a run reads,
        the validation items' and (``controls``) the control images'."""
        cache = cache or self.cache
        assert cache is not None
        wanted: List[Tuple[ImageItem, List[Tuple[Size, AugmentParams]]]] = []
        if not self._renders_pixels():
            for item, options in zip(self.items, self.dataset.buckets):
                specs = [(size, self.variant_params(item, k)) for size in dict.fromkeys(o[:2] for o in options)
                         for k in range(self.n_variants())]
                wanted.append((item, specs))
        for item, size in zip(self.validation_items, self.dataset.validation_buckets):
            wanted.append((item, [(size[:2], AugmentParams())]))
        for item, specs in list(wanted) if controls else ():
            for control in item.controls:  # rendered with its target's transform, at the control size
                wanted.append((self._control_item(control), [(self.control_size(size), params) for size, params in specs]))
        jobs: List[CacheJob] = []
        seen: set = set()
        for item, specs in wanted:
            paths, todo = [], []
            for size, params in specs:
                path = cache.entry_path(item, *self._entry(item, size, params))
                if path in seen:
                    continue
                seen.add(path)
                paths.append(path)
                todo.append((size, params))
            if paths:
                jobs.append(CacheJob(paths, Renderer(item, todo, self._min_side(todo)), str(item.path)))
        return jobs

    def _worst_side(self, sizes: Sequence[Size]) -> int:
        a = self.augment
        return int(max(max(size) for size in sizes) * (1 + a.crop_jitter) * (1.5 if a.rotation else 1.0)) + 1

    def _min_side(self, specs: Sequence[Tuple[Size, AugmentParams]]) -> int:
        side = max(max(size) * max(1.0, p.zoom) * (1.5 if p.angle else 1.0) for size, p in specs)
        return int(side) + 1

    # --- loading ----------------------------------------------------------------------------------
    def _load(self, plan: PlannedBatch, epoch: int, memo: Optional["DecodeMemo"],
              validation: bool = False) -> Dict[str, Any]:
        """Everything of one batch that needs no model: runs in a loader thread."""

        pool = self.validation_items if validation else self.items
        size = plan.size[:2]  # a video family's bucket is (width, height, frames)
        captions, weights, sizes, crops = [], [], [], []
        dists, masks, pixels, pixel_masks, texts, firsts, empties = [], [], [], [], [], [], []
        controls: List[List[Any]] = []  # per row: its control latents (cached) or pixels (rendered)
        for idx, pos in zip(plan.indices, plan.positions):
            item = pool[idx]
            if validation:
                caption = self._validation_caption(item)
            else:
                rng = sample_rng(self.seed, epoch, pos, "caption")
                caption = self.captions.process(pick_caption(item, rng), self.caption_options[item.concept_index], rng)
            captions.append(caption)
            weights.append(item.loss_weight)
            sizes.append(size)
            if self.text_cache is not None:
                texts.append(self.text_cache.get(caption, item.controls if self.text_controls else ()))
                if self.text_empty and not validation:  # what the row's features become when the step drops it
                    empties.append(self.text_cache.get("", item.controls))
            cached = self.cache is not None and (validation or not self._renders_pixels())
            if cached:
                if validation:
                    params = AugmentParams()
                else:
                    rng = sample_rng(self.seed, epoch, pos, "variant")
                    n = self.n_variants()
                    params = self.variant_params(item, rng.randrange(n) if n > 1 else 0)
                entry = self.cache.get(item, *self._entry(item, size, params))  # type: ignore[union-attr]
                crops.append(crop_top_left((item.width, item.height), size, params))
                dists.append(entry)
                masks.append(entry.get("mask"))
                if self.first_frame_cache is not None:  # image-to-video: the window's first-frame condition
                    firsts.append(self.first_frame_cache.get(item, *self._entry(item, size, params)))
                controls.append(self._controls_cached(item, size, params))
            else:
                params = AugmentParams() if validation else \
                    draw_params(self.augment, sample_rng(self.seed, epoch, pos, "augment"))
                mask_path = item.mask if self.masks else None
                min_side = self._min_side([(size, params)])
                if item.window is not None:  # a video family's window: pixels [3, F, H, W]
                    px, mpx = render_clip(item, mask_path, size, params)
                    crops.append(crop_top_left((item.width, item.height), size, params))
                    pixels.append(px)
                    pixel_masks.append(mpx)
                    controls.append([])
                    continue
                if memo is not None:  # decoded for the largest size this item can need in the epoch
                    side = self._worst_side(self.dataset.buckets[idx])
                    img, mask = memo.get(idx, lambda it=item, m=mask_path, s=side:
                                         shrink(images.decode(it.path, m, s), s))
                else:
                    img, mask = images.decode(item.path, mask_path, min_side)
                px, mpx = images.render_sample(img, mask, size, params)
                crops.append(crop_top_left((item.width, item.height), size, params))
                pixels.append(px)
                pixel_masks.append(mpx)
                controls.append(self._controls_rendered(item, size, params))
        raw: Dict[str, Any] = {"captions": captions, "loss_weights": torch.tensor(weights, dtype=torch.float32),
                               "sizes": sizes, "crop_top_lefts": crops,
                               "original_sizes": [(pool[i].height, pool[i].width) for i in plan.indices],
                               "target_sizes": [(h, w) for w, h in sizes]}
        if dists:
            raw["latent_dist"] = {k: torch.stack([e[k] for e in dists]) for k in ("mean", "std")}
            if self.masks:
                h, w = raw["latent_dist"]["mean"].shape[-2:]
                if raw["latent_dist"]["mean"].dim() == 5:  # clips: [1, f, h, w] each (an image mask on every frame)
                    f = raw["latent_dist"]["mean"].shape[2]
                    masks = [latent_frames(m if m.dim() == 4 else m.unsqueeze(1), f).expand(1, f, h, w)
                             if m is not None else torch.ones(1, f, h, w) for m in masks]
                raw["mask"] = torch.stack([m if m is not None else torch.ones(1, h, w) for m in masks])
            if self.inpaint_fn is not None and all("pixels_u8" in e for e in dists):
                raw["inpaint_pixels"] = uint8_to_pixels(torch.stack([e["pixels_u8"] for e in dists]))
                if self.masks and all("masked_mean" in e for e in dists):
                    raw["masked_mean"] = torch.stack([e["masked_mean"] for e in dists])
        else:
            raw["pixels"] = torch.stack(pixels)
            if self.masks:
                h, w = raw["pixels"].shape[-2:]
                if raw["pixels"].dim() == 5:  # clips: every row's mask over all F frames
                    f = raw["pixels"].shape[2]
                    pixel_masks = [m if m is not None else torch.ones(1, f, h, w) for m in pixel_masks]
                raw["pixel_mask"] = torch.stack([m if m is not None else torch.ones(1, h, w) for m in pixel_masks])
        if firsts:
            raw["first_frame"] = {k: torch.stack([e[k] for e in firsts]) for k in firsts[0] if k != "mask"}
        if texts:
            raw.update(stack_texts(texts))
        if empties:
            raw["empty_text"] = stack_texts(empties)
        if any(controls):
            n = len(controls[0])
            if any(len(row) != n for row in controls):
                raise DataError("A batch mixes images with different numbers of control images: give every concept "
                                "the same number of control folders.", key="data.concepts")
            raw["control_paths"] = [pool[i].controls for i in plan.indices]
            if dists:
                raw["control_latents"] = [{k: torch.stack([row[j][k] for row in controls]) for k in ("mean", "std")}
                                          for j in range(n)]
            else:
                raw["control_pixels"] = [torch.stack([row[j] for row in controls]) for j in range(n)]
        if self.priors:
            raw["prior"] = torch.tensor([pool[i].role == "prior_prediction" for i in plan.indices])
        if len(plan.size) > 2:
            raw["frames"] = int(plan.size[2])
        return raw

    def _finish(self, raw: Dict[str, Any]) -> Dict[str, Any]:
        """The model part of a batch, in the caller's thread: encode rendered pixels."""
        if "pixels" in raw:
            if self.encode_fn is None:
                raise RuntimeError("DataPipeline.prepare() must be called before batches are loaded")
            pixels = raw.pop("pixels")
            with torch.no_grad():
                out = self.encode_fn(pixels)
            raw["latent_dist"] = {"mean": out["mean"], "std": out["std"]}
            if self.first_frame_fn is not None:
                with torch.no_grad():
                    raw["first_frame"] = self.first_frame_fn(pixels)
            if self.inpaint_fn is not None:
                raw["inpaint_pixels"] = pixels
            if "pixel_mask" in raw and out["mean"].dim() == 5:  # clips: [B, 1, F, H, W] -> [B, 1, f, h, w]
                latent = mask_to_latent(raw.pop("pixel_mask")[:, 0], tuple(out["mean"].shape[-2:]))
                raw["mask"] = latent_frames(latent, out["mean"].shape[2]).unsqueeze(1)
            elif "pixel_mask" in raw:
                raw["mask"] = mask_to_latent(raw.pop("pixel_mask"), tuple(out["mean"].shape[-2:]))
        if "control_pixels" in raw:
            with torch.no_grad():
                encoded = [self.encode_fn(px) for px in raw.pop("control_pixels")]  # type: ignore[misc]
            raw["control_latents"] = [{"mean": e["mean"], "std": e["std"]} for e in encoded]
        return raw


def _probe_hash(encode_text_fn: Callable, with_image: bool = False) -> str:
    """A hash of the text encoder's output for a fixed caption, rounded to 1e-3: swapped or
    retrained weights change it, so the text cache never serves embeddings of other weights.
    ``with_image``: the encoder also sees control images; the probe shows it a grey one."""
    with torch.no_grad():
        out = as_text_dict(encode_text_fn([_PROBE_CAPTION], [[Image.new("RGB", (64, 64), (127, 127, 127))]])
                           if with_image else encode_text_fn([_PROBE_CAPTION]))
    h = hashlib.sha256()
    for key in sorted(out):
        t = out[key].detach().float().cpu()
        h.update(key.encode())
        h.update(torch.round(t * 1000).to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


def _progress_logger(stage: str, progress: Optional[ProgressFn]) -> Callable[[int, int], None]:
    state = {"last": -1.0}

    def report(done: int, total: int) -> None:
        if progress is not None:
            progress(stage, done, total)
        if not total:
            return
        now = time.time()
        if done == total or now - state["last"] > 5.0:
            state["last"] = now
            log.info("caching %s %d/%d", stage, done, total)
    return report


__all__ = ["DataPipeline"]
