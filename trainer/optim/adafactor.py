"""Adafactor (``training.optimizer.name = adafactor``): transformers' optimizer with a step that reads nothing back
from the device.

transformers' ``Adafactor.step`` (5.x) computes every weight's RMS each step and, with ``scale_parameter`` on (its
default, Adafactor's adaptive mode), takes ``max(eps2, RMS)`` in Python: one device sync per weight and step (1,680
for an SDXL UNet fine-tune, each draining a GPU's queue; 256 for the tiny SD LoRA ``bench/step_counts.py`` counts).
With ``scale_parameter`` off (the AdamW-like mode of Atelier's fine-tune presets) the RMS is computed and never read.

Its step also launches ~22 kernels per weight, one op at a time (8,900 a step for the tiny SD LoRA's 256 weights
against fused AdamW's 2,800; ~37,000 for the SDXL fine-tune), each a launch from Python on a GPU.

This subclass keeps transformers' arithmetic, settings and state (``step``, ``exp_avg``, ``exp_avg_sq_row``/``_col``
or ``exp_avg_sq``, ``RMS``: a backup of either resumes in the other) and changes three things: the elementwise work of
all weights at the same step is done by foreach ops (one launch for many weights; the means and RMS of each weight
stay its own, so ~12 kernels per weight are left), the scaled step size is ``(RMS * rel).clamp_(min=eps2 * rel)`` on
the device (the number ``max(eps2, RMS) * rel`` gives, rounded as transformers' multiplications round it; only where
RMS and eps2 lie within float32's rounding of each other may the two differ in the last bit), and the RMS is computed
only where it is used. Weights and state equal transformers' bit for bit in the tests (on the CPU), except with
``weight_decay`` and ``scale_parameter`` both on, where the decay multiplies by the device's step size instead of
reading it (float rounding: ``tests/test_optim_adafactor.py``). A backup's state keeps its float32 moments of bf16
weights (torch's load would cast them to bf16). ``AdafactorSchedule`` (``lr_scheduler = adafactor``) still reads one
RMS per parameter group a step for the LR it logs (transformers' ``_get_lr``, unchanged).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers.optimization import Adafactor as _Adafactor

_HALF = (torch.float16, torch.bfloat16)


class Adafactor(_Adafactor):
    """transformers' Adafactor; :meth:`step` keeps the step size on the device (see the module's docstring)."""

    @staticmethod
    def _relative_step(group: dict, state: dict) -> float:
        """The unscaled step size: transformers' ``_get_lr`` without its ``scale_parameter`` factor."""
        if group["relative_step"]:
            min_step = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
            return min(min_step, 1.0 / math.sqrt(state["step"]))
        return group["lr"]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load casts every state tensor to its weight's dtype; Adafactor keeps a bf16 or fp16 weight's
        moments in float32 (it steps the weight through a float32 copy), so they keep the dtype they were saved in
        and a resumed run steps as the uninterrupted one."""
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(ids, params):
            for key, value in saved.get(pid, {}).items():
                loaded = self.state[p].get(key)
                if torch.is_tensor(value) and torch.is_tensor(loaded) and loaded.dtype != value.dtype:
                    self.state[p][key] = value.to(device=loaded.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            together: Dict[Tuple[int, torch.device], List[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_for(p, group)
                state["step"] += 1
                together.setdefault((state["step"], p.device), []).append(p)
            for (step, _), params in together.items():  # one bucket unless weights missed steps
                self._update(params, group, step)
        return loss

    def _state_for(self, p: torch.Tensor, group: dict) -> dict:
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients.")
        dtype = torch.float32 if grad.dtype in _HALF else grad.dtype
        state = self.state[p]
        factored, use_first_moment = self._get_options(group, grad.shape)
        if len(state) == 0:
            state["step"] = 0
            if use_first_moment:
                state["exp_avg"] = torch.zeros_like(grad, dtype=dtype)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1], dtype=dtype, device=grad.device)
                state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:], dtype=dtype,
                                                      device=grad.device)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad, dtype=dtype)
            state["RMS"] = 0
        else:
            for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(dtype=dtype, device=grad.device)
        return state

    def _update(self, params: List[torch.Tensor], group: dict, step: int) -> None:
        """transformers' update of each weight, for weights at the same step: the elementwise work by foreach ops
        (one launch for many weights on a GPU), the per-weight reductions (means, RMS) one by one."""
        grads = [p.grad.float() if p.grad.dtype in _HALF else p.grad for p in params]
        weights = [p.float() if p.dtype in _HALF else p for p in params]
        states = [self.state[p] for p in params]
        rel = self._relative_step(group, states[0])
        lrs: Optional[List[torch.Tensor]] = None  # per weight where scale_parameter scales rel by its RMS
        if group["scale_parameter"]:
            eps2, lrs = group["eps"][1], []
            for w, state in zip(weights, states):
                rms = self._rms(w)
                state["RMS"] = rms
                lrs.append((rms * rel).clamp_(min=eps2 * rel))  # max(eps2, RMS) * rel, on the device

        beta2t = 1.0 - math.pow(step, group["decay_rate"])
        squares = torch._foreach_mul(grads, grads)  # grad**2
        torch._foreach_add_(squares, group["eps"][0])
        updates: List[Any] = [None] * len(params)
        factored = [i for i, g in enumerate(grads) if self._get_options(group, g.shape)[0]]
        if factored:
            rows = [states[i]["exp_avg_sq_row"] for i in factored]
            cols = [states[i]["exp_avg_sq_col"] for i in factored]
            torch._foreach_mul_(rows, beta2t)
            torch._foreach_add_(rows, [squares[i].mean(dim=-1) for i in factored], alpha=(1.0 - beta2t))
            torch._foreach_mul_(cols, beta2t)
            torch._foreach_add_(cols, [squares[i].mean(dim=-2) for i in factored], alpha=(1.0 - beta2t))
            approx = [self._approx_sq_grad(r, c) for r, c in zip(rows, cols)]
            torch._foreach_mul_(approx, [grads[i] for i in factored])
            for i, u in zip(factored, approx):
                updates[i] = u
        whole = [i for i in range(len(params)) if updates[i] is None]
        if whole:
            moments = [states[i]["exp_avg_sq"] for i in whole]
            torch._foreach_mul_(moments, beta2t)
            torch._foreach_add_(moments, [squares[i] for i in whole], alpha=(1.0 - beta2t))
            scaled = torch._foreach_rsqrt(moments)
            torch._foreach_mul_(scaled, [grads[i] for i in whole])
            for i, u in zip(whole, scaled):
                updates[i] = u

        for u in updates:
            u.div_((self._rms(u) / group["clip_threshold"]).clamp_(min=1.0))
        if lrs is None:
            torch._foreach_mul_(updates, rel)
        else:
            for u, lr in zip(updates, lrs):
                u.mul_(lr)

        if group["beta1"] is not None:
            averages = [state["exp_avg"] for state in states]
            torch._foreach_mul_(averages, group["beta1"])
            torch._foreach_add_(averages, updates, alpha=(1 - group["beta1"]))
            updates = averages

        if group["weight_decay"] != 0:
            if lrs is None:
                torch._foreach_add_(weights, weights, alpha=(-group["weight_decay"] * rel))
            else:
                for w, lr in zip(weights, lrs):
                    w.add_(w * (-group["weight_decay"] * lr))

        torch._foreach_sub_(weights, updates)  # p.add_(-update), the same bits
        for p, w in zip(params, weights):
            if p is not w:
                p.copy_(w)
