"""Flux.2 [klein]: Flux.2's transformer over Qwen3 features and the Flux.2 VAE."""
