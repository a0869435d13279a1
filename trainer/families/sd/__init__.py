"""Stable Diffusion 1.x / 2.x (and their 9-channel inpainting variants)."""
