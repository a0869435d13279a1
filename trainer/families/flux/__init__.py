"""Flux.1 dev and schnell (Black Forest Labs): a rectified-flow MMDiT on packed 2×2 VAE latents."""
