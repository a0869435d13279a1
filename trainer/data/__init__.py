"""The data pipeline. Import the submodules directly; this package imports nothing, so the
torch-free ones stay torch-free:

- ``concepts``  scan folders, captions, masks, bad files, epoch order          (no torch)
- ``buckets``   resolutions, aspect buckets, an epoch's batches               (no torch)
- ``captions``  caption/tag dropout, tag shuffling, placeholder hook          (no torch)
- ``dataset``   scan + buckets + plan + the dataset report                    (no torch)
- ``augment``   flip, rotation, crop jitter, colour; same geometry for masks  (Pillow)
- ``images``    file → pixels/mask tensors (EXIF, CMYK, 16-bit, alpha)
- ``cache``     latent and text-encoder caches on disk, content-addressed
- ``pipeline``  ``DataPipeline``: the loop's one door to all of the above
- ``report``    ``python -m trainer data-report``
"""
