"""The data pipeline. Import the submodules directly; this package imports nothing, so the
torch-free ones stay torch-free:

- ``concepts``  scan concept folders: images, captions, masks, bad files          (no torch)
- ``probe``     does an image decode whole, and its displayed size                 (Pillow)
- ``clips``     video clips: probe, resample to the model's rate, windowed decode (PyAV)
- ``frames``    frame extraction modes, frame-count buckets, clips cut into windows (no torch)
- ``captions``  caption files; caption/tag dropout, tag shuffling, placeholders    (no torch)
- ``order``     repeats and each epoch's seeded order                               (no torch)
- ``buckets``   resolutions, aspect buckets, an epoch's batches                    (no torch)
- ``dataset``   scan + buckets + plan + the dataset report                         (no torch)
- ``augment``   flip, rotation, crop jitter, colour; same geometry for masks       (Pillow)
- ``images``    file → pixels/mask tensors (EXIF, CMYK, 16-bit, alpha)
- ``cache``     latent and text-encoder caches on disk, content-addressed
- ``pipeline``  ``DataPipeline``: the loop's one door to all of the above
- ``report``    ``python -m trainer data-report``
"""
