"""Qwen-Image-Edit, -2509 and -2511 on diffusers' ``QwenImageEditPipeline`` (Edit) and ``QwenImageEditPlusPipeline``
(2509, 2511): a target image, one control image (Edit) or one to three references (Plus), and an instruction.

What the pipelines build, and where it is built here:

- Text: Qwen2.5-VL *with its vision tower* reads the instruction and the control images through the pipeline's
  template — Edit's holds one ``<|vision_start|><|image_pad|><|vision_end|>``, Plus prefixes the instruction with
  ``Picture i: <|vision_start|><|image_pad|><|vision_end|>`` per reference — and the features are the last hidden
  layer of every real token after the template's first 64, image tokens included (``_get_qwen_prompt_embeds``).
  Each caption is encoded alone, as the pipeline encodes a prompt, and rows are padded at the end with their mask
  (text RoPE positions start after the image's: padding moves nothing). The control images come from the batch's
  ``control_paths`` (:mod:`trainer.families.qwenimage.vl`: opened, resized with their own aspect to the pipeline's
  VL area — 1024² for Edit, 384² for Plus). These features depend on the images, so the text cache keys each entry
  by caption and the control files' content (:attr:`text_sees_controls`). An encode without control files (the VRAM
  estimate's, on fake tensors the vision tower cannot run on) stands in the image tokens' count
  (:meth:`QwenImageEdit._encode_standin`). Caption dropout (``parts.text_encoder_1.
  caption_dropout``) gives the empty instruction *with the row's images* — what the pipeline's negative prompt
  is: with the text cache on, each example's is cached beside its instruction and batches carry it
  (``empty_text``), so a dropped row costs no encode at the step (nor, with ``data.offload_text_encoders``, a swap
  of the transformer out of VRAM); without the cache it is encoded when drawn. A concept's ``caption_dropout``
  (an empty caption, cached with its images) costs nothing per step either.
- Latents: each control's cached VAE posterior mean (the pipelines encode the condition image with
  ``sample_mode="argmax"``), normalised per channel as ``_encode_vae_image`` does, packed 2×2 and placed after the
  target's tokens; ``img_shapes`` lists the target and then each control (the transformer's RoPE gives image k frame
  index k); the prediction is cut to the target's tokens. 2511 is 2509's architecture with the transformer's
  ``zero_cond_t`` on (the reference tokens are modulated with timestep 0: diffusers' ``modulate_index``, ComfyUI's
  ``index_timestep_zero``); it is set from the variant when the model loads, so a folder or file that does not say
  trains and samples right once ``model.family`` names it.
- The control image's size for the VAE: the pipelines resize every control to 1024² pixels with its own aspect
  (``calculate_dimensions``, sides rounded to 32; ai-toolkit does the same for Plus, and for Edit uses the target's
  size); musubi-tuner renders a control at its target's size unless ``control_resolution`` is set, and recommends
  ``[1024, 1024]`` "as the official code". Atelier renders controls with their target's crop and flip at
  ``data.control_resolution`` (a pixel budget with the *target's* aspect; empty = the target's bucket): the presets
  set 1024, the pipeline's area. A control whose aspect differs from its target's is cropped to the target's
  there, where the pipeline would keep its own; and the VL encoder reads the control file as it is (not flipped or
  cropped), as the pipeline does.
- Samples: ``sampling.prompts.*.control_images`` go to the pipeline as ``image`` (one image for Edit, a list for
  Plus); the pipeline sizes them by its own rule above, and the sample's ``width``/``height`` are the output's size
  (the pipeline's own default, when none is given, is 1024² with the first (Edit) or last (Plus) image's aspect).
  True CFG with " " as the negative prompt, encoded with the same images, as for Qwen-Image.
- Files: the LoRA keys of Qwen-Image (``transformer.<module>.lora_A/lora_B``): both edit pipelines load them with
  ``QwenImageLoraLoaderMixin``, and ComfyUI runs all Qwen-Image variants as one model class whose LoRA key map takes
  ``transformer.<module>`` for every weight (comfy/lora.py, comfy/model_detection.py at upstream 3cd7b32, 2026-01-07).
  A 2511 fine-tune's single file carries ComfyUI's ``__index_timestep_zero__`` marker, so ComfyUI runs it as 2511.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from trainer.errors import ModelLoadError
from trainer.families import sources
from trainer.families.base import part_dtype
from trainer.families.common.host_copy import to_device
from trainer.families.common.transformer_kit import MaskedText, pad_tokens, rows_replaced, save_transformer_file
from trainer.families.qwenimage.detect import MARKER_2511
from trainer.families.qwenimage.family import QwenImage
from trainer.families.qwenimage.info import EDIT_VARIANTS
from trainer.families.qwenimage.vl import (
    IMAGE_TOKEN,
    VL_AREA,
    build_processor,
    local_processor_config,
    open_control,
    prompt_text,
    vl_image,
)
from trainer.families.sources import classify_source, detect_source_family

log = logging.getLogger("atelier")

OFFICIAL = {"qwen-image-edit": "Qwen/Qwen-Image-Edit", "qwen-image-edit-2509": "Qwen/Qwen-Image-Edit-2509",
            "qwen-image-edit-2511": "Qwen/Qwen-Image-Edit-2511"}
PLUS = ("qwen-image-edit-2509", "qwen-image-edit-2511")
BLANK_SIZE = (1024, 1024)  # the control an encode that names none stands in for (the VRAM estimate's)


class EditConditioning(MaskedText):
    """The instruction's features with their mask, and the control tokens read after the target's: packed,
    normalised latents [B, N, C·4] and their ``img_shapes`` entries."""

    def __init__(self, prompt_embeds, prompt_mask, control_tokens, control_shapes: List[tuple],
                 lengths: Optional[List[int]] = None):
        super().__init__(prompt_embeds, prompt_mask, lengths)
        self.control_tokens, self.control_shapes = control_tokens, list(control_shapes)

    def to(self, *args: Any, **kwargs: Any) -> "EditConditioning":
        text = super().to(*args, **kwargs)
        return EditConditioning(text.prompt_embeds, text.prompt_mask, self.control_tokens.to(*args, **kwargs),
                                self.control_shapes, self.lengths)


class QwenImageEdit(QwenImage):
    """An edit model of the Qwen-Image family (see the module docstring)."""

    text_sees_controls = True

    def __init__(self, mcfg: Any, workspace: str, device: Any = "cpu", variant: str = "qwen-image-edit"):
        self.family = variant
        self.plus = variant in PLUS
        self.pipeline_cls = QwenImageEditPlusPipeline if self.plus else QwenImageEditPipeline
        self.official = OFFICIAL[variant]
        self.modelspec = (variant, "https://github.com/QwenLM/Qwen-Image", "qwen_image_edit")
        self.vl_area = VL_AREA[variant]
        self._mcfg = mcfg
        super().__init__(mcfg, workspace, device)
        self._set_zero_cond_t(variant == "qwen-image-edit-2511")

    # --- loading ----------------------------------------------------------------------------------
    def _given_components(self) -> Dict[str, Any]:
        return {"processor": None}  # transformers' processor class needs torchvision: built in _loaded

    def _loaded(self, pipe: Any) -> None:
        self._resizer = pipe.image_processor
        self.processor = build_processor(pipe.tokenizer, self._processor_config())
        wanted = getattr(pipe.text_encoder.config, "image_token_id", None)
        if wanted is not None and self.processor.image_token_id != wanted:
            raise ModelLoadError(f"model.path '{self.source.display}': the tokenizer's <|image_pad|> is token "
                                 f"{self.processor.image_token_id}, but Qwen2.5-VL reads images at token {wanted}: the "
                                 "tokenizer and text encoder are not of one model.", key="model.path",
                                 value=self.source.display)

    def _processor_config(self) -> Optional[Dict[str, Any]]:
        """The image processor's settings from the model's ``processor/`` folder, where they can be read."""
        if self.source.kind == "folder":
            return local_processor_config(self.source.location)
        where = self.source.location if self.source.kind == "hub" else \
            (getattr(self._mcfg, "config_path", "") or self.official)
        local = local_processor_config(where)
        if local is not None:
            return local
        found = sources.read_hub_json(str(where), "processor/preprocessor_config.json", self._mcfg)
        return found if isinstance(found, dict) else None

    def _set_zero_cond_t(self, on: bool) -> None:
        t = self.transformer
        if bool(getattr(t.config, "zero_cond_t", False)) == on:
            return
        log.info("%s: the transformer's zero_cond_t set %s (its config said otherwise)", self.family, on)
        t.register_to_config(zero_cond_t=on)
        t.zero_cond_t = on
        for block in t.transformer_blocks:
            block.zero_cond_t = on

    # --- text -------------------------------------------------------------------------------------
    def _vl_images(self, rows: Sequence[Sequence[Any]]) -> List[List[Any]]:
        """Per row, its control images (files or PIL images) as the pipeline hands them to the processor."""
        return [[vl_image(img if isinstance(img, Image.Image) else open_control(img), self.vl_area, self._resizer)
                 for img in row] for row in rows]

    def _encode(self, captions: List[str], grads: bool = False, images: Optional[List[List[Any]]] = None):
        """As ``QwenImageEdit(Plus)Pipeline._get_qwen_prompt_embeds`` for each caption with its row's images (VL
        size), padded at the end to the longest row: ([B, L, D], bool [B, L]). ``images`` None: see
        :meth:`_encode_standin`."""
        if images is None:
            return self._encode_standin(captions, [[BLANK_SIZE]] * len(captions), grads)
        rows = []
        for caption, imgs in zip(captions, images):
            text = prompt_text(self._template, caption, len(imgs), self.plus)
            inputs = self.processor(text=[text], images=list(imgs), padding=True, return_tensors="pt").to(self.device)
            with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
                hidden = self.text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                           pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                                           output_hidden_states=True,  # the logits are not used: only the
                                           logits_to_keep=1).hidden_states[-1]  # last token's (not the vocab's)
            rows.append(hidden[0][inputs["attention_mask"][0].bool()][self._drop:])
        return _padded(rows)

    def _encode_standin(self, captions: List[str], sizes: List[List[tuple]], grads: bool = False):
        """Features of the right length for encodes that name no control images — the VRAM estimate's, on fake
        tensors, where Qwen2.5-VL's vision tower cannot run (its attention windows and ``cu_seqlens`` are computed
        from the image grid's values): each row's text with as many ``<|image_pad|>`` tokens as controls of
        ``sizes`` ((width, height) each) bring at the VL area, through the language model without pixels. The
        sequence is the real one; the vision tower's own activations are not counted. Training never comes here:
        its batches name their control files (validate requires them for an edit model)."""
        rows = []
        for caption, row in zip(captions, sizes):  # one at a time, as the real encode
            parts = prompt_text(self._template, caption, len(row), self.plus).split(IMAGE_TOKEN)
            text = parts[0] + "".join(IMAGE_TOKEN * self._image_tokens(*wh) + rest for wh, rest in zip(row, parts[1:]))
            tokens = self.tokenizer([text], return_tensors="pt")
            with torch.set_grad_enabled(torch.is_grad_enabled() and grads):
                hidden = self.text_encoder(input_ids=tokens.input_ids.to(self.device),
                                           attention_mask=tokens.attention_mask.to(self.device),
                                           output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
            rows.append(hidden[0][self._drop:])
        return _padded(rows)

    def _image_tokens(self, width: int, height: int) -> int:
        """``<|image_pad|>`` tokens the processor makes of an image of ``width`` × ``height`` at the VL area."""
        w, h = calculate_dimensions(self.vl_area, width / height)
        ip = self.processor.image_processor
        factor = ip.patch_size * ip.merge_size
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=ip.size["shortest_edge"],
                              max_pixels=ip.size["longest_edge"])
        return (rh // factor) * (rw // factor)

    def encode_captions(self, captions: List[str], controls: Optional[Sequence[Sequence[Any]]] = None
                        ) -> Dict[str, Any]:
        """The text cache's entries: each caption with its row's control files or images (``controls``; None: see
        :meth:`_encode_standin`), in the text encoder's dtype (bf16 halves the entries, which hold the image tokens
        too)."""
        images = self._vl_images(controls) if controls is not None else None
        with torch.no_grad():
            embeds, mask = self._encode(list(captions), images=images)
        return {"prompt_embeds": embeds.cpu(), "prompt_mask": mask.float().cpu()}

    def _batch_images(self, batch: Dict[str, Any]) -> Optional[List[List[Any]]]:
        paths = batch.get("control_paths")
        return self._vl_images(paths) if paths else None

    def _standin_sizes(self, batch: Dict[str, Any], rows: int) -> List[List[tuple]]:
        sizes = [(c["mean"].shape[-1], c["mean"].shape[-2]) for c in batch.get("control_latents") or []]
        return [sizes or [BLANK_SIZE]] * rows

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        rows = len(batch["captions"])
        memo: Dict[str, Any] = {}

        def encode(captions: List[str], which: List[int], grads: bool):
            if "images" not in memo:  # opened once, only when something is encoded now
                memo["images"] = self._batch_images(batch)
            if memo["images"] is None:  # no control files (the VRAM estimate)
                return self._encode_standin(captions, [self._standin_sizes(batch, rows)[i] for i in which], grads)
            return self._encode(captions, grads, [memo["images"][i] for i in which])

        lengths = None  # each row's real tokens, known on the host for cached captions
        if batch.get("prompt_embeds") is not None:
            embeds = batch["prompt_embeds"].to(self.device)
            mask = batch["prompt_mask"].to(self.device).bool()
            lengths = batch.get("prompt_lengths")
        else:
            embeds, mask = encode(list(expand(batch["captions"])), list(range(rows)), "text_encoder" in train_text)
        cached = batch.get("empty_text")  # each row's empty instruction with its images, from the text cache
        if drop_te1 is not None and any(drop_te1) and cached is not None:
            embeds, mask, lengths = _dropped_from_cache(embeds, mask, lengths, drop_te1, cached)
        elif drop_te1 is not None and any(drop_te1):  # not cached (the text cache off): encoded now
            dropped = [i for i, d in enumerate(drop_te1) if d]
            with torch.no_grad():
                empty, empty_mask = encode([""] * len(dropped), dropped, False)
            embeds, mask = _replace_rows(embeds, mask, dropped, empty, empty_mask)
            lengths = None  # the empty instruction's rows: read from the mask at the step
        tokens, shapes = self._control_tokens(batch)
        return EditConditioning(embeds, mask, tokens, shapes, lengths)

    # --- the control tokens -----------------------------------------------------------------------
    def _control_tokens(self, batch: Dict[str, Any]) -> Tuple[Any, List[tuple]]:
        """Each control's posterior mean normalised as the pipeline normalises image latents, packed 2×2 and joined
        along the sequence; a batch without controls (the VRAM estimate of a config without control folders, which
        validate refuses for training) gets one control of zeros at the target's size."""
        controls = batch.get("control_latents")
        if not controls:
            mean = batch["latent_dist"]["mean"]
            controls = [{"mean": torch.zeros_like(mean)}]
            shift, scale = 0.0, 1.0
        else:  # made once per device (a tensor of Python numbers is a blocking copy to it)
            shift, scale = (t.view(1, -1, 1, 1) for t in self._latent_norm(torch.float32))
        tokens, shapes = [], []
        for control in controls:
            z = (control["mean"].to(self.device, torch.float32) - shift) / scale
            b, ch, h, w = z.shape
            if h % 2 or w % 2:
                raise ValueError(f"Qwen-Image packs 2×2 latent patches: control latents of {h}×{w} must be even "
                                 f"(control sizes a multiple of {2 * self.vae_scale_factor})")
            tokens.append(QwenImagePipeline._pack_latents(z, b, ch, h, w))
            shapes.append((1, h // 2, w // 2))
        return torch.cat(tokens, dim=1), shapes

    def _reference_tokens(self, conditioning: Any, batch: int, latent_hw: Tuple[int, int]) -> Tuple[Any, List[tuple]]:
        return conditioning.control_tokens, conditioning.control_shapes

    # --- sampling ---------------------------------------------------------------------------------
    def _sampling_components(self) -> Dict[str, Any]:
        return {"processor": self.processor}

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """``image``: the sample's control images (paths from the current folder), one for Edit, a list for Plus."""
        images = [open_control(p) for p in (getattr(sample_prompt, "control_images", None) or [])]
        if not images:  # the pipeline would fail on image=None
            raise ValueError(f"{self.family} samples edit an image: give the prompt its control_images.")
        return {"image": images if self.plus else images[0]}

    def text_fingerprint(self, mcfg: Any) -> str:
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{self.family}:vl{self.vl_area}:edit-template"

    # --- export -----------------------------------------------------------------------------------
    def save_single_file(self, path: Any, dtype: str, metadata: Optional[Dict[str, str]] = None) -> None:
        """The transformer's weights under diffusers' names; a 2511's with ComfyUI's marker, so it runs as 2511."""
        state = dict(self.transformer.state_dict())
        if self.family == "qwen-image-edit-2511":
            state[MARKER_2511] = torch.zeros(0)
        save_transformer_file(path, state, dtype, metadata)


def _padded(rows: List[Any]):
    """Rows of features [L_i, D] as [B, L, D] zero-padded at the end, with the bool mask of the real ones."""
    longest = max(r.shape[0] for r in rows)
    embeds = rows[0].new_zeros(len(rows), longest, rows[0].shape[-1])
    keep = torch.zeros(len(rows), longest, dtype=torch.bool, device=embeds.device)
    for i, r in enumerate(rows):
        embeds[i, :r.shape[0]] = r
        keep[i, :r.shape[0]] = True
    return embeds, keep


def _replace_rows(embeds, mask, rows: List[int], new, new_mask):
    """``embeds``/``mask`` with ``rows`` replaced by ``new``/``new_mask``, padded at the end to the longer."""
    longest = max(embeds.shape[1], new.shape[1])
    embeds, mask = pad_tokens(embeds, mask, longest)
    new, new_mask = pad_tokens(new.to(embeds), new_mask.to(mask.device), longest)
    index = to_device(torch.tensor(rows), embeds.device)  # the dropped rows, chosen on the host
    return embeds.index_copy(0, index, new), mask.index_copy(0, index, new_mask)


def _dropped_from_cache(embeds, mask, lengths: Optional[List[int]], drops: List[bool], cached: Dict[str, Any]):
    """The dropped rows' features and mask taken from ``cached`` (the batch's ``empty_text``: each row's empty
    instruction with its own images; :func:`rows_replaced`, both padded to the longer); each row's length stays
    known on the host where both sides' are."""
    embeds, mask = rows_replaced(drops, embeds, mask, cached["prompt_embeds"], cached["prompt_mask"])
    theirs = cached.get("prompt_lengths")
    if lengths is None or theirs is None:
        return embeds, mask, None
    return embeds, mask, [e if d else n for n, e, d in zip(lengths, theirs, drops)]


def resolve_variant(mcfg: Any, source: Any, found: Optional[str]) -> str:
    """The variant to load: what the weights say (``found``), or ``model.family`` where they cannot tell — a
    transformer file (Qwen-Image, -Edit and -2509 have the same tensors) and 2509 against 2511 (one pipeline class,
    one set of tensors; the transformer config's ``zero_cond_t`` is set from the variant). A folder of another
    pipeline, or ComfyUI's 2511 file against another variant, is refused."""
    asked = str(getattr(mcfg, "family", "auto") or "auto")
    if asked == "auto":
        if source.kind == "single_file" and found == "qwen-image":
            log.info("'%s' is a Qwen-Image transformer file, loaded as Qwen-Image (text to image): the weights of "
                     "Qwen-Image-Edit and -2509 look the same; for an edit model set model.family to "
                     "qwen-image-edit, qwen-image-edit-2509 or qwen-image-edit-2511", source.display)
        return found or "qwen-image"
    if found is None or found == asked or (source.kind == "single_file" and found == "qwen-image"):
        return asked
    if {asked, found} == set(PLUS):
        log.info("model.family %s: '%s' looked like %s (its transformer config or name); loaded as %s", asked,
                 source.display, found, asked)
        return asked
    raise ModelLoadError(f"model.family is {asked}, but '{source.display}' holds {found}. Set model.family to {found} "
                         "or auto, or point model.path at the model you meant.", key="model.family", value=asked)


def load_qwen_image(mcfg: Any, workspace: str, device: Any = "cpu") -> QwenImage:
    """The family object for ``mcfg``: :class:`QwenImage` for the text-to-image model, :class:`QwenImageEdit` for
    the edit models (``FamilyInfo.family_class`` of this family)."""
    source = classify_source(mcfg.path, workspace)
    variant = resolve_variant(mcfg, source, detect_source_family(source, mcfg))
    if variant in EDIT_VARIANTS:
        return QwenImageEdit(mcfg, workspace, device, variant=variant)
    return QwenImage(mcfg, workspace, device)
