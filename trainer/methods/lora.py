"""LoRA (and LoCon, with conv layers) on peft, saved in the kohya/A1111 key layout."""

from __future__ import annotations

from typing import Any, Dict, List

UNET_TARGETS: Dict[str, List[str]] = {
    "attn": ["to_q", "to_k", "to_v", "to_out.0"],
    "attn_mlp": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"],
    # LoCon: kohya's conv targets (ResNet convs, shortcuts, down/up-sampler convs) on top.
    "all": ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2",
            "conv1", "conv2", "conv_shortcut", "conv", "time_emb_proj"],
}
# out_proj/fc1/fc2 as kohya does: q/k/v alone is not loadable by diffusers (LIBRARY-NOTES).
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _lora_config(lcfg, targets: List[str]):
    from peft import LoraConfig
    return LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                      target_modules=targets, init_lora_weights=True)


class LoraMethod:
    """Adds adapters to the chosen components; only adapter weights train."""

    name = "lora"

    def __init__(self, model, cfg):
        self.model = model
        self.cfg = cfg
        t = cfg.training
        self.modules: Dict[str, Any] = {}
        if t.train_unet:
            model.unet.add_adapter(_lora_config(cfg.lora, UNET_TARGETS[cfg.lora.unet_targets]))
            self.modules["unet"] = model.unet
        if t.train_text_encoder:
            model.text_encoder.add_adapter(_lora_config(cfg.lora, TEXT_ENCODER_TARGETS))
            self.modules["text_encoder"] = model.text_encoder
        for m in self.modules.values():
            for p in m.parameters():
                if p.requires_grad:
                    p.data = p.data.float()  # adapters train in fp32 whatever the base dtype
        if cfg.lora.init_weights:
            from trainer.export import load_lora_kohya_into_peft
            load_lora_kohya_into_peft(cfg.lora.init_weights, model.unet if t.train_unet else None,
                                      model.text_encoder if t.train_text_encoder else None)

    def result_suffix(self, fmt: str) -> str:
        if fmt in ("auto", "safetensors"):
            return ".safetensors"
        raise ValueError(f"output.format = {fmt} is not available for LoRA; use safetensors.")

    def save(self, path, dtype: str, metadata: Dict[str, str]) -> None:
        from pathlib import Path
        from trainer.export import kohya_lora_state_dict, lora_metadata, save_lora_kohya
        sd = kohya_lora_state_dict(unet=self.modules.get("unet"), text_encoder=self.modules.get("text_encoder"),
                                   family=self.model.family)
        meta = lora_metadata(self.model.family, title=Path(path).stem,
                             prediction_type=self.model.prediction_type,
                             resolution=int(self.cfg.data.resolution), extra=metadata)
        save_lora_kohya(path, sd, meta, dtype)
