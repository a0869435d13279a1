"""Krea 2 (Raw and Turbo): a single-stream MMDiT over a fused stack of Qwen3-VL hidden layers and Qwen-Image latents."""
