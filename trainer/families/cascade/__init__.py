"""Stable Cascade (Würstchen 3): stage C prior training."""
