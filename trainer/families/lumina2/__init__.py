"""Lumina-Image 2.0 (Alpha-VLLM) and its fine-tunes (Neta-Lumina): a single-stream NextDiT with Gemma-2 text features."""
