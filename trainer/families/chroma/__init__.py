"""Chroma (Flux-architecture, T5 only, true CFG)."""
