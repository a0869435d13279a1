"""EMA of the trained weights: diffusers' ``EMAModel`` over the trainable parameters only.

Why a subclass and not ``EMAModel`` as is: its ``step`` computes ``shadow - param`` directly, which
fails when the shadow lives on the CPU and the weights on a GPU (the point of ``ema.device = cpu``),
and it keeps the shadow in the weights' dtype, where a bf16 shadow loses every update smaller than
bf16's step (with decay 0.999 that is most of them). The subclass keeps an fp32 shadow on its own
device, moves each weight there to update it, and adds a constant-decay mode. Everything else is
diffusers': the decay warm-up ``min(decay, (1+n)/(10+n))``, ``copy_to``, ``store``/``restore`` and
the state-dict format.

The update after the n-th EMA update (every ``update_every_n_steps`` optimizer steps):
``shadow ← d_n · shadow + (1 − d_n) · weight``, with ``d_n = decay`` (constant) or diffusers'
warm-up (``d_1 = 0``, so the first update copies the weights).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from diffusers.training_utils import EMAModel
from safetensors.torch import load_file, save_file

from trainer.errors import ConfigError

EMA_FILE = "ema.safetensors"
EMA_STATE = "ema.json"


class TrainableEMA(EMAModel):
    """EMA over named trainable parameters; shadow in fp32 on ``device``."""

    def __init__(self, named_params: List[Tuple[str, torch.nn.Parameter]], decay: float = 0.999,
                 warmup: bool = True, update_every_n_steps: int = 1, device: Any = "cpu"):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.device = torch.device(device)
        # copies made on the shadow device, so a GPU never holds a second copy of the weights
        super().__init__([p.detach().to(self.device, torch.float32) for p in self.params], decay=decay)
        self.constant_decay = not warmup
        self.update_every_n_steps = max(1, int(update_every_n_steps))

    def get_decay(self, optimization_step: int) -> float:
        if self.constant_decay:
            return float(self.decay)
        return super().get_decay(optimization_step)

    @torch.no_grad()
    def step(self, parameters=None) -> None:
        """One EMA update: shadow ← d·shadow + (1−d)·weight, computed on the shadow's device in fp32."""
        params = self.params if parameters is None else list(parameters)
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        for s, p in zip(self.shadow_params, params):
            s.lerp_(p.detach().to(s.device, s.dtype), 1.0 - decay)

    def after_optimizer_step(self, step: int) -> bool:
        """Call after every optimizer step (``step`` counts from 1); updates every N steps."""
        if step % self.update_every_n_steps:
            return False
        self.step()
        return True

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Temporarily put the EMA weights into the model (for samples or saving), then restore."""
        self.store(self.params)
        self.copy_to(self.params)
        try:
            yield
        finally:
            self.restore(self.params)

    @torch.no_grad()
    def reset(self) -> None:
        """Start over from the current weights (e.g. resuming a backup made without EMA)."""
        self.shadow_params = [p.detach().to(self.device, torch.float32).clone() for p in self.params]
        self.optimization_step = 0

    # --- persistence --------------------------------------------------------------------
    def shadow_state(self) -> Dict[str, torch.Tensor]:
        return {n: s.detach().cpu().contiguous() for n, s in zip(self.names, self.shadow_params)}

    def save(self, folder: Path) -> None:
        """Write ``ema.safetensors`` (shadow weights under the trainable-weight names) and ``ema.json``."""
        folder = Path(folder)
        save_file(self.shadow_state(), str(folder / EMA_FILE))
        (folder / EMA_STATE).write_text(json.dumps({
            "optimization_step": self.optimization_step, "decay": self.decay,
            "constant_decay": self.constant_decay, "update_every_n_steps": self.update_every_n_steps}))

    def load(self, folder: Path) -> bool:
        """Restore from a backup folder. A backup without EMA (EMA turned on later) restarts the
        EMA from the current weights and returns False."""
        folder = Path(folder)
        if not (folder / EMA_FILE).exists():
            self.reset()
            return False
        shadow = load_file(str(folder / EMA_FILE))
        missing = [n for n in self.names if n not in shadow]
        if missing:
            raise ConfigError(f"The EMA in backup {folder} does not match this run's trainable weights "
                              f"(e.g. {missing[0]} is missing).", key="ema.enabled")
        state = json.loads((folder / EMA_STATE).read_text()) if (folder / EMA_STATE).exists() else {}
        self.shadow_params = [shadow[n].to(self.device, torch.float32) for n in self.names]
        self.optimization_step = int(state.get("optimization_step", 0))
        return True


def trainable_named_parameters(method) -> List[Tuple[str, torch.nn.Parameter]]:
    """The trained weights in a fixed order, named as in backups (``<component>.<param name>``)."""
    return [(f"{name}.{pn}", p) for name, m in method.modules.items()
            for pn, p in m.named_parameters() if p.requires_grad]


def make_ema(method, ecfg, training_device: Any) -> Optional[TrainableEMA]:
    """The run's EMA, or None when ``ema.enabled`` is off."""
    if not ecfg.enabled:
        return None
    device = "cpu" if ecfg.device == "cpu" else training_device
    return TrainableEMA(trainable_named_parameters(method), decay=float(ecfg.decay), warmup=bool(ecfg.warmup),
                        update_every_n_steps=int(ecfg.update_every_n_steps), device=device)


def sample_variants(ema: Optional[TrainableEMA], ecfg) -> List[Tuple[str, bool]]:
    """(file-name suffix, use EMA) for each set of samples to draw."""
    if ema is None or ecfg.sample_with == "raw":
        return [("", False)]
    if ecfg.sample_with == "ema":
        return [("", True)]
    return [("", False), ("-ema", True)]
