"""PixArt-α and PixArt-Σ: a DiT on SD/SDXL VAE latents conditioned on T5, trained with DDPM ε-prediction."""
