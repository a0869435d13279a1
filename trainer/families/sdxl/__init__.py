"""Stable Diffusion XL base models (and SDXL inpainting)."""
