"""The EfficientNet image encoder whose embeddings Stable Cascade's stage C and Würstchen 2's prior denoise.

Both were trained against ``backbone = torchvision.models.efficientnet_v2_s().features`` followed by
``mapper = Sequential(Conv2d(1280, 16, 1, bias=False), BatchNorm2d(16, affine=...))``: ``affine=False`` in
Stable Cascade's ``effnet_encoder.safetensors``, ``affine=True`` in the ``effnet_state_dict`` of Würstchen 2's
``model_v2_stage_b.pt``. The backbone is re-implemented here (torchvision is not a dependency) with torchvision's
module names, so those files load key for key: ``backbone.0.0.weight``, ``backbone.1.0.block.0.0.weight``,
``backbone.4.0.block.2.fc1.weight`` … ``backbone.7.0.weight``, ``mapper.0.weight``, ``mapper.1.running_mean``.
Stochastic depth, which torchvision applies only in training, is left out: this encoder is always frozen.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Stage(NamedTuple):
    """One stage of EfficientNetV2: ``layers`` blocks of ``channels`` outputs; the first has ``stride``."""
    fused: bool  # FusedMBConv (a full conv) rather than MBConv (1×1 expand, depthwise conv, squeeze-excitation)
    expand_ratio: float
    kernel: int
    stride: int
    channels: int
    layers: int


#: torchvision's ``efficientnet_v2_s`` (stem 24 channels, last conv 1280).
V2_S_STAGES = (Stage(True, 1, 3, 1, 24, 2), Stage(True, 4, 3, 2, 48, 4), Stage(True, 4, 3, 2, 64, 4),
               Stage(False, 4, 3, 2, 128, 6), Stage(False, 6, 3, 1, 160, 9), Stage(False, 6, 3, 2, 256, 15))
#: Stride of each stage by index, as in every EfficientNetV2 (v2-m and v2-l add a seventh stage).
_STRIDES = (1, 2, 2, 2, 1, 2, 1)
#: The tiny test encoder: every v2-s stage, one block each, still 32× downsampling.
TINY_STAGES = (Stage(True, 1, 3, 1, 8, 1), Stage(True, 4, 3, 2, 8, 1), Stage(True, 4, 3, 2, 8, 1),
               Stage(False, 4, 3, 2, 16, 1), Stage(False, 6, 3, 1, 16, 1), Stage(False, 6, 3, 2, 16, 1))


class _ConvNormAct(nn.Sequential):
    """torchvision's ``Conv2dNormActivation``: conv without bias (``0``), BatchNorm eps 1e-3 (``1``), SiLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 1, stride: int = 1, groups: int = 1,
                 act: bool = True):
        layers = [nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(c_out, eps=1e-3)]
        if act:
            layers.append(nn.SiLU(inplace=True))
        super().__init__(*layers)


class _SqueezeExcitation(nn.Module):
    """torchvision's ``SqueezeExcitation`` with SiLU: channels scaled by sigmoid(fc2(silu(fc1(mean))))."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class _MBConv(nn.Module):
    """torchvision's ``FusedMBConv`` (``fused``) or ``MBConv`` as ``block``, plus the residual when the
    block keeps its shape. Sub-blocks only exist where torchvision builds them (no expansion at ratio 1)."""

    def __init__(self, fused: bool, c_in: int, c_out: int, expand_ratio: float, kernel: int, stride: int):
        super().__init__()
        expanded = round(c_in * expand_ratio)  # torchvision rounds to a multiple of 8: the same for v2 widths
        if fused and expanded != c_in:
            layers = [_ConvNormAct(c_in, expanded, kernel, stride), _ConvNormAct(expanded, c_out, act=False)]
        elif fused:
            layers = [_ConvNormAct(c_in, c_out, kernel, stride)]
        else:
            layers = [_ConvNormAct(c_in, expanded)] if expanded != c_in else []
            layers += [_ConvNormAct(expanded, expanded, kernel, stride, groups=expanded),
                       _SqueezeExcitation(expanded, max(1, c_in // 4)),
                       _ConvNormAct(expanded, c_out, act=False)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y + x if self.residual else y


class EfficientNetEncoder(nn.Module):
    """EfficientNetV2 ``features`` (as ``backbone``) and a 1×1 conv + BatchNorm ``mapper`` to ``c_latent``
    channels: images normalised by :func:`effnet_preprocess` → latents at 1/32 of their size.

    The defaults are Stable Cascade's encoder (v2-s, 16 latent channels, BatchNorm without affine)."""

    def __init__(self, stages: Sequence[Stage] = V2_S_STAGES, stem: int = 24, last: int = 1280,
                 c_latent: int = 16, affine: bool = False):
        super().__init__()
        layers: list = [_ConvNormAct(3, stem, 3, 2)]
        c_in = stem
        for stage in stages:
            blocks = []
            for i in range(stage.layers):
                blocks.append(_MBConv(stage.fused, c_in, stage.channels, stage.expand_ratio, stage.kernel,
                                      stage.stride if i == 0 else 1))
                c_in = stage.channels
            layers.append(nn.Sequential(*blocks))
        layers.append(_ConvNormAct(c_in, last))
        self.backbone = nn.Sequential(*layers)
        self.mapper = nn.Sequential(nn.Conv2d(last, c_latent, 1, bias=False), nn.BatchNorm2d(c_latent, affine=affine))

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (as diffusers models report it: the trainer places frozen parts by it)."""
        return next(self.parameters()).dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mapper(self.backbone(x))

    @staticmethod
    def config_from_state_dict(state: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
        """The constructor's arguments for the encoder ``state`` (``backbone.*``/``mapper.*`` keys) holds:
        stages from the keys and shapes (strides by stage index, as in EfficientNetV2). ValueError if absent."""
        def shape(key: str) -> tuple:
            if key not in state:
                raise ValueError(f"{key} is missing")
            return tuple(state[key].shape)

        def indices(prefix: str) -> list:
            pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
            return sorted({int(m.group(1)) for m in map(pattern.match, state) if m})

        top = indices("backbone.")
        if len(top) < 3 or top != list(range(len(top))) or len(top) - 2 > len(_STRIDES):
            raise ValueError(f"backbone.* has layers {top}, not a stem, 1 to {len(_STRIDES)} stages and a last conv")
        stem = c_in = shape("backbone.0.0.weight")[0]
        stages = []
        for index in top[1:-1]:
            block = f"backbone.{index}.0.block."
            parts = indices(block)
            if not parts:
                raise ValueError(f"{block}* is missing")
            fused = not any(k.startswith(block) and ".fc1." in k for k in state)
            expands = len(parts) == (2 if fused else 4)
            expanded = shape(f"{block}0.0.weight")[0] if expands else c_in
            kernel = shape(f"{block}{1 if expands and not fused else 0}.0.weight")[-1]  # (depthwise) conv
            channels = shape(f"{block}{len(parts) - 1}.0.weight")[0]
            stages.append(Stage(fused, expanded / c_in, kernel, _STRIDES[index - 1], channels,
                                len(indices(f"backbone.{index}."))))
            c_in = channels
        return dict(stages=tuple(stages), stem=stem, last=shape(f"backbone.{top[-1]}.0.weight")[0],
                    c_latent=shape("mapper.0.weight")[0], affine="mapper.1.weight" in state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> "EfficientNetEncoder":
        """Build the encoder ``state`` describes (fp32, on the device of its tensors, no random init) and load
        it strictly (``num_batches_tracked`` may be absent). ValueError if the keys or shapes do not fit."""
        config = cls.config_from_state_dict(state)
        with torch.device("meta"):
            encoder = cls(**config)
        encoder.to_empty(device=state["mapper.0.weight"].device)
        full = dict(state)
        for name, _ in encoder.named_buffers():
            if name.endswith(".num_batches_tracked"):
                full.setdefault(name, torch.zeros((), dtype=torch.long))
        try:
            encoder.load_state_dict(full, strict=True)
        except RuntimeError as exc:
            raise ValueError(" ".join(line.strip() for line in str(exc).splitlines()[1:3]).rstrip(".")) from None
        return encoder


def effnet_preprocess(pixels: torch.Tensor) -> torch.Tensor:
    """Training pixels ([B, 3, H, W] in [-1, 1]) → encoder input: resized to ¾ (bilinear, antialiased; 1024 px →
    768 px → 24×24 latents), mapped to [0, 1] and normalised with the ImageNet mean and std."""
    h, w = pixels.shape[-2:]
    x = F.interpolate(pixels, size=(h * 3 // 4, w * 3 // 4), mode="bilinear", antialias=True, align_corners=False)
    mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return ((x + 1) / 2 - mean) / std


def tiny_effnet(c_latent: int = 16, affine: bool = False, seed: int = 0) -> EfficientNetEncoder:
    """A tiny seeded encoder of the real topology (:data:`TINY_STAGES`, stem 8, last conv 32), frozen in eval
    mode. Its BatchNorm statistics are those of its own activations on random inputs (so latents are roughly
    unit-scaled, not constant); the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = EfficientNetEncoder(TINY_STAGES, stem=8, last=32, c_latent=c_latent, affine=affine)
        norms = [m for m in encoder.modules() if isinstance(m, nn.BatchNorm2d)]
        for norm in norms:
            if norm.affine:
                nn.init.normal_(norm.weight, 1.0, 0.1)
                nn.init.normal_(norm.bias, 0.0, 0.1)
            norm.momentum = None  # running statistics = plain average over the calibration batches
        with torch.no_grad():
            encoder.train()
            for _ in range(4):
                encoder(torch.randn(4, 3, 64, 64))
        for norm in norms:
            norm.momentum = 0.1
    return encoder.eval().requires_grad_(False)


def save_effnet(encoder: EfficientNetEncoder, path: str | os.PathLike) -> None:
    """Write ``encoder`` as safetensors in the layout of Stable Cascade's ``effnet_encoder.safetensors``
    (``backbone.*``, ``mapper.*``; without ``num_batches_tracked``, which eval mode never reads)."""
    state = {k: v.detach().cpu().contiguous() for k, v in encoder.state_dict().items()
             if not k.endswith(".num_batches_tracked")}
    save_file(state, str(path))


def load_effnet(path: str | os.PathLike) -> EfficientNetEncoder:
    """The frozen fp32 encoder (eval mode) in ``path``: ``.safetensors``, or ``.pt``/``.pth``/``.ckpt`` (read
    with ``weights_only``) whose ``effnet_state_dict`` or ``state_dict`` entry is unwrapped; ``effnet.`` and
    ``module.`` key prefixes are stripped. ValueError, in one sentence naming the file, for anything else."""
    path = Path(path)
    tensors = _read_tensors(path)
    state = {k: v for k, v in tensors.items() if k.startswith(("backbone.", "mapper."))}
    if "backbone.0.0.weight" not in state or "mapper.0.weight" not in state:
        raise ValueError(f"{path} is not an EfficientNet image encoder: it {_looks_like(list(tensors))}, while "
                         "the encoder holds backbone.* and mapper.* weights (Stable Cascade's "
                         "effnet_encoder.safetensors, or the effnet_state_dict in Würstchen 2's model_v2_stage_b.pt)")
    try:
        encoder = EfficientNetEncoder.from_state_dict(state)
    except ValueError as exc:
        raise ValueError(f"{path} has EfficientNet encoder keys (backbone.*, mapper.*) that do not fit an "
                         f"EfficientNetV2 encoder: {exc}") from None
    return encoder.eval().requires_grad_(False)


def _read_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """The tensors of a weights file, unwrapped from a checkpoint dict and with ``effnet.``/``module.`` stripped."""
    kind = "safetensors" if path.suffix.lower() == ".safetensors" else "PyTorch checkpoint"
    if kind != "safetensors" and path.suffix.lower() not in (".pt", ".pth", ".ckpt"):
        raise ValueError(f"{path} is not an EfficientNet encoder file: expected .safetensors or .pt/.pth/.ckpt")
    try:
        if kind == "safetensors":
            obj: Any = load_file(str(path))
        else:
            obj = _torch_load(path)
    except Exception as exc:  # torch's weights-only refusals give their reason after "WeightsUnpickler error:"
        text = str(exc).split("error:", 1)[-1].strip() or "no details"
        reason = text.splitlines()[0].split(". ")[0][:200]
        raise ValueError(f"{path} could not be read as a {kind} file ({type(exc).__name__}: {reason})") from None
    if isinstance(obj, Mapping):
        obj = next((obj[k] for k in ("effnet_state_dict", "state_dict") if isinstance(obj.get(k), Mapping)), obj)
    if not isinstance(obj, Mapping):
        return {}
    return {re.sub(r"^(?:(?:effnet|module)\.)+", "", k): v for k, v in obj.items()
            if isinstance(k, str) and isinstance(v, torch.Tensor)}


def _torch_load(path: Path) -> Any:
    """``torch.load`` on the CPU, weights only; memory-mapped where the format allows, since a Würstchen
    stage B checkpoint is gigabytes around an 80 MB encoder."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)


def _looks_like(keys: Sequence[str]) -> str:
    """What a file with these tensor names looks like, as a verb phrase."""
    if not keys:
        return "holds no tensors"
    if any(k.startswith(("lora_", "lycoris_")) or ".lora_" in k or ".hada_" in k or ".lokr_" in k for k in keys):
        return "looks like a LoRA"
    if "features.0.0.weight" in keys:
        return "looks like a torchvision EfficientNet classifier (features.*), without the latent mapper"
    if any(k.startswith(("backbone.", "mapper.")) for k in keys):
        return "holds only part of an encoder (backbone.0.0.weight or mapper.0.weight is missing)"
    return f"holds other weights ({', '.join(keys[:3])}{', …' if len(keys) > 3 else ''})"
