"""The data pipeline: ``concepts`` (scan folders, captions, epoch order; no torch),
``images`` (file → pixel tensor) and ``cache`` (VAE latents on disk). Import the submodules
directly; this package imports nothing so that ``trainer.data.concepts`` stays torch-free."""
