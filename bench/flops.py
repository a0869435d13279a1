#!/usr/bin/env python3
"""FLOPs of one training step of a denoiser at real size, and model FLOPs utilisation (MFU) from a speed.

    .venv/bin/python bench/flops.py --family sd15 --resolution 512 --batch 1 --method lora
    .venv/bin/python bench/flops.py --family sdxl --resolution 1024 --batch 1 --steps-per-s 1.2 --peak-tflops 165
    .venv/bin/python bench/flops.py --family sd15 --resolution 512 --json
    .venv/bin/python bench/flops.py --family qwen-image --resolution 1024 --text-tokens 32   # and 512: the padding
    .venv/bin/python bench/flops.py --family hunyuan-image --resolution 2048 --text-tokens 64 # and 1000
    .venv/bin/python bench/flops.py --family chroma --resolution 1024 --text-tokens 64        # and 512
    .venv/bin/python bench/flops.py --family krea2 --resolution 1024 --text-tokens 64         # and 520
    .venv/bin/python bench/flops.py --family sana --resolution 512 --text-tokens 64           # and 300

The UNet is built from the shipped diffusers config (``trainer/families/common/sd_kit/configs/<family>/unet``)
on the meta device (no weights, no memory) and one forward pass is counted with
``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention; an elementwise op counts 0,
as in the usual MFU convention). A training step is counted as 3× the forward for a fine-tune (forward,
gradients of the activations, gradients of the weights) and 2× for LoRA or an embedding (the frozen
weights get no gradient matmuls; the adapters' own FLOPs are negligible). With a measured speed
(``--steps-per-s``, e.g. bench_train's ``steady_steps_per_s``) and the device's dense peak
(``--peak-tflops``: e.g. an H100 SXM's bf16 989, an RTX 4090's bf16 165 — with dense, not sparse, figures),
it prints MFU = FLOPs per step × steps/s ÷ peak.

``qwen-image``, ``hunyuan-image``, ``chroma``, ``krea2``, ``sana``: the transformer from the family's shipped full-size config, with
``--text-tokens`` caption tokens through its text stream and joint attention (what a step hands it: the batch's
longest caption; before 2026-11-28 steps passed the text cache's padded length, 512 for Qwen-Image and Chroma, 520
for Krea 2, 300 for Sana and 1000 for HunyuanImage). HunyuanImage is counted without its glyph (ByT5) tokens: its transformer reorders them by their mask,
which the meta device cannot (they add at most 128 tokens more, 8 for a short quote).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "trainer" / "families" / "common" / "sd_kit" / "configs"
TEXT_WIDTH = {"sd15": 768, "sd2": 1024, "sd2-base": 1024, "sdxl": 2048}
TRANSFORMERS = ("chroma", "hunyuan-image", "krea2", "qwen-image", "sana")
STEP_FACTOR = {"finetune": 3.0, "lora": 2.0, "embedding": 2.0}


def unet_forward_flops(unet_config: Dict, resolution: int, batch: int, text_width: int, sdxl: bool) -> int:
    """FLOPs of one UNet forward at ``resolution`` (pixels) and ``batch``, counted on the meta device."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
        side = resolution // 8
        latents = torch.empty(batch, unet.config.in_channels, side, side)
        t = torch.zeros(batch)
        text = torch.empty(batch, 77, text_width)
        added = None
        if sdxl:
            added = {"text_embeds": torch.empty(batch, 1280), "time_ids": torch.empty(batch, 6)}
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        unet(latents, t, encoder_hidden_states=text, added_cond_kwargs=added)
    return int(counter.get_total_flops())


def transformer_forward_flops(family: str, resolution: int, batch: int, text_tokens: int) -> int:
    """FLOPs of one forward of the family's transformer at ``resolution`` with ``text_tokens`` caption tokens (every
    one real), counted on the meta device from the shipped full-size config."""
    import tempfile

    import torch
    from diffusers import (ChromaTransformer2DModel, HunyuanImageTransformer2DModel, Krea2Transformer2DModel,
                           QwenImageTransformer2DModel, SanaTransformer2DModel)
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.families.common import full_size
    cls = {"qwen-image": QwenImageTransformer2DModel, "hunyuan-image": HunyuanImageTransformer2DModel,
           "chroma": ChromaTransformer2DModel, "krea2": Krea2Transformer2DModel,
           "sana": SanaTransformer2DModel}[family]
    with tempfile.TemporaryDirectory() as tmp:
        config = cls.load_config(str(full_size.config_folder(family, Path(tmp)) / "transformer"))
    with torch.device("meta"):  # fp32: the FLOPs are the same in any dtype
        model = cls.from_config(config)
        t = torch.ones(batch)
        if family == "qwen-image":
            side = resolution // 16  # 8x VAE, 2x2 patches
            kwargs = dict(hidden_states=torch.empty(batch, side * side, config["in_channels"]),
                          encoder_hidden_states=torch.empty(batch, text_tokens, config["joint_attention_dim"]),
                          timestep=t, img_shapes=[[(1, side, side)]] * batch)
        elif family == "sana":
            side = resolution // 32  # 32x VAE, 1x1 patches
            kwargs = dict(hidden_states=torch.empty(batch, config["in_channels"], side, side), timestep=t,
                          encoder_hidden_states=torch.empty(batch, text_tokens, config["caption_channels"]))
        elif family == "krea2":
            side = resolution // 16  # 8x VAE, 2x2 patches
            kwargs = dict(hidden_states=torch.empty(batch, side * side, config["in_channels"]), timestep=t,
                          encoder_hidden_states=torch.empty(batch, text_tokens, config["num_text_layers"],
                                                            config["text_hidden_dim"]),
                          position_ids=torch.zeros(text_tokens + side * side, 3))
        elif family == "chroma":
            side = resolution // 16  # 8x VAE, 2x2 patches
            kwargs = dict(hidden_states=torch.empty(batch, side * side, config["in_channels"]), timestep=t,
                          encoder_hidden_states=torch.empty(batch, text_tokens, config["joint_attention_dim"]),
                          img_ids=torch.zeros(side * side, 3), txt_ids=torch.zeros(text_tokens, 3))
        else:
            side = resolution // 32  # 32x VAE, 1x1 patches
            kwargs = dict(hidden_states=torch.empty(batch, config["in_channels"], side, side), timestep=t,
                          encoder_hidden_states=torch.empty(batch, text_tokens, config["text_embed_dim"]),
                          encoder_attention_mask=torch.ones(batch, text_tokens, dtype=torch.bool))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**kwargs, return_dict=False)
    return int(counter.get_total_flops())


def step_flops(family: str, resolution: int, batch: int, method: str, text_tokens: int = 512) -> Dict[str, float]:
    if family in TRANSFORMERS:
        forward = transformer_forward_flops(family, resolution, batch, text_tokens)
    else:
        config = json.loads((CONFIGS / family / "unet" / "config.json").read_text(encoding="utf-8"))
        forward = unet_forward_flops(config, resolution, batch, TEXT_WIDTH[family], family == "sdxl")
    return {"family": family, "resolution": resolution, "batch": batch, "method": method,
            "forward_tflops": forward / 1e12, "step_tflops": STEP_FACTOR[method] * forward / 1e12}


def mfu(step_tflops: float, steps_per_s: float, peak_tflops: float) -> float:
    return step_tflops * steps_per_s / peak_tflops


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted([*TEXT_WIDTH, *TRANSFORMERS]), default="sd15")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--method", choices=sorted(STEP_FACTOR), default="lora")
    ap.add_argument("--steps-per-s", type=float, help="measured training speed (for MFU)")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense peak in the training precision (for MFU)")
    ap.add_argument("--text-tokens", type=int, default=512, help="qwen-image, hunyuan-image: caption tokens the transformer sees")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = step_flops(a.family, a.resolution, a.batch, a.method, a.text_tokens)
    if a.steps_per_s and a.peak_tflops:
        out["mfu"] = mfu(out["step_tflops"], a.steps_per_s, a.peak_tflops)
    if a.json:
        print(json.dumps(out))
    else:
        text = (f"{a.family} {a.method} at {a.resolution} px, batch {a.batch}: forward {out['forward_tflops']:.3f} "
                f"TFLOPs, training step {out['step_tflops']:.3f} TFLOPs")
        if "mfu" in out:
            text += f"; at {a.steps_per_s:g} steps/s on a {a.peak_tflops:g} TFLOPS device: MFU {100 * out['mfu']:.1f} %"
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
