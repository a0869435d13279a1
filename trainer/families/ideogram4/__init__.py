"""Ideogram 4: Ideogram4Pipeline (Qwen3-VL features, a packed text+image transformer, asymmetric CFG)."""
