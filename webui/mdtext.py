"""Text from disk or from the trainer, put into the page's Markdown so that it shows as it is.

File names and the trainer's messages reach Markdown components (the Run tab's problem list, the notes that name
skipped files). Markdown reads ``<cat>`` as an HTML tag, which the page's sanitiser then drops, ``*`` and ``_`` as
emphasis and ``[…]`` as a link: ``photo <1>.png`` would show as ``photo .png``. These helpers escape such text;
what the trainer itself wrote as code (between backticks) is kept as code, where Markdown shows every character.
"""

from __future__ import annotations

import re

_CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # `code` or ``code with ` inside``
_EMPHASIS = re.compile(r"([\\*_\[\]`])")
_LINE_START = re.compile(r"(?m)^(\s*)([#+\-=|]|\d+[.)])")  # a heading, list item or table row from a log line


def _plain(text: str) -> str:
    text = _EMPHASIS.sub(r"\\\1", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), text)


def md_escape(text: str) -> str:
    """``text`` as Markdown that shows every character of it; its code spans are kept as code."""
    text = str(text)
    out, pos = [], 0
    for match in _CODE_SPAN.finditer(text):
        out += [_plain(text[pos:match.start()]), match.group(0)]
        pos = match.end()
    return "".join(out + [_plain(text[pos:])])


def md_code(text: str) -> str:
    """``text`` as a Markdown code span, whatever backticks it holds (a file name is shown as it is)."""
    text = str(text).replace("\n", " ")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_fence(text: str, info: str = "") -> str:
    """``text`` as a fenced code block that no line of it can close early."""
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


__all__ = ["md_code", "md_escape", "md_fence"]
