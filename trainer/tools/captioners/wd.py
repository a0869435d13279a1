"""The WD taggers as SmilingWolf publishes them (``wd-eva02-large-tagger-v3``, ``wd-vit-large-tagger-v3``, …):
``model.onnx`` and ``selected_tags.csv``, run with onnxruntime, the library made to run ONNX models (a CUDA
GPU through onnxruntime-gpu's CUDA provider where that build is installed, else the CPU).

Each image is prepared as kohya's ``tag_images_by_wd14_tagger.py`` (sd-scripts, commit 03b35be3) prepares it for
these models: padded to a square on white (transparent pixels are already white: :func:`trainer.data.images.open_rgb`),
resized to the model's input size (read from the ONNX input's shape; area-averaging when shrinking, Lanczos when
growing, as kohya's cv2 ``INTER_AREA`` / PIL resize), channels in BGR order, float32 0–255, NHWC. The scores
become tags in :mod:`trainer.tools.captioners.tags`.

``--model`` is a local folder holding both files, or a hub id: the two files come from the local cache when they
are there, else are downloaded (``hf_hub_download``), and with no network the command fails within a second
saying how to download them elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
from PIL import Image

from trainer.tools import ToolError
from trainer.tools.captioners.shared import (
    Captioner,
    ModelSource,
    hub_reachable,
    load_problem,
    not_downloaded,
    say,
)
from trainer.tools.captioners.tags import TagOptions, TagTable, read_tag_table, wd_tags

ONNX_FILE, TAGS_FILE = "model.onnx", "selected_tags.csv"
DEFAULT_WD_TAGGER = "SmilingWolf/wd-eva02-large-tagger-v3"  # the most accurate of the v3 taggers
DEFAULT_SIZE = 448  # the v3 taggers' input when the ONNX file leaves it open


def wd_files(src: ModelSource) -> Tuple[Path, Path]:
    """(model.onnx, selected_tags.csv) of a local folder or a hub repo (cache first); ToolError in one line."""
    if src.local:
        folder = Path(src.path)
        onnx = folder / ONNX_FILE
        if not onnx.is_file():
            found = sorted(folder.glob("*.onnx"))
            if len(found) != 1:
                raise ToolError(f"--model '{src.spec}' has {'no' if not found else len(found)} .onnx files; a WD "
                                f"tagger's folder holds {ONNX_FILE} and {TAGS_FILE}.")
            onnx = found[0]
        tags = folder / TAGS_FILE
        if not tags.is_file():
            raise ToolError(f"--model '{src.spec}' has {onnx.name} but no {TAGS_FILE} (the tag names, published beside "
                            "the WD taggers' model.onnx): put it in the folder (`hf download <repo> "
                            f"{TAGS_FILE} --local-dir FOLDER`), or give a transformers image-classification export "
                            "of the tagger.")
        return onnx, tags
    # inside: the hub client (0.4 s) only when a tagger is fetched; --help imports this module for its defaults
    from huggingface_hub import hf_hub_download
    paths = []
    for name in (ONNX_FILE, TAGS_FILE):
        try:
            paths.append(Path(hf_hub_download(src.spec, name, local_files_only=True)))
            continue
        except Exception:  # not in the cache: download it, when the hub answers
            pass
        if not hub_reachable():
            raise ToolError(not_downloaded(src))
        try:
            paths.append(Path(hf_hub_download(src.spec, name)))
        except Exception as exc:
            if type(exc).__name__ == "EntryNotFoundError":
                raise ToolError(f"--model '{src.spec}' has no {name}; caption runs the WD taggers published as "
                                f"{ONNX_FILE} + {TAGS_FILE} (SmilingWolf/wd-*-tagger-v3).") from None
            raise ToolError(load_problem(src, exc, "a WD tagger")) from None
    return paths[0], paths[1]


def onnx_providers(device: str) -> List[str]:
    """CUDA when asked for (``--device cuda``, or ``auto``) and this onnxruntime build has it, else the CPU."""
    # inside: onnxruntime is loaded only when a WD tagger runs (--help and the page stay light)
    import onnxruntime as ort
    available = ort.get_available_providers()
    if device == "auto":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in available \
            else ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        say("note: this onnxruntime has no CUDA provider (install onnxruntime-gpu for the GPU); tagging on the CPU.")
    return ["CPUExecutionProvider"]


def square_on_white(image: Image.Image) -> Image.Image:
    """The image centred on a white square as wide as its longer side (kohya: the odd pixel right/bottom)."""
    side = max(image.size)
    if image.size == (side, side):
        return image
    canvas = Image.new("RGB", (side, side), (255, 255, 255))
    canvas.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return canvas


def prepare(image: Image.Image, size: int) -> np.ndarray:
    """One RGB image as the WD taggers take it: [size, size, 3] BGR float32 in 0–255."""
    img = square_on_white(image.convert("RGB"))
    if img.width != size:
        img = img.resize((size, size), Image.Resampling.BOX if img.width > size else Image.Resampling.LANCZOS)
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8)[:, :, ::-1]).astype(np.float32)


class WdTagger(Captioner):
    """An ONNX WD tagger: images → scores → tags (the table's order, the options' choice)."""

    kind = "wd-tagger"
    tags = True

    def __init__(self, session: Any, table: TagTable, opts: TagOptions):
        self.session, self.table, self.opts = session, table, opts
        inp = session.get_inputs()[0]
        shape = list(inp.shape)
        if len(shape) != 4 or shape[3] != 3:
            raise ToolError(f"the tagger's input is {shape}; caption runs WD taggers, whose input is "
                            "[batch, height, width, 3] (NHWC).")
        self.input = inp.name
        self.size = shape[1] if isinstance(shape[1], int) and shape[1] > 0 else DEFAULT_SIZE
        self.fixed_batch = shape[0] if isinstance(shape[0], int) and shape[0] > 0 else 0
        outputs = list(session.get_outputs()[0].shape)
        if outputs and isinstance(outputs[-1], int) and outputs[-1] != len(table.names):
            raise ToolError(self.mismatch(outputs[-1]))

    def mismatch(self, scores: int) -> str:
        return (f"the tagger gives {scores} scores per image but its {TAGS_FILE} lists {len(self.table.names)} "
                "tags; the two files are not of one model.")

    def scores(self, images: List[Any]) -> np.ndarray:
        batch = np.stack([prepare(im, self.size) for im in images])
        if not self.fixed_batch:
            return np.asarray(self.session.run(None, {self.input: batch})[0])
        out = []  # a model exported for one batch size: run it that many at a time (the last chunk padded)
        for start in range(0, len(batch), self.fixed_batch):
            chunk = batch[start:start + self.fixed_batch]
            pad = self.fixed_batch - len(chunk)
            if pad:
                chunk = np.concatenate([chunk, np.zeros((pad, *chunk.shape[1:]), np.float32)])
            out.append(np.asarray(self.session.run(None, {self.input: chunk})[0])[: len(chunk) - pad])
        return np.concatenate(out)

    def caption(self, images: List[Any]) -> List[str]:
        probs = self.scores(images)
        if probs.ndim != 2 or probs.shape[1] != len(self.table.names):
            raise ToolError(self.mismatch(probs.shape[-1]))
        return [self.opts.separator.join(wd_tags(row, self.table, self.opts)) for row in probs]


def load_wd_tagger(src: ModelSource, device: str, opts: TagOptions) -> WdTagger:
    """The WD tagger ``--model`` names, ready to run on ``device`` (``--device``: auto, cpu, cuda; mps runs on the
    CPU); ToolError for missing files or a file that is no model."""
    onnx, tags = wd_files(src)
    table = read_tag_table(tags)
    # inside: onnxruntime is loaded only when a WD tagger runs (--help and the page stay light)
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the providers' notes are not the user's business
    providers = onnx_providers(device)
    say(f"loading {src.spec} ({onnx.name}, {len(table.names)} tags) on {providers[0].replace('ExecutionProvider', '')} …")
    try:
        session = ort.InferenceSession(str(onnx), sess_options=options, providers=providers)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ToolError(f"--model '{src.spec}': {onnx.name} could not be loaded by onnxruntime ({first[:200]}).") \
            from None
    return WdTagger(session, table, opts)
