"""Loss: per-sample MSE between prediction and target, weighted per concept."""

from __future__ import annotations


def diffusion_loss(model_pred, target, weights=None):
    """Mean squared error per sample (mean over C,H,W), then the weighted batch mean."""
    import torch.nn.functional as F
    per_sample = F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if weights is not None:
        per_sample = per_sample * weights.to(per_sample.device)
    return per_sample.mean()
