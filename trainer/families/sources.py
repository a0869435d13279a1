"""Where weights come from (folder, hub id, single file) and what detection may read of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.config.schema import PART_OF_SLOT
from trainer.families import MISSING, Evidence


def evidence_for(source: Any, mcfg: Any = None) -> Evidence:
    """Key names/shapes of a single file, or a JSON reader over a folder or hub repo (no weights load).

    Raises ValueError for a file that cannot be read as a checkpoint at all."""
    if source.kind == "single_file":
        from trainer.families.common.sd_kit.sd_configs import _read_key_shapes
        return Evidence("single_file", f"model.path '{source.display}'", shapes=_read_key_shapes(Path(source.location)))
    if source.kind == "folder":
        folder = Path(source.location)

        def read_local(rel: str):
            p = folder / rel
            if not p.is_file():
                return MISSING
            from trainer.families.common.sd_kit.sd_configs import _read_json
            try:
                return _read_json(p)
            except ValueError:
                return MISSING
        return Evidence("folder", f"model.path '{source.display}'", read_json=read_local)

    from trainer.models.base import _MISSING, _read_hub_json
    cache: dict = {}

    def read_hub(rel: str):
        if rel not in cache:
            value = _read_hub_json(source.location, rel, mcfg)
            cache[rel] = MISSING if value is _MISSING else value
        return cache[rel]
    return Evidence("hub", f"hub model '{source.location}'", read_json=read_hub)


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
        den = cfg.parts.denoiser
        deferred = {"unet"} if den.get("fp8", False) or den.get("nf4", False) or den.get("blocks_to_swap", 0) else set()
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
