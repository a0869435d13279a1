"""Sana and Sana 1.5 (NVIDIA Efficient-Large-Model): a linear-attention DiT over DC-AE latents with Gemma-2 text."""
