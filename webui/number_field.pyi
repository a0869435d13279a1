"""A gr.Number whose out-of-range values reach Atelier's validator.

Gradio's own bounds check fails the whole event with an anonymous "Value 0 is less than minimum
value 1.0", before any handler runs; the UI wants to say *which* field is wrong and keep the form.
The bounds still go to the browser (the input's min/max). It is a subclass rather than a patched
instance because Gradio rebuilds a component from its class whenever a handler updates it.
Gradio writes ``number_field.pyi`` (event stubs) next to any component class; it is kept in git.
"""

from __future__ import annotations

import gradio as gr

class FieldNumber(gr.Number):
    is_template = True  # render with the stock Number frontend

    def preprocess(self, payload: float | None) -> float | int | None:
        if payload is None:
            return None
        return self.round_to_precision(payload, self.precision)
    from typing import Callable, Literal, Sequence, Any, TYPE_CHECKING
    from gradio.blocks import Block
    if TYPE_CHECKING:
        from gradio.components import Timer
        from gradio.components.base import Component