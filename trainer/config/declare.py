"""How a setting is declared in the schema: :func:`f` puts a field's default, its one-line help text (the UI's
tooltip, the CLI's ``config-help``), its allowed values (``choices``), its range (``min``/``max``) and a UI hint
(``"path"``, ``"textarea"``, ``"hidden"``) in one place. Imports nothing of Atelier."""

from __future__ import annotations

from dataclasses import field
from typing import Any, List, Optional

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
