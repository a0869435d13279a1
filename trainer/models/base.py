"""What every model family offers the training loop.

A family loads its components (from a diffusers folder, a hub id or a single file), turns captions
into conditioning, images into latents, builds the noisy input and the target for a timestep,
predicts, and makes a sampling pipeline. The loop only talks to this interface, so a new family
(SDXL, SD3, Flux …) is a new module, not a new loop. Families never import each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer.config import ConfigError

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def torch_dtype(name: str):
    import torch
    return getattr(torch, DTYPE_NAMES[name])


class ModelLoadError(ConfigError):
    """The base model could not be loaded; the message says why and what to do."""


@dataclass
class ModelSource:
    """Where the weights come from: kind is 'folder', 'single_file' or 'hub'."""
    kind: str
    location: str
    display: str


def classify_source(path: str, workspace: str | os.PathLike) -> ModelSource:
    """Turn ``model.path`` into a concrete source, building built-in tiny models on demand."""
    if not path:
        raise ModelLoadError("model.path is empty: give a diffusers folder, a hub id (org/name), a "
                             ".safetensors/.ckpt file, or builtin:tiny-sd.", key="model.path", value=path)
    if path.startswith("builtin:"):
        from trainer.models.tiny import TINY_NAMES, ensure_tiny_model
        name = path.split(":", 1)[1]
        if name not in TINY_NAMES:
            raise ModelLoadError(f"model.path '{path}': unknown built-in model; choose from "
                                 + ", ".join(f"builtin:{n}" for n in TINY_NAMES) + ".", key="model.path",
                                 value=path)
        paths = ensure_tiny_model(name, Path(workspace) / "models")
        return ModelSource("folder", str(paths["diffusers"]), path)
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "model_index.json").exists() and not (p / "unet").is_dir():
            raise ModelLoadError(f"model.path '{path}' is a folder but not a diffusers model (no "
                                 "model_index.json). Point it at the model's top folder, or at a "
                                 ".safetensors file.", key="model.path", value=path)
        return ModelSource("folder", str(p), path)
    if p.is_file():
        if p.suffix.lower() not in (".safetensors", ".ckpt", ".pt", ".pth", ".bin"):
            raise ModelLoadError(f"model.path '{path}' is a {p.suffix or 'extension-less'} file; expected a "
                                 ".safetensors or .ckpt checkpoint.", key="model.path", value=path)
        return ModelSource("single_file", str(p), path)
    looks_local = path.startswith((".", "/", "~")) or os.sep in path.strip("/").replace("/", "", 1) \
        or path.lower().endswith((".safetensors", ".ckpt"))
    if looks_local or path.count("/") != 1:
        raise ModelLoadError(f"model.path '{path}' does not exist. Check the path (it is read relative to "
                             f"the folder you started from: {os.getcwd()}).", key="model.path", value=path)
    return ModelSource("hub", path, path)


class ModelFamily:
    """Interface the loop uses. Tensors: ``pixels`` in [-1, 1], ``latents`` scaled for the UNet."""

    family: str = ""
    prediction_type: str = "epsilon"

    def trainable_modules(self) -> Dict[str, Any]:
        raise NotImplementedError

    def tokenize(self, captions: List[str]):
        raise NotImplementedError

    def encode_text(self, input_ids):
        raise NotImplementedError

    def encode_pixels(self, pixels) -> Dict[str, Any]:
        raise NotImplementedError

    def sample_latents(self, dist: Dict[str, Any], generator: Optional[Any]):
        raise NotImplementedError

    def noisy_and_target(self, latents, noise, timesteps):
        raise NotImplementedError

    def predict(self, noisy_latents, timesteps, conditioning):
        raise NotImplementedError

    def pipeline(self, sampler: str):
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def prompt_kwargs(self, sample_prompt) -> Dict[str, Any]:
        """Per-prompt extra pipeline arguments (an inpainting model's image and mask)."""
        return {}


# --------------------------------------------------------------------------------------------------
# Shared by the latent-diffusion families (SDXL uses these; sd.py still has its own copies, which
# behave the same and can switch to these).
# --------------------------------------------------------------------------------------------------

SAMPLERS = {  # sampling.scheduler → diffusers scheduler class
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
}

FAMILY_NAMES = {"sd15": "SD 1.x", "sd2": "SD 2.x", "sdxl": "SDXL", "sd15-inpaint": "SD 1.x inpainting",
                "sd2-inpaint": "SD 2.x inpainting", "sdxl-inpaint": "SDXL inpainting"}


def detect_source_family(source: ModelSource, mcfg: Any = None) -> Optional[str]:
    """The family the weights at ``source`` belong to (``sd15``, ``sd2``, ``sdxl``, ``*-inpaint``).

    Local folders and files are read with :func:`sd_configs.detect_family` (key names and shapes only);
    a file that is no model at all raises :class:`ModelLoadError` saying what it looks like. For a hub
    id the repo's ``unet/config.json`` decides (SDXL by its ``text_time`` conditioning or 2048-wide
    context, SD 1.x/2.x by the context width, inpainting by 9 input channels), with ``model_index.json``
    as a hint (or, without the UNet's config, alone: ``sdxl``/``sdxl-inpaint`` by the pipeline class).
    Read from the cache when ``mcfg.hub_offline``. None when nothing can be read (not cached, no
    network, gated …: the family's own loader then reports); a repo that has neither file raises."""
    if source.kind in ("folder", "single_file"):
        from trainer.models import sd_configs
        try:
            return sd_configs.detect_family(Path(source.location))
        except (ValueError, OSError) as exc:  # refiner, depth/pix2pix UNet, VAE-only or LoRA file, garbage
            raise ModelLoadError(f"model.path '{source.display}': {exc}", key="model.path",
                                 value=source.display) from None
    from trainer.models import sd_configs
    index = _read_hub_json(source.location, "model_index.json", mcfg)
    unet = _read_hub_json(source.location, "unet/config.json", mcfg)
    if isinstance(unet, dict):
        try:
            return sd_configs.detect_from_configs(unet, index if isinstance(index, dict) else {},
                                                  f"hub model '{source.location}'")
        except ValueError as exc:  # refiner, unCLIP, depth …
            raise ModelLoadError(f"model.path {exc}", key="model.path", value=source.display) from None
    if isinstance(index, dict):
        name = str(index.get("_class_name", "") or "")
        if "XL" in name:
            return "sdxl-inpaint" if "Inpaint" in name else "sdxl"
        return None  # SD 1.x or 2.x: the loader tells them apart from the loaded UNet
    if index is _MISSING and unet is _MISSING:
        raise ModelLoadError(
            f"model.path '{source.location}': the hub repo has neither model_index.json nor unet/config.json, so it "
            "is not a diffusers Stable Diffusion pipeline. If it holds a single .safetensors/.ckpt checkpoint, "
            "download that file and set model.path to it.", key="model.path", value=source.display)
    return None


_MISSING = object()  # a hub repo (or its cached snapshot) that has no such file


def _hub_kwargs(mcfg: Any) -> Dict[str, Any]:
    return {"cache_dir": getattr(mcfg, "cache_dir", "") or None, "revision": getattr(mcfg, "revision", "") or None}


def _hub_offline(mcfg: Any) -> bool:
    from huggingface_hub import constants
    return bool(getattr(mcfg, "hub_offline", False)) or bool(constants.HF_HUB_OFFLINE)


def _read_hub_json(repo: str, filename: str, mcfg: Any):
    """A JSON file of a hub repo as a dict; ``_MISSING`` when the repo (or, offline, its cached
    snapshot) has no such file or it is no JSON object; None when it cannot be told (not cached,
    no network, gated, no such repo)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    from trainer.models import sd_configs
    kw = _hub_kwargs(mcfg)
    offline = _hub_offline(mcfg)
    try:
        path = Path(hf_hub_download(repo, filename, local_files_only=offline, **kw))
    except LocalEntryNotFoundError:  # not in the cache: missing, if a snapshot of the repo is
        try:
            snapshot = Path(snapshot_download(repo, local_files_only=True, **kw))
        except Exception:
            return None
        return _MISSING if not (snapshot / filename).is_file() else None
    except EntryNotFoundError:
        return _MISSING
    except Exception:
        return None
    try:
        return sd_configs._read_json(path)
    except ValueError:
        return _MISSING


def _usable_index(folder: Path) -> bool:
    """A ``model_index.json`` that ``from_pretrained`` can use: a JSON object naming a pipeline class."""
    from trainer.models import sd_configs
    try:
        return bool(sd_configs._read_json(folder / "model_index.json").get("_class_name"))
    except ValueError:
        return False


def load_components(pipeline_cls: Any, folder: Path, dtype: Any = None, build_model: Any = None, **common: Any):
    """``pipeline_cls`` from a diffusers folder without a usable ``model_index.json``: each component from
    its own subfolder, its class read from its config (``_class_name`` for diffusers models and
    schedulers, ``architectures`` for transformers models, ``tokenizer_class`` for tokenizers).
    Components the pipeline may go without (safety checker, image encoder …) are None when absent.
    ``build_model(cls, subfolder, dtype)`` replaces ``cls.from_pretrained`` for the models (weights)."""
    import diffusers
    import transformers

    from trainer.models import sd_configs
    expected, optional = pipeline_cls._get_signature_keys(pipeline_cls)
    parts: Dict[str, Any] = {k: v for k, v in common.items() if k in expected}
    for name in sorted(set(expected) - set(parts)):
        sub = folder / name
        if not sub.is_dir():
            if name in pipeline_cls._optional_components:
                parts[name] = None
                continue
            raise ValueError(f"no model_index.json and no {name}/ subfolder")
        dt = dtype.get(name, dtype.get("default")) if isinstance(dtype, dict) else dtype
        dkw = {} if dt is None else {"dtype": dt}
        if (sub / "scheduler_config.json").is_file():
            cls_name = sd_configs._read_json(sub / "scheduler_config.json").get("_class_name", "")
            parts[name] = getattr(diffusers, cls_name).from_pretrained(str(folder), subfolder=name)
        elif name.startswith("tokenizer"):
            tok_cfg = sub / "tokenizer_config.json"
            cls_name = (sd_configs._read_json(tok_cfg).get("tokenizer_class") if tok_cfg.is_file() else None)
            cls_name = str(cls_name or "CLIPTokenizer").removesuffix("Fast")
            cls = getattr(transformers, cls_name, transformers.CLIPTokenizer)
            parts[name] = cls.from_pretrained(str(folder), subfolder=name)
        else:
            cfg = sd_configs._read_json(sub / "config.json")
            if cfg.get("_class_name"):
                cls = getattr(diffusers, cfg["_class_name"])
            else:
                cls = getattr(transformers, (cfg.get("architectures") or ["CLIPTextModel"])[0])
            parts[name] = (build_model(cls, sub, dt) if build_model is not None
                           else cls.from_pretrained(str(folder), subfolder=name, **dkw))
    return pipeline_cls(**parts, **{k: v for k, v in common.items() if k in optional})


def check_family(source: ModelSource, found: Optional[str], mcfg: Any, accepted: tuple, label: str) -> None:
    """Refuse weights of another family, naming the family they look like and what to set."""
    if found is None:
        return
    if found.endswith("-inpaint") and found.removesuffix("-inpaint") in accepted:
        found = found.removesuffix("-inpaint")  # inpainting variants load with their base family
    if found not in accepted:
        base = found.removesuffix("-inpaint")
        raise ModelLoadError(f"model.path '{source.display}' looks like {FAMILY_NAMES[found]} ({found}), but this "
                             f"run is set up for {label}. Set model.family to {base} (or auto), or use a "
                             f"{FAMILY_NAMES[base]} preset.", key="model.path", value=source.display)
    family = getattr(mcfg, "family", "auto")
    if family not in ("auto", found):
        raise ModelLoadError(f"model.family is {family}, but '{source.display}' holds a {FAMILY_NAMES[found]} "
                             f"({found}) model. Set model.family to {found} or auto.", key="model.family",
                             value=family)


def load_pipeline(pipeline_cls: Any, source: ModelSource, mcfg: Any, workspace: str, *, family: str,
                  dtype: Any = None, **common: Any):
    """Load ``pipeline_cls`` from a folder, a single file (with a shipped or given config) or a hub id.

    ``family`` picks the shipped config for single files (:func:`sd_configs.default_config_for`; an
    ``*-inpaint`` family gets its base config with a 9-channel UNet). A folder or hub snapshot without
    a usable ``model_index.json`` is loaded component by component (:func:`load_components`).
    ``dtype`` (a dtype or diffusers' ``{component: dtype, "default": dtype}``) loads weights
    straight into their storage dtype: an SDXL UNet in fp32 alone is 10 GB of RAM."""
    kw: Dict[str, Any] = dict(common)
    if dtype is not None:
        kw["dtype"] = dtype
    if source.kind == "folder":
        try:
            if not _usable_index(Path(source.location)):  # detected from unet/config.json
                return load_components(pipeline_cls, Path(source.location), kw.pop("dtype", None), **kw)
            return pipeline_cls.from_pretrained(source.location, local_files_only=True, **kw)
        except Exception as exc:
            raise ModelLoadError(f"Could not load the diffusers folder '{source.display}' as "
                                 f"{pipeline_cls.__name__}: {type(exc).__name__}: {_first_line(exc)}",
                                 key="model.path", value=source.display) from None
    if source.kind == "single_file":
        from trainer.models import sd_configs
        if getattr(mcfg, "config_path", ""):
            config = mcfg.config_path
        else:
            pred = getattr(mcfg, "prediction_type", "auto")
            # an inpainting family (9-channel conv_in in the file) gets its base config with in_channels 9
            name = sd_configs.default_config_for(family, None if pred == "auto" else pred)
            config = str(sd_configs.config_folder(name, Path(workspace) / "cache"))
        if isinstance(kw.get("dtype"), dict):  # from_single_file takes one dtype
            dtypes = set(kw.pop("dtype").values())
            if len(dtypes) == 1:
                kw["dtype"] = dtypes.pop()
        try:
            return pipeline_cls.from_single_file(source.location, config=config, local_files_only=True, **kw)
        except Exception as exc:  # diffusers raises many kinds here
            hint = "" if getattr(mcfg, "config_path", "") else (
                " If the model is not the standard size, set model.config_path to a diffusers folder with "
                "its configs.")
            raise ModelLoadError(f"Could not load '{source.display}' as a single-file {family} checkpoint "
                                 f"(config {config}): {type(exc).__name__}: {_first_line(exc)}.{hint}",
                                 key="model.path", value=source.display) from None
    kw["local_files_only"] = bool(mcfg.hub_offline)
    if mcfg.cache_dir:
        kw["cache_dir"] = mcfg.cache_dir
    if mcfg.revision:
        kw["revision"] = mcfg.revision
    try:
        if not isinstance(_read_hub_json(source.location, "model_index.json", mcfg), dict):
            folder = _hub_snapshot_without_index(source.location, mcfg)
            if folder is not None:
                common_kw = {k: v for k, v in kw.items() if k not in ("local_files_only", "cache_dir", "revision")}
                return load_components(pipeline_cls, folder, common_kw.pop("dtype", None), **common_kw)
        return pipeline_cls.from_pretrained(source.location, **kw)
    except Exception as exc:
        if mcfg.hub_offline:
            raise ModelLoadError(
                f"model.path '{source.location}' is a hub id, but it is not in the hub cache"
                f"{' ' + mcfg.cache_dir if mcfg.cache_dir else ''} and model.hub_offline is on. Download it "
                "once with model.hub_offline off, or point model.path at a local folder or file.",
                key="model.path", value=source.location) from None
        raise ModelLoadError(f"Could not download or load '{source.location}' from the hub: "
                             f"{type(exc).__name__}: {_first_line(exc)}. "
                             "Check the id, your network and (for gated models) your HF token.",
                             key="model.path", value=source.location) from None


_COMPONENT_DIRS = ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def _hub_snapshot_without_index(repo: str, mcfg: Any) -> Optional[Path]:
    """The local snapshot of a hub repo without a usable ``model_index.json`` but with ``unet/``: its
    component folders (safetensors weights where the repo has them), from the cache when offline."""
    from huggingface_hub import snapshot_download
    if _read_hub_json(repo, "unet/config.json", mcfg) is None and not _hub_offline(mcfg):
        return None
    folder = Path(snapshot_download(repo, local_files_only=_hub_offline(mcfg),
                                    allow_patterns=[f"{c}/*" for c in _COMPONENT_DIRS],
                                    ignore_patterns=["*.onnx", "*.msgpack", "*.h5", "*.ckpt", "*.fp16.*"],
                                    **_hub_kwargs(mcfg)))
    return folder if (folder / "unet" / "config.json").is_file() else None


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def source_fingerprint(source: ModelSource, extra: str) -> str:
    """Identifies what changes cached latents: the weights' source (the VAE files where there is a
    folder) and ``extra`` (the VAE dtype)."""
    import hashlib
    h = hashlib.sha256(f"{source.kind}:{source.location}:{extra}".encode())
    p = Path(source.location)
    if p.exists():
        target = p / "vae" if (p / "vae").is_dir() else p
        for fp in sorted(target.glob("*")) if target.is_dir() else [target]:
            st = fp.stat()
            h.update(f"{fp.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


from trainer.models.inpaint import InpaintingMixin  # noqa: E402  (torch-free at import)


class LatentDiffusionFamily(InpaintingMixin, ModelFamily):
    """The parts of the objective every VAE-latent, DDPM-trained UNet family shares (and, for
    9-channel inpainting UNets, the masked input: :class:`~trainer.models.inpaint.InpaintingMixin`).

    Needs ``self.vae``, ``self.device``, ``self.noise_scheduler``, ``self.prediction_type`` and
    ``self._sched_config`` (the sampling schedulers' config)."""

    def _setup_schedule(self, scheduler_config: Dict[str, Any], prediction_type: str) -> None:
        """Training schedule = the model's own betas in a DDPMScheduler; ``auto`` reads the prediction type."""
        from diffusers import DDPMScheduler
        self.noise_scheduler = DDPMScheduler.from_config(scheduler_config)
        pred = prediction_type
        if pred == "auto":
            pred = self.noise_scheduler.config.get("prediction_type", "epsilon")
        self.prediction_type = pred
        self.noise_scheduler.register_to_config(prediction_type=pred)
        self._sched_config = dict(scheduler_config)
        self._sched_config["prediction_type"] = pred
        self.num_train_timesteps = int(self.noise_scheduler.config.num_train_timesteps)
        self._alphas = self.noise_scheduler.alphas_cumprod

    def encode_pixels(self, pixels) -> Dict[str, Any]:
        """VAE posterior (mean, std) in fp32: cached as is, sampled every step."""
        import torch
        with torch.no_grad():
            dist = self.vae.encode(pixels.to(self.device, dtype=self.vae.dtype)).latent_dist
        return {"mean": dist.mean.float().cpu(), "std": dist.std.float().cpu()}

    def sample_latents(self, dist: Dict[str, Any], generator=None):
        import torch
        mean = dist["mean"].to(self.device)
        std = dist["std"].to(self.device)
        eps = torch.randn(mean.shape, generator=generator, dtype=mean.dtype).to(self.device)
        return (mean + std * eps) * self.vae.config.scaling_factor

    def noisy_and_target(self, latents, noise, timesteps):
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        elif self.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"unknown prediction type {self.prediction_type}")
        return noisy, target

    def _set_attention(self, backend: str) -> None:
        """``model.attention``: PyTorch SDPA (diffusers' default) or xformers, refused clearly when absent."""
        if backend == "xformers":
            try:
                self.unet.enable_xformers_memory_efficient_attention()
            except Exception as exc:
                raise ModelLoadError(f"model.attention = xformers, but xformers is not usable here ({exc}). "
                                     "Use sdpa.", key="model.attention") from None

    def sampling_kwargs(self) -> Dict[str, Any]:
        """Extra arguments for ``pipeline(...)(prompt, ...)`` so samples see what training saw."""
        return {"clip_skip": self.clip_skip} if getattr(self, "clip_skip", 0) else {}

    def fingerprint(self) -> str:
        """Identifies what changes cached latents: the weights' source and the VAE dtype."""
        return source_fingerprint(self.source, self._vae_dtype_name)

    def rescale_zero_terminal_snr(self) -> None:
        """Rescale the betas so the last timestep is pure noise (Lin et al. 2023, diffusers'
        ``rescale_betas_zero_snr``); samplers get the same schedule with trailing timestep spacing."""
        from diffusers import DDPMScheduler
        self.noise_scheduler = DDPMScheduler.from_config(self.noise_scheduler.config, rescale_betas_zero_snr=True)
        self._sched_config.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
        self._alphas = self.noise_scheduler.alphas_cumprod


def load_model(mcfg: Any, workspace: str, device: Any = "cpu") -> ModelFamily:
    """Pick the family class for ``model.family`` (``auto``: detected from the weights) and load it.

    The one entry point the loop needs; each family still refuses weights of another family itself."""
    family = getattr(mcfg, "family", "auto")
    if family == "auto":
        family = detect_source_family(classify_source(mcfg.path, workspace), mcfg) or "sd15"
    if family.startswith("sdxl"):
        from trainer.models.sdxl import StableDiffusionXL
        return StableDiffusionXL(mcfg, workspace, device)
    from trainer.models.sd import StableDiffusion
    return StableDiffusion(mcfg, workspace, device)
