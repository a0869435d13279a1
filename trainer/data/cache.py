"""The latent cache: encode each image with the VAE once, reuse the latents in every epoch and run.

An entry is addressed by *content*: sha256 of the image file's bytes, the caller's
``settings_key`` (everything that changes latents: model fingerprint, resolution, crop mode, VAE
dtype, ...) and a variant number (e.g. 0 = as is, 1 = mirrored). So renaming or moving images keeps
their latents, editing an image re-encodes just that image, and changing a setting re-encodes all
without ever serving stale latents. Entries are written atomically (temp file, then
``os.replace``): a run stopped mid-caching resumes where it stopped and never reads half a file.

Layout: ``<cache_dir>/latents/<first 2 hex>/<sha256>.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

from trainer.data.concepts import DataError, ImageItem

if TYPE_CHECKING:  # pragma: no cover
    import torch

CACHE_FORMAT = 1  # bump when the stored layout changes: old entries are then simply not found
_RACY_SECONDS = 2.0  # a file modified this recently may change again within the same mtime tick
_TMP_MAX_AGE_S = 3600.0

_hash_memo: Dict[Tuple[str, int, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, memoised per process by (path, inode, size, mtime, ctime).

    A file modified within the last two seconds is hashed again on every call (git's "racy clean"
    rule): filesystem timestamps are coarse, so an edit in the same tick could keep size and mtime.
    """
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _hash_memo.get(key)
    if digest is None:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if time.time() - max(st.st_mtime, st.st_ctime) > _RACY_SECONDS:
            _hash_memo[key] = digest
    return digest


def make_settings_key(**parts: object) -> str:
    """A canonical settings string from named parts, e.g.
    ``make_settings_key(model=fingerprint, resolution=512, center_crop=True, vae_dtype="fp32")``."""
    return json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True, default=str)


EncodeFn = Callable[["torch.Tensor"], Dict[str, "torch.Tensor"]]
LoadFn = Callable[[ImageItem, int], "torch.Tensor"]
ProgressFn = Callable[[int, int], None]


class LatentCache:
    """Content-addressed latents on disk (see the module docstring)."""

    def __init__(self, cache_dir: Path, settings_key: str):
        self.cache_dir = Path(cache_dir)
        self.root = self.cache_dir / "latents"
        self.settings_key = str(settings_key)

    # -- addressing ---------------------------------------------------------------------------

    def entry_key(self, item: ImageItem, variant: int) -> str:
        """The entry's hex name: sha256 over image bytes' hash, settings and variant."""
        material = "\0".join((file_sha256(item.path), self.settings_key, str(int(variant))))
        return hashlib.sha256(material.encode("utf-8")).hexdigest()

    def entry_path(self, item: ImageItem, variant: int) -> Path:
        key = self.entry_key(item, variant)
        return self.root / key[:2] / f"{key}.safetensors"

    def has(self, item: ImageItem, variant: int) -> bool:
        return self.entry_path(item, variant).is_file()

    # -- filling --------------------------------------------------------------------------------

    def ensure(self, items: Sequence[ImageItem], variants: List[int], encode_fn: EncodeFn,
               load_fn: LoadFn, batch_size: int, progress: Optional[ProgressFn] = None) -> int:
        """Encode every (item, variant) that has no entry yet; return how many were encoded.

        ``load_fn(item, variant)`` gives pixels [3, H, W]; ``encode_fn(pixels [B, 3, H, W])`` gives
        a dict of tensors with batch dimension B (e.g. ``{"mean": ..., "std": ...}``), split here
        into one entry per item. Images of different sizes (aspect buckets) are batched per size.
        ``progress(done, total)`` is called after each batch, with ``total`` = entries to encode.
        The same file listed twice (two concepts sharing a folder) is encoded once.
        """
        import torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._remove_stale_temp_files()
        todo: "OrderedDict[Path, Tuple[ImageItem, int]]" = OrderedDict()
        for item in items:
            for variant in variants:
                path = self.entry_path(item, variant)
                if path not in todo and not path.is_file():
                    todo[path] = (item, int(variant))
        total = len(todo)
        if progress is not None:
            progress(0, total)
        done = 0
        pending: Dict[Tuple[int, ...], List[Tuple[Path, torch.Tensor]]] = {}

        def flush(shape: Tuple[int, ...]) -> None:
            nonlocal done
            batch = pending.pop(shape)
            pixels = torch.stack([px for _, px in batch])
            with torch.no_grad():
                out = encode_fn(pixels)
            self._write_batch([p for p, _ in batch], out, len(batch))
            done += len(batch)
            if progress is not None:
                progress(done, total)

        for path, (item, variant) in todo.items():
            pixels = load_fn(item, variant)
            shape = tuple(pixels.shape)
            pending.setdefault(shape, []).append((path, pixels))
            if len(pending[shape]) >= batch_size:
                flush(shape)
        for shape in list(pending):
            flush(shape)
        return done

    def _write_batch(self, paths: List[Path], out: Dict[str, "torch.Tensor"], n: int) -> None:
        from safetensors.torch import save_file

        if not isinstance(out, dict) or not out:
            raise TypeError(f"encode_fn must return a dict of tensors, got {type(out).__name__}")
        for name, tensor in out.items():
            if getattr(tensor, "shape", (None,))[0] != n:
                raise ValueError(f"encode_fn output '{name}' has shape {tuple(tensor.shape)}; "
                                 f"its first dimension must be the batch size {n}")
        meta = {"settings_key": self.settings_key, "format": str(CACHE_FORMAT)}
        for i, path in enumerate(paths):
            # clone: encoders return views of one tensor (mean/logvar = chunk(moments)), which
            # safetensors refuses to save as shared storage, and a view would save the whole batch
            tensors = {name: t[i].detach().to("cpu").contiguous().clone() for name, t in out.items()}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                save_file(tensors, str(tmp), metadata=meta)
                os.replace(tmp, path)
            finally:
                if tmp.exists():
                    tmp.unlink()

    def _remove_stale_temp_files(self) -> None:
        """Temp files left by a killed run (fresh ones may belong to a run caching right now)."""
        if not self.root.is_dir():
            return
        now = time.time()
        for tmp in self.root.glob("*/*.tmp"):
            try:
                if now - tmp.stat().st_mtime > _TMP_MAX_AGE_S:
                    tmp.unlink()
            except OSError:
                pass

    # -- reading --------------------------------------------------------------------------------

    def get(self, item: ImageItem, variant: int) -> Dict[str, "torch.Tensor"]:
        """The cached tensors of (item, variant), without batch dimension.

        Raises :class:`DataError` when the entry is missing (the image changed after caching, or
        ``ensure`` was not run) or unreadable (the broken entry is deleted, so the next
        ``ensure`` re-encodes it).
        """
        from safetensors.torch import load_file

        path = self.entry_path(item, variant)
        if not path.is_file():
            raise DataError(f"No cached latents for '{item.path}' (variant {variant}): the image "
                            "changed since caching started, or the cache was not filled. Start the "
                            "run again to re-encode it.", value=str(item.path))
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            try:
                path.unlink()
            except OSError:
                pass
            raise DataError(f"Cached latents of '{item.path}' were unreadable ({exc}) and have been "
                            "removed; start the run again to re-encode them.",
                            value=str(item.path)) from None


__all__ = ["LatentCache", "make_settings_key", "file_sha256", "CACHE_FORMAT"]
