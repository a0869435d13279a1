"""Generated bad (and good) configs: the demo run with one to three settings changed at random, drawn from the schema
itself (every key, its type, choices and range), plus the shapes users get wrong by hand (a section as a list, a list
as a mapping, deep nesting, long paths, files of the wrong kind). Deterministic: ``corpus(n, seed)`` gives the same
configs on every machine. ``tests/test_config_fuzz.py`` checks that ``validate`` answers each with a message, never a
traceback; ``bench/fuzz_configs.py`` also trains every config ``validate`` passes, to find those that fail only in train.

Run ``python tests/config_fuzz.py OUT_DIR [N]`` to write the corpus as YAML files.
"""

from __future__ import annotations

import random
import sys
import typing
from pathlib import Path
from typing import Any, Dict, List

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.config.fields import all_keys, field_info  # noqa: E402  (the project, importable from a checkout)

#: The run every mutation starts from: the demo, one epoch, one two-step sample (seconds on a CPU).
BASE: Dict[str, Any] = {
    "base": "demo",
    "training": {"epochs": 1},
    "sampling": {"every_n_epochs": 1, "prompts": [{"prompt": "a red square", "steps": 2, "width": 64, "height": 64}]},
    "backup": {"every_n_epochs": 0},
}

_STRINGS = ["", "x", "none", "auto", "../../etc", "a" * 300, "ünïcødé", "1e-4", "true", "${oc.env:NOPE_NOT_SET}",
            "<script>", "C:\\\\data\\\\x", "a:b*?"]
_SHAPES = [[1, 2], {"a": 1}, None, [], {}]


def _files(tmp: Path) -> Dict[str, str]:
    """Files a path setting may be pointed at: missing, empty, text, a folder, an image."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "empty.safetensors").write_bytes(b"")
    (tmp / "text.safetensors").write_text("not weights", encoding="utf-8")
    (tmp / "notes.txt").write_text("a caption\n", encoding="utf-8")
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "yaml.yaml").write_text("a: [1\n", encoding="utf-8")
    return {k: str(tmp / k) for k in ("empty.safetensors", "text.safetensors", "notes.txt", "folder", "yaml.yaml",
                                       "missing.png")}


def _value(key: str, rng: random.Random, files: Dict[str, str]) -> Any:
    fld, tp = field_info(key)
    meta = fld.metadata
    lo, hi = meta.get("min"), meta.get("max")
    origin = typing.get_origin(tp)
    pick = rng.random()
    if pick < 0.08:
        return rng.choice(_SHAPES)
    if meta.get("ui") in ("path", "paths"):
        value = rng.choice(list(files.values()) + ["", "builtin:tiny-sd", "org/name", "x" * 5000])
        return [value] if origin in (list, List) else value
    if "choices" in meta:
        return rng.choice(list(meta["choices"]) + ["nope", 3])
    if tp is bool:
        return rng.choice([True, False, "maybe", 2])
    if tp in (int, float):
        edges = [0, -1, 1, 2, 10 ** 12, 1.5, "abc", float("inf"), float("nan")]
        if lo is not None:
            edges += [lo, lo - 1]
        if hi is not None:
            edges += [hi, hi + 1]
        if lo is not None and hi is not None and pick < 0.5:
            v = rng.uniform(lo, hi)
            return int(v) if tp is int else v
        return rng.choice(edges)
    if origin in (list, List):
        return rng.choice([[], ["x"], ["a", "b"], "x", [1, [2]]])
    if origin in (dict, Dict):
        return rng.choice([{}, {"foo": 1}, {"step_size": 2}, {"gamma": "x"}, [1], "x"])
    return rng.choice(_STRINGS)


def _set(tree: Dict[str, Any], key: str, value: Any, rng: random.Random) -> None:
    """Put ``value`` at a dotted key; a key inside a list item picks or adds an item."""
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if part in ("concepts", "prompts"):
            items = node.setdefault(part, [])
            if not isinstance(items, list):
                return
            if not items or rng.random() < 0.3:
                items.append({"path": "${atelier_root:}/presets/demo-data"} if part == "concepts" else {"prompt": "x"})
            node = items[rng.randrange(len(items))]
            continue
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def corpus(n: int = 200, seed: int = 0, tmp: Path = Path("fuzz-files")) -> List[str]:
    """``n`` config files' texts (YAML): each the demo with 1-3 settings changed, or one of the hand-made shapes."""
    rng = random.Random(seed)
    files = _files(Path(tmp))
    keys = [k for k in all_keys() if k not in ("version",)]
    sections = sorted({k.split(".")[0] for k in keys})
    out: List[str] = []
    for i in range(n):
        tree = yaml.safe_load(yaml.safe_dump(BASE))
        roll = rng.random()
        if roll < 0.06:  # a whole section of the wrong shape
            tree[rng.choice(sections)] = rng.choice([[1, 2], "x", 3])
        elif roll < 0.09:  # nesting deeper than any setting
            deep: Any = 1
            for d in range(rng.choice([6, 40, 300])):
                deep = {f"k{d}": deep}
            tree[rng.choice(sections)] = deep
        elif roll < 0.11:
            tree["data"] = {"concepts": rng.choice([{"a": 1}, [1, 2], "x", [{"path": files["notes.txt"]}]])}
        else:
            for key in rng.sample(keys, rng.choice([1, 1, 2, 3])):
                _set(tree, key, _value(key, rng, files), rng)
        out.append(yaml.safe_dump(tree, sort_keys=False, allow_unicode=True))
    return out


if __name__ == "__main__":
    dest = Path(sys.argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(corpus(int(sys.argv[2]) if len(sys.argv) > 2 else 200, tmp=dest / "files")):
        (dest / f"{i:03d}.yaml").write_text(text, encoding="utf-8")
