"""What a run holds in GPU memory, and what it needs: ``precision`` (fp8/NF4 weight storage, stochastic
rounding), ``offload`` (text encoders in CPU RAM), ``block_swap`` (the denoiser's blocks visiting the GPU),
``tiers`` (a memory-tier preset's promise) and ``estimate`` (the VRAM estimate). Nothing is imported here."""
