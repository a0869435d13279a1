"""Building a config: ``preset (base:) ⊕ user YAML ⊕ --set key=value`` merged into the schema
(:func:`compose`, :func:`compose_dict`), older files migrated (:func:`migrate`), and writing it back.

Loading does not check values beyond their types: ``trainer.config.checks`` (``load_config``,
``config_from_dict``) composes and then validates. Torch-free.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from pathlib import Path
from typing import Any, Iterable, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from trainer.config.fields import allowed, field_info, suggest
from trainer.config.schema import CONFIG_VERSION, AtelierConfig
from trainer.errors import ConfigError, raise_all

ATELIER_ROOT = Path(__file__).resolve().parent.parent.parent
PRESETS_DIR = ATELIER_ROOT / "presets"

# ``${atelier_root:}`` in a config or preset: the project's folder (the demo preset's images live there).
if not OmegaConf.has_resolver("atelier_root"):
    OmegaConf.register_resolver("atelier_root", lambda: str(ATELIER_ROOT))


def preset_names() -> List[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _read_yaml(path: Path, what: str) -> DictConfig:
    if not path.exists():
        raise ConfigError(f"{what} '{path}' does not exist.", key="", value=str(path))
    try:
        data = OmegaConf.load(path)
    except RecursionError:
        raise ConfigError(f"{what} '{path}' nests mappings or lists hundreds of levels deep; Atelier's settings go "
                          "at most four levels down (data.concepts.0.path). Compare the file with `python -m trainer "
                          "config-help`.", value=str(path)) from None
    except Exception as exc:  # yaml.YAMLError and friends
        hint = ""
        try:
            raw = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            raw = ""
        if re.search(r'"[^"\n]*\\[^"\n]*"', raw):  # "C:\Users\…" in double quotes: \U starts an escape in YAML
            hint = ("\nA Windows path in double quotes needs every backslash doubled (\"C:\\\\data\"); "
                    "write it in single quotes ('C:\\data'), without quotes, or with forward slashes (C:/data).")
        raise ConfigError(f"{what} '{path}' is not valid YAML: {exc}{hint}", value=str(path)) from None
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
        names = preset_names()
        close = difflib.get_close_matches(name, names, n=4, cutoff=0.5)
        hint = f"Did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"Unknown preset '{name}'. {hint}`python -m trainer presets` lists the {len(names)} built-in "
                          "presets (the UI's preset menu too).", key="base", value=name)
    return p


def _load_layers(path: Path, what: str, depth: int = 0, files: Optional[List[Path]] = None) -> List[tuple]:
    """A YAML file and, recursively, the presets named by its ``base:`` keys: ``[(layer, source), ...]`` with the
    lowest preset first. Each layer merges into the schema on its own, so a layer of the wrong shape is named with
    its file whatever the layer below holds. ``files``, when given, collects the files read."""
    if files is not None:
        files.append(path)
    if depth > 8:
        raise ConfigError(f"{what} '{path}': 'base:' presets nest too deeply (a loop?).", key="base")
    data = _read_yaml(path, what)
    base = data.pop("base", None) if "base" in data else None
    data = migrate(data, str(path))
    source = str(path) if what != "Preset" else f"preset {path.stem}"
    if base:
        if not isinstance(base, str):
            raise ConfigError(f"{what} '{path}': 'base' names one preset (base: demo), not {_shape_name(base)}.",
                              key="base")
        return _load_layers(resolve_preset(base, path.parent), "Preset", depth + 1, files) + [(data, source)]
    return [(data, source)]


# Version 1 kept the UNet/text-encoder settings as fixed fields; version 2 has them per part (parts.*).
# old key -> new keys (one old key may fill several parts: model.text_encoder_dtype was both encoders').
RENAMED_V1 = {
    "model.unet_dtype": ("parts.denoiser.dtype",),
    "model.text_encoder_dtype": ("parts.text_encoder_1.dtype", "parts.text_encoder_2.dtype"),
    "training.train_unet": ("parts.denoiser.train",),
    "training.train_text_encoder": ("parts.text_encoder_1.train",),
    "training.train_text_encoder_2": ("parts.text_encoder_2.train",),
    "training.unet_learning_rate": ("parts.denoiser.learning_rate",),
    "training.text_encoder_learning_rate": ("parts.text_encoder_1.learning_rate",),
    "training.text_encoder_2_learning_rate": ("parts.text_encoder_2.learning_rate",),
    "training.unet_stop_after_steps": ("parts.denoiser.stop_after_steps",),
    "training.unet_stop_after_epochs": ("parts.denoiser.stop_after_epochs",),
    "training.text_encoder_stop_after_steps": ("parts.text_encoder_1.stop_after_steps",),
    "training.text_encoder_stop_after_epochs": ("parts.text_encoder_1.stop_after_epochs",),
    "training.text_encoder_2_stop_after_steps": ("parts.text_encoder_2.stop_after_steps",),
    "training.text_encoder_2_stop_after_epochs": ("parts.text_encoder_2.stop_after_epochs",),
    "training.caption_dropout_te1": ("parts.text_encoder_1.caption_dropout",),
    "training.caption_dropout_te2": ("parts.text_encoder_2.caption_dropout",),
    "precision.fp8_unet": ("parts.denoiser.fp8",),
    "lora.unet_targets": ("parts.denoiser.lora_targets",),
}


def renamed_key(key: str) -> tuple:
    """The version-2 keys of a version-1 key (``--set`` accepts the old names); ``(key,)`` when unchanged."""
    return RENAMED_V1.get(key, (key,))


def migrate(data: DictConfig, source: str = "") -> DictConfig:
    """Bring an older config file (or a form, a preset) up to CONFIG_VERSION without losing a setting.

    Version 1 -> 2: the per-part fields move under ``parts`` (see RENAMED_V1). A file without
    ``version`` that still uses old keys is read as version 1. Version 2 -> 3: a concept's ``validation: true``
    becomes ``role: validation`` (:func:`migrate_concept`)."""
    version = data.get("version", None)
    try:
        version = int(version) if version is not None else None
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: 'version' must be a whole number, got {version!r}.", "version", version)
    if version is not None and version > CONFIG_VERSION:
        raise ConfigError(f"{source}: config version {version} is newer than this Atelier "
                          f"(knows up to {CONFIG_VERSION}); update Atelier.", "version", version)
    if version is None or version < 2:
        _move_v1_keys(data)
    if version is None or version < 3:
        concepts = data.get("data", {}).get("concepts") if isinstance(data.get("data"), DictConfig) else None
        if isinstance(concepts, ListConfig):
            for concept in concepts:
                migrate_concept(concept)
    data["version"] = CONFIG_VERSION
    return data


def _move_v1_keys(data: DictConfig) -> None:
    for old, new_keys in RENAMED_V1.items():
        section, leaf = old.split(".")
        node = data.get(section) if isinstance(data, DictConfig) else None
        if not isinstance(node, DictConfig) or leaf not in node:
            continue
        value = node._get_node(leaf)
        raw = value._value() if hasattr(value, "_value") else value
        if isinstance(raw, str) and raw.startswith("${") and raw.endswith("}"):  # keep interpolations working
            raw = "${" + renamed_key(raw[2:-1])[0] + "}" if raw[2:-1] in RENAMED_V1 else raw
        for new in new_keys:
            OmegaConf.update(data, new, raw, merge=False, force_add=True)
        node.pop(leaf)


def migrate_concept(concept: Any) -> Any:
    """A concept of a version-2 config (a mapping): ``validation: true/false`` becomes ``role: validation``
    (or nothing: the role's default is train). Returns it, changed in place where it is a mapping."""
    if isinstance(concept, (dict, DictConfig)) and "validation" in concept:
        was = concept.pop("validation")
        if was and str(was).lower() not in ("false", "0", "no", "off"):
            concept["role"] = "validation"
    return concept


def _shape_problems(schema: Any, layer: Any, prefix: str = "") -> List[tuple]:
    """(key, message) for every place where ``layer`` has a value of the wrong shape for the schema:
    a section (mapping) given as a list or a scalar, a list (concepts, prompts) given as a mapping."""
    if not isinstance(layer, DictConfig) or not isinstance(schema, DictConfig):
        return []
    found: List[tuple] = []
    for key in layer.keys():
        if key not in schema:
            continue  # unknown keys get their own message from the merge
        full = f"{prefix}{key}"
        value = layer._get_node(key)
        if value is None or (hasattr(value, "_is_none") and value._is_none()):
            continue
        target = schema._get_node(key)
        if isinstance(target, DictConfig) and not isinstance(value, DictConfig):
            if hasattr(value, "_is_interpolation") and value._is_interpolation():
                continue
            found.append((full, f"'{full}' is a section of settings and must be a mapping ('{key}:' followed by "
                                f"indented '<setting>: <value>' lines), not {_shape_name(value)}."))
        elif isinstance(target, ListConfig) and not isinstance(value, ListConfig):
            if hasattr(value, "_is_interpolation") and value._is_interpolation():
                continue
            found.append((full, f"'{full}' must be a list (one '- ' item per entry), not {_shape_name(value)}."))
        elif isinstance(target, DictConfig):
            found += _shape_problems(target, value, full + ".")
    return found


def _shape_name(node: Any) -> str:
    if isinstance(node, ListConfig):
        return "a list"
    if isinstance(node, DictConfig):
        return "a mapping"
    value = getattr(node, "_value", lambda: node)()
    return f"the value {value!r}"


def _merge_into_schema(schema: DictConfig, layer: DictConfig, source: str,
                       errors: Optional[List[ConfigError]] = None) -> DictConfig:
    """``layer`` merged into ``schema``. Every key of the wrong shape, unknown or of the wrong type is a ConfigError
    naming it: raised at once without ``errors``; with it, each is added there and the merge goes on without that
    key, so one pass names them all."""
    if errors is None:
        collected: List[ConfigError] = []
        merged = _merge_into_schema(schema, layer, source, collected)
        raise_all(collected)
        return merged
    problems = _shape_problems(schema, layer)
    copied = bool(problems)
    if copied:
        layer = copy.deepcopy(layer)  # the caller's layer (a form's data) stays as it was
    for key, message in problems:
        errors.append(ConfigError(f"{source}: {message}", key=key))
        _drop(layer, key.split("."))
    for _ in range(1000):  # each round drops one bad key
        try:
            return OmegaConf.merge(schema, layer)  # type: ignore[return-value]
        except ConfigKeyError as exc:
            path = _bad_path(layer, exc)
            key = ".".join(path) if path else exc.full_key or str(exc.key)
            errors.append(ConfigError(f"{source}: unknown setting '{key}'.{suggest(key)}", key=key))
        except ValidationError as exc:
            path = _bad_path(layer, exc)
            key = ".".join(path) if path else exc.full_key or ""
            errors.append(ConfigError(f"{source}: '{key}' = {exc.value!r} is not allowed: {allowed(key)}",
                                      key=key, value=exc.value))
        except OmegaConfBaseException as exc:
            errors.append(ConfigError(f"{source}: {str(exc).splitlines()[0]}",
                                      key=getattr(exc, "full_key", "") or ""))
            return schema
        except (TypeError, ValueError) as exc:  # merge of incompatible shapes the check above did not foresee
            errors.append(ConfigError(f"{source}: a setting has the wrong shape ({exc}); compare the file with "
                                      "`python -m trainer config-help`."))
            return schema
        if not path:
            return schema  # the bad key cannot be found to leave out: this layer is left out
        if not copied:
            layer, copied = copy.deepcopy(layer), True
        _drop(layer, path)
    return schema


def _layer_paths(node: Any, prefix: tuple = ()) -> Iterable[tuple]:
    """(path, value) of every leaf and section of a layer, depth first; list items by their index."""
    if isinstance(node, DictConfig):
        items = [(str(k), node._get_node(k)) for k in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(str(i), node._get_node(i)) for i in range(len(node))]
    else:
        return
    for name, child in items:
        yield prefix + (name,), child
        yield from _layer_paths(child, prefix + (name,))


def _bad_path(layer: DictConfig, exc: OmegaConfBaseException) -> List[str]:
    """Where in ``layer`` the key a merge refused sits. OmegaConf names a key inside a list item (a concept's) by its
    leaf only, so that one is looked up: the item's key of that name the schema does not know (or whose value
    was refused)."""
    full = str(getattr(exc, "full_key", "") or "")
    path = [p for p in re.split(r"[.\[\]]+", full) if p]
    try:
        if path and OmegaConf.select(layer, ".".join(path), default=_MISSING) is not _MISSING:
            return path
    except OmegaConfBaseException:  # an interpolation on the way
        pass
    leaf = str(getattr(exc, "key", "") or "")
    for where, node in _layer_paths(layer):
        if where[-1] != leaf or not any(p.isdigit() for p in where[:-1]):
            continue
        if isinstance(exc, ValidationError):
            value = node._value() if hasattr(node, "_value") else node
            if value == exc.value:
                return list(where)
        else:
            try:
                field_info(".".join(where))
            except KeyError:
                return list(where)
    return []


_MISSING = object()


def _drop(layer: DictConfig, path: List[str]) -> None:
    """Take the key at ``path`` out of a layer (to merge the rest)."""
    node: Any = layer
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, ListConfig) else node[part]
    if isinstance(node, ListConfig):
        node.pop(int(path[-1]))
    else:
        node.pop(path[-1])


def _check_interpolations(cfg: DictConfig) -> None:
    """``${...}`` references that cannot be resolved, as one line naming the setting (resolved on a copy:
    saved configs keep their interpolations)."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        first = str(exc).splitlines()[0]
        raise ConfigError(f"'{key}': its ${{...}} reference cannot be resolved ({first}). Write the value itself, "
                          "or refer to an existing setting (${section.key}).", key=key) from None


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


def _merge_plain(into: dict, key: str, value: Any) -> None:
    """Put ``value`` at dotted ``key`` of the plain dict ``into`` as a merge would: mappings merge,
    anything else (lists included) replaces."""
    *parents, leaf = key.split(".")
    node = into
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for k, v in value.items():
            _merge_plain(node[leaf], k, v)
    else:
        node[leaf] = value


_CONCEPT = re.compile(r"^data\.concepts\.(\d+)(\.validation)?$")


def _concept_v2(key: str, value: Any) -> tuple:
    """``--set`` in a version-2 config's words: ``data.concepts.N.validation=true`` is ``...N.role=validation``;
    concepts given whole (``data.concepts=[...]``, ``data.concepts.N={...}``) are migrated item by item."""
    if key == "data.concepts" and isinstance(value, (list, ListConfig)):
        return key, [migrate_concept(c) for c in value]
    m = _CONCEPT.match(key)
    if m and m.group(2):
        on = bool(value) and str(value).lower() not in ("false", "0", "no", "off")
        return f"data.concepts.{m.group(1)}.role", "validation" if on else "train"
    if m:
        return key, migrate_concept(value)
    return key, value


def _apply_overrides(cfg: DictConfig, overrides: Iterable[str],
                     errors: Optional[List[ConfigError]] = None) -> DictConfig:
    """Apply --set overrides in order; list items are addressed by index (data.concepts.0.path).
    Runs of plain keys are merged in one step (each merge copies the whole config). A bad override raises, or
    without raising joins ``errors`` (the others still apply)."""
    if errors is None:
        collected: List[ConfigError] = []
        cfg = _apply_overrides(cfg, overrides, collected)
        raise_all(collected)
        return cfg
    pending: dict = {}

    def flush(cfg: DictConfig) -> DictConfig:
        if pending:
            cfg = _merge_into_schema(cfg, OmegaConf.create(pending), "--set", errors)
            pending.clear()
        return cfg

    for override in overrides:
        try:
            [(old_key, value)] = parse_overrides([override])
        except ConfigError as exc:
            errors.append(exc)
            continue
        value = _as_written(old_key, value, override)
        old_key, value = _concept_v2(old_key, value)  # version-2 concept settings keep working too
        keys = renamed_key(old_key)  # version-1 names keep working on the command line
        if len(keys) > 1 or keys[0] != old_key:
            for key in keys:
                _merge_plain(pending, key, value)
            continue
        key = old_key
        if not any(part.isdigit() for part in key.split(".")):
            _merge_plain(pending, key, value)
            continue
        cfg = flush(cfg)
        try:
            _set_indexed(cfg, key, value)
        except ConfigError as exc:
            errors.append(exc)
    return flush(cfg)


def _as_written(key: str, value: Any, override: str) -> Any:
    """A ``--set`` value for a text setting as it was typed: YAML 1.1 reads ``no``/``on`` as booleans, ``0755`` as
    octal, ``12:30`` as a base-60 number and ``1e3`` as a float, which the text field would then hold as 'False',
    '493', '750' and '1000.0' (a run named by ``general.run_name=0755`` got the folder ``493``). Other settings,
    quoted values and ``null`` are as YAML reads them."""
    if isinstance(value, (str, list, dict)) or value is None or not _text_setting(key):
        return value
    return override.split("=", 1)[1].strip()


@functools.lru_cache(maxsize=None)
def _text_setting(key: str) -> bool:
    """``key`` is a text setting of the schema (False for an unknown or renamed key: named or mapped later)."""
    try:
        return field_info(key)[1] is str
    except (KeyError, TypeError):
        return False


def _set_indexed(cfg: DictConfig, key: str, value: Any) -> None:
    """One ``--set`` of a key inside a list item (``data.concepts.0.path``), in place."""
    parent_key, _, leaf = key.rpartition(".")
    try:
        parent = OmegaConf.select(cfg, parent_key, throw_on_missing=True) if parent_key else cfg
    except Exception:
        parent = None
    if parent is None:
        raise ConfigError(f"--set: unknown setting '{key}'.{suggest(key)}", key=key)
    if isinstance(parent, ListConfig):
        if not leaf.isdigit() or int(leaf) >= len(parent):
            raise ConfigError(f"--set: '{key}': {parent_key} has {len(parent)} items; index {leaf} "
                              "does not exist.", key=key)
    elif leaf not in parent:
        raise ConfigError(f"--set: unknown setting '{key}'.{suggest(key)}", key=key)
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except ValidationError:
        raise ConfigError(f"--set: '{key}' = {value!r} is not allowed: {allowed(key)}",
                          key=key, value=value) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"--set {key}: {exc}", key=key) from None


@functools.lru_cache(maxsize=1)
def _schema_template() -> DictConfig:
    return OmegaConf.structured(AtelierConfig)


def schema_defaults() -> DictConfig:
    """A fresh config of the schema's defaults: a copy of one built once (building it from the dataclasses takes
    four times as long as copying it, and every preset, form and validate builds one)."""
    return copy.deepcopy(_schema_template())


def _merged_at_once(layers: List[tuple]) -> Optional[DictConfig]:
    """The schema's defaults with ``layers`` merged in, in place in one fresh copy (``OmegaConf.merge`` copies its
    target at every layer: most of a preset's composing time), or None where a layer has a problem: the caller then
    merges each layer with :func:`_merge_into_schema`, which names every problem and where it is."""
    cfg = schema_defaults()
    try:
        for layer, _ in layers:
            if _shape_problems(cfg, layer):
                return None
            cfg.merge_with(layer)
    except (OmegaConfBaseException, TypeError, ValueError):
        return None
    return cfg


# A shipped preset merged into the schema, per preset: (the stamps of the files its base: chain read, the config).
_SHIPPED_MERGED: dict = {}


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_mtime_ns, st.st_size)


def _schema_with_preset(preset: str, errors: List[ConfigError]) -> DictConfig:
    """The schema's defaults with a preset and its ``base:`` chain merged in. A shipped preset's (every file of the
    chain under presets/) is merged once per version of its files and copied after (the merges cost ten times the
    copy, and the page, validate and each run compose presets again and again); a user's YAML is read each time."""
    path = resolve_preset(preset)
    hit = _SHIPPED_MERGED.get(str(path))
    if hit is not None:
        try:
            if all(_stamp(Path(stamp[0])) == stamp for stamp in hit[0]):
                return copy.deepcopy(hit[1])
        except OSError:
            pass
    files: List[Path] = []
    layers = _load_layers(path, "Preset", files=files)
    own: List[ConfigError] = []
    cfg = _merged_at_once(layers)
    if cfg is None:
        cfg = schema_defaults()
        for layer, source in layers:
            cfg = _merge_into_schema(cfg, layer, source, own)
    errors.extend(own)
    shipped = PRESETS_DIR.resolve()
    if not own and all(f.resolve().parent == shipped for f in files):
        _SHIPPED_MERGED[str(path)] = (tuple(_stamp(f) for f in files), copy.deepcopy(cfg))
    return cfg


def compose(path: Optional[str | os.PathLike] = None, overrides: Iterable[str] = (),
            preset: Optional[str] = None, problems: Optional[List[ConfigError]] = None) -> DictConfig:
    """Preset ⊕ user file ⊕ --set overrides, merged into the schema (types checked; values are
    ``trainer.config.checks``' business: its ``load_config`` is this, validated).

    Every unknown key, wrong type or wrong shape is named: raised together (:class:`ConfigErrors` for several), or,
    with ``problems``, added there and left out of the config returned, so ``validate`` can check the rest too.
    A file that cannot be read at all (missing, not YAML, an unknown preset) raises at once."""
    errors: List[ConfigError] = []
    layers = _load_layers(Path(path), "Config file") if path is not None else []
    cfg = None if preset or not layers else _merged_at_once(layers)  # a file alone: its layers in one pass
    if cfg is None:
        cfg = _schema_with_preset(preset, errors) if preset else schema_defaults()
        for layer, source in layers:
            cfg = _merge_into_schema(cfg, layer, source, errors)
    cfg = _apply_overrides(cfg, overrides, errors)
    try:
        _check_interpolations(cfg)
    except ConfigError as exc:
        errors.append(exc)
    if problems is None:
        raise_all(errors)
    else:
        problems.extend(errors)
    return cfg


def compose_dict(data: dict | DictConfig, problems: Optional[List[ConfigError]] = None) -> DictConfig:
    """Merge a plain mapping (e.g. from the web UI's form) into the schema (``config_from_dict`` validates it);
    ``problems`` as for :func:`compose`."""
    errors: List[ConfigError] = []
    layer = OmegaConf.create(data) if not isinstance(data, DictConfig) else data
    base = layer.pop("base", None) if "base" in layer else None
    layers = _load_layers(resolve_preset(str(base)), "Preset") if base else []
    layers.append((migrate(layer, "form"), "config"))
    cfg = _merged_at_once(layers)
    if cfg is None:
        cfg = schema_defaults()
        for lower, source in layers:
            cfg = _merge_into_schema(cfg, lower, source, errors)
    if problems is None:
        raise_all(errors)
    else:
        problems.extend(errors)
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


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
