"""Adafactor (``training.optimizer.name = adafactor``): transformers' optimizer with a step that reads nothing back
from the device.

transformers' ``Adafactor.step`` (5.x) computes every weight's RMS each step and, with ``scale_parameter`` on (its
default, Adafactor's adaptive mode), takes ``max(eps2, RMS)`` in Python: one device sync per weight and step (1,680
for an SDXL UNet fine-tune, each draining a GPU's queue; 256 for the tiny SD LoRA ``bench/step_counts.py`` counts).
With ``scale_parameter`` off (the AdamW-like mode of Atelier's fine-tune presets) the RMS is computed and never read.

This subclass keeps transformers' arithmetic, settings and state (``step``, ``exp_avg``, ``exp_avg_sq_row``/``_col``
or ``exp_avg_sq``, ``RMS``: a backup of either resumes in the other) and changes two things: the scaled step size is
``(RMS * rel).clamp_(min=eps2 * rel)`` on the device (the number ``max(eps2, RMS) * rel`` gives, rounded as
transformers' multiplications round it; only where RMS and eps2 lie within float32's rounding of each other may
the two differ in the last bit), and the RMS is computed only where it is used. Weights and state equal
transformers' bit for bit, except with ``weight_decay`` and ``scale_parameter`` both on, where the decay multiplies
by the device's step size instead of reading it (float rounding: ``tests/test_optim_adafactor.py``).
A backup's state keeps its float32 moments of bf16 weights (torch's load would cast them to bf16).
``AdafactorSchedule`` (``lr_scheduler = adafactor``) still reads one RMS per parameter group a step for the LR it
logs (transformers' ``_get_lr``, unchanged).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.optimization import Adafactor as _Adafactor


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
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad
        if grad.dtype in {torch.float16, torch.bfloat16}:
            grad = grad.float()
        if grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients.")
        state = self.state[p]
        grad_shape = grad.shape
        factored, use_first_moment = self._get_options(group, grad_shape)
        if len(state) == 0:
            state["step"] = 0
            if use_first_moment:
                state["exp_avg"] = torch.zeros_like(grad)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(grad_shape[:-1]).to(grad)
                state["exp_avg_sq_col"] = torch.zeros(grad_shape[:-2] + grad_shape[-1:]).to(grad)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
            state["RMS"] = 0
        else:
            for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(grad)

        p_data_fp32 = p.float() if p.dtype in {torch.float16, torch.bfloat16} else p
        state["step"] += 1
        rel = self._relative_step(group, state)
        if group["scale_parameter"]:
            rms = self._rms(p_data_fp32)
            state["RMS"] = rms
            eps2 = group["eps"][1]
            lr: Any = (rms * rel).clamp_(min=eps2 * rel)  # max(eps2, RMS) * rel, on the device
        else:
            lr = rel

        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
        update = (grad**2) + group["eps"][0]
        if factored:
            exp_avg_sq_row = state["exp_avg_sq_row"]
            exp_avg_sq_col = state["exp_avg_sq_col"]
            exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            exp_avg_sq_col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
            update = self._approx_sq_grad(exp_avg_sq_row, exp_avg_sq_col)
            update.mul_(grad)
        else:
            exp_avg_sq = state["exp_avg_sq"]
            exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            update = exp_avg_sq.rsqrt().mul_(grad)

        update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)

        if use_first_moment:
            exp_avg = state["exp_avg"]
            exp_avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
            update = exp_avg

        if group["weight_decay"] != 0:
            if isinstance(lr, torch.Tensor):
                p_data_fp32.add_(p_data_fp32 * (-group["weight_decay"] * lr))
            else:
                p_data_fp32.add_(p_data_fp32, alpha=(-group["weight_decay"] * lr))

        p_data_fp32.add_(-update)
        if p.dtype in {torch.float16, torch.bfloat16}:
            p.copy_(p_data_fp32)
