"""The family protocol: everything the loop, the methods and the writers may call on a loaded model.

A family object holds its loaded modules as attributes named by its parts (``FamilyInfo.parts``:
``unet``/``transformer``, ``text_encoder``, ``text_encoder_2`` …) plus a VAE, and provides::

    latents      = family.sample_latents(family.encode_pixels(pixels), generator)   # cached dist → latents
    cond         = family.batch_condition(batch, expand, train_text, drop_te1=…, drop_te2=…)
    timesteps    = family.objective.sample_timesteps(bsz, cfg.loss, generator, latents)
    noisy, target = family.objective.noisy_and_target(latents, noise, timesteps)
    model_pred   = family.predict(family.model_input(noisy, batch, generator, warn), timesteps, cond)
    losses       = per_sample_loss(model_pred, target, cfg.loss, timesteps, family.objective, mask)

and for samples ``sample_defaults()``, ``pipeline(sampler)``, ``sampling_kwargs()``,
``prompt_kwargs(sample_prompt)``; for the caches ``encode_captions(captions)`` and ``fingerprint()``; for the
writers ``lora_namer()``, ``lora_metadata(...)`` and ``save_single_file(...)``.

Imports nothing heavy at module level.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from trainer.errors import ModelLoadError
from trainer.families import SampleDefaults, info_for
from trainer.families.sources import source_fingerprint

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def part_dtype(mcfg: Any, slot: str) -> str:
    """The storage dtype name of a part: ``parts.<part>.dtype`` as carried by :class:`trainer.families.sources.ModelSettings`
    (``load_model`` builds it from the whole config); fp32 for a bare ``model`` section."""
    dtypes = getattr(mcfg, "dtypes", None)
    if isinstance(dtypes, dict):
        return dtypes.get(slot, "fp32")
    return "fp32"


def torch_dtype(name: str):
    return getattr(torch, DTYPE_NAMES[name])


# The kohya-style LoRA namer: slot -> (key prefix, module-path rename). A file key is
# f"{prefix}_{rename(module_path).replace('.', '_')}.lora_down.weight" (…lora_up.weight, …alpha).
Namer = Dict[str, Tuple[str, Callable[[str], str]]]


class StorageDtypes(dict):
    """Module name -> storage dtype, with ``deferred``: the modules loaded to CPU RAM first (quantised parts)."""
    deferred: Tuple[str, ...] = ()


class Family:
    """Base class of every family. Subclasses set the class attributes and implement the methods
    that raise NotImplementedError; the rest has defaults that fit most families."""

    name: str = ""  # registry name ("sd", "pixart"); the info is ``trainer.families.info_for(name)``
    family: str = ""  # the loaded variant ("sd15", "sdxl", "pixart-sigma", "flux-dev"): files' metadata
    prediction_type: str = "epsilon"  # "epsilon" | "v_prediction" | "flow"
    inpainting: bool = False
    fp8_skip: Tuple[str, ...] = ()  # module-name parts whose frozen weights stay out of fp8 storage
    swap_blocks: Tuple[str, ...] = ()  # the denoiser's block lists in running order (parts.denoiser.blocks_to_swap)
    block_swap: Any = None  # the run's trainer.memory.block_swap.BlockSwap, when blocks are swapped
    objective: Any = None  # trainer.objectives.DDPMObjective | FlowMatchingObjective
    true_cfg: bool = True  # samples run the denoiser twice a step with cfg_scale > 1 (False: guidance is embedded)
    # its text features depend on the control images too (an edit model's VL encoder): encode_captions takes the
    # rows' control files, and the text cache keys entries by caption and those files' content
    text_sees_controls: bool = False
    device: Any = None
    source: Any = None

    # --- parts ------------------------------------------------------------------------------
    @property
    def info(self):
        return info_for(self.name)

    def part(self, slot: str) -> Any:
        """The module in ``slot`` (``unet`` = the denoiser, ``text_encoder``, ``text_encoder_2``), or None."""
        part = self.info.part(slot)
        return None if part is None else getattr(self, part.attr, None)

    def parts(self) -> Dict[str, Any]:
        """slot -> module for every part this model has."""
        return {p.slot: getattr(self, p.attr) for p in self.info.parts if getattr(self, p.attr, None) is not None}

    def set_part(self, slot: str, module: Any) -> None:
        """Replace a part's module (FSDP's gathered copy, a compiled module)."""
        setattr(self, self.info.part(slot).attr, module)

    @property
    def denoiser(self) -> Any:
        return self.part("unet")

    def trainable_modules(self) -> Dict[str, Any]:
        return self.parts()

    #: modules left in CPU RAM by :meth:`_place_frozen` (stored quantised: ``trainer.memory.precision.apply_storage``
    #: moves them to ``device`` layer by layer once quantised)
    deferred: Tuple[str, ...] = ()

    def _place_frozen(self, dtypes: Dict[str, Any], names: Tuple[str, ...]) -> None:
        """Move each named module to ``self.device`` in its storage dtype (a single file with mixed dtypes
        loads in fp32), frozen and in eval mode: the methods unfreeze what trains. Modules whose part is
        stored quantised (``dtypes.deferred``) stay in CPU RAM for now."""
        later = getattr(dtypes, "deferred", ())
        for name in names:
            module = getattr(self, name)
            if name in later:
                self.deferred = tuple(self.deferred) + (name,)
            else:
                module.to(self.device)
            if module.dtype != dtypes[name]:
                module.to(dtype=dtypes[name])
            module.requires_grad_(False)
            module.eval()

    @staticmethod
    def _storage_dtypes(mcfg: Any, **parts: str) -> Dict[str, Any]:
        """``{module name: torch dtype}``: each module named in ``parts`` (module name -> part slot) gets its
        part's ``parts.*.dtype``; plus the VAE's. ``.deferred``: the modules whose part is stored quantised."""
        out = StorageDtypes({name: torch_dtype(part_dtype(mcfg, slot)) for name, slot in parts.items()})
        out.update(vae=torch_dtype(mcfg.vae_dtype), default=torch.float32)
        quantised = getattr(mcfg, "deferred", frozenset())
        out.deferred = tuple(name for name, slot in parts.items() if slot in quantised)
        return out

    # --- latents ----------------------------------------------------------------------------
    def latent_shape(self, width: int, height: int) -> Tuple[int, ...]:
        """The cached posterior's shape for one image of ``width`` x ``height``, as :meth:`encode_pixels` makes it
        (packed, patchified or per-frame in some families): one encode of a blank image."""
        return tuple(self.encode_pixels(torch.zeros(1, 3, height, width))["mean"].shape[1:])

    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """VAE posterior (mean, std) in fp32 on the CPU: cached as is, sampled every step."""
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        return {"mean": dist.mean.float().cpu(), "std": dist.std.float().cpu()}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        """A latent drawn from the cached posterior, in the denoiser's scale: (z - shift) * scale."""
        mean = dist["mean"].to(self.device)
        std = dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype,  # on the generator's device
                          device=None if generator is None else generator.device).to(self.device)
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return (mean + std * eps - shift) * self.vae.config.scaling_factor

    # --- text -------------------------------------------------------------------------------
    def encode_captions(self, captions: List[str]) -> Any:
        """Frozen-encoder outputs for the text cache (a tensor or a dict of tensors, on the CPU)."""
        raise NotImplementedError

    def batch_condition(self, batch: Dict[str, Any], expand, train_text: set, drop_te1=None, drop_te2=None):
        """The denoiser's conditioning for a data batch: the cached encoder outputs when the batch has
        them, else the captions (after ``expand``: embedding placeholders) through the encoders, with
        gradients only for slots in ``train_text``. ``drop_te1``/``drop_te2``: one bool per image,
        caption dropout of the first/second text encoder."""
        raise NotImplementedError

    # --- the denoiser -----------------------------------------------------------------------
    def model_input(self, noisy_latents, batch: Dict[str, Any], generator=None, warn=None):
        """What the denoiser sees besides the conditioning (inpainting adds mask channels)."""
        return noisy_latents

    def predict(self, model_input, timesteps, conditioning):
        """The denoiser's prediction in the objective's target space (packing/unpacking, learned-σ
        chunking happen here)."""
        raise NotImplementedError

    def before_compile(self, device: Any) -> None:
        """Before ``training.compile_scope`` denoiser compiles the denoiser whole: build what its first call would
        build lazily in code torch cannot trace (tables made under a device context), so the first compiled call
        is whole too. Nothing for most families."""

    # --- sampling ---------------------------------------------------------------------------
    def pipeline(self, sampler: Optional[str] = None):
        raise NotImplementedError

    def sample_defaults(self) -> SampleDefaults:
        """Steps, guidance and sampler of a sample prompt that leaves them empty: the loaded variant's, as its
        ``FamilyInfo.sample_defaults`` declares them."""
        return self.info.sample_defaults_for(self.family)

    def sampling_kwargs(self) -> Dict[str, Any]:
        """Extra arguments for ``pipeline(...)(prompt, ...)`` so samples see what training saw."""
        return {}

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """Per-prompt extra pipeline arguments (an inpainting model's image and mask)."""
        return {}

    def fingerprint(self) -> str:
        """Identifies what changes cached latents: the weights' source and the VAE dtype."""
        return source_fingerprint(self.source, getattr(self, "_vae_dtype_name", ""))

    def text_fingerprint(self, mcfg: Any) -> str:
        """Identifies what changes cached text-encoder outputs."""
        return f"{mcfg.path}:{part_dtype(mcfg, 'text_encoder')}:{getattr(mcfg, 'clip_skip', 0)}"

    # --- export -----------------------------------------------------------------------------
    def lora_namer(self) -> Namer:
        """slot -> (kohya key prefix, module-path rename) for LoRA/LyCORIS files."""
        raise NotImplementedError

    def peft_file_names(self) -> Dict[str, Tuple[str, Callable[[str], str]]]:
        """slot -> (key prefix, module-path rename) of the parts whose LoRA files are in the diffusers/peft layout
        (``{prefix}.{rename(path)}.lora_A/lora_B.weight``, α/r baked into lora_B); {} for kohya-layout families.
        The model tools (merge, sample --lora) read such files through it."""
        return {}

    def lora_metadata(self, *, title: str, resolution: Any = None, extra: Optional[Dict[str, str]] = None
                      ) -> Dict[str, str]:
        """Header keys model sites and loaders read (``modelspec.*``, ``ss_*``)."""
        return dict(extra or {})

    def save_single_file(self, path: Any, dtype: str, parts: Dict[str, Any]) -> None:
        """Write a fine-tune as the single file the community's loaders read (original layout)."""
        raise NotImplementedError


def refuse(message: str, key: str, value: Any = None) -> ModelLoadError:
    """A ModelLoadError for ``raise``: one message naming the field and what to do."""
    return ModelLoadError(message, key=key, value=value)
