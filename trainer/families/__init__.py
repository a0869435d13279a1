"""The model families Atelier trains: a torch-free registry, and detection that asks each family.

A family is one folder under ``trainer/families/`` with an ``info.py`` that defines ``INFO`` (a
:class:`FamilyInfo`, plain data, importable without torch) and, beside it, the family class, its
detection, export namer/key maps, tiny offline model and shipped configs. Adding a family is that
folder plus one line in :data:`REGISTERED`.

The schema (``model.family`` choices), ``validate`` (options a family's objective refuses), the
UI (its Quick start lists :func:`quick_choices`) and ``builtin:`` model names read this registry; nothing
here imports torch, diffusers or a family class. :func:`family_class` imports the class only when a model
is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from trainer.families.common.describe import describe_non_checkpoint

# One line per family: the folder name under trainer/families/. Order = detection order.
REGISTERED: Tuple[str, ...] = (
    "sd",
    "sdxl",
    "sana",  # before PixArt, whose single-file keys (blocks.N.cross_attn.kv_linear) Sana shares
    "pixart",
    "flux",
    "cascade",
    "wuerstchen",
    "sd3",
    "chroma",
    "lumina2",
    "krea2",
    "zimage",
    "qwenimage21",  # before qwenimage, which refuses every other QwenImage* pipeline
    "qwenimage",
    "flux2",
    "wan",
    "ideogram4",
    "hidream",
    "ernieimage",
    "hunyuanimage",
)


@dataclass(frozen=True)
class Part:
    """One trainable part of a family.

    ``slot`` is the settings group and the key the training methods, optimizer groups, precision and
    stop-after windows use: ``unet`` (the denoiser, UNet or transformer), ``text_encoder``,
    ``text_encoder_2``. ``attr`` is the attribute holding the module on the loaded family object."""

    slot: str
    attr: str
    role: str  # "denoiser" | "text_encoder"
    label: str  # what the UI calls it: "UNet", "Transformer", "CLIP-L", "T5-XXL"
    optional: bool = False  # a text encoder the model can do without (parts.<part>.enabled may be off)


@dataclass(frozen=True)
class QuickChoice:
    """One model of the web UI's Quick start: a name a user recognises, and the preset each method starts from.

    ``presets`` maps ``training.method`` (``lora``, ``finetune``, ``embedding``) to a preset name, in the order
    the page offers them; a preset's memory tiers (``<preset>-<N>gb``) are the preset files beside it, not
    listed here. A ``builtin`` choice's presets name their model and images (a built-in tiny model and the
    demo shapes): the user may give neither."""

    key: str  # the Quick start's value for it: "sd15", "sdxl-inpaint", "flux2-dev"
    label: str  # "SDXL (and Pony, Illustrious, … based on it)"
    presets: Dict[str, str]
    builtin: bool = False


@dataclass(frozen=True)
class VideoSpec:
    """A family that trains on clips: how many frames its VAE takes and at what rate its model was trained.

    A clip's frame count must be ``frame_multiple * k + 1`` (the VAE keeps the first frame and compresses every
    ``frame_multiple`` after it: 1, 5, 9, … 81 for Wan); images train as one-frame clips. Clips are resampled to
    ``fps`` before frames are taken."""

    frame_multiple: int = 4
    fps: float = 16.0
    max_frames: int = 81  # the longest clip the model was trained on

    def fits(self, frames: int) -> bool:
        """Whether ``frames`` is a frame count the VAE takes."""
        return frames >= 1 and (frames - 1) % self.frame_multiple == 0


@dataclass(frozen=True)
class SampleDefaults:
    """What a sample prompt that leaves ``steps`` or ``cfg_scale`` empty (and ``sampling.scheduler: auto``) samples
    with: the model's own settings, so a sample looks as the model's authors mean it to (Flux.1 [dev] at guidance 7
    or Z-Image Turbo at CFG 7 burn, and look like a broken LoRA).

    The values are the ``__call__`` defaults of ``pipeline`` (the diffusers class the family's sampler calls) unless
    ``differs`` names them: there the pipeline's default is a placeholder shared across models (Flux.1 [schnell]
    inherits [dev]'s 28 steps and guidance 3.5) and the model card's setting, or Atelier's, is declared instead."""

    steps: int
    guidance: float  # what cfg_scale means for the model: CFG, embedded guidance, or true CFG (``guidance_arg``)
    scheduler: str = ""  # a sampling.scheduler name (DDIM …) for the DDPM families; "" = the model's own scheduler
    pipeline: str = ""  # the diffusers pipeline class these defaults are read from
    steps_arg: str = "num_inference_steps"  # that pipeline's names for the two
    guidance_arg: str = "guidance_scale"
    differs: Tuple[str, ...] = ()  # "steps" / "guidance": declared from the model card (or Atelier), not the pipeline
    why: str = ""  # where a value ``differs`` comes from
    frames: int = 1  # a video model's sample length (its pipeline's num_frames) where sampling.frames is 0 (auto)

    def frames_for(self, frames: Optional[int]) -> int:
        """``sampling.frames``, or this default when it is 0 (auto)."""
        return self.frames if frames in (None, 0) else int(frames)

    def steps_for(self, steps: Optional[int]) -> int:
        """A prompt's ``steps``, or this default when it is empty."""
        return self.steps if steps in (None, 0) else int(steps)

    def guidance_for(self, cfg_scale: Optional[float]) -> float:
        """A prompt's ``cfg_scale``, or this default when it is empty (0 is a value: no guidance)."""
        return self.guidance if cfg_scale is None else float(cfg_scale)

    def sampler_for(self, scheduler: Optional[str]) -> Optional[str]:
        """What ``Family.pipeline`` takes for ``sampling.scheduler``: the name the config gives, else this default
        (None: the model's own scheduler)."""
        chosen = scheduler if scheduler not in (None, "", "auto") else self.scheduler
        return chosen or None


@dataclass(frozen=True)
class FamilyInfo:
    """What a family is, as data: read by the schema, validate, the UI and detection."""

    name: str  # registry name = folder name: "sd", "pixart"
    label: str  # "Stable Diffusion 1.x/2.x"
    choices: Tuple[str, ...]  # model.family values it owns: ("sd15", "sd2")
    variants: Tuple[str, ...]  # what detection may return (choices + e.g. "sd15-inpaint", "flux-dev")
    parts: Tuple[Part, ...]
    objective: str  # "ddpm" | "flow" | "cosine" (trainer.objectives)
    family_class: str  # "trainer.families.pixart.family:PixArt" (or a function (mcfg, workspace, device) -> family)
    detect: str  # module with claim(evidence) -> variant | None (raises ValueError to refuse)
    tiny: Dict[str, str] = field(default_factory=dict)  # builtin name -> "module:function(root) -> paths"
    caption_limit: int = 77  # longest caption (tokens) the default text path sees
    # options this family cannot use, refused by validate: (config key, the value that means "off" or a tuple of
    # the values it takes, why); lora.* keys only on a LoRA run
    refuses: Tuple[Tuple[str, Any, str], ...] = ()
    # parts a fine-tune can save (the single file holds the denoiser alone in some families); () = all
    finetune_slots: Tuple[str, ...] = ()
    # image sides must be multiples of this (0 = whatever the buckets give): a latent size the encoder fixes
    pixel_multiple: int = 0
    # textual-inversion embeddings train for it (its text encoders are CLIPs whose token table the
    # embedding method extends)
    embeddings: bool = False
    # config fields only this family (and others that list them) reads: the UI shows them for it alone
    own_fields: Tuple[str, ...] = ()
    # what the web UI's Quick start offers for it: each model a user picks, with its presets
    quick_start: Tuple[QuickChoice, ...] = ()
    # its text encoders are CLIPs it conditions on a hidden layer of (model.clip_skip applies)
    clip_skip: bool = False
    # variants whose transformer embeds a guidance scale (guidance-distilled: model.guidance_scale feeds it)
    guidance_variants: Tuple[str, ...] = ()
    # variants whose scheduler shifts σ by the image size (``use_dynamic_shifting``): loss.resolution_shift applies to
    # them alone; the others' schedulers have a fixed shift
    dynamic_shift_variants: Tuple[str, ...] = ()
    # variant -> (fewest, most) control/reference images an example takes (edit models, references); absent = none
    controls: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    # variant -> what its samples use where a prompt leaves steps/cfg_scale empty (every variant has one; a family
    # whose loaded model tells two kinds apart adds keys of its own, e.g. a step-distilled and a base model)
    sample_defaults: Dict[str, SampleDefaults] = field(default_factory=dict)
    # it trains on video clips (None: an image family, which refuses clip concepts)
    video: Optional[VideoSpec] = None
    # variant -> the frame rate it was trained at, where it is not ``video.fps`` (Wan 2.2 TI2V-5B: 24)
    video_fps: Dict[str, float] = field(default_factory=dict)
    # variants whose samples start from an image (image-to-video): every sample prompt needs sampling.prompts.N.image
    start_image: Tuple[str, ...] = ()

    def control_range(self, variant: str) -> Tuple[int, int]:
        """(fewest, most) control images ``variant`` takes: (0, 0) for a plain text-to-image model."""
        return self.controls.get(variant, (0, 0))

    def video_for(self, variant: str) -> Optional[VideoSpec]:
        """The clip rules of ``variant``: ``video`` at the variant's own frame rate (None for an image family)."""
        if self.video is None or variant not in self.video_fps:
            return self.video
        return replace(self.video, fps=self.video_fps[variant])

    def sample_defaults_for(self, variant: str) -> SampleDefaults:
        """The sample defaults of ``variant`` (a detected variant or a ``model.family`` choice)."""
        try:
            return self.sample_defaults[variant]
        except KeyError:
            raise KeyError(f"family {self.name} declares no sample defaults for {variant!r}") from None

    def part(self, slot: str) -> Optional[Part]:
        return next((p for p in self.parts if p.slot == slot), None)

    @property
    def text_slots(self) -> Tuple[str, ...]:
        return tuple(p.slot for p in self.parts if p.role == "text_encoder")


def _load_info(name: str) -> FamilyInfo:
    return importlib.import_module(f"trainer.families.{name}.info").INFO


_INFOS: Optional[Dict[str, FamilyInfo]] = None


def family_only_fields() -> Tuple[str, ...]:
    """Every config field some family lists as its own (the UI hides those its model's family does not read)."""
    return tuple(sorted({k for info in infos().values() for k in info.own_fields}))


def embedding_families() -> str:
    """The labels of the families that train textual-inversion embeddings, for messages."""
    return ", ".join(info.label for info in infos().values() if info.embeddings)


def infos() -> Dict[str, FamilyInfo]:
    """Every registered family's info, in detection order (torch-free)."""
    global _INFOS
    if _INFOS is None:
        _INFOS = {name: _load_info(name) for name in REGISTERED}
    return _INFOS


def family_choices() -> List[str]:
    """The values ``model.family`` accepts: ``auto`` and each family's own choices."""
    return ["auto"] + [c for info in infos().values() for c in info.choices]


def info_for(variant: str) -> FamilyInfo:
    """The family that owns a ``model.family`` choice or a detected variant (``sd15-inpaint`` → sd)."""
    for info in infos().values():
        if variant == info.name or variant in info.choices or variant in info.variants:
            return info
    raise KeyError(f"no registered family owns {variant!r}; known: {', '.join(family_choices()[1:])}")


def quick_choices() -> Dict[str, QuickChoice]:
    """The Quick start's models by key: the built-in ones first (they need nothing from the user), then each
    family's in registry order."""
    choices = [c for info in infos().values() for c in info.quick_start]
    return {c.key: c for c in sorted(choices, key=lambda c: not c.builtin)}


def tiny_models() -> Dict[str, Tuple[FamilyInfo, str]]:
    """``builtin:<name>`` models: name -> (family info, "module:function")."""
    return {name: (info, fn) for info in infos().values() for name, fn in info.tiny.items()}


def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def family_class(variant: str) -> Any:
    """The class that loads and trains ``variant`` — or a function choosing among a family's classes by variant, called
    the same way (imports it: torch/diffusers load here)."""
    return _resolve(info_for(variant).family_class)


def build_tiny(name: str, root: Any) -> Dict[str, Any]:
    """Build (once) the built-in tiny model ``name`` under ``root``: ``{"diffusers": folder, "single_file": file}``."""
    _, fn = tiny_models()[name]
    return _resolve(fn)(name, root)


# --------------------------------------------------------------------------------------------------
# Detection: each family claims or declines what it is shown
# --------------------------------------------------------------------------------------------------

MISSING = object()  # a file a folder/hub repo does not have (vs None: cannot tell, e.g. offline)


@dataclass
class Evidence:
    """What detection may look at, without loading weights.

    ``kind``: ``single_file`` (``shapes``: key → shape), ``folder`` or ``hub`` (``read_json(relpath)``
    returns the parsed JSON object, :data:`MISSING` when the file is absent, None when it cannot be
    told). ``where`` names the source in messages."""

    kind: str
    where: str
    shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    read_json: Callable[[str], Any] = lambda rel: MISSING

    def json(self, rel: str) -> Optional[dict]:
        """The JSON object at ``rel`` or None (absent, unreadable, unknown)."""
        value = self.read_json(rel)
        return value if isinstance(value, dict) else None

    def has_prefix(self, *prefixes: str) -> bool:
        return any(k.startswith(prefixes) for k in self.shapes)


# Weights Atelier does not train yet, recognised so the message can name them (first match wins).
# (single-file key marker, diffusers class name marker, what to say)
NOT_YET = (
    ("", "HunyuanDiT", "Hunyuan-DiT"),
    ("", "Kandinsky", "Kandinsky"),
    ("", "AuraFlow", "AuraFlow"),
    ("", "Lumina", "Lumina"),
)


def _class_names(ev: Evidence) -> List[str]:
    names = []
    index = ev.json("model_index.json")
    if index:
        names.append(str(index.get("_class_name", "")))
        names += [str(v[1]) for v in index.values() if isinstance(v, list) and len(v) == 2]
    for sub in ("transformer", "unet", "prior", "decoder"):
        cfg = ev.json(f"{sub}/config.json")
        if cfg:
            names.append(str(cfg.get("_class_name", "")))
    own = ev.json("config.json")
    if own:
        names.append(str(own.get("_class_name", "")))
    return [n for n in names if n]


def unclaimed_message(ev: Evidence) -> str:
    """Why nobody claimed ``ev``: the closest family, or what the file is instead."""
    trained = ", ".join(info.label for info in infos().values())
    keys = list(ev.shapes)
    stripped = [k.split("model.diffusion_model.", 1)[-1] for k in keys]
    classes = _class_names(ev)
    for key_marker, class_marker, label in NOT_YET:
        if (key_marker and any(k.startswith(key_marker) or f".{key_marker}" in k for k in stripped)) or \
                any(class_marker in c for c in classes):
            return (f"{ev.where} looks like {label}, which Atelier does not train yet (it trains {trained}). "
                    "Pick a model of one of those families.")
    if ev.kind == "single_file":
        return describe_non_checkpoint(ev.shapes, ev.where) + f". Atelier trains {trained}."
    if classes:
        return (f"{ev.where} holds {', '.join(sorted(set(classes)))}, which no Atelier family loads "
                f"(it trains {trained}).")
    if ev.kind == "folder":
        return (f"{ev.where} is a folder but not a diffusers model (no model_index.json and no unet/ or "
                "transformer/ folder). Point model.path at the model's top folder, or at a .safetensors file.")
    return (f"{ev.where}: the hub repo has neither model_index.json nor unet/config.json (nor transformer/config.json), "
            "so it is not a diffusers pipeline. If it holds a single .safetensors checkpoint, download that file and set "
            "model.path to it.")


# key endings of weights stored pre-quantised for inference: bitsandbytes NF4/FP4/int8, torchao/quanto, NVFP4 (its
# second scale), GGUF-in-safetensors conversions; such a file cannot be trained from (its weights are not floats). fp8
# files (plain or with per-tensor scales: common/fp8_files.py) are not among them: they load as a LoRA's frozen base
PREQUANTISED = (".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4",
                ".nested_absmax", ".SCB", "._data", ".weight_scale_2")


def _refuse_prequantised(ev: Evidence) -> None:
    marked = [k for k in ev.shapes if k.endswith(PREQUANTISED)]
    if marked:
        raise ValueError(f"the weights are stored pre-quantised for inference ({marked[0]} …: an NF4/FP4/int8 "
                         "checkpoint), which cannot be trained from. Use the model's full-precision release (bf16/fp16 "
                         ".safetensors or the diffusers folder) or its fp8 one; to save memory, let Atelier store the "
                         "frozen base in fp8 (parts.denoiser.fp8)")


def claim(ev: Evidence) -> Optional[str]:
    """The variant of the first family that claims ``ev``; None when none does. A family that
    recognises the weights but refuses them (an SDXL refiner, a Flux fill model) raises ValueError, and so
    does a file of pre-quantised weights."""
    if ev.kind == "single_file":
        _refuse_prequantised(ev)
    for info in infos().values():
        variant = _resolve(info.detect).claim(ev)
        if variant:
            return variant
    return None
