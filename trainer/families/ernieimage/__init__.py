"""ERNIE-Image: a single-stream DiT with shared AdaLN over Mistral3 hidden states and the Flux.2 VAE's latents."""
