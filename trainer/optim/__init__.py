"""Optimizers and learning-rate schedules: ``registry`` (names → constructors, torch-free: the schema's choices),
``rules`` (checks and warnings on the settings, LR resolution), ``build`` (param groups, the optimizer, fused
backward) and ``schedule`` (LR schedules, per-component training windows). Nothing is imported here."""
