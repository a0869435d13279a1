"""The rules of weight storage and precision settings: fp8/NF4 storage, block swapping, stochastic rounding
(``trainer.config.checks`` calls them before any model loads; torch-free)."""

from __future__ import annotations

from typing import Any, List

from trainer.errors import ConfigError, Issue


def _check_scale_block(cfg: Any, part: str) -> None:
    """``parts.<part>.fp8_scale_block``: a power of two from 16 to 4096, with fp8_scaled, not with fp8_matmul."""
    block = int(cfg.parts[part].get("fp8_scale_block", 0) or 0)
    if not block:
        return
    key = f"parts.{part}.fp8_scale_block"
    if block < 16 or block & (block - 1):
        raise ConfigError(f"{key} = {block}: the scales' blocks are a power of two from 16 to 4096 inputs (musubi-"
                          "tuner's default is 64), or 0 for one scale per output row.", key=key, value=block)
    if not cfg.parts[part].get("fp8_scaled", False):
        raise ConfigError(f"{key} = {block} sizes the scales of parts.{part}.fp8_scaled, which is off. Turn "
                          f"parts.{part}.fp8_scaled on, or set fp8_scale_block to 0.", key=key, value=block)
    if cfg.parts[part].get("fp8_matmul", False):
        raise ConfigError(f"{key} = {block} with parts.{part}.fp8_matmul: the fp8 products take one scale per output "
                          "row. Set fp8_scale_block to 0, or turn fp8_matmul off.", key=key, value=block)


def check_storage(cfg: Any) -> None:
    """Hard rules of fp8/NF4 weight storage and block swapping (``validate``)."""
    if cfg.parts.denoiser.nf4:
        if cfg.training.method != "lora" and cfg.parts.denoiser.train:
            raise ConfigError("parts.denoiser.nf4 stores the frozen denoiser in 4 bits, but a fine-tune trains its own "
                              "weights (4-bit weights cannot take its updates). Use training.method = lora, or turn "
                              "parts.denoiser.nf4 off.", key="parts.denoiser.nf4", value=True)
        if cfg.parts.denoiser.fp8:
            raise ConfigError("parts.denoiser.nf4 and parts.denoiser.fp8 are both on: the frozen weights are stored "
                              "one way. Turn one of them off.", key="parts.denoiser.nf4", value=True)
        if cfg.training.method == "lora" and cfg.lora.type != "lora":
            raise ConfigError(f"parts.denoiser.nf4 with lora.type = {cfg.lora.type}: DoRA, LoHa and LoKr read the base "
                              "weights, which are 4-bit packed here. Use lora.type = lora, or turn parts.denoiser.nf4 "
                              "off.", key="parts.denoiser.nf4", value=True)
    for part in ("text_encoder_1", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        for kind in ("fp8", "nf4"):
            if cfg.parts[part].get(kind, False) and cfg.parts[part].train:
                raise ConfigError(f"parts.{part}.{kind} stores this text encoder's frozen weights in {kind}, but "
                                  f"parts.{part}.train is on. Turn one of them off.", key=f"parts.{part}.{kind}", value=True)
        if cfg.parts[part].get("fp8_scaled", False) and not cfg.parts[part].get("fp8", False):
            raise ConfigError(f"parts.{part}.fp8_scaled scales the fp8 weights of parts.{part}.fp8, which is off. "
                              f"Turn parts.{part}.fp8 on, or fp8_scaled off.", key=f"parts.{part}.fp8_scaled",
                              value=True)
        if cfg.parts[part].get("fp8", False) and cfg.parts[part].get("nf4", False):
            raise ConfigError(f"parts.{part}.nf4 and parts.{part}.fp8 are both on: the frozen weights are stored one way. "
                              "Turn one of them off.", key=f"parts.{part}.nf4", value=True)
    if cfg.parts.denoiser.get("fp8_matmul", False) and not cfg.parts.denoiser.fp8:
        raise ConfigError("parts.denoiser.fp8_matmul multiplies with the fp8 weights of parts.denoiser.fp8, which is "
                          "off. Turn parts.denoiser.fp8 on, or fp8_matmul off.", key="parts.denoiser.fp8_matmul",
                          value=True)
    if cfg.parts.denoiser.get("fp8_scaled", False) and not cfg.parts.denoiser.fp8:
        raise ConfigError("parts.denoiser.fp8_scaled scales the fp8 weights of parts.denoiser.fp8, which is off. Turn "
                          "parts.denoiser.fp8 on, or fp8_scaled off.", key="parts.denoiser.fp8_scaled", value=True)
    for part in ("denoiser", "text_encoder_1", "text_encoder_2", "text_encoder_3", "text_encoder_4"):
        _check_scale_block(cfg, part)
    swap = int(cfg.parts.denoiser.get("blocks_to_swap", 0) or 0)
    if swap and not cfg.training.gradient_checkpointing:
        raise ConfigError(f"parts.denoiser.blocks_to_swap = {swap} needs training.gradient_checkpointing: a swapped "
                          "block leaves the GPU right after its forward, and backward recomputes that forward to bring "
                          "it back. Turn gradient checkpointing on, or set blocks_to_swap to 0.",
                          key="parts.denoiser.blocks_to_swap", value=swap)
    interval = int(cfg.training.get("gradient_checkpointing_interval", 1) or 1)
    if swap and interval > 1:
        raise ConfigError(f"parts.denoiser.blocks_to_swap = {swap} needs every block checkpointed, and "
                          f"training.gradient_checkpointing_interval = {interval} leaves some blocks' activations, "
                          "which hold their weights, for backward. Set the interval to 1, or blocks_to_swap to 0.",
                          key="training.gradient_checkpointing_interval", value=interval)
    if swap and cfg.training.method != "lora" and cfg.parts.denoiser.train:
        raise ConfigError(f"parts.denoiser.blocks_to_swap = {swap} swaps the denoiser's frozen weights, but a fine-tune "
                          "trains all of them. Use training.method = lora, or set blocks_to_swap to 0.",
                          key="parts.denoiser.blocks_to_swap", value=swap)
    if cfg.parts.denoiser.fp8 and cfg.training.method != "lora" and cfg.parts.denoiser.train:
        raise ConfigError("parts.denoiser.fp8 stores the frozen denoiser in fp8, but a fine-tune trains its own "
                          "weights. Use training.method = lora, or turn parts.denoiser.fp8 off.",
                          key="parts.denoiser.fp8", value=True)


def precision_warnings(cfg: Any) -> List[Issue]:
    """Rules on weight precision: fp16 weights trained directly, stochastic rounding where it does nothing or
    is missing; and checkpointing's interval and kept attention without checkpointing."""
    out: List[Issue] = []
    t = cfg.training
    if t.mixed_precision == "fp16" and t.method == "finetune" and cfg.parts.denoiser.dtype == "fp16":
        out.append(Issue("parts.denoiser.dtype", "Training fp16 weights directly loses updates; keep the "
                                                 "trained denoiser in fp32 (or bf16) with fp16 autocast."))
    if cfg.precision.stochastic_rounding and t.method == "lora":
        out.append(Issue("precision.stochastic_rounding", "LoRA adapters train in fp32: stochastic rounding "
                                                          "only matters for bf16 fine-tunes."))
    if t.method == "finetune" and cfg.parts.denoiser.dtype == "bf16" and cfg.parts.denoiser.train \
            and not cfg.precision.stochastic_rounding:
        out.append(Issue("precision.stochastic_rounding", "Training bf16 weights rounds small updates away; "
                                                          "turn on precision.stochastic_rounding."))
    if int(t.get("gradient_checkpointing_interval", 1) or 1) > 1 and not t.gradient_checkpointing:
        out.append(Issue("training.gradient_checkpointing_interval", "The interval only chooses which blocks "
                                                                     "training.gradient_checkpointing checkpoints, "
                                                                     "and it is off."))
    if t.get("checkpoint_keep_attention", False) and not t.gradient_checkpointing:
        out.append(Issue("training.checkpoint_keep_attention", "Keeping attention outputs only changes checkpointed "
                                                               "blocks: without training.gradient_checkpointing "
                                                               "every activation is kept anyway."))
    return out
