"""Wan 2.x (text-to-video and image-to-video): info, detect, family, experts, first_frame, keys, tiny, full_size."""
