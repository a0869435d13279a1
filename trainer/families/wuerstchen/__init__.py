"""Würstchen 2: prior training."""
