"""Prodigy (``training.optimizer.name = prodigy``): prodigyopt's optimizer with its step taken by foreach ops and
one read of the device a step.

prodigyopt 1.1.2's ``Prodigy.step`` reads two numbers back from the device for every weight (``.item()`` of each
weight's contribution to the step-size estimate's numerator and denominator): 512 device syncs a step for an SD 1.5
LoRA of 256 weights, each one draining the GPU's queue, and it updates each weight's moments and the weight itself
with a few ops of its own (6,100 kernels a step for the tiny SD LoRA against 2,700 with fused AdamW). This subclass
keeps prodigyopt's arithmetic, settings and state (``s``, ``p0``, ``exp_avg``, ``exp_avg_sq``, ``step``; the
groups' ``d``, ``d_max``, ``d_numerator``, ``d_hat``, ``k``: a backup of either resumes in the other) and changes
how it is carried out: the per-weight numbers (the same kernels make them) stay on the device and are added there
in float64 (prodigyopt adds them in Python floats, also float64), the two sums are read once, and the moments and
the weights are updated with foreach ops (the same arithmetic, one kernel per op for many weights). Only the order
of the float64 additions differs: the step-size estimates agree to float64's rounding and the weights and state
bit for bit (``tests/test_optim_prodigy.py``). FSDP (``fsdp_in_use`` or flattened parameters) takes prodigyopt's
own step.
"""

from __future__ import annotations

import math
from typing import Any, List

import torch
from prodigyopt import Prodigy as _Prodigy


class Prodigy(_Prodigy):
    """prodigyopt's Prodigy; :meth:`step` reads the device once (see the module's docstring)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        groups = self.param_groups
        if self._fsdp():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = groups[0]
        beta1, beta2 = first["betas"]
        beta3 = first["beta3"] if first["beta3"] is not None else math.sqrt(beta2)
        k, d, d_max, d_coef = first["k"], first["d"], first["d_max"], first["d_coef"]
        lr = max(g["lr"] for g in groups)
        bias_correction = 1.0
        if first["use_bias_correction"]:
            bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        dlr = d * lr * bias_correction
        growth_rate = first["growth_rate"]
        d_numerator = first["d_numerator"] * beta3

        numerators: List[torch.Tensor] = []  # per weight: torch.dot(sliced grad, p0 - sliced weight), fp32
        denominators: List[torch.Tensor] = []  # per weight: s.abs().sum(), fp32
        for group in groups:
            if group["lr"] not in (lr, 0.0):
                raise RuntimeError("Setting different lr values in different parameter groups is only supported "
                                   "for values of 0")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            decay, d0, slice_p = group["weight_decay"], group["d0"], group["slice_p"]
            if decay != 0 and not group["decouple"]:
                torch._foreach_add_(grads, params, alpha=decay)
            for p in params:
                if "step" not in self.state[p]:
                    self._init_state(p, beta1, slice_p)
            if group["lr"] <= 0.0:
                continue
            sliced = [g.flatten()[::slice_p] for g in grads]
            for g, p in zip(sliced, params):
                numerators.append(torch.dot(g, self.state[p]["p0"] - p.flatten()[::slice_p]))
            if beta1 > 0:
                exp_avgs = [self.state[p]["exp_avg"] for p in params]
                torch._foreach_mul_(exp_avgs, beta1)
                torch._foreach_add_(exp_avgs, grads, alpha=d * (1 - beta1))
            exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=d * d * (1 - beta2))
            ss = [self.state[p]["s"] for p in params]
            torch._foreach_mul_(ss, beta3)
            torch._foreach_add_(ss, sliced, alpha=(d / d0) * (d if group["safeguard_warmup"] else dlr))
            denominators.extend([a.sum() for a in torch._foreach_abs(ss)])  # each summed as prodigyopt sums it

        if not denominators:  # no weight with a gradient at a learning rate above 0: prodigyopt returns here too
            return loss
        d0 = first["d0"]
        delta_numerator, d_denom = torch.stack([_sum64(numerators), _sum64(denominators)]).tolist()  # the one read
        delta_numerator *= (d / d0) * dlr
        if d_denom == 0:  # no progress yet (all gradients 0): prodigyopt returns here too
            return loss
        d_hat = d
        global_d_numerator, global_d_denom = d_numerator, d_denom
        if lr > 0.0:
            global_d_numerator = d_numerator + delta_numerator
            d_hat = d_coef * global_d_numerator / global_d_denom
            if d == d0:
                d = max(d, d_hat)
            d_max = max(d_max, d_hat)
            d = min(d_max, d * growth_rate)

        for group in groups:
            group.update(d_numerator=global_d_numerator, d_denom=global_d_denom, d=d, d_max=d_max, d_hat=d_hat)
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                states = [self.state[p] for p in params]
                for state in states:
                    state["step"] += 1
                denoms = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
                torch._foreach_add_(denoms, d * group["eps"])
                if group["weight_decay"] != 0 and group["decouple"]:
                    torch._foreach_add_(params, params, alpha=-group["weight_decay"] * dlr)
                if beta1 > 0:
                    torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denoms, value=-dlr)
                else:
                    torch._foreach_addcdiv_(params, [p.grad for p in params], denoms, value=-dlr * d)
            group["k"] = group["k"] + 1
        return loss

    def _fsdp(self) -> bool:
        """FSDP in use (prodigyopt's setting, or a flattened FSDP parameter): prodigyopt's own step, which
        all-reduces the estimate. Looked for once (the parameters stay those the optimizer was made with)."""
        if getattr(self, "_fsdp_found", None) is None:
            self._fsdp_found = any(g["fsdp_in_use"] or any(hasattr(p, "_fsdp_flattened") for p in g["params"])
                                   for g in self.param_groups)
        return self._fsdp_found

    def _init_state(self, p: torch.Tensor, beta1: float, slice_p: int) -> None:
        """prodigyopt's state of a weight at its first step (the same tensors, made the same way)."""
        state = self.state[p]
        state["step"] = 0
        state["s"] = torch.zeros_like(p.flatten()[::slice_p]).detach()
        if p.any():
            state["p0"] = p.flatten()[::slice_p].detach().clone()
        else:  # all zeros (a LoRA's B at the start): a zero scalar saves the copy, as prodigyopt does
            state["p0"] = torch.tensor(0, device=p.device, dtype=p.dtype)
        if beta1 > 0:
            state["exp_avg"] = torch.zeros_like(p).detach()
        state["exp_avg_sq"] = torch.zeros_like(p).detach()


def _sum64(values: List[torch.Tensor]) -> torch.Tensor:
    """The sum of 0-dim tensors in float64, on the first one's device (one stack per device and dtype: a bf16
    weight's dot is bf16)."""
    by_kind: dict = {}
    for v in values:
        by_kind.setdefault((v.device, v.dtype), []).append(v)
    device = values[0].device
    sums = [torch.stack(vs).double().sum().to(device) for vs in by_kind.values()]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


__all__ = ["Prodigy"]
