"""The README's table of supported models, made from the family registry and the preset files, so it stays true.

    python3 tools/family_table.py           # print the table
    python3 tools/family_table.py --write   # put it into README.md between its markers

One row per model of the web UI's Quick start: its family (``model.family``), the LoRA types the family trains, the
preset each method starts from, and the memory tiers of its LoRA preset (the ``<preset>-<N>gb`` files beside it,
each sized for a card of N GB). tests/test_launch.py fails when README.md's table differs from this output.
Torch-free: it reads ``trainer/families/*/info.py`` and the preset file names.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from trainer.config.fields import field_info  # noqa: E402  (after the path above)
from trainer.config.load import preset_names  # noqa: E402
from trainer.families import FamilyInfo, infos  # noqa: E402
from trainer.memory.tiers import card_gib  # noqa: E402

START = "<!-- families-table: made by tools/family_table.py; edit the registry, not this table -->"
END = "<!-- families-table end -->"


def lora_types(info: FamilyInfo) -> Tuple[str, ...]:
    """The ``lora.type`` values a family trains: all of the schema's unless its info refuses some."""
    every = tuple(field_info("lora.type")[0].metadata["choices"])
    for key, allowed, _why in info.refuses:
        if key == "lora.type":
            allowed = (allowed,) if isinstance(allowed, str) else tuple(allowed)
            return tuple(t for t in every if t in allowed)
    return every


def memory_tiers(preset: str, names: List[str]) -> Dict[int, str]:
    """Card GB -> the tier presets of ``preset``'s stem (``flux-lora-24gb`` → flux-lora-12gb, -16gb, -24gb)."""
    gib = card_gib(preset)
    stem = preset.removesuffix(f"-{gib}gb") if gib else preset
    return {card_gib(n): n for n in names if card_gib(n) and n == f"{stem}-{card_gib(n)}gb"}


def family_values(info: FamilyInfo, key: str) -> str:
    """The ``model.family`` values of one Quick start model: its key where that is a choice, ``auto`` for a variant
    only detection tells (SD 1.5 inpainting), else the family's choices no other of its models claims."""
    if key in info.choices:
        return f"`{key}`"
    if key in info.variants:
        return "`auto`"
    claimed = {c.key for c in info.quick_start}
    return ", ".join(f"`{c}`" for c in info.choices if c not in claimed)


def table() -> str:
    names = preset_names()
    lines = ["| Model | `model.family` | LoRA (preset) | LoRA types | LoRA memory tiers | Fine-tune (preset) | "
             "Embedding (preset) |", "|---|---|---|---|---|---|---|"]
    for info in infos().values():
        for choice in info.quick_start:
            p = choice.presets
            tiers = memory_tiers(p["lora"], names) if "lora" in p else {}
            family = "built in" if choice.builtin else family_values(info, choice.key)
            lines.append("| " + " | ".join([
                choice.label,
                family,
                f"`{p['lora']}`" if "lora" in p else "yes",
                ", ".join(lora_types(info)),
                ", ".join(f"{gib} GB" for gib in sorted(tiers)) or "—",
                f"`{p['finetune']}`" if "finetune" in p else "yes",
                f"`{p['embedding']}`" if "embedding" in p else "yes" if info.embeddings else "—",
            ]) + " |")
    return "\n".join(lines)


def with_table(readme: str) -> str:
    """README.md's text with its table (between START and END) replaced by :func:`table`."""
    head, start, rest = readme.partition(START)
    _old, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"README.md has no table markers ({START} … {END})")
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: List[str]) -> int:
    if "--write" in argv:
        readme = ROOT / "README.md"
        readme.write_text(with_table(readme.read_text(encoding="utf-8")), encoding="utf-8")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
