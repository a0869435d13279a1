"""``resize``: a kohya LoRA/LoCon at a lower rank, by SVD of each layer's delta.

Each layer's delta D = (alpha/r) · up @ down has rank ≤ r. Its SVD comes cheaply from QR factors of
up and downᵀ (an r × r SVD, exact, in float64), and its best rank-R approximation (Eckart–Young) is
written as up' = U_R · √S_R, down' = √S_R · V_Rᵀ with alpha = R, so loaders' alpha/rank is 1 and
up' @ down' is that approximation. Layers whose rank is already ≤ R are copied unchanged. The header is
kept, with ``ss_network_dim``/``ss_network_alpha`` (and conv args) recomputed and stale hashes dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from trainer.io import save_safetensors_atomic
from trainer.tools import ToolError, check_out
from trainer.tools.common import network_metadata, read_lora


def svd_of_product(up: Any, down: Any) -> Tuple[Any, Any, Any]:
    """U, S, Vh of up @ down (up [out, r], down [r, in]) without forming the product's full SVD."""
    qu, ru = torch.linalg.qr(up)
    qd, rd = torch.linalg.qr(down.T)
    um, s, vmh = torch.linalg.svd(ru @ rd.T, full_matrices=False)
    return qu @ um, s, vmh @ qd.T


def resize_layer(layer: Dict[str, Any], alpha: float, rank: int) -> Tuple[Dict[str, Any], Any]:
    """(new down/up/alpha tensors, the singular values dropped) for one layer at ``rank``."""
    down, up = layer["down"], layer["up"]
    r = int(down.shape[0])
    dtype = up.dtype
    u, s, vh = svd_of_product(up.flatten(1).double() * (alpha / r), down.flatten(1).double())
    keep = min(rank, s.numel())
    root = s[:keep].sqrt()
    new_up = (u[:, :keep] * root).reshape(up.shape[0], keep, *up.shape[2:])
    new_down = (root[:, None] * vh[:keep]).reshape(keep, *down.shape[1:])
    out = {"down": new_down.to(dtype).contiguous(), "up": new_up.to(dtype).contiguous(),
           "alpha": torch.tensor(float(keep), dtype=torch.float32)}
    return out, s[keep:]


def run(args: Any) -> int:
    lora = read_lora(args.lora, "LORA")
    kinds = {lora.kind(n) for n in lora.layers} - {"lora"}
    if kinds:
        raise ToolError(f"LORA '{args.lora}' is a LyCORIS {'/'.join(sorted(kinds)).replace('loha', 'LoHa').replace('lokr', 'LoKr')} "
                        "file: resize lowers the rank of up·down products (LoRA/LoCon). Merge it into the model "
                        "(python -m trainer merge) or train it at the rank you want.")
    rank, top = int(args.rank), lora.max_rank
    if rank <= 0:
        raise ToolError(f"--rank {rank}: the new rank must be at least 1.")
    if rank > top:
        raise ToolError(f"--rank {rank} is larger than the LoRA's rank ({top}); resize only lowers the rank. "
                        f"Give --rank between 1 and {top}.")
    out = Path(args.out).expanduser() if args.out else lora.path.with_name(f"{lora.path.stem}-r{rank}.safetensors")
    if out.suffix.lower() != ".safetensors":
        raise ToolError(f"--out {out}: LoRA files are .safetensors; give a name ending in .safetensors.")
    check_out(out, args.overwrite, folder=False, inputs=[lora.path])
    state: Dict[str, Any] = {}
    lost, total, changed = 0.0, 0.0, 0
    for name in lora.layers:
        layer, alpha = lora.layers[name], lora.alpha(name)
        if lora.rank(name) <= rank:
            new = {"down": layer["down"], "up": layer["up"],
                   "alpha": layer.get("alpha", torch.tensor(float(lora.rank(name))))}
            total += float(lora.delta(name).double().pow(2).sum())
        else:
            new, dropped = resize_layer(layer, alpha, rank)
            changed += 1
            lost += float(dropped.pow(2).sum())
            total += float(lora.delta(name).double().pow(2).sum())
        if name.startswith("peft:"):  # diffusers/peft layout: α/r stays baked into lora_B (the new alpha is the rank)
            state[f"{name[5:]}.lora_A.weight"] = new["down"]
            state[f"{name[5:]}.lora_B.weight"] = new["up"]
            continue
        state[f"{name}.lora_down.weight"] = new["down"]
        state[f"{name}.lora_up.weight"] = new["up"]
        state[f"{name}.alpha"] = new["alpha"].to(torch.float32).reshape(())
    state.update(lora.extra)  # bundled embeddings travel along
    meta = network_metadata(state, lora.metadata)
    meta["atelier_resized_from"] = f"{lora.path.name} (rank {top})"
    save_safetensors_atomic(state, out, meta)
    kept = 100.0 * (1.0 - lost / total) if total > 0 else 100.0
    print(f"resized {changed} of {len(lora.layers)} layers from rank {top} to {rank}; "
          f"{kept:.2f}% of the weight change's energy kept")
    print(f"wrote {out}")
    return 0
