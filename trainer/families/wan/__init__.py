"""Wan 2.x (text-to-video): info, detect, family, keys, tiny, full_size."""
