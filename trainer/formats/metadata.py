"""Header keys of saved files that model sites and loaders read: ``modelspec.*`` (Stability's model spec) and
kohya's ``ss_network_*``.

What is family-specific (``modelspec.architecture``, ``ss_base_model_version``, ``ss_v2`` …) the family's
``lora_metadata`` adds on top of :func:`modelspec_common`; what the tensors tell (rank, alpha, conv rank) the
writers add from :func:`network_shape_metadata`.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch


def modelspec_common(*, title: str, resolution: tuple[int, int] | int | None = None) -> dict[str, str]:
    """The family-independent ``modelspec.*`` header keys (title, date, resolution)."""
    meta = {"modelspec.sai_model_spec": "1.0.0", "modelspec.title": title,
            "modelspec.date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()}
    if resolution is not None:
        w, h = (resolution, resolution) if isinstance(resolution, int) else resolution
        meta["modelspec.resolution"] = f"{w}x{h}"
    return meta


def network_shape_metadata(state_dict: Mapping[str, "torch.Tensor"]) -> dict[str, str]:
    """Most common (rank, alpha) of linear/1×1 layers and of k×k convs, as kohya's headers state them."""
    linear: Counter = Counter()
    conv: Counter = Counter()
    for key, down in state_dict.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        rank = int(down.shape[0])
        alpha_t = state_dict.get(f"{name}.alpha")
        alpha = float(alpha_t.item()) if alpha_t is not None else float(rank)
        is_kxk_conv = down.ndim == 4 and tuple(down.shape[2:]) != (1, 1)
        (conv if is_kxk_conv else linear)[(rank, alpha)] += 1
    meta: dict[str, str] = {}
    if linear:
        rank, alpha = linear.most_common(1)[0][0]
        meta.update(ss_network_dim=str(rank), ss_network_alpha=str(alpha))
    if conv:
        rank, alpha = conv.most_common(1)[0][0]
        meta["ss_network_args"] = json.dumps({"conv_dim": str(rank), "conv_alpha": str(alpha)})
        if not linear:
            meta.update(ss_network_dim=str(rank), ss_network_alpha=str(alpha))
    return meta
