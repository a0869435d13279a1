"""Tags as the booru taggers' users write them: which tags a WD tagger's scores keep, and how each is written.

The WD taggers (SmilingWolf's, ``selected_tags.csv`` beside ``model.onnx``) score every tag of their table; each
row of the table has a category: 9 rating, 4 character, 0 general. What is kept and how it is written follows
kohya's ``finetune/tag_images_by_wd14_tagger.py`` (sd-scripts, read at commit 03b35be3): general and character
tags scoring at least their threshold, in the table's order (general before character unless character tags go
first), the one best rating first when asked for, underscores written as spaces except in kaomoji (``^_^``),
the excluded tags left out, joined with ``, ``. MCut (the threshold at the widest gap between sorted scores, as
SmilingWolf's own demo computes it; at least 0.15 for characters) replaces the fixed thresholds when asked.

Torch-free (numpy): ``--help`` and the page import the defaults from here.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from trainer.tools import ToolError

DEFAULT_THRESHOLD = 0.35
# The WD taggers' rating labels: a rating, not something in the picture.
RATING_TAGS = ("general", "sensitive", "questionable", "explicit")
# Tags whose underscores are part of the face they draw (kohya's list): written as they are.
KAOMOJIS = {"0_0", "(o)_(o)", "+_+", "+_-", "._.", "<o>_<o>", "<|>_<|>", "=_=", ">_<", "3_3", "6_9", ">_o", "@_@",
            "^_^", "o_o", "u_u", "x_x", "|_|", "||_||"}


# selected_tags.csv's categories
RATING, GENERAL, CHARACTER = 9, 0, 4
CHARACTER_MCUT_FLOOR = 0.15  # SmilingWolf's demo: MCut never keeps characters below this


def tag_text(label: str) -> str:
    """A tag as kohya's tagger writes it: underscores as spaces, except in kaomoji (``^_^``)."""
    label = str(label).strip()
    return label if label in KAOMOJIS else label.replace("_", " ")


def pick_tags(scores: Sequence[float], labels: Dict[int, str], threshold: float, limit: int = 0,
              skip: Sequence[str] = ()) -> List[str]:
    """Tags scoring above ``threshold``, best first (ties: label order), at most ``limit`` (0: all)."""
    chosen = [(float(s), i) for i, s in enumerate(scores) if float(s) > threshold and labels.get(i) not in skip]
    chosen.sort(key=lambda t: (-t[0], t[1]))
    if limit > 0:
        chosen = chosen[:limit]
    return [tag_text(labels[i]) for _, i in chosen]


def compose(caption: str, prefix: str = "", suffix: str = "") -> str:
    """``prefix, caption, suffix`` on one line (training reads each line as its own caption), joined with ", ";
    a prefix that ends with punctuation (``,;:.-``) is joined with a space, a suffix that starts with
    punctuation (``,;:.``) as it is."""
    text = " ".join(str(caption).split())
    prefix, suffix = " ".join(str(prefix or "").split()), " ".join(str(suffix or "").split())
    if prefix:
        text = prefix + ("" if not text else " " if prefix[-1] in ",;:.-" else ", ") + text
    if suffix:
        text = text + ("" if not text or suffix[0] in ",;:." else ", ") + suffix
    return text.strip()


def merge_tags(existing: str, new: Sequence[str], separator: str = ", ") -> str:
    """``--append`` for tags (kohya's ``--append_tags``): the existing file's tags, then the new ones it lacks."""
    sep = separator.strip() or ","
    old = [t.strip() for t in existing.replace("\n", sep).split(sep) if t.strip()]
    return separator.join(old + [t for t in new if t not in old])


# --------------------------------------------------------------------------------------------------
# the WD taggers' table and choice
# --------------------------------------------------------------------------------------------------

@dataclass
class TagTable:
    """``selected_tags.csv``: one row per model output, in output order."""
    names: List[str]
    categories: List[int]

    def count(self, category: int) -> int:
        return sum(1 for c in self.categories if c == category)


def read_tag_table(path: Path) -> TagTable:
    """The rows of a WD tagger's ``selected_tags.csv`` (``tag_id,name,category,count``); ToolError naming the file
    when it is not one."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.reader(fh))
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolError(f"'{path}' could not be read as the tagger's tag list ({exc}).") from None
    head = [h.strip() for h in rows[0]] if rows else []
    if "name" not in head or "category" not in head:
        raise ToolError(f"'{path}' is not a WD tagger's selected_tags.csv: its first line should be "
                        f"tag_id,name,category,count (it is {','.join(head) or 'empty'}).")
    name_at, cat_at = head.index("name"), head.index("category")
    names, cats = [], []
    for n, row in enumerate(rows[1:], 2):
        if not row:
            continue
        try:
            names.append(row[name_at])
            cats.append(int(row[cat_at]))
        except (IndexError, ValueError):
            raise ToolError(f"'{path}' line {n}: no name and number category ({','.join(row)[:60]}).") from None
    if not names:
        raise ToolError(f"'{path}' lists no tags.")
    return TagTable(names, cats)


def mcut(scores: Sequence[float]) -> float:
    """MCut (Largeron et al. 2012): the middle of the widest gap between the sorted scores."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    if s.size < 2:
        return 0.0
    gaps = np.diff(s)
    t = int(gaps.argmax())
    return float((s[t] + s[t + 1]) / 2)


@dataclass
class TagOptions:
    """How WD scores become a caption (the ``caption`` command's tagger options)."""
    general_threshold: float = DEFAULT_THRESHOLD
    character_threshold: float = DEFAULT_THRESHOLD
    use_mcut: bool = False
    ratings: bool = False             # the best rating tag first
    character_first: bool = False
    keep_underscores: bool = False
    escape_brackets: bool = False
    exclude: Sequence[str] = ()
    replace: Dict[str, str] = field(default_factory=dict)
    limit: int = 0                    # at most this many general + character tags, the best (0: all)
    separator: str = ", "


def written_tag(name: str, opts: TagOptions) -> str:
    """One tag as written: replaced (``--replace-tag``, matching the name as listed or as written), underscores
    as spaces (not in kaomoji, unless kept), brackets escaped (``\\(``: prompt syntax reads them as plain text)."""
    text = name if opts.keep_underscores else tag_text(name)
    text = opts.replace.get(name, opts.replace.get(text, text))
    if opts.escape_brackets:
        text = text.replace("(", "\\(").replace(")", "\\)")
    return text


def excluded(name: str, opts: TagOptions) -> bool:
    return name in opts.exclude or tag_text(name) in opts.exclude


def wd_tags(scores: Sequence[float], table: TagTable, opts: TagOptions) -> List[str]:
    """The tags one image's scores keep, in the order kohya's tagger writes them."""
    scores = np.asarray(scores, dtype=np.float64)
    cats = np.asarray(table.categories)
    general_t, character_t = opts.general_threshold, opts.character_threshold
    if opts.use_mcut:
        general_t = mcut(scores[cats == GENERAL])
        character_t = max(CHARACTER_MCUT_FLOOR, mcut(scores[cats == CHARACTER]))
    kept: List[Tuple[int, float]] = []
    for i, (name, cat) in enumerate(zip(table.names, table.categories)):
        limit = general_t if cat == GENERAL else character_t if cat == CHARACTER else None
        if limit is not None and scores[i] >= limit and not excluded(name, opts):
            kept.append((i, float(scores[i])))
    if opts.limit > 0 and len(kept) > opts.limit:
        best = sorted(kept, key=lambda t: (-t[1], t[0]))[: opts.limit]
        kept = sorted(best)
    order = [i for i, _ in kept]
    if opts.character_first:
        order = [i for i in order if cats[i] == CHARACTER] + [i for i in order if cats[i] != CHARACTER]
    tags = [written_tag(table.names[i], opts) for i in order]
    if opts.ratings:
        ratings = [i for i, c in enumerate(table.categories) if c == RATING]
        if ratings:
            best_rating = max(ratings, key=lambda i: (scores[i], -i))
            if not excluded(table.names[best_rating], opts):
                tags.insert(0, written_tag(table.names[best_rating], opts))
    return tags
