"""``merge``: bake one or several kohya LoRA/LoCon files into a model's weights.

Per layer W' = W + weight · (alpha/rank) · up @ down (conv LoCon layers: the product reshaped to the
kernel; LoHa/LoKr as their loaders compute them; DoRA: W + weight · (m · V/‖V‖ − W), the trained weight at weight 1),
computed in fp32 on the loaded model, then written like a fine-tune (single file or diffusers
folder). Every LoRA is checked against the model before anything changes: a LoRA of another family
is refused, naming how many of its layers match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Tuple

from trainer.tools import ToolError, check_out, split_weight
from trainer.tools.common import apply_loras, load_family, read_lora, source_dtype
from trainer.tools.convert import format_of, save_model


def parse_loras(specs: List[str]) -> List[Tuple[str, float]]:
    return [split_weight(s, "LORA") for s in specs]


def run(args: Any) -> int:
    if not args.loras:
        raise ToolError("give at least one LoRA file to merge: merge BASE LORA[:WEIGHT] … --out PATH")
    specs = parse_loras(args.loras)
    loras = [(read_lora(path, "LORA", allow_dora=True), weight)  # bad files fail before the model loads
             for path, weight in specs]
    out = Path(args.out).expanduser()
    fmt = format_of(out, args.format)
    inputs = [Path(p) for p, _ in specs] + ([Path(args.base)] if Path(args.base).expanduser().exists() else [])
    check_out(out, args.overwrite, folder=fmt == "diffusers", inputs=inputs)
    model = load_family(args.base, args.workspace, config_path=args.config_path)
    layers = apply_loras(model, loras)
    dtype = args.dtype or source_dtype(model)
    merged = [{"file": lora.path.name, "weight": weight} for lora, weight in loras]
    meta = {"modelspec.title": out.stem, "atelier_merged_from": Path(str(args.base)).name,
            "atelier_merged_loras": json.dumps(merged)}
    save_model(model, out, fmt, dtype, meta)
    names = ", ".join(f"{lora.path.name}:{weight:g}" for lora, weight in loras)
    print(f"merged {names} ({layers} layers) into {args.base}")
    print(f"wrote {out} ({fmt}, {dtype})")
    return 0
