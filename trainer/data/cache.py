"""The latent cache: encode each image with the VAE once, reuse the latents in every epoch and run.

An entry is addressed by *content*: sha256 of the image file's bytes, the caller's
``settings_key`` (model fingerprint, VAE dtype, ...) and a variant (a number, or the tag the
pipeline builds from the bucket size and the exact augmentation parameters, plus the mask file's
hash when masks are on). So renaming or moving images keeps
their latents, editing an image re-encodes just that image, and changing a setting re-encodes all
without ever serving stale latents. Entries are written atomically (temp file, then
``os.replace``): a run stopped mid-caching resumes where it stopped and never reads half a file.

Layout: ``<cache_dir>/latents/<first 2 hex>/<sha256>.safetensors``; an entry holds ``mean``,
``std`` and, for a masked image, ``mask`` [1, h, w] at latent resolution. For an inpainting model
(``extras_fn`` given) it also holds what the masked-image latents are built from, exactly:
``pixels_u8`` (the rendered, augmented pixels as uint8 [3, H, W], lossless) and, with data masks,
``masked_mean`` (the VAE mean of the image with its own mask blanked). :class:`TextCache` does the
same for text-encoder outputs under ``<cache_dir>/text/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from trainer.data.concepts import ImageItem
from trainer.data.images import mask_to_latent
from trainer.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import torch

CACHE_FORMAT = 1  # bump when the stored layout changes: old entries are then simply not found
_RACY_SECONDS = 2.0  # a file modified this recently may change again within the same mtime tick
_TMP_MAX_AGE_S = 3600.0

_hash_memo: Dict[Tuple[int, int, int, int, int], str] = {}


def _memo_key(st: os.stat_result) -> Tuple[int, int, int, int, int]:
    """The file's identity and version: device, inode, size, mtime and ctime (no ``resolve()``: one syscall per
    path is what a 50k-image scan cannot afford, and the inode already names the file whatever path reached it)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, memoised per process by (device, inode, size, mtime, ctime).

    A file modified within the last two seconds is hashed again on every call (git's "racy clean"
    rule): filesystem timestamps are coarse, so an edit in the same tick could keep size and mtime.
    """
    st = os.stat(path)
    key = _memo_key(st)
    digest = _hash_memo.get(key)
    if digest is None:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if time.time() - max(st.st_mtime, st.st_ctime) > _RACY_SECONDS:
            _hash_memo[key] = digest
    return digest


def remember_sha256(st: os.stat_result, digest: str) -> None:
    """Hand :func:`file_sha256` a digest known for the file of stat ``st`` (the dataset scan index remembers
    them between launches), under the same racy rule."""
    if time.time() - max(st.st_mtime, st.st_ctime) > _RACY_SECONDS:
        _hash_memo[_memo_key(st)] = digest


def cache_folder(cfg: Any) -> Path:
    """The caches' folder of a run config: ``data.cache_dir``, else ``<general.workspace>/cache``."""
    d = cfg.data
    return Path(d.cache_dir) if getattr(d, "cache_dir", "") else Path(cfg.general.workspace or ".") / "cache"


def make_settings_key(**parts: object) -> str:
    """A canonical settings string from named parts, e.g.
    ``make_settings_key(model=fingerprint, resolution=512, center_crop=True, vae_dtype="fp32")``."""
    return json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True, default=str)


EncodeFn = Callable[["torch.Tensor"], Dict[str, "torch.Tensor"]]
# (pixels [B, 3, H, W], per entry: its mask at latent resolution or None, latent (h, w)) -> more batched
# tensors to store
ExtrasFn = Callable[["torch.Tensor", List[Optional["torch.Tensor"]], Tuple[int, int]], Dict[str, "torch.Tensor"]]
LoadFn = Callable[[ImageItem, int], "torch.Tensor"]
ProgressFn = Callable[[int, int], None]
# what a cache job's loader returns: one (pixels [3,H,W], pixel mask [1,H,W] or None) per entry
Rendered = Tuple["torch.Tensor", Optional["torch.Tensor"]]


@dataclass
class CacheJob:
    """Entries of one image: ``paths[k]`` is filled from ``load()[k]``. Grouping an image's
    entries lets the image be decoded once for all its variants and buckets."""
    paths: List[Path]
    load: Callable[[], List[Rendered]]
    label: str = ""


class LatentCache:
    """Content-addressed latents on disk (see the module docstring)."""

    def __init__(self, cache_dir: Path, settings_key: str):
        self.cache_dir = Path(cache_dir)
        self.root = self.cache_dir / "latents"
        self.settings_key = str(settings_key)

    # -- addressing ---------------------------------------------------------------------------

    def entry_key(self, item: ImageItem, variant: Union[int, str], extra: str = "") -> str:
        """The entry's hex name: sha256 over the image's content hash, settings, variant (an int,
        or a tag naming bucket size and augmentation) and ``extra`` (e.g. the mask's hash)."""
        parts = [file_sha256(item.path), self.settings_key, str(variant)]
        if extra:
            parts.append(extra)
        return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()

    def entry_path(self, item: ImageItem, variant: Union[int, str], extra: str = "") -> Path:
        key = self.entry_key(item, variant, extra)
        return self.root / key[:2] / f"{key}.safetensors"

    def has(self, item: ImageItem, variant: Union[int, str], extra: str = "") -> bool:
        return self.entry_path(item, variant, extra).is_file()

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
        jobs: List[CacheJob] = []
        seen: set = set()
        for item in items:
            for variant in variants:
                path = self.entry_path(item, variant)
                if path in seen or path.is_file():
                    continue
                seen.add(path)
                jobs.append(CacheJob([path], (lambda it=item, v=int(variant): [(load_fn(it, v), None)]),
                                     str(item.path)))
        return self.run_jobs(jobs, encode_fn, batch_size, progress)

    def run_jobs(self, jobs: Sequence[CacheJob], encode_fn: EncodeFn, batch_size: int,
                 progress: Optional[ProgressFn] = None, workers: int = 0,
                 extras_fn: Optional[ExtrasFn] = None) -> int:
        """Encode the entries of ``jobs`` that do not exist yet (in batches of equal pixel size)
        and write them atomically; return how many were encoded.

        A job's pixel mask, when given, is stored with its entry as ``mask`` at latent resolution
        (area-averaged to the encoded latents' height and width). ``extras_fn(pixels, latent_masks, latent_hw)``
        adds more batched tensors to store (an inpainting model's pixels and masked-image latents).
        ``workers`` > 0 decodes images in that many background threads while the encoder runs.
        """
        import torch  # torch inside: data-report and the UI import this module without torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._remove_stale_temp_files()
        todo = [j for j in jobs if any(not p.is_file() for p in j.paths)]
        total = sum(sum(1 for p in j.paths if not p.is_file()) for j in todo)
        if progress is not None:
            progress(0, total)
        done = 0
        pending: Dict[Tuple[int, ...], List[Tuple[Path, Rendered]]] = {}

        def flush(shape: Tuple[int, ...]) -> None:
            nonlocal done
            batch = pending.pop(shape)
            pixels = torch.stack([px for _, (px, _) in batch])
            with torch.no_grad():
                out = encode_fn(pixels)
            extras: List[Dict[str, torch.Tensor]] = []
            latent_hw = tuple(next(iter(out.values())).shape[-2:]) if isinstance(out, dict) and out else None
            for _, (_, mask) in batch:
                if mask is None:
                    extras.append({})
                else:
                    extras.append({"mask": mask_to_latent(mask, latent_hw)})
            if extras_fn is not None:
                with torch.no_grad():
                    more = extras_fn(pixels, [e.get("mask") for e in extras], latent_hw)
                out = {**out, **more}
            self._write_batch([p for p, _ in batch], out, len(batch), extras)
            done += len(batch)
            if progress is not None:
                progress(done, total)

        def load(job: CacheJob) -> List[Tuple[Path, Rendered]]:
            rendered = job.load()
            if len(rendered) != len(job.paths):
                raise ValueError(f"cache job for {job.label} rendered {len(rendered)} of {len(job.paths)} entries")
            return [(p, r) for p, r in zip(job.paths, rendered) if not p.is_file()]

        for entries in map_ahead(load, todo, workers):
            for path, rendered in entries:
                shape = tuple(rendered[0].shape)
                pending.setdefault(shape, []).append((path, rendered))
                if len(pending[shape]) >= batch_size:
                    flush(shape)
        for shape in list(pending):
            flush(shape)
        return done

    def _write_batch(self, paths: List[Path], out: Dict[str, "torch.Tensor"], n: int,
                     extras: Optional[List[Dict[str, "torch.Tensor"]]] = None) -> None:
        if not isinstance(out, dict) or not out:
            raise TypeError(f"encode_fn must return a dict of tensors, got {type(out).__name__}")
        for name, tensor in out.items():
            if getattr(tensor, "shape", (None,))[0] != n:
                raise ValueError(f"encode_fn output '{name}' has shape {tuple(tensor.shape)}; "
                                 f"its first dimension must be the batch size {n}")
        for i, path in enumerate(paths):
            # clone: encoders return views of one tensor (mean/logvar = chunk(moments)), which
            # safetensors refuses to save as shared storage, and a view would save the whole batch
            tensors = {name: t[i].detach().to("cpu").contiguous().clone() for name, t in out.items()}
            if extras is not None:
                tensors.update({k: v.detach().to("cpu").contiguous() for k, v in extras[i].items()})
            _save_atomic(path, tensors, {"settings_key": self.settings_key, "format": str(CACHE_FORMAT)})

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

    def get(self, item: ImageItem, variant: Union[int, str], extra: str = "") -> Dict[str, "torch.Tensor"]:
        """The cached tensors of (item, variant), without batch dimension.

        Raises :class:`DataError` when the entry is missing (the image changed after caching, or
        ``ensure`` was not run) or unreadable (the broken entry is deleted, so the next
        ``ensure`` re-encodes it).
        """
        from safetensors.torch import load_file  # torch inside: data-report and the UI import this module without torch

        path = self.entry_path(item, variant, extra)
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


def _save_atomic(path: Path, tensors: Dict[str, "torch.Tensor"], meta: Dict[str, str]) -> None:
    from safetensors.torch import save_file  # torch inside: data-report and the UI import this module without torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def map_ahead(fn: Callable, items: Sequence, workers: int) -> Iterator:
    """``map(fn, items)`` in order; with ``workers`` > 0 computed in background threads, at most
    ``2 * workers`` ahead of the consumer (bounded memory)."""
    if workers <= 0 or len(items) <= 1:
        for x in items:
            yield fn(x)
        return

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="atelier-cache")
    try:
        futures: List = []
        it = iter(items)
        for x in it:
            futures.append(pool.submit(fn, x))
            if len(futures) >= 2 * workers:
                break
        while futures:
            result = futures.pop(0).result()
            nxt = next(it, _END)
            if nxt is not _END:
                futures.append(pool.submit(fn, nxt))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_END = object()


# --------------------------------------------------------------------------------------------
# text-encoder outputs
# --------------------------------------------------------------------------------------------

class TextCache:
    """Text-encoder outputs per caption on disk, for a frozen text encoder.

    Entry name: sha256 of (settings key, caption). The settings key must identify the text
    encoder's weights (see ``DataPipeline.prepare``: it includes a hash of the encoder's output
    for a probe caption, so swapped weights never serve stale embeddings). An encoder that also
    sees the example's control images (an edit model's VL encoder) gives each entry its caption
    *and* the control files (:func:`text_key`: their content, so renaming keeps the entry and
    editing an image re-encodes it). Layout: ``<cache_dir>/text/<first 2 hex>/<sha256>.safetensors``;
    recent entries are kept in memory.
    """

    def __init__(self, cache_dir: Path, settings_key: str, memory_entries: int = 256):
        self.root = Path(cache_dir) / "text"
        self.settings_key = str(settings_key)
        self._memory: "Dict[str, Dict[str, torch.Tensor]]" = {}
        self._memory_entries = memory_entries
        self._lock = threading.Lock()

    def entry_path(self, caption: str, controls: Sequence[Path] = ()) -> Path:
        key = hashlib.sha256(f"{self.settings_key}\0{text_key(caption, controls)}".encode("utf-8")).hexdigest()
        return self.root / key[:2] / f"{key}.safetensors"

    def ensure(self, captions: Iterable[Union[str, Tuple[str, Sequence[Path]]]], encode_text_fn: Callable,
               batch_size: int = 16, progress: Optional[ProgressFn] = None) -> int:
        """Encode the captions without an entry; return how many were encoded.

        ``captions``: strings, or ``(caption, control files)`` pairs for an encoder that sees the controls.
        ``encode_text_fn(list_of_captions)`` — with pairs ``encode_text_fn(list_of_captions, list_of_controls)`` —
        returns a tensor [B, ...] (stored as ``encoder_hidden_states``) or a dict of such tensors."""
        import torch  # torch inside: data-report and the UI import this module without torch

        entries: Dict[str, Tuple[str, Tuple[Path, ...]]] = {}
        for c in captions:
            caption, controls = (c, ()) if isinstance(c, str) else (c[0], tuple(c[1]))
            entries.setdefault(text_key(caption, controls), (caption, controls))
        todo = [entries[k] for k in sorted(entries) if not self.entry_path(*entries[k]).is_file()]
        if progress is not None:
            progress(0, len(todo))
        for start in range(0, len(todo), max(1, batch_size)):
            chunk = todo[start:start + batch_size]
            texts, controls = [c for c, _ in chunk], [list(k) for _, k in chunk]
            with torch.no_grad():
                out = as_text_dict(encode_text_fn(texts, controls) if any(controls) else encode_text_fn(texts))
            for i, (caption, files) in enumerate(chunk):
                tensors = {k: v[i].detach().to("cpu").contiguous().clone() for k, v in out.items()}
                _save_atomic(self.entry_path(caption, files), tensors, {"settings_key": self.settings_key})
            if progress is not None:
                progress(min(start + batch_size, len(todo)), len(todo))
        return len(todo)

    def get(self, caption: str, controls: Sequence[Path] = ()) -> Dict[str, "torch.Tensor"]:
        from safetensors.torch import load_file  # torch inside: data-report and the UI import this module without torch

        key = text_key(caption, controls)
        with self._lock:
            hit = self._memory.get(key)
        if hit is not None:
            return hit
        path = self.entry_path(caption, controls)
        if not path.is_file():
            raise DataError(f"No cached text-encoder output for the caption {caption!r}: the cache was "
                            "not filled for this caption. Start the run again.")
        try:
            entry = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            try:
                path.unlink()
            except OSError:
                pass
            raise DataError(f"A cached text-encoder output was unreadable ({exc}) and has been removed; "
                            "start the run again to re-encode it.") from None
        with self._lock:
            if len(self._memory) >= self._memory_entries:
                self._memory.pop(next(iter(self._memory)))
            self._memory[key] = entry
        return entry


def text_key(caption: str, controls: Sequence[Path] = ()) -> str:
    """A text cache entry's key: the caption, and the content of the control images its encoder sees with it."""
    return caption + "".join(f"\0control:{file_sha256(Path(c))}" for c in controls)


def as_text_dict(out: object) -> Dict[str, "torch.Tensor"]:
    """A text encoder's output as ``{"encoder_hidden_states": ...}`` (dicts pass through)."""
    if isinstance(out, dict):
        return out
    if isinstance(out, (tuple, list)):
        out = out[0]
    return {"encoder_hidden_states": out}  # type: ignore[dict-item]


__all__ = ["LatentCache", "TextCache", "CacheJob", "ExtrasFn", "make_settings_key", "file_sha256", "CACHE_FORMAT",
           "as_text_dict", "text_key"]
