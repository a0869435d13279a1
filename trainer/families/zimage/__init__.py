"""Z-Image (Tongyi-MAI): a single-stream DiT with Qwen3 text features."""
