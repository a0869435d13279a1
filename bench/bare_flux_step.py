"""The reference for bench/step_counts.py's ``flux-depth-bf16`` case: the LoRA step of diffusers'
``examples/dreambooth/train_dreambooth_lora_flux.py`` (huggingface/diffusers 58eb52c0, the script the side-by-side
runs) on Flux.1 [dev], with nothing of Atelier in it.

The side-by-side's settings (``bench/gpu_side_by_side.sh``'s flux example): the transformer stored in bf16 (the
script's ``weight_dtype`` under ``--mixed_precision bf16``; its LoRA weights stay bf16, the script casts them to
fp32 only for fp16) under accelerate's bf16 autocast, diffusers' gradient checkpointing of every block
(non-reentrant), peft LoRA rank 16 (alpha 16, gaussian init), ``--guidance_scale 1``, ``--cache_latents`` (a
posterior sampled at every step), the weighting scheme "none", gradient clipping at 1.0, AdamW ``foreach`` (torch's
default on CUDA), a constant LR, ``loss.detach().item()`` at every step. Its real depth (19 double, 38 single
blocks) at ``step_counts``' narrow widths (its ``flux-depth`` case), so the counts are the real step's.

``targets``: the script's ``--lora_layers`` (module-name endings peft matches). :data:`ATELIER_TARGETS` is
Atelier's Flux ``attn`` preset written that way (the side-by-side passes it); :data:`EXAMPLE_TARGETS` is the
script's default, which also adapts the double blocks' feed-forwards.

Two things the script does at every step that Atelier does not: with one ``--instance_prompt`` and no captions it
encodes that prompt with CLIP-L and T5-XXL again at every step (its ``text_encoders`` list keeps both models on the
GPU after ``del text_encoder_one, text_encoder_two``), and it looks up each sample's sigma with
``(schedule_timesteps == t).nonzero().item()``. The text encoding is left out here (the step starts from the
prompt's features, as Atelier's does from its cache): what is compared is the transformer's step around it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.optimization import get_scheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from peft import LoraConfig

from trainer.families.flux.family import TARGETS
from trainer.families.flux.full_size import FULL_SIZE

# the script's default --lora_layers (train_dreambooth_lora_flux.py at 58eb52c0)
EXAMPLE_TARGETS = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                   "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                   "ff_context.net.2")
# Atelier's Flux LoRA preset "attn" (the default) as --lora_layers: every one of its layers sits in an ``attn``
ATELIER_TARGETS = tuple(f"attn.{name}" for name in TARGETS["attn"])


def build(narrow: Optional[Dict[str, object]] = None, side: int = 256, rank: int = 16,
          targets: Sequence[str] = ATELIER_TARGETS, text_tokens: int = 512, seed: int = 0,
          device: torch.device = torch.device("cpu")) -> Tuple[Callable[[], float], Callable[[], List[torch.Tensor]]]:
    """``step()``: one optimizer step of the script's loop on a cached posterior and prompt features, ``resident()``:
    the tensors that live on the training device between steps (weights, optimizer state, the cached inputs).
    ``narrow``: values laid over Flux.1 [dev]'s transformer config (widths)."""
    torch.manual_seed(seed)
    config = {**FULL_SIZE["flux-dev"]["configs"]["transformer"], **(narrow or {})}
    transformer = FluxTransformer2DModel.from_config(config)
    noise_scheduler_copy = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler config
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096)
    transformer.requires_grad_(False)
    transformer.to(device, dtype=torch.bfloat16)
    transformer.enable_gradient_checkpointing()
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, init_lora_weights="gaussian",
                                       target_modules=list(targets)))
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8, foreach=True)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=0, num_training_steps=1000)
    latent = side // 8
    channels = config["in_channels"] // 4
    posterior = DiagonalGaussianDistribution(torch.randn(1, 2 * channels, latent, latent, device=device))
    shift, scaling = 0.1159, 0.3611  # FLUX.1-dev's VAE
    prompt_embeds = torch.randn(1, text_tokens, config["joint_attention_dim"], device=device, dtype=torch.bfloat16)
    pooled_prompt_embeds = torch.randn(1, config["pooled_projection_dim"], device=device, dtype=torch.bfloat16)
    text_ids = torch.zeros(text_tokens, 3, device=device, dtype=torch.bfloat16)
    transformer.train()
    weight_dtype = torch.bfloat16

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):  # the script's own, verbatim
        sigmas = noise_scheduler_copy.sigmas.to(device=device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(device)
        timesteps = timesteps.to(device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def step() -> float:
        model_input = posterior.sample()
        model_input = (model_input - shift) * scaling
        model_input = model_input.to(dtype=weight_dtype)
        latent_image_ids = FluxPipeline._prepare_latent_image_ids(
            model_input.shape[0], model_input.shape[2] // 2, model_input.shape[3] // 2, device, weight_dtype)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=bsz)
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)
        sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed = FluxPipeline._pack_latents(noisy_model_input, batch_size=model_input.shape[0],
                                            num_channels_latents=model_input.shape[1],
                                            height=model_input.shape[2], width=model_input.shape[3])
        guidance = torch.tensor([1.0], device=device).expand(model_input.shape[0])
        with torch.autocast(device.type, dtype=torch.bfloat16):  # accelerate's autocast around the forward
            model_pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                                     pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds,
                                     txt_ids=text_ids, img_ids=latent_image_ids, return_dict=False)[0]
        model_pred = FluxPipeline._unpack_latents(model_pred, height=model_input.shape[2] * 8,
                                                  width=model_input.shape[3] * 8, vae_scale_factor=8)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
                          1)
        loss = loss.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return loss.detach().item()  # the script's logs at every step

    def resident() -> List[torch.Tensor]:
        state = [t for st in optimizer.state.values() for k, t in st.items()
                 if isinstance(t, torch.Tensor) and k != "step"]
        return [*transformer.parameters(), *transformer.buffers(), *state, posterior.parameters, posterior.mean,
                posterior.std, posterior.logvar, posterior.var, prompt_embeds, pooled_prompt_embeds, text_ids]

    return step, resident


__all__ = ["ATELIER_TARGETS", "EXAMPLE_TARGETS", "build"]
