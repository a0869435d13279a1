"""Stable Diffusion 3 / 3.5 (MMDiT, flow matching, CLIP-L + CLIP-G + T5)."""
