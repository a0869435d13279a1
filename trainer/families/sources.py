"""Where weights come from (folder, hub id, single file) and what detection may read of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
