"""The one configuration schema of Atelier.

Every knob is a field of a dataclass below, with a default and ``metadata``:

- ``help``: a one-line explanation (the UI's tooltip, the CLI's ``config-help``),
- ``choices``: the allowed values of a string field,
- ``min`` / ``max``: the allowed range of a number,
- ``ui``: optional hint for the web UI (``"path"``, ``"textarea"``, ``"hidden"``).

A run config is built as ``preset (base:) ⊕ user YAML ⊕ --set key=value`` by :func:`load_config`,
checked by :func:`validate` (errors stop the run before any model loads) and
:func:`cross_field_warnings` (community rules shown before launch). This module imports nothing
heavy: the CLI's ``--help`` and the web UI use it without torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

CONFIG_VERSION = 1
ATELIER_ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = ATELIER_ROOT / "presets"

# ``${atelier_root:}`` in a config or preset: the project's folder (the demo preset's images live there).
if not OmegaConf.has_resolver("atelier_root"):
    OmegaConf.register_resolver("atelier_root", lambda: str(ATELIER_ROOT))

DTYPES = ["fp32", "fp16", "bf16"]


def f(default: Any = None, help: str = "", *, choices: Optional[List[str]] = None,
      min: Optional[float] = None, max: Optional[float] = None, ui: Optional[str] = None,
      factory: Any = None) -> Any:
    """A schema field: default, help text, allowed values and range in one place."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = list(choices)
    if min is not None:
        meta["min"] = min
    if max is not None:
        meta["max"] = max
    if ui is not None:
        meta["ui"] = ui
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------

@dataclass
class GeneralConfig:
    workspace: str = f("workspace", "Folder that holds runs/, caches and built-in models.", ui="path")
    run_name: str = f("", "Name of the run folder under <workspace>/runs/; empty = a timestamped name.")
    seed: int = f(42, "Random seed: same seed and data give the same run.", min=0, max=2**32 - 1)
    device: str = f("auto", "Where to train: auto picks CUDA when present, else CPU.",
                    choices=["auto", "cuda", "cpu", "mps"])
    tensorboard: bool = f(True, "Write TensorBoard logs to <run>/tensorboard.")
    dataloader_workers: int = f(0, "Background workers that load images (0 = in the main process).",
                                min=0, max=64)


@dataclass
class ModelConfig:
    path: str = f("", "Base model: a diffusers folder, a hub id (org/name), a .safetensors/.ckpt file, "
                      "or builtin:tiny-sd for the offline demo model.", ui="path")
    family: str = f("auto", "Model family; auto detects it from the weights.",
                    choices=["auto", "sd15", "sd2"])
    prediction_type: str = f("auto", "What the UNet predicts; auto reads it from the model "
                                     "(SD 2.x 768 models are v_prediction).",
                             choices=["auto", "epsilon", "v_prediction"])
    config_path: str = f("", "For single-file models: a diffusers folder whose configs describe the model; "
                             "empty = the built-in config of the detected family.", ui="path")
    hub_offline: bool = f(False, "Never touch the network: a hub id must already be in the cache.")
    cache_dir: str = f("", "Hub cache folder; empty = the Hugging Face default.", ui="path")
    revision: str = f("", "Hub revision (branch, tag or commit); empty = main.")
    unet_dtype: str = f("fp32", "Storage dtype of the UNet's frozen weights.", choices=DTYPES)
    text_encoder_dtype: str = f("fp32", "Storage dtype of the text encoder's frozen weights.", choices=DTYPES)
    vae_dtype: str = f("fp32", "VAE dtype (fp32 avoids NaN latents with the SD VAE).", choices=DTYPES)
    attention: str = f("sdpa", "Attention backend: PyTorch SDPA, or xformers when installed.",
                       choices=["sdpa", "xformers"])


@dataclass
class ConceptConfig:
    name: str = f("", "A label for this concept in reports and logs.")
    path: str = f("", "Folder of training images.", ui="path")
    enabled: bool = f(True, "Train on this concept.")
    recursive: bool = f(False, "Also read images in sub-folders.")
    caption_source: str = f("txt", "Where captions come from: <image>.txt, one text file for all, "
                                   "or the file name.",
                            choices=["txt", "concept_file", "filename"])
    caption_file: str = f("", "With caption_source=concept_file: the text file (one caption a line).",
                          ui="path")
    caption_extension: str = f(".txt", "Extension of per-image caption files.")
    repeats: float = f(1.0, "How many times each image is seen per epoch.", min=0.0, max=10000.0)
    loss_weight: float = f(1.0, "Loss multiplier for this concept.", min=0.0, max=100.0)


@dataclass
class DataConfig:
    concepts: List[ConceptConfig] = f(help="Image folders to train on.", factory=list)
    resolution: int = f(512, "Training resolution in pixels (square; images are resized and cropped).",
                        min=64, max=4096)
    center_crop: bool = f(True, "Crop the center after resizing (off = random crop).")
    random_flip: bool = f(False, "Flip images horizontally at random.")
    cache_latents: bool = f(True, "Encode images with the VAE once and reuse the latents.")
    cache_dir: str = f("", "Where caches live; empty = <workspace>/cache.", ui="path")


@dataclass
class OptimizerConfig:
    name: str = f("adamw", "Optimizer.", choices=["adamw", "adam", "sgd"])
    weight_decay: float = f(0.01, "Decoupled weight decay.", min=0.0, max=10.0)
    beta1: float = f(0.9, "First-moment decay (Adam family).", min=0.0, max=1.0)
    beta2: float = f(0.999, "Second-moment decay (Adam family).", min=0.0, max=1.0)
    eps: float = f(1e-8, "Numerical epsilon (Adam family).", min=0.0, max=1.0)
    momentum: float = f(0.0, "Momentum (SGD).", min=0.0, max=1.0)


@dataclass
class TrainingConfig:
    method: str = f("lora", "What to train: a LoRA adapter or the whole model.",
                    choices=["lora", "finetune"])
    epochs: int = f(10, "Passes over the data (ignored when max_steps > 0).", min=1, max=100000)
    max_steps: int = f(0, "Stop after this many optimizer steps; 0 = use epochs.", min=0, max=10**8)
    batch_size: int = f(1, "Images per step.", min=1, max=1024)
    gradient_accumulation_steps: int = f(1, "Batches summed into one optimizer step.", min=1, max=1024)
    max_grad_norm: float = f(1.0, "Clip gradients to this norm; 0 = no clipping.", min=0.0, max=1e6)
    mixed_precision: str = f("no", "Autocast precision for the forward pass.",
                             choices=["no", "fp16", "bf16"])
    gradient_checkpointing: bool = f(False, "Trade compute for memory: recompute activations.")
    learning_rate: float = f(1e-4, "Base learning rate.", min=0.0, max=10.0)
    unet_learning_rate: Optional[float] = f(None, "UNet learning rate; blank = the base rate.",
                                            min=0.0, max=10.0)
    text_encoder_learning_rate: Optional[float] = f(None, "Text encoder learning rate; blank = the base rate.",
                                                    min=0.0, max=10.0)
    train_unet: bool = f(True, "Train the UNet.")
    train_text_encoder: bool = f(False, "Train the text encoder.")
    lr_scheduler: str = f("constant", "Learning-rate schedule.",
                          choices=["constant", "constant_with_warmup", "linear", "cosine",
                                   "cosine_with_restarts"])
    lr_warmup_steps: int = f(0, "Warm-up steps at the start of the schedule.", min=0, max=10**7)
    lr_cycles: int = f(1, "Restarts for cosine_with_restarts.", min=1, max=1000)
    noise_offset: float = f(0.0, "Noise offset (brighter darks / darker lights); 0.05–0.1 is typical.",
                            min=0.0, max=1.0)
    optimizer: OptimizerConfig = f(help="Optimizer and its settings.", factory=OptimizerConfig)


@dataclass
class LossConfig:
    type: str = f("mse", "Loss between prediction and target.", choices=["mse"])


@dataclass
class EmaConfig:
    enabled: bool = f(False, "Keep an exponential moving average of the trained weights.")


@dataclass
class LoraConfig:
    rank: int = f(16, "LoRA rank (dim): capacity of the adapter.", min=1, max=1024)
    alpha: float = f(16.0, "LoRA alpha: the update is scaled by alpha/rank.", min=0.0, max=4096.0)
    dropout: float = f(0.0, "Dropout on the LoRA path.", min=0.0, max=1.0)
    unet_targets: str = f("attn", "UNet layers to adapt: attention, attention+MLP, or all "
                                  "(adds conv layers: LoCon).",
                          choices=["attn", "attn_mlp", "all"])
    init_weights: str = f("", "Start from an existing LoRA .safetensors (kohya layout).", ui="path")


@dataclass
class SamplePromptConfig:
    prompt: str = f("", "Text of the sample.", ui="textarea")
    negative_prompt: str = f("", "Negative prompt.")
    seed: int = f(42, "Seed of the sample's noise.", min=0, max=2**32 - 1)
    steps: int = f(20, "Denoising steps.", min=1, max=1000)
    cfg_scale: float = f(7.0, "Classifier-free guidance scale.", min=0.0, max=50.0)
    width: int = f(512, "Width in pixels (multiple of 8).", min=64, max=4096)
    height: int = f(512, "Height in pixels (multiple of 8).", min=64, max=4096)


@dataclass
class SamplingConfig:
    every_n_steps: int = f(0, "Sample every N optimizer steps; 0 = never.", min=0, max=10**7)
    every_n_epochs: int = f(1, "Sample every N epochs; 0 = never.", min=0, max=100000)
    at_start: bool = f(False, "Sample once before training (a baseline).")
    at_end: bool = f(True, "Sample once after the last step.")
    scheduler: str = f("ddim", "Sampler.", choices=["ddim", "euler", "euler_a", "dpmpp_2m"])
    prompts: List[SamplePromptConfig] = f(help="Prompts sampled during training.", factory=list)


@dataclass
class BackupConfig:
    every_n_steps: int = f(0, "Write a backup every N optimizer steps; 0 = never.", min=0, max=10**7)
    every_n_epochs: int = f(0, "Write a backup every N epochs; 0 = never.", min=0, max=100000)
    keep_last: int = f(2, "Keep the newest K backups; older ones are deleted.", min=1, max=1000)
    on_stop: bool = f(True, "Write a backup when the run is stopped (Stop / Ctrl+C).")


@dataclass
class OutputConfig:
    name: str = f("", "File or folder name of the result; empty = the run name.")
    path: str = f("", "Folder for the result; empty = the run folder.", ui="path")
    format: str = f("auto", "Result format: auto = kohya .safetensors for LoRA, single file for "
                            "fine-tunes.",
                    choices=["auto", "safetensors", "diffusers", "ckpt"])
    dtype: str = f("fp16", "dtype of the saved weights.", choices=DTYPES)
    save_every_n_epochs: int = f(0, "Also save an intermediate result every N epochs; 0 = only at the end.",
                                 min=0, max=100000)


@dataclass
class AtelierConfig:
    version: int = f(CONFIG_VERSION, "Config format version (for migrating old files).",
                     min=1, max=CONFIG_VERSION, ui="hidden")
    general: GeneralConfig = f(help="Workspace, run name, seed, device.", factory=GeneralConfig)
    model: ModelConfig = f(help="Base model and precision.", factory=ModelConfig)
    data: DataConfig = f(help="Concepts and image handling.", factory=DataConfig)
    training: TrainingConfig = f(help="Optimisation.", factory=TrainingConfig)
    loss: LossConfig = f(help="Loss function and weighting.", factory=LossConfig)
    ema: EmaConfig = f(help="Exponential moving average of the weights.", factory=EmaConfig)
    lora: LoraConfig = f(help="LoRA adapter (training.method = lora).", factory=LoraConfig)
    sampling: SamplingConfig = f(help="Sample images during training.", factory=SamplingConfig)
    backup: BackupConfig = f(help="Backups for resuming.", factory=BackupConfig)
    output: OutputConfig = f(help="The saved result.", factory=OutputConfig)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

class ConfigError(ValueError):
    """A config problem a user can fix; ``key`` names the field (dotted path)."""

    def __init__(self, message: str, key: str = "", value: Any = None):
        super().__init__(message)
        self.key = key
        self.value = value


@dataclass
class Issue:
    """A cross-field warning (or error) attached to a field, shown before launch."""
    key: str
    message: str
    level: str = "warning"


# --------------------------------------------------------------------------------------------
# schema introspection (used by validation, the CLI's config-help and the web UI)
# --------------------------------------------------------------------------------------------

def _inner_type(tp: Any) -> Any:
    """Strip Optional[...] from a resolved type annotation."""
    args = getattr(tp, "__args__", None)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0]
    return tp


def iter_fields(cls: type = AtelierConfig, prefix: str = "") -> Iterable[tuple[str, dataclasses.Field, Any]]:
    """Yield (dotted key, dataclass field, resolved type) for every leaf and list field."""
    import typing
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        tp = _inner_type(hints[fld.name])
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, key + ".")
        else:
            yield key, fld, tp


def field_info(key: str) -> tuple[dataclasses.Field, Any]:
    """The field and type of a dotted key such as ``training.learning_rate`` or
    ``data.concepts.0.path`` (list indices are skipped)."""
    import typing
    cls: Any = AtelierConfig
    parts = [p for p in key.split(".") if not p.isdigit()]
    fld = None
    tp = None
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        matches = [x for x in dataclasses.fields(cls) if x.name == part]
        if not matches:
            raise KeyError(key)
        fld = matches[0]
        tp = _inner_type(hints[part])
        origin = getattr(tp, "__origin__", None)
        if origin in (list, List):
            tp_item = tp.__args__[0]
            if dataclasses.is_dataclass(tp_item) and i < len(parts) - 1:
                cls = tp_item
                continue
        if dataclasses.is_dataclass(tp):
            cls = tp
    assert fld is not None
    return fld, tp


def all_keys(cls: type = AtelierConfig, prefix: str = "") -> List[str]:
    """Every dotted key of the schema, including those inside list items (without indices)."""
    import typing
    out = []
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        tp = _inner_type(hints[fld.name])
        if dataclasses.is_dataclass(tp):
            out += all_keys(tp, key + ".")
        else:
            out.append(key)
            origin = getattr(tp, "__origin__", None)
            if origin in (list, List) and dataclasses.is_dataclass(tp.__args__[0]):
                out += all_keys(tp.__args__[0], key + ".")
    return out


# --------------------------------------------------------------------------------------------
# loading and merging
# --------------------------------------------------------------------------------------------

def preset_names() -> List[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _suggest(bad_key: str) -> str:
    keys = all_keys()
    leaf = bad_key.split(".")[-1]
    close = difflib.get_close_matches(bad_key, keys, n=1, cutoff=0.6)
    if not close:
        close = [k for k in keys if k.split(".")[-1] in difflib.get_close_matches(
            leaf, [x.split(".")[-1] for x in keys], n=1, cutoff=0.7)][:1]
    return f" Did you mean '{close[0]}'?" if close else ""


def _read_yaml(path: Path, what: str) -> DictConfig:
    if not path.exists():
        raise ConfigError(f"{what} '{path}' does not exist.", key="", value=str(path))
    try:
        data = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends
        raise ConfigError(f"{what} '{path}' is not valid YAML: {exc}", value=str(path)) from None
    if data is None:
        data = OmegaConf.create({})
    if not isinstance(data, DictConfig):
        raise ConfigError(f"{what} '{path}' must hold a mapping of settings, not a {type(data).__name__}.",
                          value=str(path))
    return data


def resolve_preset(name: str, relative_to: Optional[Path] = None) -> Path:
    """A preset name (``sd15-lora``) or a path to a YAML file."""
    cand = Path(name)
    if cand.suffix in (".yaml", ".yml"):
        if not cand.is_absolute() and relative_to is not None:
            cand = relative_to / cand
        return cand
    p = PRESETS_DIR / f"{name}.yaml"
    if not p.exists():
        raise ConfigError(f"Unknown preset '{name}'. Built-in presets: {', '.join(preset_names())}.",
                          key="base", value=name)
    return p


def _load_layer(path: Path, what: str, depth: int = 0) -> DictConfig:
    """Load a YAML file and, recursively, the preset named by its ``base:`` key."""
    if depth > 8:
        raise ConfigError(f"{what} '{path}': 'base:' presets nest too deeply (a loop?).", key="base")
    data = _read_yaml(path, what)
    base = data.pop("base", None) if "base" in data else None
    data = migrate(data, str(path))
    if base:
        lower = _load_layer(resolve_preset(str(base), path.parent), "Preset", depth + 1)
        return OmegaConf.merge(lower, data)  # type: ignore[return-value]
    return data


def migrate(data: DictConfig, source: str = "") -> DictConfig:
    """Bring an older config file up to CONFIG_VERSION (none needed yet: version 1 is the first)."""
    version = data.get("version", CONFIG_VERSION)
    try:
        version = int(version)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: 'version' must be a whole number, got {version!r}.", "version", version)
    if version > CONFIG_VERSION:
        raise ConfigError(f"{source}: config version {version} is newer than this Atelier "
                          f"(knows up to {CONFIG_VERSION}); update Atelier.", "version", version)
    data["version"] = CONFIG_VERSION
    return data


def _merge_into_schema(schema: DictConfig, layer: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(schema, layer)  # type: ignore[return-value]
    except ConfigKeyError as exc:
        key = exc.full_key or str(exc.key)
        raise ConfigError(f"{source}: unknown setting '{key}'.{_suggest(key)}", key=key) from None
    except ValidationError as exc:
        key = exc.full_key or ""
        raise ConfigError(f"{source}: '{key}' = {exc.value!r} is not allowed: {_allowed(key)}",
                          key=key, value=exc.value) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {exc}", key=getattr(exc, "full_key", "") or "") from None


def _allowed(key: str) -> str:
    try:
        fld, tp = field_info(key)
    except KeyError:
        return "see the schema."
    meta = fld.metadata
    if "choices" in meta:
        return "one of " + ", ".join(meta["choices"]) + "."
    name = {"int": "whole number", "float": "number", "bool": "true/false", "str": "text"}.get(
        getattr(tp, "__name__", ""), str(tp))
    rng = ""
    if "min" in meta or "max" in meta:
        rng = f" between {meta.get('min')} and {meta.get('max')}"
    return f"a {name}{rng}."


def parse_overrides(overrides: Iterable[str]) -> List[tuple[str, Any]]:
    """``key=value`` strings → (key, parsed value); values are YAML (numbers, lists, mappings)."""
    items = []
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"--set '{ov}' must look like key=value (e.g. training.epochs=20).", key=ov)
        key, raw = ov.split("=", 1)
        try:
            value = OmegaConf.from_dotlist([f"v={raw}"])["v"]
        except Exception as exc:
            raise ConfigError(f"--set {ov}: the value is not valid YAML ({exc}).", key=key) from None
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        items.append((key.strip(), value))
    return items


def _apply_overrides(cfg: DictConfig, overrides: Iterable[str]) -> DictConfig:
    """Apply --set overrides one by one; list items are addressed by index (data.concepts.0.path)."""
    for key, value in parse_overrides(overrides):
        if not any(part.isdigit() for part in key.split(".")):
            nested: Any = value
            for part in reversed(key.split(".")):
                nested = {part: nested}
            cfg = _merge_into_schema(cfg, OmegaConf.create(nested), "--set")
            continue
        parent_key, _, leaf = key.rpartition(".")
        try:
            parent = OmegaConf.select(cfg, parent_key, throw_on_missing=True) if parent_key else cfg
        except Exception:
            parent = None
        if parent is None:
            raise ConfigError(f"--set: unknown setting '{key}'.{_suggest(key)}", key=key)
        if isinstance(parent, ListConfig):
            if not leaf.isdigit() or int(leaf) >= len(parent):
                raise ConfigError(f"--set: '{key}': {parent_key} has {len(parent)} items; index {leaf} "
                                  "does not exist.", key=key)
        elif leaf not in parent:
            raise ConfigError(f"--set: unknown setting '{key}'.{_suggest(key)}", key=key)
        try:
            OmegaConf.update(cfg, key, value, merge=False)
        except ValidationError as exc:
            raise ConfigError(f"--set: '{key}' = {value!r} is not allowed: {_allowed(key)}",
                              key=key, value=value) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(f"--set {key}: {exc}", key=key) from None
    return cfg


def load_config(path: Optional[str | os.PathLike] = None, overrides: Iterable[str] = (),
                preset: Optional[str] = None) -> DictConfig:
    """Preset ⊕ user file ⊕ --set overrides, merged into the schema and validated."""
    schema = OmegaConf.structured(AtelierConfig)
    cfg = schema
    if preset:
        cfg = _merge_into_schema(cfg, _load_layer(resolve_preset(preset), "Preset"), f"preset {preset}")
    if path is not None:
        cfg = _merge_into_schema(cfg, _load_layer(Path(path), "Config file"), str(path))
    cfg = _apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def config_from_dict(data: dict | DictConfig) -> DictConfig:
    """Merge a plain mapping (e.g. from the web UI's form) into the schema and validate it."""
    layer = OmegaConf.create(data) if not isinstance(data, DictConfig) else data
    base = layer.pop("base", None) if "base" in layer else None
    cfg = OmegaConf.structured(AtelierConfig)
    if base:
        cfg = _merge_into_schema(cfg, _load_layer(resolve_preset(str(base)), "Preset"), f"preset {base}")
    cfg = _merge_into_schema(cfg, migrate(layer, "form"), "config")
    validate(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


def save_config(cfg: DictConfig, path: str | os.PathLike) -> None:
    """Write a config atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_yaml(cfg), encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def _check_value(key: str, value: Any, meta: dict) -> None:
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"'{key}' = {value!r} is not allowed: one of {', '.join(map(str, meta['choices']))}.",
                          key=key, value=value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = meta.get("min"), meta.get("max")
        if value != value:  # NaN
            raise ConfigError(f"'{key}' is NaN; give a number.", key=key, value=value)
        if lo is not None and value < lo or hi is not None and value > hi:
            raise ConfigError(f"'{key}' = {value!r} is out of range: allowed {lo} to {hi}.",
                              key=key, value=value)


def _walk(node: Any, cls: type, prefix: str) -> None:
    import typing
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        key = f"{prefix}{fld.name}"
        value = node[fld.name] if fld.name in node else None
        tp = _inner_type(hints[fld.name])
        if dataclasses.is_dataclass(tp):
            _walk(value, tp, key + ".")
            continue
        origin = getattr(tp, "__origin__", None)
        if origin in (list, List):
            item_tp = tp.__args__[0]
            if dataclasses.is_dataclass(item_tp) and value is not None:
                for i, item in enumerate(value):
                    _walk(item, item_tp, f"{key}.{i}.")
            continue
        _check_value(key, value, fld.metadata)


def validate(cfg: DictConfig) -> None:
    """Field checks (choices, ranges) and the hard cross-field rules. Raises ConfigError."""
    _walk(cfg, AtelierConfig, "")
    t = cfg.training
    if t.method == "lora" and not (t.train_unet or t.train_text_encoder):
        raise ConfigError("Nothing to train: turn on training.train_unet and/or training.train_text_encoder.",
                          key="training.train_unet", value=False)
    for i, c in enumerate(cfg.data.concepts):
        if c.caption_source == "concept_file" and not c.caption_file:
            raise ConfigError(f"Concept {i} ('{c.name or c.path}') reads captions from one file, but "
                              f"data.concepts.{i}.caption_file is empty.",
                              key=f"data.concepts.{i}.caption_file")
    for i, s in enumerate(cfg.sampling.prompts):
        for dim in ("width", "height"):
            if s[dim] % 8:
                raise ConfigError(f"sampling.prompts.{i}.{dim} = {s[dim]} must be a multiple of 8.",
                                  key=f"sampling.prompts.{i}.{dim}", value=s[dim])


def cross_field_warnings(cfg: DictConfig) -> List[Issue]:
    """The rules the community learned the hard way: shown before launch, never blocking."""
    out: List[Issue] = []
    t = cfg.training
    if t.method == "lora" and cfg.lora.alpha > cfg.lora.rank:
        out.append(Issue("lora.alpha", f"LoRA alpha ({cfg.lora.alpha:g}) is above rank ({cfg.lora.rank}): "
                                       "the update is scaled up, which often overcooks. Use alpha ≤ rank."))
    res = cfg.data.resolution
    for i, s in enumerate(cfg.sampling.prompts):
        if max(s.width, s.height) < 0.6 * res or min(s.width, s.height) > 1.6 * res:
            out.append(Issue(f"sampling.prompts.{i}.width",
                             f"Sample size {s.width}x{s.height} is far from the training resolution {res}: "
                             "samples may look like noise even when training works."))
    enabled = [c for c in cfg.data.concepts if c.enabled]
    if not enabled:
        out.append(Issue("data.concepts", "No enabled concept: add a folder of images to train on.",
                         level="error"))
    if t.lr_scheduler in ("constant_with_warmup", "linear", "cosine", "cosine_with_restarts") \
            and t.max_steps and t.lr_warmup_steps >= t.max_steps:
        out.append(Issue("training.lr_warmup_steps",
                         f"Warm-up ({t.lr_warmup_steps} steps) is as long as the whole run ({t.max_steps})."))
    if t.mixed_precision == "fp16" and t.method == "finetune" and cfg.model.unet_dtype == "fp16":
        out.append(Issue("model.unet_dtype", "Training fp16 weights directly loses updates; keep the "
                                             "trained UNet in fp32 (or bf16) with fp16 autocast."))
    if t.train_text_encoder and t.method == "lora" and t.text_encoder_learning_rate is None \
            and t.learning_rate > 5e-4:
        out.append(Issue("training.text_encoder_learning_rate",
                         "The text encoder usually wants a lower LR than the UNet (e.g. 5e-5)."))
    return out


def resolved_learning_rates(cfg: DictConfig) -> dict:
    t = cfg.training
    return {
        "unet": t.unet_learning_rate if t.unet_learning_rate is not None else t.learning_rate,
        "text_encoder": t.text_encoder_learning_rate if t.text_encoder_learning_rate is not None
        else t.learning_rate,
    }


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


__all__ = [
    "AtelierConfig", "ConfigError", "Issue", "CONFIG_VERSION", "load_config", "config_from_dict",
    "validate", "cross_field_warnings", "save_config", "to_yaml", "iter_fields", "field_info",
    "all_keys", "preset_names", "resolve_preset", "resolved_learning_rates", "to_container",
    "ListConfig",
]
