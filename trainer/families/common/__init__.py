"""Kits shared by several families (latents, text encoders, key maps, descriptions of files)."""
