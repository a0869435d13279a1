"""Caption processing per sample: caption dropout, tag dropout, tag shuffling, placeholders.

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

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Tuple, Union

Replacement = Union[str, Callable[[str], str]]


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
