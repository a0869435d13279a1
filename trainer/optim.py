"""Optimizer and learning-rate scheduler registry: config names → constructors from real libraries."""

from __future__ import annotations

from typing import Any, Dict, List

from trainer.config import ConfigError, resolved_learning_rates


def param_groups(method, cfg) -> List[Dict[str, Any]]:
    """One group per trained component, each with its own learning rate (blank → base LR)."""
    lrs = resolved_learning_rates(cfg)
    groups = []
    for name, module in method.modules.items():
        params = [p for p in module.parameters() if p.requires_grad]
        if params:
            groups.append({"params": params, "lr": lrs[name], "name": name})
    if not groups:
        raise ConfigError("Nothing to train: no trainable parameters (check training.train_unet / "
                          "training.train_text_encoder).", key="training.train_unet")
    return groups


def build_optimizer(groups: List[Dict[str, Any]], cfg):
    import torch
    o = cfg.training.optimizer
    if o.name == "adamw":
        return torch.optim.AdamW(groups, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "adam":
        return torch.optim.Adam(groups, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "sgd":
        return torch.optim.SGD(groups, momentum=o.momentum, weight_decay=o.weight_decay)
    raise ConfigError(f"training.optimizer.name = {o.name} is not known.", key="training.optimizer.name")


def build_scheduler(optimizer, cfg, total_steps: int):
    from diffusers.optimization import get_scheduler
    t = cfg.training
    kwargs: Dict[str, Any] = {}
    if t.lr_scheduler == "cosine_with_restarts":
        kwargs["num_cycles"] = t.lr_cycles
    return get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=t.lr_warmup_steps,
                         num_training_steps=max(total_steps, 1), **kwargs)
