"""``mask``: a training mask next to every image of a folder, from a text prompt (CLIPSeg) or around the subject
(SAM: background removal).

Each mask is ``<image stem>-masklabel.png`` (:data:`trainer.data.concepts.MASK_SUFFIX`, what training reads
with ``data.masks`` on), 8-bit greyscale at the image's size (as training sees it: EXIF-rotated), white where
the prompt's thing is (trained), black elsewhere (ignored). Several ``--prompt``s are joined: a pixel is white
when any prompt scores above ``--threshold``. ``--invert`` swaps white and black (mask the thing out);
``--expand N`` then grows the white area by N pixels in every direction (a negative N shrinks it).

``--method subject`` removes the background: Segment Anything (transformers' ``SamModel``) is asked for the thing
at the centre of each image (one point prompt, the way a user clicks the subject), and of its three candidate
masks (a part, a larger part, the whole object) the largest whose predicted quality is within
:data:`SUBJECT_IOU_SLACK` of the best is kept, so a character or product comes out whole. No ``--prompt``; the
threshold applies to the chosen mask's probability. The background-removal models people also use (rembg's u2net,
RMBG, BiRefNet) run only through their own packages or repositories' code (trust_remote_code), which Atelier does
not run.

An existing mask is never replaced unless ``--overwrite``; an image that does not open is named and skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Sequence, Tuple

import numpy as np
from PIL import Image

from trainer.data.concepts import mask_path
from trainer.io import atomic_path, write_failure
from trainer.tools import ToolError
from trainer.tools.captioners.shared import (
    Progress, Written, config_dict, folder_images, load_pretrained, model_dtype, model_source, open_batch,
    pick_device, say, unique_outputs)

DEFAULT_MASK_MODEL = "CIDAS/clipseg-rd64-refined"
DEFAULT_SUBJECT_MODEL = "facebook/sam-vit-base"
DEFAULT_MASK_THRESHOLD = 0.4
METHODS = ("clipseg", "subject")
DEFAULT_MODELS = {"clipseg": DEFAULT_MASK_MODEL, "subject": DEFAULT_SUBJECT_MODEL}
SUBJECT_IOU_SLACK = 0.1  # a larger candidate wins while its predicted IoU is at most this far below the best


class ClipSeg:
    """A loaded CLIPSeg model: :meth:`probabilities` of a batch of images for the prompts."""

    def __init__(self, spec: str, device: str):
        src = model_source(spec)
        cfg = config_dict(src)
        kind = str(cfg.get("model_type") or "")
        if kind != "clipseg":
            raise ToolError(f"--model '{spec}' is a {kind or 'non-transformers'} model; --method clipseg needs a "
                            f"CLIPSeg model (e.g. {DEFAULT_MASK_MODEL}).")
        # inside: --help and the UI import this module for its defaults, without torch
        from transformers import CLIPSegForImageSegmentation, CLIPSegProcessor
        say(f"loading {spec} on {device} …")
        self.processor = load_pretrained(src, CLIPSegProcessor.from_pretrained, "a CLIPSeg processor")
        self.model = load_pretrained(src, CLIPSegForImageSegmentation.from_pretrained, "a CLIPSeg model",
                                     dtype=model_dtype(device))
        self.model.to(device).eval()
        self.device = device

    def probabilities(self, images: List[Any], prompts: Sequence[str]) -> List[Any]:
        """Per image a float [H, W] tensor at the image's size: the best prompt's probability per pixel."""
        import torch  # inside: --help and the UI import this module for its defaults, without torch
        import torch.nn.functional as F  # inside: --help and the UI import this module for its defaults, without torch
        n, p = len(images), len(prompts)
        inputs = self.processor(text=[t for _ in images for t in prompts],
                                images=[im for im in images for _ in prompts], padding=True, return_tensors="pt")
        dtype = next(self.model.parameters()).dtype
        inputs = {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                  for k, v in inputs.items() if hasattr(v, "to")}
        with torch.inference_mode():
            logits = self.model(**inputs).logits.float()
        logits = logits.reshape(n, p, logits.shape[-2], logits.shape[-1])
        out = []
        for i, image in enumerate(images):
            w, h = image.size
            full = F.interpolate(logits[i:i + 1], size=(h, w), mode="bilinear", align_corners=False)[0]
            out.append(full.sigmoid().amax(0).cpu())
        return out


class SamSubject:
    """A loaded Segment Anything model: :meth:`probabilities` of the thing at each image's centre."""

    def __init__(self, spec: str, device: str):
        src = model_source(spec)
        kind = str(config_dict(src).get("model_type") or "")
        if kind != "sam":
            raise ToolError(f"--model '{spec}' is a {kind or 'non-transformers'} model; --method subject needs a "
                            f"Segment Anything model (e.g. {DEFAULT_SUBJECT_MODEL}).")
        # inside: --help and the UI import this module for its defaults, without torch
        from transformers import SamModel, SamProcessor
        say(f"loading {spec} on {device} …")
        self.processor = load_pretrained(src, SamProcessor.from_pretrained, "a SAM processor")
        self.model = load_pretrained(src, SamModel.from_pretrained, "a SAM model", dtype=model_dtype(device))
        self.model.to(device).eval()
        self.device = device

    def probabilities(self, images: List[Any], prompts: Sequence[str] = ()) -> List[Any]:
        """Per image a float [H, W] tensor at the image's size: the chosen candidate's probability per pixel."""
        import torch  # inside: --help and the UI import this module for its defaults, without torch
        points = [[[im.width / 2, im.height / 2]] for im in images]  # one point each, at the centre
        inputs = self.processor(images=images, input_points=points, return_tensors="pt")
        dtype = next(self.model.parameters()).dtype
        model_in = {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                    for k, v in inputs.items() if k in ("pixel_values", "input_points")}
        with torch.inference_mode():
            out = self.model(**model_in, multimask_output=True)
        logits = self.processor.image_processor.post_process_masks(
            out.pred_masks.float().cpu(), inputs["original_sizes"], inputs["reshaped_input_sizes"], binarize=False)
        scores = out.iou_scores.float().cpu()
        return [choose_candidate(masks[0], iou[0]) for masks, iou in zip(logits, scores)]


def choose_candidate(logits: Any, iou: Any) -> Any:
    """Of SAM's candidates for one point ([3, H, W] logits, [3] predicted IoU), the probabilities of the largest
    whose predicted IoU is within SUBJECT_IOU_SLACK of the best: the whole object rather than a part of it."""
    probs = logits.sigmoid()
    areas = (probs > 0.5).flatten(1).sum(1)
    good = [i for i in range(len(iou)) if float(iou[i]) >= float(iou.max()) - SUBJECT_IOU_SLACK]
    return probs[max(good, key=lambda i: (int(areas[i]), -i))]


def grow(mask: Any, pixels: int) -> Any:
    """A bool [H, W] mask with its True area grown by ``pixels`` in every direction (shrunk when negative)."""
    import torch.nn.functional as F  # inside: --help and the UI import this module for its defaults, without torch
    if pixels == 0:
        return mask
    k = 2 * abs(pixels) + 1
    x = (mask if pixels > 0 else ~mask).float()[None, None]
    x = F.max_pool2d(x, (1, k), stride=1, padding=(0, abs(pixels)))  # separable: rows, then columns
    x = F.max_pool2d(x, (k, 1), stride=1, padding=(abs(pixels), 0))
    grown = x[0, 0] > 0.5
    return grown if pixels > 0 else ~grown


def to_mask(prob: Any, threshold: float, invert: bool, expand: int) -> Any:
    """Probabilities → an ``L`` image with only 0 (ignored) and 255 (trained)."""
    white = prob > threshold
    if invert:
        white = ~white
    white = grow(white, expand)
    return Image.fromarray(white.numpy().astype(np.uint8) * 255)  # 2-D uint8: mode L


def _check_args(args: Any) -> List[str]:
    prompts = [" ".join(str(p).split()) for p in (args.prompt or [])]
    prompts = [p for p in prompts if p]
    if args.method not in METHODS:
        raise ToolError(f"--method {args.method}: choose one of {', '.join(METHODS)}.")
    if args.method == "subject" and prompts:
        raise ToolError("--method subject takes no --prompt: it keeps the thing at the centre of each image. Use "
                        "--method clipseg to mask what a prompt names.")
    if args.method == "clipseg" and not prompts:
        raise ToolError("give --prompt TEXT: what the masks should cover (e.g. --prompt person); repeat it for "
                        "several things (or --method subject to keep whatever is at the centre).")
    if not 0.0 < args.threshold < 1.0:
        raise ToolError(f"--threshold {args.threshold:g}: give a probability between 0 and 1, e.g. 0.4.")
    if args.batch < 1:
        raise ToolError(f"--batch {args.batch}: give at least 1.")
    return prompts


def run(args: Any) -> int:
    prompts = _check_args(args)
    folder, images = folder_images(args.folder, args.recursive)
    pairs = unique_outputs(images, mask_path, say)
    todo = [(im, m) for im, m in pairs if args.overwrite or not (m.exists() or m.is_symlink())]
    kept = len(pairs) - len(todo)
    if not todo:
        print(f"all {len(pairs)} images in {folder} already have masks; nothing to do (--overwrite replaces them).")
        return 0
    if kept:
        say(f"{kept} of {len(pairs)} images already have masks and are left as they are (--overwrite replaces them).")
    device = pick_device(args.device)
    model = args.model or DEFAULT_MODELS[args.method]
    seg = SamSubject(model, device) if args.method == "subject" else ClipSeg(model, device)

    progress, written = Progress("masked", len(todo)), Written()
    skipped: List[Tuple[Path, str]] = []
    black: List[Path] = []
    white_share = 0.0
    for start in range(0, len(todo), args.batch):
        batch = todo[start:start + args.batch]
        ready = open_batch(batch, skipped)
        probs = seg.probabilities([r[2] for r in ready], prompts) if ready else []
        for (image, out, img), prob in zip(ready, probs):
            mask = to_mask(prob, args.threshold, args.invert, args.expand)
            share = sum(mask.histogram()[255:]) / float(img.width * img.height)
            if not args.overwrite and (out.exists() or out.is_symlink()):  # made meanwhile by someone else
                continue
            try:
                with atomic_path(out) as tmp:
                    mask.save(tmp, format="PNG")
            except OSError as exc:
                say(f"Error: {write_failure(exc, out.parent, 'a mask')}")
                return 1
            written.add(out)
            white_share += share
            if share == 0.0:
                black.append(out)
        progress.step(len(batch))
    written.rest("masks")
    parts = [f"masked {written.count} of {len(pairs)} images in {folder}"]
    if written.count:
        parts.append(f"white (trained) on {100 * white_share / written.count:.0f}% of the pixels on average")
    if kept:
        parts.append(f"{kept} already had masks")
    if skipped:
        parts.append(f"{len(skipped)} skipped (would not open: "
                     f"{', '.join(p.name for p, _ in skipped[:5])}{' …' if len(skipped) > 5 else ''})")
    say("; ".join(parts))
    if black:
        say(f"note: {len(black)} masks are black everywhere (nothing scored above --threshold {args.threshold:g}"
            f"{', after --invert' if args.invert else ''}), e.g. {black[0].name}; those images would train only "
            "at loss.unmasked_weight. Lower --threshold or change --prompt (or --method), and run again with "
            "--overwrite.")
    if written.count == 0 and skipped and len(skipped) == len(todo):
        raise ToolError(f"none of the {len(todo)} images to mask in '{folder}' would open "
                        f"(e.g. {skipped[0][0].name}: {skipped[0][1]}).")
    return 0
