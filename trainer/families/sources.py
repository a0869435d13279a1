"""Where weights come from and how a family loads them: ``model.path`` as a source (:func:`classify_source`: a
diffusers folder, a hub id, a single file, or a ``builtin:`` tiny model from the registry), what detection may read of
it (:func:`evidence_for`), which family claims it (:func:`detect_source_family`), loading a diffusers pipeline from any
of the three (:func:`load_pipeline`, :func:`load_components`, :func:`load_by_component`), and :func:`load_model`, the
loop's one entry point. :class:`ModelSettings` is what a family reads of the config to load.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import diffusers
import diffusers.loaders.single_file as diffusers_single_file
import torch
import transformers
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from safetensors.torch import load_file

from trainer.config.preflight import fp8_file_kind, model_path_problem
from trainer.config.fields import PART_OF_SLOT
from trainer.errors import ModelLoadError
from trainer.families import MISSING, Evidence, build_tiny, claim, family_class, info_for, unclaimed_message
from trainer.families.common.fp8_weights import dequantise_fp8, fp8_layer_scales_from_maps, fp8_scale_maps
from trainer.families.common.sd_kit import sd_configs
from trainer.families.common.sd_kit.sd_configs import read_json, read_key_shapes


@dataclass
class ModelSource:
    """Where the weights come from: kind is 'folder', 'single_file' or 'hub'."""
    kind: str
    location: str
    display: str


def classify_source(path: str, workspace: str | os.PathLike) -> ModelSource:
    """Turn ``model.path`` into a concrete source, building built-in tiny models on demand."""
    problem = model_path_problem(path)  # the same rules validate applies
    if problem:
        raise ModelLoadError(problem, key="model.path", value=path)
    if path.startswith("builtin:"):
        paths = build_tiny(path.split(":", 1)[1], Path(workspace) / "models")
        return ModelSource("folder", str(paths["diffusers"]), path)
    p = Path(path).expanduser()
    if p.is_dir():
        return ModelSource("folder", str(p), path)
    if p.is_file():
        return ModelSource("single_file", str(p), path)
    return ModelSource("hub", path, path)


def evidence_for(source: Any, mcfg: Any = None) -> Evidence:
    """Key names/shapes of a single file, or a JSON reader over a folder or hub repo (no weights load).

    Raises ValueError for a file that cannot be read as a checkpoint at all."""
    if source.kind == "single_file":
        return Evidence("single_file", f"model.path '{source.display}'", shapes=read_key_shapes(Path(source.location)))
    if source.kind == "folder":
        folder = Path(source.location)

        def read_local(rel: str):
            p = folder / rel
            if not p.is_file():
                return MISSING
            try:
                return read_json(p)
            except ValueError:
                return MISSING
        return Evidence("folder", f"model.path '{source.display}'", read_json=read_local)

    cache: dict = {}

    def read_hub(rel: str):
        if rel not in cache:
            value = read_hub_json(source.location, rel, mcfg)
            cache[rel] = value
        return cache[rel]
    return Evidence("hub", f"hub model '{source.location}'", read_json=read_hub)


def detect_source_family(source: ModelSource, mcfg: Any = None) -> Optional[str]:
    """The variant the weights at ``source`` belong to (``sd15``, ``sdxl-inpaint``, ``pixart-sigma`` …),
    asked of every registered family (``trainer.families.claim``) from key names/shapes or configs only.

    Raises :class:`ModelLoadError` when a family recognises the weights but refuses them (an SDXL
    refiner, a Flux fill model …) or when no family claims them (naming the closest family or what the
    file is instead). None only for a hub id whose files cannot be read (not cached, no network, gated):
    the caller then says so."""
    try:
        ev = evidence_for(source, mcfg)
        found = claim(ev)
    except (ValueError, OSError) as exc:  # refiner, depth/pix2pix UNet, Flux fill, VAE-only or LoRA file, garbage
        raise ModelLoadError(f"model.path '{source.display}': {exc}" if source.kind != "hub" else f"model.path {exc}",
                             key="model.path", value=source.display) from None
    if found:
        return found
    if source.kind == "hub" and all(ev.read_json(rel) is None for rel in (
            "model_index.json", "unet/config.json", "transformer/config.json")):
        return None  # nothing could be read: not cached / offline / gated
    where = unclaimed_message(ev)
    raise ModelLoadError(f"model.path {where}" if source.kind == "hub" else where, key="model.path",
                         value=source.display)


def hub_kwargs(mcfg: Any) -> Dict[str, Any]:
    return {"cache_dir": getattr(mcfg, "cache_dir", "") or None, "revision": getattr(mcfg, "revision", "") or None}


def hub_offline(mcfg: Any) -> bool:
    return bool(getattr(mcfg, "hub_offline", False)) or bool(constants.HF_HUB_OFFLINE)


def read_hub_json(repo: str, filename: str, mcfg: Any):
    """A JSON file of a hub repo as a dict; ``MISSING`` when the repo (or, offline, its cached
    snapshot) has no such file or it is no JSON object; None when it cannot be told (not cached,
    no network, gated, no such repo)."""

    kw = hub_kwargs(mcfg)
    offline = hub_offline(mcfg)
    try:
        path = Path(hf_hub_download(repo, filename, local_files_only=offline, **kw))
    except LocalEntryNotFoundError:  # not in the cache: missing, if a snapshot of the repo is
        try:
            snapshot = Path(snapshot_download(repo, local_files_only=True, **kw))
        except Exception:
            return None
        return MISSING if not (snapshot / filename).is_file() else None
    except EntryNotFoundError:
        return MISSING
    except Exception:
        return None
    try:
        return sd_configs.read_json(path)
    except ValueError:
        return MISSING


def _usable_index(folder: Path) -> bool:
    """A ``model_index.json`` that ``from_pretrained`` can use: a JSON object naming a pipeline class."""
    try:
        return bool(sd_configs.read_json(folder / "model_index.json").get("_class_name"))
    except ValueError:
        return False


def load_components(pipeline_cls: Any, folder: Path, dtype: Any = None, build_model: Any = None, **common: Any):
    """``pipeline_cls`` from a diffusers folder without a usable ``model_index.json``: each component from
    its own subfolder, its class read from its config (``_class_name`` for diffusers models and
    schedulers, ``architectures`` for transformers models, ``tokenizer_class`` for tokenizers).
    Components the pipeline may go without (safety checker, image encoder …) are None when absent.
    ``build_model(cls, subfolder, dtype)`` replaces ``cls.from_pretrained`` for the models (weights)."""

    expected, optional = pipeline_cls._get_signature_keys(pipeline_cls)
    parts: Dict[str, Any] = {k: v for k, v in common.items() if k in expected}
    for name in sorted(set(expected) - set(parts)):
        sub = folder / name
        if not sub.is_dir():
            if name in pipeline_cls._optional_components:
                parts[name] = None
                continue
            raise ValueError(f"it has no {name}/ subfolder" + ("" if (folder / "model_index.json").is_file()
                                                                   else " (and no model_index.json)"))
        dt = dtype.get(name, dtype.get("default")) if isinstance(dtype, dict) else dtype
        dkw = {} if dt is None else {"dtype": dt}
        if (sub / "scheduler_config.json").is_file():
            cls_name = sd_configs.read_json(sub / "scheduler_config.json").get("_class_name", "")
            parts[name] = getattr(diffusers, cls_name).from_pretrained(str(folder), subfolder=name)
        elif (sub / "guider_config.json").is_file():  # a guider (HunyuanImage 2.1's): configuration, no weights
            cls_name = sd_configs.read_json(sub / "guider_config.json").get("_class_name", "")
            parts[name] = getattr(diffusers, cls_name).from_pretrained(str(folder), subfolder=name)
        elif not name.startswith("tokenizer") and (sub / "preprocessor_config.json").is_file():
            # an image processor (Wan 2.1 I2V's CLIP's); a tokenizer/ folder may hold a whole processor's files
            # (Flux.2 [dev]'s Pixtral), read below as its tokenizer
            parts[name] = transformers.AutoImageProcessor.from_pretrained(str(folder), subfolder=name)
        elif name.startswith("tokenizer"):
            tok_cfg = sub / "tokenizer_config.json"
            cls_name = (sd_configs.read_json(tok_cfg).get("tokenizer_class") if tok_cfg.is_file() else None)
            cls_name = str(cls_name or "CLIPTokenizer").removesuffix("Fast")
            # a class this transformers lacks (a processor folder's tokenizer, a newer name): AutoTokenizer reads it
            cls = getattr(transformers, cls_name, None) or (transformers.AutoTokenizer if tok_cfg.is_file() else
                                                            transformers.CLIPTokenizer)
            parts[name] = cls.from_pretrained(str(folder), subfolder=name)
        else:
            cfg = sd_configs.read_json(sub / "config.json")
            if cfg.get("_class_name"):
                cls = getattr(diffusers, cfg["_class_name"])
            else:
                cls = getattr(transformers, (cfg.get("architectures") or ["CLIPTextModel"])[0])
            parts[name] = (build_model(cls, sub, dt) if build_model is not None
                           else cls.from_pretrained(str(folder), subfolder=name, **dkw))
    # the pipeline's own settings (not components: those are [library, class] pairs) that model_index.json records:
    # Wan's boundary_ratio and expand_timesteps tell which model it is, Krea 2's text_encoder_select_layers (a list)
    # which hidden states its text features take
    index = folder / "model_index.json"
    settings = {k: v for k, v in (sd_configs.read_json(index) if index.is_file() else {}).items()
                if k in optional and not _component_entry(v) and not k.startswith("_")}
    return pipeline_cls(**parts, **{**settings, **{k: v for k, v in common.items() if k in optional}})


def _component_entry(value: Any) -> bool:
    """A model_index.json entry naming a component: ``["diffusers", "AutoencoderKL"]`` (or ``[null, null]``)."""
    return isinstance(value, list) and len(value) == 2 and all(v is None or isinstance(v, str) for v in value)


def load_by_component(pipeline_cls: Any, location: str, mcfg: Any, dtype: Any = None,
                      skip: Tuple[str, ...] = (), **common: Any):
    """``pipeline_cls`` from a local diffusers folder or a hub repo, component by component (:func:`load_components`),
    not through ``from_pretrained``: each component's class comes from its own config, not from
    ``model_index.json`` (Flux.2 [dev]'s tokenizer/ is a PixtralProcessor folder there, read here as its tokenizer).
    ``skip``: component folders not to download (given in ``common``)."""
    folder = Path(location)
    if not folder.is_dir():
        names = [n for n in pipeline_cls._get_signature_keys(pipeline_cls)[0] if n not in skip]
        try:
            folder = Path(snapshot_download(location, local_files_only=hub_offline(mcfg),
                                            allow_patterns=["model_index.json", *[f"{n}/*" for n in names]],
                                            **hub_kwargs(mcfg)))
        except Exception as exc:
            raise ModelLoadError(f"Could not download or find '{location}' in the hub cache: {type(exc).__name__}: "
                                 f"{_first_line(exc)}. Check the id, your network (or model.hub_offline) and, for gated "
                                 "models, your HF token.", key="model.path", value=location) from None
    return load_components(pipeline_cls, folder, dtype, **common)


def _denoiser_dtype(dtype: Any) -> Any:
    """The dtype a pipeline's denoiser loads in, from ``load_pipeline``'s ``dtype`` (one, or diffusers' dict)."""
    if isinstance(dtype, dict):
        dtype = dtype.get("unet", dtype.get("transformer", dtype.get("default")))
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _read_fp8_file(source: ModelSource, dtype: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """An fp8 single file's weights as ``dtype`` floats (``fp8 · scale``), and its per-row scale maps
    (:func:`trainer.families.common.fp8_weights.fp8_scale_maps`) for :func:`_mark_fp8_layers`."""
    try:
        state = load_file(source.location)
    except Exception as exc:
        raise ModelLoadError(f"model.path '{source.display}' could not be read as a .safetensors file: "
                             f"{_first_line(exc)}", key="model.path", value=source.display) from None
    maps = fp8_scale_maps(state)
    return dequantise_fp8(state, dtype, source.display), maps


@contextmanager
def _single_file_state(state: Dict[str, Any]) -> Iterator[None]:
    """While loading: diffusers' pipeline ``from_single_file`` reads ``state`` instead of the file. Its pipeline
    loader takes only a path (its model loaders take a state dict); it looks ``load_single_file_checkpoint`` up in
    its module at call time, which is what is replaced here, and put back."""
    original = diffusers_single_file.load_single_file_checkpoint
    diffusers_single_file.load_single_file_checkpoint = lambda *_args, **_kwargs: state
    try:
        yield
    finally:
        diffusers_single_file.load_single_file_checkpoint = original


def _mark_fp8_layers(pipe: Any, maps: Dict[str, Any]) -> None:
    """Tell the pipeline's denoiser which of its layers the file stored in fp8, with which scales
    (``fp8_file_scales``: fp8 storage keeps them so, memory/precision.py), through diffusers' own converter of that
    model; nothing when the converter cannot take the maps (the layers then stay as loaded)."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    entry = SINGLE_FILE_LOADABLE_CLASSES.get(type(denoiser).__name__) if denoiser is not None else None
    if entry is None or not maps:
        return
    convert = entry["checkpoint_mapping_fn"]
    config = dict(denoiser.config)
    scales = fp8_layer_scales_from_maps(maps, lambda m: convert(checkpoint=m, config=config))
    if scales:
        denoiser.fp8_file_scales = scales


def load_pipeline(pipeline_cls: Any, source: ModelSource, mcfg: Any, workspace: str, *, family: str,
                  dtype: Any = None, by_component: bool = False, prediction_type: Optional[str] = None, **common: Any):
    """Load ``pipeline_cls`` from a folder, a single file (with a shipped or given config) or a hub id.

    ``family`` picks the shipped config for single files (:func:`sd_configs.default_config_for`; an
    ``*-inpaint`` family gets its base config with a 9-channel UNet). A folder or hub snapshot without
    a usable ``model_index.json`` is loaded component by component (:func:`load_components`).
    ``dtype`` (a dtype or diffusers' ``{component: dtype, "default": dtype}``) loads weights
    straight into their storage dtype: an SDXL UNet in fp32 alone is 10 GB of RAM. ``prediction_type`` (a single
    file's, when the family told it from the weights) chooses the shipped config instead of ``model.prediction_type``."""
    kw: Dict[str, Any] = dict(common)
    if by_component and source.kind in ("folder", "hub"):
        try:
            return load_by_component(pipeline_cls, source.location, mcfg, dtype, **common)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"Could not load '{source.display}' as {pipeline_cls.__name__}: "
                                 f"{type(exc).__name__}: {_first_line(exc)}", key="model.path",
                                 value=source.display) from None
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
        if getattr(mcfg, "config_path", ""):
            config = mcfg.config_path
        else:
            pred = prediction_type or getattr(mcfg, "prediction_type", "auto")
            # an inpainting family (9-channel conv_in in the file) gets its base config with in_channels 9
            name = sd_configs.default_config_for(family, None if pred == "auto" else pred)
            config = str(sd_configs.config_folder(name, Path(workspace) / "cache"))
        # an fp8 file: diffusers' single-file loader would drop the scales (and keep nothing in fp8), so it is given
        # the file's weights dequantised, and the denoiser learns which of its layers the file stored in fp8
        fp8_state = _read_fp8_file(source, _denoiser_dtype(kw.get("dtype"))) if fp8_file_kind(source.location) else None
        if isinstance(kw.get("dtype"), dict):  # from_single_file takes one dtype
            dtypes = set(kw.pop("dtype").values())
            if len(dtypes) == 1:
                kw["dtype"] = dtypes.pop()
        try:
            if fp8_state is None:
                return pipeline_cls.from_single_file(source.location, config=config, local_files_only=True, **kw)
            state, maps = fp8_state
            with _single_file_state(state):
                pipe = pipeline_cls.from_single_file(source.location, config=config, local_files_only=True, **kw)
            _mark_fp8_layers(pipe, maps)
            return pipe
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
        if not isinstance(read_hub_json(source.location, "model_index.json", mcfg), dict):
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
    if read_hub_json(repo, "unet/config.json", mcfg) is None and not hub_offline(mcfg):
        return None
    folder = Path(snapshot_download(repo, local_files_only=hub_offline(mcfg),
                                    allow_patterns=[f"{c}/*" for c in _COMPONENT_DIRS],
                                    ignore_patterns=["*.onnx", "*.msgpack", "*.h5", "*.ckpt", "*.fp16.*"],
                                    **hub_kwargs(mcfg)))
    return folder if (folder / "unet" / "config.json").is_file() else None


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def source_fingerprint(source: ModelSource, extra: str) -> str:
    """Identifies what changes cached latents: the weights' source (the VAE files where there is a
    folder) and ``extra`` (the VAE dtype)."""
    h = hashlib.sha256(f"{source.kind}:{source.location}:{extra}".encode())
    p = Path(source.location)
    if p.exists():
        target = p / "vae" if (p / "vae").is_dir() else p
        for fp in sorted(target.glob("*")) if target.is_dir() else [target]:
            st = fp.stat()
            h.update(f"{fp.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def load_model(mcfg: Any, workspace: str, device: Any = "cpu") -> Any:
    """Detect the family (``model.family: auto``) or take the given one, and load it with its class.

    The one entry point the loop needs; each family still refuses weights of another family itself.
    ``mcfg``: the whole config (each part then gets its ``parts.*.dtype``) or its ``model`` section (fp32)."""
    if hasattr(mcfg, "parts") and hasattr(mcfg, "model"):
            mcfg = ModelSettings(mcfg)
    family = getattr(mcfg, "family", "auto")
    source = classify_source(mcfg.path, workspace)
    found = detect_source_family(source, mcfg)
    if family == "auto":
        if found is None:
            raise ModelLoadError(
                f"model.path '{mcfg.path}' is a hub id, but its model_index.json could not be read "
                f"({'model.hub_offline is on and it is not in the hub cache' if getattr(mcfg, 'hub_offline', False) else 'not in the hub cache and not downloadable: check the id, your network and, for gated models, your HF token'}). "
                "Set model.family to the model's family to load it anyway, or point model.path at a local "
                "folder or file.", key="model.path", value=mcfg.path)
        family = found
    elif found is not None and info_for(found).name != info_for(family).name:
        got, want = info_for(found), info_for(family)
        raise ModelLoadError(f"model.family is {family} ({want.label}), but '{source.display}' holds a "
                             f"{got.label} model ({found}). Set model.family to {found.removesuffix('-inpaint')} "
                             "or auto.", key="model.family", value=family)
    return family_class(family)(mcfg, workspace, device)


class ModelSettings:
    """What a family needs to load: the ``model`` section plus each part's storage dtype (``dtypes``:
    slot -> dtype name, from ``parts.*.dtype``) and the text encoders switched off (``disabled``: slots)."""

    def __init__(self, cfg: Any):
        object.__setattr__(self, "_model", cfg.model)
        object.__setattr__(self, "dtypes", {slot: str(cfg.parts[part].dtype) for slot, part in PART_OF_SLOT.items()})
        object.__setattr__(self, "disabled", frozenset(slot for slot, part in PART_OF_SLOT.items()
                                                       if not cfg.parts[part].get("enabled", True)))
        # parts stored quantised (fp8/NF4): they stay in CPU RAM when loaded and reach the device layer by
        # layer, already quantised (trainer.memory.precision.apply_storage), never whole in their load dtype
        # (a base read from an fp8 file is stored so too: its fp8 layers go back to fp8 with their scales)
        den = cfg.parts.denoiser
        deferred = {"unet"} if (den.get("fp8", False) or den.get("nf4", False) or den.get("blocks_to_swap", 0)
                                or fp8_file_kind(str(cfg.model.path or ""))) else set()
        # text encoders that may live in CPU RAM (data.offload_text_encoders) or are stored in fp8: loaded there, and
        # placed by trainer.memory.precision.place_text_encoders (never whole on the device in their load dtype)
        offload = bool(cfg.get("data", {}).get("offload_text_encoders", False)) if hasattr(cfg, "get") else False
        deferred |= {slot for slot, part in PART_OF_SLOT.items()
                     if slot != "unet" and (offload or cfg.parts[part].get("fp8", False)
                                            or cfg.parts[part].get("nf4", False))}
        object.__setattr__(self, "deferred", frozenset(deferred))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def get(self, key: str, default: Any = None) -> Any:
        return self._model.get(key, default)
