"""Qwen-Image 2.1 (and its Turbo checkpoint): a family of its own, see family.py."""
