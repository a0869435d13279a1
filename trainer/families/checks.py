"""``validate``'s family rules: options the model's family (or its objective) cannot use, refused
before any model loads, naming the field and the reason. Torch-free.

The family is ``model.family`` when set, else what can be told without loading weights: a
``builtin:`` name, a diffusers folder's configs, or a ``.safetensors`` file's header (read as JSON,
no torch). A hub id with ``model.family: auto`` is checked when the model loads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from omegaconf import OmegaConf

from trainer.config.schema import ModelConfig, PartsConfig
from trainer.config.fields import PART_OF_SLOT, part_key, part_of
from trainer.data.buckets import parse_resolution
from trainer.errors import ConfigError, Issue
from trainer.families import MISSING, Evidence, claim, embedding_families, info_for, infos, tiny_models
from trainer.objectives import refused_options


def read_safetensors_header(path: Path) -> Dict[str, Any]:
    """The JSON header of a .safetensors file (8-byte length + JSON: key -> dtype, shape, offsets; and
    ``__metadata__``), without torch."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a .safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= min(path.stat().st_size - 8, 100 * 2**20):
            raise ValueError(f"{path}: not a .safetensors file (bad header length)")
        return json.loads(fh.read(n))


def read_safetensors_shapes(path: Path) -> Dict[str, Tuple[int, ...]]:
    """key -> shape from a .safetensors header, without torch."""
    header = read_safetensors_header(path)
    return {k: tuple(v.get("shape", ())) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def family_without_loading(mcfg: Any, workspace: str = "") -> Optional[str]:
    """The variant of ``model`` as far as it can be told cheaply; None when it cannot (hub ids, .ckpt,
    unreadable or unknown files: the loader reports those)."""
    family = getattr(mcfg, "family", "auto") or "auto"
    return family if family != "auto" else detected_without_loading(mcfg, workspace)


def detected_without_loading(mcfg: Any, workspace: str = "") -> Optional[str]:
    """What ``model.path`` holds as far as it can be told cheaply, whatever ``model.family`` says; None when it
    cannot be told."""
    path = str(getattr(mcfg, "path", "") or "")
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        entry = tiny_models().get(name)
        if not entry:
            return None
        # a tiny model named after a variant (tiny-flux-kontext) is that variant; the others their family's first
        named = name.removeprefix("tiny-")
        return named if named in entry[0].variants else entry[0].choices[0]
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            def read(rel: str):
                f = p / rel
                if not f.is_file():
                    return MISSING
                try:
                    data = json.loads(f.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    return MISSING
                return data if isinstance(data, dict) else MISSING
            ev = Evidence("folder", str(p), read_json=read)
        elif p.is_file() and p.suffix.lower() == ".safetensors":
            ev = Evidence("single_file", str(p), shapes=read_safetensors_shapes(p))
        else:
            return None
        return claim(ev)
    except (OSError, ValueError):
        return None  # the loader says what is wrong with the file, at the field


def check_controls(cfg: Any, info: Any, variant: str) -> None:
    """Control/reference images as the model takes them: none for a text-to-image model, at least and at most
    as many as an edit model reads, the same number in every concept (a batch holds one layout), and samples
    with what they edit."""
    fewest, most = info.control_range(variant)
    counts = {}
    for i, concept in enumerate(cfg.data.concepts or []):
        if not concept.enabled:
            continue
        n = len([p for p in (concept.get("control_paths", None) or []) if str(p).strip()])
        counts[i] = n
        key = f"data.concepts.{i}.control_paths"
        if n and not most:
            edits = [v for v in info.variants if info.control_range(v)[1]]
            hint = (f" If model.path is one of {info.label}'s edit models whose weights do not say which (a single "
                    f"file or transformer file with the base model's keys), set model.family to it: model.family: "
                    f"{edits[0]}" + (f" (or {', '.join(edits[1:])})." if edits[1:] else ".") if edits else "")
            raise ConfigError(f"{key}: {info.label} ({variant}) takes no control or reference images; remove the "
                              "control folders, or pick an edit model (FLUX.1 Kontext, Qwen-Image-Edit) or one that "
                              "takes references." + hint, key=key)
        if n < fewest:
            raise ConfigError(f"{key}: {variant} learns from pairs: give concept {i} {fewest} control folder(s) whose "
                              "images (same file names) are what each target was made from.", key=key)
        if n > most:
            raise ConfigError(f"{key}: concept {i} has {n} control folders, but {variant} takes at most {most} "
                              "control images.", key=key)
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"concept {i}: {n}" for i, n in counts.items())
        raise ConfigError(f"data.concepts: the concepts have different numbers of control folders ({shown}); a batch "
                          "holds one layout, so give every concept the same number.", key="data.concepts")
    for i, prompt in enumerate(cfg.sampling.prompts or []):
        n = len(prompt.get("control_images", None) or [])
        key = f"sampling.prompts.{i}.control_images"
        if n > most:
            raise ConfigError(f"{key}: {n} image(s), but {variant} takes "
                              + (f"at most {most}." if most else "none: remove them."), key=key)
        if n < fewest:
            raise ConfigError(f"{key}: {variant} samples by editing an image: give the sample {fewest} image(s) to "
                              "edit (e.g. one of the concept's control images).", key=key)


def check_start_images(cfg: Any, info: Any, variant: str) -> None:
    """An image-to-video model's samples start from an image: every sample prompt names one (``image``)."""
    if variant not in info.start_image:
        return
    for i, prompt in enumerate(cfg.sampling.prompts or []):
        if not str(prompt.get("image", "") or "").strip():
            key = f"sampling.prompts.{i}.image"
            raise ConfigError(f"{key}: start image required: {variant} is an image-to-video model, its samples start "
                              "from an image (e.g. the first frame of a training clip).", key=key)


def check_family_options(cfg: Any) -> None:
    """Raise ConfigError for the first option the family of ``cfg.model`` cannot use (a ``model.family`` the
    model's files contradict first, as the loader would)."""
    workspace = str(cfg.general.get("workspace", "") or "")
    variant = family_without_loading(cfg.model, workspace)
    if not variant:
        return
    family = getattr(cfg.model, "family", "auto") or "auto"
    found = detected_without_loading(cfg.model, workspace) if family != "auto" else None
    if found is not None and info_for(found).name != info_for(family).name:
        got, want = info_for(found), info_for(family)
        raise ConfigError(f"model.family is {family} ({want.label}), but '{cfg.model.path}' holds a {got.label} "
                          f"model ({found}). Set model.family to {found.removesuffix('-inpaint')} or auto.",
                          key="model.family", value=family)
    info = info_for(variant)
    for key, message in refused_options(info.objective, cfg.loss, info.label):
        raise ConfigError(message, key=key)
    if info.objective == "cosine" and cfg.model.prediction_type not in ("auto", "epsilon"):
        raise ConfigError(f"model.prediction_type = {cfg.model.prediction_type}: {info.label} predicts the noise "
                          "(epsilon). Set it to auto.", key="model.prediction_type", value=cfg.model.prediction_type)
    if info.objective == "flow" and cfg.model.prediction_type != "auto":
        raise ConfigError(f"model.prediction_type = {cfg.model.prediction_type}: {info.label} is a flow-matching "
                          "model (it predicts the velocity ε − x). Set it to auto.", key="model.prediction_type",
                          value=cfg.model.prediction_type)
    check_controls(cfg, info, variant)
    check_start_images(cfg, info, variant)
    t = cfg.training
    slots = {p.slot for p in info.parts}
    for slot in PART_OF_SLOT:
        if part_of(cfg, slot).train and t.method in ("lora", "finetune") and slot not in slots:
            have = ", ".join(f"{p.label} ({part_key(p.slot, 'train')})" for p in info.parts)
            key = part_key(slot, "train")
            raise ConfigError(f"{key} is on, but {info.label} has no such part; its parts are {have}.", key=key)
    if not info.embeddings and (t.method == "embedding" or cfg.embedding.train_alongside):
        key = "training.method" if t.method == "embedding" else "embedding.train_alongside"
        raise ConfigError(f"{key}: textual-inversion embeddings are trained for {embedding_families()}; this is "
                          f"a {info.label} model. Train a LoRA or a fine-tune instead.", key=key)
    if not info.clip_skip:
        if int(cfg.model.clip_skip or 0):
            raise ConfigError(f"model.clip_skip = {cfg.model.clip_skip}: {info.label} does not condition on a CLIP "
                              "hidden layer (clip skip is an SD 1.x/2.x/SDXL setting). Set it to 0.",
                              key="model.clip_skip", value=cfg.model.clip_skip)
    if t.method == "finetune" and info.finetune_slots:
        for slot in ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
            if part_of(cfg, slot).train and slot not in info.finetune_slots:
                part = info.part(slot)
                raise ConfigError(f"{part_key(slot, 'train')} is on with training.method = finetune, but a {info.label} "
                                  f"fine-tune is saved as the {info.part('unet').label.lower()} alone, so the trained "
                                  f"{part.label if part else slot} would be lost. Train it with LoRA, or turn it off.",
                                  key=part_key(slot, "train"))
    for slot in PART_OF_SLOT:
        if part_of(cfg, slot).get("enabled", True):
            continue
        part = info.part(slot)
        key = part_key(slot, "enabled")
        if part is not None and not part.optional:
            optional = [p.label for p in info.parts if p.optional]
            raise ConfigError(f"{key} = false: {info.label} cannot do without its {part.label}"
                              + (f" (only {', '.join(optional)} can be switched off)" if optional else "")
                              + ". Turn it back on.", key=key, value=False)
        if part is not None and part_of(cfg, slot).train:
            raise ConfigError(f"{key} = false with {part_key(slot, 'train')} on: an encoder that is switched off "
                              "cannot train. Turn one of them around.", key=key, value=False)
    if info.pixel_multiple:
        check_pixel_multiple(cfg, info)
    check_sample_frames(cfg, info)
    for key, off, why in info.refuses:
        if key.startswith("lora.") and cfg.training.method != "lora":
            continue  # the adapter's settings mean nothing to a fine-tune or an embedding
        value = OmegaConf.select(cfg, key)
        allowed = off if isinstance(off, tuple) else (off,)
        if value not in allowed:
            raise ConfigError(f"{key} = {value}: {why}. Set it to {' or '.join(str(a) for a in allowed)}.",
                              key=key, value=value)


def check_sample_frames(cfg: Any, info: Any) -> None:
    """``sampling.frames``: a frame count the video family's VAE takes; more than one frame only for a video family."""
    frames = int(cfg.sampling.get("frames", 0) or 0)
    if frames == 0:
        return
    video = info.video
    if video is None:
        if frames > 1:
            raise ConfigError(f"sampling.frames = {frames}: {info.label} draws images (one frame). Set it to 0.",
                              key="sampling.frames", value=frames)
        return
    if not video.fits(frames):
        k = video.frame_multiple
        near = max(1, round((frames - 1) / k) * k + 1)
        raise ConfigError(f"sampling.frames = {frames}: {info.label}'s VAE takes {k}k+1 frames (1, {k + 1}, "
                          f"{2 * k + 1} … {video.max_frames}). Use e.g. {near}.", key="sampling.frames", value=frames)


def check_pixel_multiple(cfg: Any, info: Any) -> None:
    """Training sizes a family's latent encoder can take: every resolution and the bucket step."""
    if not any(c.enabled for c in cfg.data.concepts):
        return  # nothing to train on (a config that only loads or samples the model): sizes do not matter
    m = info.pixel_multiple
    why = (f"{info.label} trains on image sides that are multiples of {m} pixels (its latents come from an encoder "
           f"that fixes the size, e.g. 1024 px → 24×24)")
    if cfg.data.aspect_buckets and int(cfg.data.bucket_step) % m:
        raise ConfigError(f"data.bucket_step = {cfg.data.bucket_step}: {why}. Set it to {m}.", key="data.bucket_step",
                          value=cfg.data.bucket_step)
    places = [("data.resolution", cfg.data.resolution)] + [
        (f"data.concepts.{i}.resolution", c.resolution) for i, c in enumerate(cfg.data.concepts) if c.get("resolution")]
    for key, value in places:
        for w, h in parse_resolution(value):
            if w % m or h % m:
                raise ConfigError(f"{key} = {value}: {why}. Use e.g. {max(m, round(w / m) * m)}.", key=key, value=value)


def part_warnings(cfg: Any) -> list:
    """Per-part settings of parts the model's family does not have (told without loading it): ignored, and
    said so (``train`` on such a part is an error, raised by :func:`check_family_options`)."""
    variant = family_without_loading(cfg.model, str(cfg.general.get("workspace", "") or ""))
    if not variant:
        return []
    info = info_for(variant)
    have = {p.slot for p in info.parts}
    defaults = OmegaConf.structured(PartsConfig)
    out = []
    for slot, part in PART_OF_SLOT.items():
        if slot in have:
            continue
        changed = [k for k in cfg.parts[part] if k not in ("train", "dtype") and cfg.parts[part][k] != defaults[part][k]]
        if changed:
            out.append(Issue(f"parts.{part}.{changed[0]}",
                             f"parts.{part}: {', '.join(changed)} set, but {info.label} has no "
                             f"{part.replace('_', ' ')}: ignored."))
    return out


def guidance_warnings(cfg: Any) -> list:
    """``model.guidance_scale`` changed for a model whose transformer has no guidance embedding (told without
    loading it): ignored, and said so."""
    value = cfg.model.get("guidance_scale", ModelConfig.guidance_scale)
    if value == ModelConfig.guidance_scale:
        return []
    variant = family_without_loading(cfg.model, str(cfg.general.get("workspace", "") or ""))
    if not variant:
        return []
    info = info_for(variant)
    if variant in info.guidance_variants:
        return []
    takes = [v for i in infos().values() for v in i.guidance_variants]
    return [Issue("model.guidance_scale",
                  f"model.guidance_scale = {value}: {info.label} ({variant}) has no guidance embedding, so training "
                  f"ignores it (only the guidance-distilled {', '.join(takes)} read it). The guidance of samples is "
                  "each sample prompt's cfg_scale.")]


def resolution_shift_warnings(cfg: Any) -> list:
    """``loss.resolution_shift`` on a flow-matching model whose scheduler has a fixed shift (SD3, Z-Image, Flux.1
    schnell, Flux.2, Wan: told without loading it), or under a fixed ``loss.flow_shift``: ignored, and said so."""
    loss = cfg.loss
    if not loss.get("resolution_shift", False):
        return []
    variant = family_without_loading(cfg.model, str(cfg.general.get("workspace", "") or ""))
    info = info_for(variant) if variant else None
    if info is not None and info.objective != "flow":
        return []  # the other objectives refuse it (validate)
    if float(loss.get("flow_shift", 0.0) or 0.0) > 0:
        return [Issue("loss.resolution_shift", f"loss.resolution_shift is ignored: loss.flow_shift = "
                                               f"{loss.flow_shift:g} sets a fixed shift, which wins.")]
    if info is None or variant in info.dynamic_shift_variants:
        return []
    takes = [i.label + (f" ({', '.join(i.dynamic_shift_variants)})" if set(i.dynamic_shift_variants) != set(i.variants)
                        else "") for i in infos().values() if i.dynamic_shift_variants]
    return [Issue("loss.resolution_shift",
                  f"loss.resolution_shift is ignored: {info.label} ({variant}) samples with a fixed shift, not one "
                  f"by the image size (only {', '.join(takes)} do); loss.flow_shift sets the training shift.")]
