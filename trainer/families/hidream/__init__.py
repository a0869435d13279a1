"""HiDream-I1 (full, dev, fast): a sparse mixture-of-experts DiT conditioned on CLIP-L, CLIP-G, T5-XXL and several
hidden layers of Llama-3.1-8B-Instruct."""
