"""``python -m trainer data-report CONFIG``: what the trainer will do with the images, before any GPU time."""

from __future__ import annotations

import json
import sys
from typing import Any, List


def build_report(cfg: Any) -> dict:
    """Scan the concepts (no model, no torch) and return the report as a dict with the warnings."""
    from trainer.data.concepts import scan_concepts
    warnings: List[str] = []
    _items, report = scan_concepts(cfg.data, warn=warnings.append)
    out = report.to_dict()
    out["warnings"] = warnings
    return out


def print_report(cfg: Any, as_json: bool = False) -> int:
    from trainer.config import ConfigError
    try:
        rep = build_report(cfg)
    except ConfigError as exc:
        print(f"Data error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(rep, indent=1, default=str))
        return 0
    for c in rep.get("concepts", []):
        print(f"concept {c.get('index')} {c.get('name') or ''} ({c.get('path')}): "
              f"{c.get('images_used')} used / {c.get('images_found')} found, "
              f"{c.get('captions_missing', 0)} without caption")
        for entry in c.get("skipped", []):
            print(f"  skipped: {entry}")
    for w in rep["warnings"]:
        print(f"warning: {w}")
    print(f"total: {rep.get('total_images')} images")
    return 0
