"""What the dataset tools (``caption``, ``mask``) share: a folder's training images, the device, where ``--model``
points (a local folder or a hub id, cached or not) with one clear line when it cannot be loaded, opening images
the way training does (every one that will not open named), progress and the list of files written, and the
captioners' common shape (:class:`Captioner`).

Torch-free to import: ``--help`` and the page import the tools' defaults; torch and transformers are imported
inside the functions that load a model.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

from trainer.data.concepts import IMAGE_EXTENSIONS, find_images
from trainer.data.images import open_rgb
from trainer.data.probe import probe_image
from trainer.errors import DataError
from trainer.tools import ToolError

LIST_LIMIT = 20  # written files printed one a line before the rest is summed up


# --------------------------------------------------------------------------------------------------
# shared with ``mask``: images, device, models
# --------------------------------------------------------------------------------------------------

def folder_images(folder: str, recursive: bool) -> Tuple[Path, List[Path]]:
    """The folder and its training images (the trainer's rules), or ToolError naming the folder."""
    path = Path(folder).expanduser()
    if not path.exists():
        raise ToolError(f"FOLDER '{folder}' does not exist; give the folder that holds the images.")
    if not path.is_dir():
        raise ToolError(f"FOLDER '{folder}' is a file; give the folder that holds the images.")
    images = find_images(path, recursive)
    if not images:
        hint = " Its sub-folders do hold images: add --recursive." if not recursive and find_images(path, True) else ""
        raise ToolError(f"FOLDER '{folder}' has no images ({' '.join(IMAGE_EXTENSIONS)}).{hint}")
    return path, images


def unique_outputs(images: Sequence[Path], output: Callable[[Path], Path],
                   note: Callable[[str], None]) -> List[Tuple[Path, Path]]:
    """(image, output file) pairs; two images with one stem (``a.png``, ``a.jpg``) share one output file,
    as training reads it for both: the first one makes it, the other is named."""
    seen: Dict[Path, Path] = {}
    pairs: List[Tuple[Path, Path]] = []
    for image in images:
        out = output(image)
        if out in seen:
            note(f"note: '{image}' shares '{out.name}' with '{seen[out].name}' (same name); it is made once, "
                 "from the first.")
            continue
        seen[out] = image
        pairs.append((image, out))
    return pairs


def pick_device(name: str) -> str:
    """``auto`` → cuda, else mps, else cpu; ToolError for a device that is not there."""
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    mps = getattr(torch.backends, "mps", None)
    has_mps = mps is not None and mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ToolError("--device cuda, but PyTorch sees no CUDA GPU (a CPU-only build or a driver problem); "
                        "use --device cpu or auto.")
    if name == "mps" and not has_mps:
        raise ToolError("--device mps, but MPS is not available here; use --device cpu or auto.")
    return name


def model_dtype(device: str) -> Any:
    import torch  # inside: --help and the UI import this module for its defaults, without torch
    return torch.float16 if device == "cuda" else torch.float32


@dataclass
class ModelSource:
    """Where ``--model`` points: a local folder, or a hub id (downloaded on first use, then cached)."""
    spec: str
    path: str
    local: bool

    def kwargs(self) -> Dict[str, Any]:
        return {"local_files_only": True} if self.local else {}


def model_source(spec: str) -> ModelSource:
    """``--model`` as a local folder or a hub id; ToolError for a path that is not a model folder."""
    spec = str(spec or "").strip()
    if not spec:
        raise ToolError("--model is empty; give a hub id or a local model folder.")
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ToolError(f"--model '{spec}' is a file; give the model's folder (saved with save_pretrained: "
                            "config.json, the weights and the processor's files).")
        onnx = any(path.glob("*.onnx")) or (path / "selected_tags.csv").is_file()
        if not (path / "config.json").is_file() and not onnx:
            raise ToolError(f"--model '{spec}' has no config.json; give a folder saved with save_pretrained "
                            "(config.json, the weights and the processor's files), a WD tagger's folder "
                            "(model.onnx + selected_tags.csv) or a hub id.")
        return ModelSource(spec, str(path), True)
    looks_local = spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1 or \
        (len(spec) > 1 and spec[1] == ":")
    if looks_local:
        raise ToolError(f"--model '{spec}': no such folder. Give a local model folder or a hub id (owner/name).")
    return ModelSource(spec, spec, False)


def _chain(exc: BaseException) -> List[BaseException]:
    out: List[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def load_problem(src: ModelSource, exc: BaseException, what: str = "") -> str:
    """One line for a model that did not load: offline, no such repo, gated, or the library's own words."""
    names = {type(e).__name__ for e in _chain(exc)}
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if not src.local:
        fetch = (f"On a machine that is online run `hf download {src.spec} --local-dir FOLDER`, copy FOLDER here "
                 "and pass --model FOLDER.")
        if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"} or "couldn't connect" in first.lower():
            return not_downloaded(src)
        if "GatedRepoError" in names:
            return (f"--model '{src.spec}' is gated on the hub: accept its terms on its page and log in "
                    f"(`hf auth login`), or give a local folder. {fetch}")
        if names & {"RepositoryNotFoundError", "HFValidationError"}:
            return (f"--model '{src.spec}' is not a model on the hub (or it is private); check the id, or give a "
                    "local model folder.")
    as_what = f" as {what}" if what else ""
    return f"--model '{src.spec}' could not be loaded{as_what} ({type(exc).__name__}: {first})"


def hub_reachable(timeout: float = 1.0) -> bool:
    """Whether the hub's host answers within ``timeout`` seconds (False at once with HF_HUB_OFFLINE): a model
    that is not downloaded fails in a second on a machine without network, instead of after the library's
    retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def not_downloaded(src: ModelSource) -> str:
    """The line for a hub id that is neither in the local cache nor reachable."""
    return (f"--model '{src.spec}' is not downloaded yet and the hub cannot be reached (offline, or HF_HUB_OFFLINE "
            f"is set). On a machine that is online run `hf download {src.spec} --local-dir FOLDER`, copy FOLDER "
            "here and pass --model FOLDER.")


def config_dict(src: ModelSource) -> Dict[str, Any]:
    """The model's config.json as a dict (downloaded for a hub id), or ToolError saying why not."""
    # inside: --help and the UI import this module for its defaults, without torch (transformers) and without the
    # hub client (0.4 s), which only loading a model needs
    from huggingface_hub import try_to_load_from_cache
    from transformers import PretrainedConfig
    if not src.local and not isinstance(try_to_load_from_cache(src.spec, "config.json"), str) and not hub_reachable():
        raise ToolError(not_downloaded(src))
    try:
        return dict(PretrainedConfig.get_config_dict(src.path, **src.kwargs())[0])
    except Exception as exc:  # offline, no such repo, broken JSON
        raise ToolError(load_problem(src, exc)) from None


def timm_or_onnx(src: ModelSource, cfg: Dict[str, Any]) -> bool:
    """A timm/ONNX model (the WD taggers as published): config.json with ``architecture`` and no ``model_type``."""
    if "model_type" in cfg:
        return False
    if "architecture" in cfg or "pretrained_cfg" in cfg:
        return True
    return src.local and any(Path(src.path).glob("*.onnx"))


def load_pretrained(src: ModelSource, loader: Callable[..., Any], what: str, **kwargs: Any) -> Any:
    """``loader(path, **kwargs)`` (a ``from_pretrained``) with the load problems as one ToolError line. A local
    folder loads without progress bars; a hub id keeps the download's."""
    if src.local:
        # inside: --help and the UI import this module for its defaults, without torch
        import transformers.utils.logging as tlog
        tlog.disable_progress_bar()
    try:
        return loader(src.path, **src.kwargs(), **kwargs)
    except ToolError:
        raise
    except Exception as exc:
        raise ToolError(load_problem(src, exc, what)) from None


def open_image(path: Path) -> Tuple[Optional[Any], Optional[str]]:
    """(RGB image the right way up, None) or (None, why it cannot be used): the trainer's checks and decoding."""
    _, problem = probe_image(path)
    if problem:
        return None, problem
    try:
        return open_rgb(path), None
    except DataError as exc:
        return None, str(exc)


def open_batch(batch: List[Tuple[Path, Path]], skipped: List[Tuple[Path, str]]) -> List[Tuple[Path, Path, Any]]:
    """(image, output, opened image) for each image that opens; the others are named and added to ``skipped``."""
    ready: List[Tuple[Path, Path, Any]] = []
    for image, out in batch:
        img, problem = open_image(image)
        if img is None:
            skipped.append((image, problem or "unreadable"))
            say(f"skipped '{image}': {problem}")
        else:
            ready.append((image, out, img))
    return ready


def say(text: str) -> None:
    """Progress and notes: on stderr, at once (stdout holds what was written)."""
    print(text, file=sys.stderr, flush=True)


class Progress:
    """``<verb> K/N (R images/s, about T left)`` lines: after the first batch, then at most every 2 seconds, and at
    the end. The rate counts from the first batch's end, so the model's warm-up does not skew it."""

    def __init__(self, verb: str, total: int):
        self.verb, self.total, self.done, self.last = verb, total, 0, 0.0
        self.started: Optional[float] = None
        self.first = 0

    def step(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.started is None:
            self.started, self.first = now, self.done
        if self.done >= self.total or now - self.last >= 2.0:
            self.last = now
            say(f"{self.verb} {self.done}/{self.total}{self.rate(now)}")

    def rate(self, now: float) -> str:
        counted, spent = self.done - self.first, now - (self.started or now)
        if counted <= 0 or spent <= 0:
            return ""
        per_s = counted / spent
        left = (self.total - self.done) / per_s
        eta = f", about {format_duration(left)} left" if self.done < self.total else ""
        return f" ({per_s:.2f} images/s{eta})"


def format_duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3.5 h``."""
    if seconds < 90:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Written:
    """Prints ``wrote PATH`` for the first :data:`LIST_LIMIT` files, then counts."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, path: Path) -> None:
        self.count += 1
        if self.count <= LIST_LIMIT:
            print(f"wrote {path}", flush=True)

    def rest(self, what: str) -> None:
        if self.count > LIST_LIMIT:
            print(f"… and {self.count - LIST_LIMIT} more {what}", flush=True)


class Captioner:
    """One loaded captioner: ``kind`` (blip, florence2, tagger, wd-tagger, vlm) and :meth:`caption` of a batch of
    RGB images (an edit-pair captioner takes (before, after) pairs)."""

    kind = ""
    tags = False  # its captions are tag lists (``--append`` merges them)
    pairs = False  # it captions (before, after) pairs

    def caption(self, images: List[Any]) -> List[str]:  # pragma: no cover - overridden
        raise NotImplementedError
