"""The reference for bench/step_counts.py's ``sd15`` case: a bare diffusers + peft LoRA step of SD 1.5, the step of
diffusers' ``examples/text_to_image/train_text_to_image_lora.py`` (v0.42.1) with nothing of Atelier in it.

Same settings as the ``sd15`` case: the real SD 1.5 UNet (the shipped full-size config, random weights) stored in
bf16 under bf16 autocast, peft LoRA rank 16 on ``to_q/to_k/to_v/to_out.0`` (the example's targets, Atelier's
``attn`` preset) with its adapters cast back to fp32 (``cast_training_params``), batch 4 of 8×8 latents (64 px),
no gradient checkpointing, eager. The example encodes every batch with the VAE and the text encoder; Atelier
caches both, so the reference starts from cached latents and text features as well: what is compared is the
step both make (noise, timesteps, ``add_noise``, the UNet, the MSE loss, backward, gradient clipping, AdamW, the
LR scheduler, ``zero_grad``), plus the example's per-step ``loss.item()``. AdamW runs ``foreach``, torch's
default on CUDA (on the CPU torch would loop over the tensors one by one, which no GPU run does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import cast_training_params
from peft import LoraConfig

from trainer.families.common import full_size


def build(cache_root: Path, batch: int = 4, side: int = 64, rank: int = 16,
          seed: int = 0) -> Tuple[Callable[[], float], Callable[[], List[torch.Tensor]]]:
    """``step()``: one optimizer step of the example's loop on cached inputs (the UNet with its adapters built
    here), and ``resident()``: the tensors that live on the training device between steps (weights, buffers,
    optimizer state, the cached inputs, the noise schedule diffusers moves there at its first use)."""
    torch.manual_seed(seed)
    folder = full_size.config_folder("sd15", cache_root)
    unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(folder / "unet")))
    noise_scheduler = DDPMScheduler.from_pretrained(str(folder), subfolder="scheduler")
    unet.requires_grad_(False)
    unet.to(torch.bfloat16)  # the example's weight_dtype under --mixed_precision bf16
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    cast_training_params(unet, dtype=torch.float32)
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8, foreach=True)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=0, num_training_steps=1000)
    latent = side // 8
    inputs = {"latents": torch.randn(batch, 4, latent, latent),
              "encoder_hidden_states": torch.randn(batch, 77, unet.config.cross_attention_dim)}
    unet.train()

    def step() -> float:
        latents, ehs = inputs["latents"], inputs["encoder_hidden_states"]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # accelerate's autocast under mixed_precision bf16
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=latents.device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            model_pred = unet(noisy_latents, timesteps, ehs, return_dict=False)[0]
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return loss.detach().item()  # the example's train_loss += avg_loss.item() at every step

    def resident() -> List[torch.Tensor]:
        state = [t for st in optimizer.state.values() for k, t in st.items()  # "step" stays on the host (not
                 if isinstance(t, torch.Tensor) and k != "step"]  # capturable), as on CUDA
        return [*unet.parameters(), *unet.buffers(), *state, *inputs.values(), noise_scheduler.alphas_cumprod]

    return step, resident


__all__ = ["build"]
