"""Whether an image file decodes whole, and its displayed size: every image of a dataset is checked here before a
model loads (a broken file is named and skipped, not found at caching). Pillow and the standard library only."""

from __future__ import annotations

import struct
import warnings
import zlib
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from PIL import Image, UnidentifiedImageError

from trainer.data.captions import Warn, read_image_captions

# Pillow only warns on an image between its pixel limit (Image.MAX_IMAGE_PIXELS, ~89 MP) and twice that, then decodes
# it (gigabytes for a crafted file): Atelier checks the size itself (too_large) and names and skips such a file as it
# does the larger ones Pillow refuses, so the warning would only repeat that in the log.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
TOO_LARGE = (Image.DecompressionBombError, Image.DecompressionBombWarning)


def too_large(img: Any) -> Optional[str]:
    """Pillow's decompression-bomb limit applied to an opened image (its warning made a refusal), or None."""
    limit = Image.MAX_IMAGE_PIXELS
    pixels = img.size[0] * img.size[1]
    if limit and pixels > limit:
        return (f"too large to open safely (Pillow: {pixels} pixels, over its limit of {limit} pixels for a safe "
                "decode; could be a decompression bomb); downscale it")
    return None


def probe_image(path: Path) -> Tuple[Tuple[int, int], Optional[str]]:
    """Check that ``path`` is an image that decodes whole: ``((width, height), None)`` or
    ``((0, 0), reason)``.

    Every image is decoded in full, so a file whose checksums are valid but whose pixel stream is
    broken is caught here, not at caching. PNGs also get Pillow's ``verify()`` (chunk CRCs) and a
    check that the compressed stream holds every row (Pillow fills missing rows with black without
    a word); JPEGs are decoded at a reduced DCT scale (``draft``: the whole entropy-coded stream is
    still read, so truncation and corruption show, for a fraction of the cost).
    """
    try:
        if path.stat().st_size == 0:
            return (0, 0), "the file is empty (0 bytes)"
        with Image.open(path) as img:
            width, height = img.size
            fmt = img.format
            if too_large(img):
                return (0, 0), too_large(img)
            orientation = exif_orientation(img)
            if fmt == "PNG":
                img.verify()
        if fmt == "PNG":
            problem = png_stream_problem(path)
            if problem:
                return (0, 0), problem
        with Image.open(path) as img:
            if fmt == "JPEG":
                img.draft(None, (64, 64))
            img.load()
    except UnidentifiedImageError:
        return (0, 0), "not an image Pillow can read (wrong extension or damaged file)"
    except TOO_LARGE as exc:
        return (0, 0), f"too large to open safely ({exc}); downscale it"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        return (0, 0), f"damaged or truncated image ({exc})"
    if width <= 0 or height <= 0:
        return (0, 0), f"image has no pixels ({width}x{height})"
    if orientation in (5, 6, 7, 8):  # rotated by 90°: displayed size is transposed
        width, height = height, width
    return (width, height), None


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def png_stream_problem(path: Path) -> Optional[str]:
    """Why the pixel data of a PNG is incomplete or broken, or None: the IDAT stream must inflate to
    exactly the bytes its header promises (a cut-off stream with valid checksums otherwise decodes
    as an image whose last rows are black). Standard library only."""
    with open(path, "rb") as fh:
        data = fh.read()
    pos, ihdr, inflater, got = 8, None, zlib.decompressobj(), 0
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        ctype, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if ctype == b"IHDR" and len(body) >= 13:
            ihdr = struct.unpack(">IIBBBBB", body[:13])
        elif ctype == b"IDAT":
            try:
                got += len(inflater.decompress(body))
            except zlib.error as exc:
                return f"damaged pixel data ({exc})"
        elif ctype == b"IEND":
            break
    if ihdr is None:
        return "no PNG header"
    width, height, depth, colour, _c, _f, interlace = ihdr
    bits = _PNG_CHANNELS.get(colour, 4) * depth
    if interlace:  # Adam7: seven reduced images, each row with its filter byte
        passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
        want = 0
        for x0, y0, dx, dy in passes:
            w, h = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
            if w and h:
                want += h * (1 + (w * bits + 7) // 8)
    else:
        want = height * (1 + (width * bits + 7) // 8)
    if got < want or not inflater.eof:
        rows = got * height // want if want else 0
        return (f"truncated pixel data: about {rows} of {height} rows are in the file (the rest would train "
                "as black)")
    return None


def mask_is_blank(path: Path) -> bool:
    """True when a mask is black everywhere (no pixel in focus)."""
    try:
        with Image.open(path) as img:
            return img.convert("L").getextrema()[1] == 0
    except (OSError, ValueError, SyntaxError):
        return False


def exif_orientation(img: Any) -> int:
    """EXIF orientation without decoding pixels (PNG's getexif() would load the whole image;
    its eXIf chunk normally precedes the pixel data, so it is already in ``info``)."""
    try:
        if img.format == "PNG":
            raw = img.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = img.getexif()
        return int(exif.get(0x0112, 1) or 1)
    except Exception:  # broken EXIF is not a reason to drop the image
        return 1


class Prober:
    """How a scan probes its images and reads their caption files: this one probes and reads every file afresh
    (:func:`probe_image`); ``trainer.data.scanindex.ScanIndex`` answers from the remembered scan where a file is
    unchanged."""

    def probe(self, path: Path) -> Tuple[Tuple[int, int], Optional[str]]:
        return probe_image(path)

    def probe_all(self, paths: Sequence[Path], pool: Executor) -> List[Tuple[Tuple[int, int], Optional[str]]]:
        """:meth:`probe` of every path, in order, decoding on ``pool``'s threads (decoding releases the GIL)."""
        return list(pool.map(self.probe, paths))

    def scanning(self, folder: Path) -> None:
        """Told of each concept folder a scan reads whole (the index forgets the files no longer there)."""

    def captions(self, image: Path, extension: str, warn: Warn) -> Optional[List[str]]:
        """The caption candidates of ``image`` from ``<stem><extension>`` next to it; None when there is no such
        file (:func:`trainer.data.captions.read_image_captions`)."""
        return read_image_captions(image, extension, warn)
