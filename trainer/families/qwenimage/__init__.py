"""Qwen-Image: an MMDiT over a Qwen2.5-VL text model's features and a Wan-style VAE."""
