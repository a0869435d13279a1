"""Captions: reading caption files (encodings, one candidate a line, captions from file names) and processing
per sample: caption dropout, tag dropout, tag shuffling, placeholders.

Order of operations for one sample (all draws from the sample's own rng, so a resumed run makes
the same choices):

1. one candidate line is picked (``concepts.pick_caption``);
2. caption dropout: with probability ``caption_dropout`` the caption becomes ``""`` (trains the
   unconditional prediction that classifier-free guidance needs) and nothing else happens;
3. only when tag dropout or shuffling is on, the caption is split at ``tag_delimiter``; the first
   ``keep_tags`` tags stay in place and are never dropped, as are tags in ``tag_dropout_keep`` and
   tags that contain a placeholder; each other tag is dropped with probability ``tag_dropout``;
   the rest are shuffled when ``shuffle_tags`` is on; tags are joined with the delimiter
   (plus a space after a non-space delimiter: ``"a, b, c"``);
4. placeholders are replaced (:meth:`CaptionProcessor.set_placeholder`).

**Placeholder hook** (for textual-inversion/pivotal methods): the method calls
``pipeline.set_placeholder("<embedding>", "emb_0 emb_1 emb_2")`` — or passes a function
``(caption) -> replacement`` — before ``DataPipeline.prepare``; every caption then has the
placeholder replaced by the trained token(s). Text-encoder caching keys on the *final* caption,
and a method that trains token embeddings must not pass ``encode_text_fn`` to ``prepare``.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

Replacement = Union[str, Callable[[str], str]]
Warn = Callable[[str], None]

log = logging.getLogger(__name__)


def _default_warn(message: str) -> None:
    log.warning(message)


@dataclass(frozen=True)
class CaptionOptions:
    """The caption settings of one concept (see ``ConceptConfig``)."""
    shuffle_tags: bool = False
    tag_delimiter: str = ","
    keep_tags: int = 0
    tag_dropout: float = 0.0
    tag_dropout_keep: Tuple[str, ...] = ()
    caption_dropout: float = 0.0

    @classmethod
    def from_concept(cls, concept: Any) -> "CaptionOptions":
        delim = str(getattr(concept, "tag_delimiter", ",") or ",")
        keep_raw = str(getattr(concept, "tag_dropout_keep", "") or "")
        keep = tuple(t.strip() for t in keep_raw.split(delim if delim.strip() else ",") if t.strip())
        return cls(shuffle_tags=bool(getattr(concept, "shuffle_tags", False)), tag_delimiter=delim,
                   keep_tags=int(getattr(concept, "keep_tags", 0) or 0),
                   tag_dropout=float(getattr(concept, "tag_dropout", 0.0) or 0.0), tag_dropout_keep=keep,
                   caption_dropout=float(getattr(concept, "caption_dropout", 0.0) or 0.0))

    @property
    def splits_tags(self) -> bool:
        return self.shuffle_tags or self.tag_dropout > 0

    @property
    def deterministic(self) -> bool:
        """True when the set of possible captions is just the candidate lines (plus ``""`` with
        caption dropout), so text-encoder outputs can be cached per line."""
        return not self.splits_tags


def split_tags(caption: str, delimiter: str) -> List[str]:
    return [t.strip() for t in caption.split(delimiter) if t.strip()]


def join_tags(tags: Iterable[str], delimiter: str) -> str:
    joiner = delimiter if (not delimiter.strip() or delimiter.endswith(" ")) else delimiter + " "
    return joiner.join(tags)


@dataclass
class CaptionProcessor:
    """Applies :class:`CaptionOptions` and the placeholder replacements to a caption."""
    placeholders: Dict[str, Replacement] = field(default_factory=dict)

    def set_placeholder(self, placeholder: str, replacement: Replacement) -> None:
        """Replace ``placeholder`` (e.g. ``"<embedding>"``) in every caption by ``replacement``:
        a string, or a function of the whole caption returning the string. Tags holding a
        placeholder are never dropped by tag dropout."""
        if not placeholder:
            raise ValueError("the placeholder must be a non-empty string")
        self.placeholders[placeholder] = replacement

    def replace_placeholders(self, caption: str) -> str:
        for placeholder, replacement in self.placeholders.items():
            if placeholder in caption:
                text = replacement(caption) if callable(replacement) else replacement
                caption = caption.replace(placeholder, str(text))
        return caption

    def process(self, caption: str, options: CaptionOptions, rng: random.Random) -> str:
        """One sample's caption. Draws from ``rng`` in a fixed pattern (one draw for caption
        dropout, then per-tag draws only when tags are split)."""
        if options.caption_dropout > 0 and rng.random() < options.caption_dropout:
            return ""
        if options.splits_tags and caption:
            caption = self._tags(caption, options, rng)
        return self.replace_placeholders(caption)

    def _tags(self, caption: str, o: CaptionOptions, rng: random.Random) -> str:
        tags = split_tags(caption, o.tag_delimiter)
        keep_n = max(0, o.keep_tags)
        head, tail = tags[:keep_n], tags[keep_n:]
        if o.tag_dropout > 0:
            protected = set(o.tag_dropout_keep)
            kept = []
            for tag in tail:
                draw = rng.random()
                if tag in protected or any(p in tag for p in self.placeholders) or draw >= o.tag_dropout:
                    kept.append(tag)
            tail = kept
        if o.shuffle_tags:
            rng.shuffle(tail)
        return join_tags(head + tail, o.tag_delimiter)

    def possible_captions(self, candidates: Iterable[str], options: CaptionOptions) -> List[str]:
        """Every caption a deterministic concept can produce (for text-encoder caching)."""
        if not options.deterministic:
            raise ValueError("captions with tag shuffling or tag dropout have too many variants to cache")
        out = {self.replace_placeholders(c) for c in candidates}
        if options.caption_dropout > 0:
            out.add("")
        return sorted(out)


__all__ = ["CaptionOptions", "CaptionProcessor", "split_tags", "join_tags"]


# --------------------------------------------------------------------------------------------
# caption files
# --------------------------------------------------------------------------------------------

def read_text(path: Path, warn: Warn = _default_warn) -> str:
    """Read a caption file: UTF-8 (with or without BOM), UTF-16 with BOM, else cp1252/latin-1.

    Captions written on Windows by older taggers are often cp1252; reading them as latin-1
    silently would turn ``’`` into mojibake, so the fallback is announced.
    """
    raw = path.read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError:
            pass
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    for encoding in ("cp1252", "latin-1"):
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError:
            continue
        warn(f"Caption file '{path}' is not UTF-8; read it as {encoding}. Re-save it as UTF-8 "
             "if any character looks wrong.")
        return text
    raise AssertionError("latin-1 decodes any bytes")  # pragma: no cover


def caption_lines(text: str) -> List[str]:
    """Non-empty, stripped lines: each is one candidate caption."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def caption_ext(ext: str) -> str:
    ext = str(ext or ".txt").strip()
    return ext if ext.startswith(".") else "." + ext


def read_image_captions(image: Path, extension: str, warn: Warn) -> Optional[List[str]]:
    """Candidates from ``<stem><extension>`` next to the image; None when there is no such file."""
    cap = image.with_name(image.stem + caption_ext(extension))
    if not cap.is_file():
        return None
    return read_caption_file(cap, warn)


def read_caption_file(cap: Path, warn: Warn) -> List[str]:
    """The candidates of an existing caption file ([] with a warning when it cannot be read)."""
    try:
        return caption_lines(read_text(cap, warn))
    except OSError as exc:
        warn(f"Could not read caption file '{cap}' ({exc}); the image trains with an empty caption.")
        return []


# "_001", "-3", ".02", " 7" and " (2)" at the end of a name: copies and numbered exports.
_NUMBERING = re.compile(r"(?:[\s_.\-]+\d+|\s*\(\d+\))$")


def caption_from_filename(path: Path) -> str:
    """``a_red_fox_001.png`` → ``a red fox``: the stem without trailing numbering, ``_`` → space.

    Bare digits glued to a word (``r2d2``, ``sks1``) are kept: they are usually part of the name.
    """
    stem = Path(path).stem
    text = stem
    while True:
        stripped = _NUMBERING.sub("", text)
        if stripped == text or not stripped.strip(" _.-"):
            break
        text = stripped
    text = text.replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def pick_caption(item: Any, rng: random.Random) -> str:
    """One candidate caption of ``item`` (a ``trainer.data.concepts.ImageItem``), chosen with ``rng``.

    Pass an rng from :func:`sample_rng` so a resumed run picks the same caption for the same sample.
    """
    if not item.captions:
        return ""
    if len(item.captions) == 1:
        return item.captions[0]
    return item.captions[rng.randrange(len(item.captions))]
