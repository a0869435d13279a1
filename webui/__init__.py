"""Atelier's browser UI (Gradio). Knows the trainer only through trainer.config, the CLI and run folders."""
