"""Config rules of the training methods (LoRA variants, embeddings): hard checks and warnings.

Torch-free: ``trainer.config.checks`` calls these before any model loads (CLI ``validate``, the web UI).
"""

from __future__ import annotations

import re
from typing import Any, List, Pattern, Tuple

from trainer.errors import ConfigError, Issue
from trainer.families import info_for
from trainer.families.checks import family_without_loading


def placeholder_pattern(placeholder: str) -> Pattern[str]:
    """Where a placeholder stands as a word in a caption or prompt (case-insensitive, as CLIP).

    A placeholder that begins or ends with a word character must not touch other word characters
    (``ohwx`` is not found in ``ohwxy``); one ending in ``>`` or the like may touch anything but the
    ``_<n>`` of an already expanded token, so expanding twice changes nothing.
    """
    word = r"[^\W]"
    before = rf"(?<!{word})" if re.match(r"\w", placeholder[:1]) else ""
    after = rf"(?!{word})" if re.match(r"\w", placeholder[-1:]) else r"(?!_\d)"
    return re.compile(before + re.escape(placeholder) + after, re.IGNORECASE)


def uses_embedding(cfg: Any) -> bool:
    return cfg.training.method == "embedding" or bool(cfg.embedding.train_alongside)


def custom_target_regex(entries: List[str]) -> str:
    """``lora.custom_targets`` → one regular expression over full module paths (peft's ``target_modules``
    as a string is full-matched): a plain entry matches a path that is it or ends in ``.<entry>``; an
    entry ``re:<regex>`` is the regex itself."""
    parts = []
    for entry in entries:
        entry = str(entry).strip()
        if entry.startswith("re:"):
            parts.append(f"(?:{entry[3:]})")
        elif entry:
            parts.append(rf"(?:(?:.*\.)?{re.escape(entry)})")
    return "|".join(parts)


def parse_blocks(spec: str) -> List[Tuple[str, int, int]]:
    """``parts.denoiser.lora_blocks`` → (block list or "" for every list, first, last) ranges; ValueError with what
    is wrong."""
    out = []
    for item in str(spec or "").replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, numbers = item.rpartition(":")
        first, _, last = numbers.partition("-")
        if not first.strip().isdigit() or (last and not last.strip().isdigit()):
            raise ValueError(f"'{item}' is not a block number, a range like 0-7, or list:range")
        a, b = int(first), int(last) if last else int(first)
        if b < a:
            raise ValueError(f"'{item}': the range ends before it starts")
        out.append((name.strip(), a, b))
    return out


def block_of(path: str) -> Tuple[str, int]:
    """(block list, index) of a module path (the first ``<…blocks|layers>.<N>``), or ("", -1) outside any."""
    parts = path.split(".")
    for i in range(len(parts) - 1):
        if (parts[i].endswith("blocks") or parts[i] == "layers") and parts[i + 1].isdigit():
            return parts[i], int(parts[i + 1])
    return "", -1


def validate_method(cfg: Any) -> None:
    """Hard errors (ConfigError) of the lora/embedding sections."""

    lora, emb, t = cfg.lora, cfg.embedding, cfg.training
    for i, concept in enumerate(cfg.data.concepts or []):
        role = str(concept.get("role", "train") or "train")
        if not concept.enabled or role in ("train", "validation"):
            continue
        key = f"data.concepts.{i}.role"
        if role == "regularisation" and t.method == "embedding":
            raise ConfigError(f"{key} = regularisation: an embedding learns a new word and changes nothing else, so "
                              "class images have nothing to preserve. Remove the concept, or train a LoRA or "
                              "fine-tune.", key=key, value=role)
        if role == "prior_prediction" and t.method != "lora":
            raise ConfigError(f"{key} = prior_prediction: its target is the base model's prediction with the "
                              f"adapter off, which needs training.method = lora (this run: {t.method}). Use role "
                              "regularisation with class images instead, or train a LoRA.", key=key, value=role)
    try:
        parse_blocks(cfg.parts.denoiser.get("lora_blocks", ""))
    except ValueError as exc:
        raise ConfigError(f"parts.denoiser.lora_blocks: {exc}. Write block numbers and ranges (0-7,12), optionally "
                          "for one block list (single_transformer_blocks:10-37).", key="parts.denoiser.lora_blocks",
                          value=cfg.parts.denoiser.lora_blocks) from None
    if t.method == "lora" and cfg.parts.denoiser.lora_targets == "custom" and cfg.parts.denoiser.train:
        entries = [str(e).strip() for e in lora.custom_targets if str(e).strip()]
        if not entries:
            raise ConfigError("parts.denoiser.lora_targets = custom, but lora.custom_targets is empty: list module names "
                              "(to_q, attn2.to_k, conv1, …) or re:<regex> entries.", key="lora.custom_targets")
        for e in entries:
            if e.startswith("re:"):
                try:
                    re.compile(e[3:])
                except re.error as exc:
                    raise ConfigError(f"lora.custom_targets entry {e!r} is not a valid regular expression: {exc}.",
                                      key="lora.custom_targets", value=e) from None
    if t.method == "lora":
        check_adapter_options(lora)
    if uses_embedding(cfg):
        p = emb.placeholder
        if not p or not p.strip():
            raise ConfigError("embedding.placeholder is empty: give the word the embedding learns, as written in "
                              "your captions and prompts (e.g. <sks>).", key="embedding.placeholder", value=p)
        if any(c.isspace() for c in p):
            raise ConfigError(f"embedding.placeholder = {p!r} contains spaces: use one word such as <my-style>.",
                              key="embedding.placeholder", value=p)
        if emb.bundle and "." in p:
            raise ConfigError(f"embedding.placeholder = {p!r}: a bundled embedding's name cannot contain a dot "
                              "(A1111 splits bundle_emb keys at dots). Remove the dot or turn off embedding.bundle.",
                              key="embedding.placeholder", value=p)


def check_adapter_options(lora: Any) -> None:
    """The settings of one adapter kind given with another (LoRA+ for LoRA/DoRA, full-matrix LoKr for LoKr)."""
    for key in ("loraplus_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        if lora.get(key, None) and lora.type not in ("lora", "dora"):
            raise ConfigError(f"lora.{key} = {lora[key]:g}: LoRA+ raises the learning rate of a LoRA's B "
                              f"(lora_up) matrix, which lora.type = {lora.type} has not. Use lora.type = lora or "
                              f"dora, or leave lora.{key} blank.", key=f"lora.{key}", value=lora[key])
    if lora.type == "oft":
        for key in ("dropout", "rank_dropout", "module_dropout", "conv_rank", "conv_alpha"):
            if lora[key]:
                raise ConfigError(f"lora.{key} = {lora[key]:g} with lora.type = oft: OFT here rotates every targeted "
                                  f"layer in blocks of lora.rank, with no dropout or conv rank of its own. Leave "
                                  f"lora.{key} blank/0.", key=f"lora.{key}", value=lora[key])
    if lora.get("lokr_full_matrix", False):
        if lora.type != "lokr":
            raise ConfigError(f"lora.lokr_full_matrix is on, but lora.type = {lora.type}: it shapes LoKr's factors. "
                              "Use lora.type = lokr, or turn it off.", key="lora.lokr_full_matrix", value=True)
        if lora.decompose_both:
            raise ConfigError("lora.lokr_full_matrix and lora.decompose_both are both on: full-matrix LoKr keeps "
                              "both Kronecker factors full. Turn one of them off.", key="lora.lokr_full_matrix",
                              value=True)


def method_warnings(cfg: Any) -> list:
    """Community rules for adapters and embeddings, as ``trainer.errors.Issue`` warnings."""

    out = []
    lora, emb, t = cfg.lora, cfg.embedding, cfg.training
    roles = {str(c.get("role", "train") or "train") for c in cfg.data.concepts or [] if c.enabled}
    if roles & {"regularisation", "prior_prediction"} and "train" not in roles:
        out.append(Issue("data.concepts", "Every enabled concept keeps the model as it is (regularisation or "
                                          "prior_prediction) and none has role train: the run learns nothing new. "
                                          "Add the subject's images as a train concept."))
    if t.method == "lora":
        if lora.alpha > lora.rank and lora.type != "oft":  # OFT has no alpha scale
            out.append(Issue("lora.alpha", f"LoRA alpha ({lora.alpha:g}) is above rank ({lora.rank}): the update "
                                           "is scaled up, which often overcooks. Use alpha ≤ rank."))
        conv_rank = lora.conv_rank if lora.conv_rank is not None else lora.rank
        conv_alpha = lora.conv_alpha if lora.conv_alpha is not None else lora.alpha
        if (lora.conv_rank is not None or lora.conv_alpha is not None) and conv_alpha > conv_rank:
            out.append(Issue("lora.conv_alpha", f"Conv alpha ({conv_alpha:g}) is above conv rank ({conv_rank}): "
                                                "the update is scaled up. Use conv_alpha ≤ conv_rank."))
        if lora.type in ("loha", "lokr") and lora.dropout > 0:
            out.append(Issue("lora.dropout", f"lora.dropout is not applied to {lora.type} (LyCORIS has no input "
                                             "dropout for it); use lora.rank_dropout or lora.module_dropout."))
        if lora.type in ("lora", "dora") and (lora.rank_dropout > 0 or lora.module_dropout > 0):
            out.append(Issue("lora.rank_dropout", f"lora.rank_dropout/module_dropout apply to LoHa/LoKr only; "
                                                  f"{lora.type} uses lora.dropout."))
        if (lora.conv_rank is not None or lora.conv_alpha is not None) and not _targets_convs(cfg):
            out.append(Issue("lora.conv_rank", "lora.conv_rank/conv_alpha are set but no conv layer is targeted: "
                                               "use parts.denoiser.lora_targets = all (LoCon) or custom targets with convs."))
    if uses_embedding(cfg):
        if t.method == "embedding" and emb.train_alongside:
            out.append(Issue("embedding.train_alongside", "embedding.train_alongside has no effect when "
                                                          "training.method = embedding (the embedding is the result)."))
        if emb.bundle and t.method != "lora":
            out.append(Issue("embedding.bundle", "embedding.bundle stores the embedding inside a LoRA file; with "
                                                 f"training.method = {t.method} it is saved on its own only."))
        prompts = [s.prompt + " " + (s.negative_prompt or "") for s in cfg.sampling.prompts]
        if emb.placeholder and prompts:
            pattern = placeholder_pattern(emb.placeholder)
            if not any(pattern.search(p) for p in prompts):
                out.append(Issue("embedding.placeholder",
                                 f"No sample prompt contains the placeholder {emb.placeholder!r}: samples will not "
                                 "show the embedding. Write it into sampling.prompts (it must also be in the "
                                 "captions, or the embedding learns nothing)."))
    elif emb.bundle:
        out.append(Issue("embedding.bundle", "embedding.bundle is on but no embedding is trained "
                                             "(training.method embedding or embedding.train_alongside)."))
    return out


def check_output_format(cfg: Any) -> None:
    """output.format must be one the method can write (checked at save time, after training, before)."""
    method, fmt = cfg.training.method, cfg.output.format
    allowed = {"lora": ("auto", "safetensors"), "embedding": ("auto", "safetensors", "ckpt")}.get(method)
    if allowed and fmt not in allowed:
        what = {"lora": "a LoRA is saved as a kohya .safetensors file: use auto or safetensors",
                "embedding": "an embedding is saved as .safetensors (or an A1111 .pt with ckpt)"}[method]
        raise ConfigError(f"output.format = {fmt} does not fit training.method = {method}: {what}.",
                          key="output.format", value=fmt)
    if method == "embedding" and fmt == "ckpt":
        variant = family_without_loading(cfg.model)
        info = info_for(variant) if variant else None
        if info is not None and len(info.text_slots) > 1:  # one vector set per text encoder (SDXL: clip_l + clip_g)
            encoders = " + ".join(info.part(slot).label for slot in info.text_slots)
            raise ConfigError(f"output.format = ckpt: {info.label} embeddings ({encoders}) have no A1111 .pt form; use "
                              "safetensors.", key="output.format", value=fmt)


def _targets_convs(cfg: Any) -> bool:
    choice = cfg.parts.denoiser.lora_targets
    if choice == "all":
        return True
    if choice == "custom":
        return any("conv" in str(e) or str(e).startswith("re:") for e in cfg.lora.custom_targets)
    return False
