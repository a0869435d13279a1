"""What a VRAM estimate says, and how it is asked for and shown: the bytes of each phase by kind
(:class:`Breakdown`), the estimate with its allowance and verdict (:class:`Estimate`), the card a memory preset
is for, the text and JSON reports, and the options of ``python -m trainer estimate-vram``.

Torch-free, unlike the estimator itself (:mod:`trainer.memory.estimate`): ``python -m trainer --help`` lists the
command's options from here, and the web UI reads the JSON that :meth:`Estimate.to_dict` writes.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

GiB = 2 ** 30
CONTEXT_GIB = 0.75  # CUDA context + cuBLAS/cuDNN handles: outside torch's allocator, not tracked
FRAGMENTATION = 0.15  # allocator slack (reserved - allocated) and kernel workspaces, x non-weight bytes
MEMORY_PRESET = re.compile(r"-(\d+)gb(?:[-.]|$)")
PHASES = ("load", "encode", "train", "sample")


@dataclass
class Breakdown:
    """Bytes live at one moment, by what they are."""
    weights: int = 0       # frozen weights and buffers on the device
    trainable: int = 0     # trained weights (LoRA adapters in fp32, or the fine-tuned modules)
    grads: int = 0
    optimizer: int = 0
    activations: int = 0   # activations, their gradients and temporaries (incl. the batch)

    @property
    def total(self) -> int:
        return self.weights + self.trainable + self.grads + self.optimizer + self.activations


@dataclass
class Estimate:
    name: str
    card_gib: Optional[float]
    phases: Dict[str, Breakdown] = field(default_factory=dict)
    details: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    context_gib: float = CONTEXT_GIB
    fragmentation: float = FRAGMENTATION

    def phase_gib(self, phase: str) -> float:
        """A phase's tracked peak plus the allowance: ``fragmentation`` x its non-weight bytes (allocator
        fragmentation and kernel workspaces grow with activations, not with weights loaded once) plus
        the CUDA context."""
        b = self.phases[phase]
        dynamic = b.grads + b.optimizer + b.activations
        return (b.total + self.fragmentation * dynamic) / GiB + self.context_gib

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_gib)

    @property
    def tracked_peak(self) -> int:
        return self.phases[self.peak_phase].total

    @property
    def total_gib(self) -> float:
        """What the card must hold: the largest phase with its allowance."""
        return self.phase_gib(self.peak_phase)

    @property
    def margin_gib(self) -> Optional[float]:
        return None if self.card_gib is None else self.card_gib - self.total_gib

    @property
    def fits(self) -> Optional[bool]:
        return None if self.card_gib is None else self.margin_gib >= 0

    def to_dict(self) -> Dict[str, Any]:
        out = {"name": self.name, "card_gib": self.card_gib, "peak_phase": self.peak_phase,
               "tracked_peak_gib": round(self.tracked_peak / GiB, 3), "total_gib": round(self.total_gib, 3),
               "margin_gib": None if self.margin_gib is None else round(self.margin_gib, 3), "fits": self.fits,
               "context_gib": self.context_gib, "fragmentation": self.fragmentation,
               "phases": {k: {**{f: round(v / GiB, 3) for f, v in asdict(b).items()}, "total": round(b.total / GiB, 3)}
                          for k, b in self.phases.items()},
               "details": self.details, "notes": self.notes}
        return out


def card_gib_of(name: str) -> Optional[float]:
    """The card a memory preset is for, from its name: ``sdxl-lora-8gb`` → 8.0 (GiB: an "8 GB" card has
    8192 MiB)."""
    m = MEMORY_PRESET.search(name)
    return float(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------
# reports
# ----------------------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def format_table(estimates: Sequence[Estimate]) -> str:
    """A Markdown table: the peak phase's breakdown, every phase's tracked peak, total with allowance."""
    head = ("| preset | card | peak phase | weights | trainable | grads | optimizer | activations | tracked peak "
            "| load / encode / train / sample | + allowance = total | fits (margin) |")
    rows = [head, "|" + "---|" * 12]
    for e in estimates:
        b = e.phases[e.peak_phase]
        per = " / ".join(_gib(e.phases[p].total) if p in e.phases else "–" for p in PHASES)
        allowance = e.total_gib - e.tracked_peak / GiB
        fits = "–" if e.fits is None else f"{'yes' if e.fits else '**no**'} ({e.margin_gib:+.2f})"
        card = "–" if e.card_gib is None else f"{e.card_gib:g} GiB"
        rows.append(f"| {e.name} | {card} | {e.peak_phase} | {_gib(b.weights)} | {_gib(b.trainable)} | {_gib(b.grads)} "
                    f"| {_gib(b.optimizer)} | {_gib(b.activations)} | {_gib(e.tracked_peak)} | {per} "
                    f"| {allowance:.2f} = {e.total_gib:.2f} | {fits} |")
    return "\n".join(rows)


def format_report(e: Estimate) -> str:
    """One estimate in a few lines: the run's settings, each phase's breakdown, the peak with its allowance and
    the verdict, where the peak is reached, the notes."""
    lines = [f"{e.name}: {e.details.get('method')} {e.details.get('resolution')} batch {e.details.get('batch_size')}"
             f" x{e.details.get('gradient_accumulation_steps')}, {e.details.get('optimizer')}, "
             f"unet {e.details.get('unet_dtype')}{' fp8 storage' if e.details.get('fp8_unet') else ''}, "
             f"autocast {e.details.get('mixed_precision')}, checkpointing "
             f"{'on' if e.details.get('gradient_checkpointing') else 'off'}"]
    lines.append(f"  {'phase':<8} {'weights':>8} {'trainable':>9} {'grads':>7} {'optim':>7} {'activ':>7} "
                 f"{'total':>7}  GiB")
    for p, b in e.phases.items():
        lines.append(f"  {p:<8} {_gib(b.weights):>8} {_gib(b.trainable):>9} {_gib(b.grads):>7} {_gib(b.optimizer):>7} "
                     f"{_gib(b.activations):>7} {_gib(b.total):>7}")
    allowance = e.total_gib - e.tracked_peak / GiB
    verdict = "" if e.fits is None else (f" -> fits {e.card_gib:g} GiB, margin {e.margin_gib:+.2f} GiB" if e.fits
                                          else f" -> does NOT fit {e.card_gib:g} GiB ({e.margin_gib:+.2f} GiB)")
    lines.append(f"  peak {e.peak_phase}: {_gib(e.tracked_peak)} tracked + {allowance:.2f} allowance "
                 f"({e.context_gib:g} context + {e.fragmentation:.0%} of non-weights) = {e.total_gib:.2f} GiB{verdict}")
    where = e.details.get(f"{e.peak_phase}_peak_at")
    if where:
        lines.append(f"  the {e.peak_phase} peak is reached {where}")
    for n in e.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# the command's options
# ----------------------------------------------------------------------------------------------

def _phase_list(text: str) -> List[str]:
    phases = text.split(",")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    return phases


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``python -m trainer estimate-vram`` (and of ``bench/estimate_vram.py``, the same command)."""
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("config", nargs="?", help="a run's config YAML (as the UI or a run folder has it)")
    what.add_argument("--config", dest="config_file", metavar="CONFIG", help="the same, as an option")
    what.add_argument("--preset", action="append", help="preset name (repeatable)")
    what.add_argument("--all-memory-presets", action="store_true", help="every *-<N>gb preset")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a setting (repeatable)")
    ap.add_argument("--card-gib", type=float, help="card size to check against (default: from the preset name)")
    ap.add_argument("--context-gib", type=float, default=CONTEXT_GIB,
                    help=f"CUDA context allowance in GiB (default {CONTEXT_GIB})")
    ap.add_argument("--fragmentation", type=float, default=FRAGMENTATION,
                    help="allocator fragmentation + kernel workspaces, as a fraction of the peak's non-weight bytes "
                         f"(default {FRAGMENTATION})")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps measured (>= 2: state exists)")
    ap.add_argument("--resolution", help="override the training size for the estimate (e.g. 1024x1024)")
    ap.add_argument("--phases", type=_phase_list, default=list(PHASES), help="comma list of " + ", ".join(PHASES))
    ap.add_argument("--no-cuda-autocast", action="store_true", help="keep CPU autocast's op policy")
    ap.add_argument("--real", action="store_true", help="real tensors instead of fake (small models only!)")
    ap.add_argument("--workspace", help="where shipped configs are materialised (default: a temp folder)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per estimate")


__all__ = ["Breakdown", "CONTEXT_GIB", "Estimate", "FRAGMENTATION", "GiB", "MEMORY_PRESET", "PHASES", "add_arguments",
           "card_gib_of", "format_report", "format_table"]
