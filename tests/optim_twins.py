"""Atelier's optimizers that take a library's step without its device reads (trainer/optim/prodigy.py,
trainer/optim/adafactor.py) against the library's own: the same gradients, stepped side by side."""

from __future__ import annotations


def step_both(step: int, gradients, reference, ours, params, our_params) -> None:
    """Draw step ``step``'s gradients for ``params``, give ``our_params`` copies of them, and step both."""
    gradients(step, params)
    for p, q in zip(params, our_params):
        q.grad = None if p.grad is None else p.grad.clone()
    reference.step()
    ours.step()
