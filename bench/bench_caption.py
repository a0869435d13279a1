#!/usr/bin/env python3
"""Captioning speed on real-size models with random weights (nothing downloaded): images/s of a WD-v3 tagger of
EVA02-large size through onnxruntime, and of Qwen2.5-VL-7B-size captioning, on 1024x1024 images, with the caption
command's own code (``trainer.tools.captioners``: the same preprocessing, prompt, batching and decoding).

    .venv/bin/python bench/bench_caption.py                 # a GPU machine: the numbers for docs/performance.md
    .venv/bin/python bench/bench_caption.py --tiny          # any machine: the script itself, on tiny sizes

The WD tagger is an EVA02-large-shaped ViT (patch 14 at 448 px: 1024 tokens, width 1024, 24 blocks, 16 heads, an
MLP with the FLOPs of EVA02's SwiGLU, 10861 tags) exported with torch's ONNX exporter; it runs on onnxruntime's CUDA
provider when the onnxruntime-gpu build is installed, else on the CPU (the line says which). The VLM is
Qwen2.5-VL-7B's configuration (Qwen/Qwen2.5-VL-7B-Instruct's config.json) in bf16 on the GPU; decoding is greedy
with end-of-text switched off, so every caption is --new-tokens long (a real one stops earlier).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from trainer.tools.captioners.shared import ModelSource  # noqa: E402
from trainer.tools.captioners.tags import TagOptions  # noqa: E402
from trainer.tools.captioners.vlm import STYLES, VlmCaptioner, image_only_processor_class  # noqa: E402
from trainer.tools.captioners.wd import load_wd_tagger  # noqa: E402

EVA02_LARGE = dict(size=448, patch=14, width=1024, depth=24, heads=16, mlp=4096, tags=10861)
TINY_WD = dict(size=64, patch=16, width=32, depth=2, heads=2, mlp=64, tags=100)
QWEN25_VL_7B = dict(text=dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
                              num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, max_position_embeddings=128000,
                              rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
                    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                                patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]))
TINY_VL = dict(text=dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=152064, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
               vision=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, window_size=112, fullatt_block_indexes=[0]))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, mlp), torch.nn.GELU(), torch.nn.Linear(mlp, width))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class Tagger(torch.nn.Module):
    """A ViT taking the WD taggers' input ([N, H, W, 3] BGR 0-255) and giving one score per tag."""

    def __init__(self, size: int, patch: int, width: int, depth: int, heads: int, mlp: int, tags: int):
        super().__init__()
        self.embed = torch.nn.Conv2d(3, width, patch, patch)
        self.pos = torch.nn.Parameter(torch.randn(1, (size // patch) ** 2, width) * 0.02)
        self.blocks = torch.nn.Sequential(*[Block(width, heads, mlp) for _ in range(depth)])
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, tags)

    def forward(self, x):
        x = self.embed(x.permute(0, 3, 1, 2) / 127.5 - 1.0).flatten(2).transpose(1, 2) + self.pos
        return torch.sigmoid(self.head(self.norm(self.blocks(x)).mean(1)))


def write_tagger(folder: Path, shape: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Tagger(**shape).eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, shape["size"], shape["size"], 3),), str(folder / "model.onnx"),
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {0: "batch"}},
                          dynamo=False, opset_version=17)
    cats = [9] * 4 + [0] * (shape["tags"] * 3 // 4 - 4) + [4] * (shape["tags"] - shape["tags"] * 3 // 4)
    rows = ["tag_id,name,category,count"] + [f"{i},tag_{i},{c},1" for i, c in enumerate(cats)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


def images(count: int, side: int) -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)) for _ in range(count)]


def timed(caption, pictures: list, batch: int) -> float:
    """Seconds for all ``pictures`` in batches, after one warm-up batch (not counted)."""
    caption(pictures[:batch])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(pictures), batch):
        caption(pictures[i:i + batch])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_wd(work: Path, pictures: list, tiny: bool, batch: int) -> None:
    folder = write_tagger(work / "wd", TINY_WD if tiny else EVA02_LARGE)
    tagger = load_wd_tagger(ModelSource(str(folder), str(folder), True), "auto", TagOptions())
    where = tagger.session.get_providers()[0].replace("ExecutionProvider", "")
    spent = timed(tagger.caption, pictures, batch)
    print(f"WD tagger ({'tiny' if tiny else 'EVA02-large size'}, {where}, batch {batch}): "
          f"{len(pictures) / spent:.2f} images/s ({len(pictures)} images of {pictures[0].width} px in {spent:.1f} s)")


def bench_vlm(work: Path, pictures: list, tiny: bool, batch: int, new_tokens: int) -> None:
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from trainer.families.common.tiny_text import write_tiny_qwen_tokenizer
    vision_tokens = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    write_tiny_qwen_tokenizer(work / "tok", max_length=32768, extra_special=vision_tokens)
    tok = AutoTokenizer.from_pretrained(work / "tok")
    tok.chat_template = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{%- for c in m['content'] %}"
                         "{%- if c['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else %}"
                         "{{ c['text'] }}{%- endif %}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
                         "{{ '<|im_start|>assistant\\n' }}")
    ids = dict(zip(vision_tokens, tok.convert_tokens_to_ids(list(vision_tokens))))
    shape = TINY_VL if tiny else QWEN25_VL_7B
    config = Qwen2_5_VLConfig(text_config=dict(shape["text"], eos_token_id=None, bos_token_id=None, pad_token_id=0),
                              vision_config=dict(shape["vision"], spatial_merge_size=2, temporal_patch_size=2),
                              image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every caption new_tokens long: a steady measure
    params = sum(p.numel() for p in model.parameters())
    processor = image_only_processor_class("qwen2_5_vl")(
        Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2), tok,
        chat_template=tok.chat_template)
    tok.padding_side = "left"
    captioner = VlmCaptioner("qwen2_5_vl", model, processor, device, STYLES["detailed"], new_tokens, pairs=False)
    spent = timed(captioner.caption, pictures, batch)
    peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device == "cuda" else ""
    print(f"Qwen2.5-VL ({params / 1e9:.2f}B parameters, {device} {str(dtype).replace('torch.', '')}, batch {batch}, "
          f"{new_tokens} new tokens): {len(pictures) / spent:.3f} images/s ({len(pictures)} images of "
          f"{pictures[0].width} px in {spent:.1f} s{peak})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="Tiny shapes: checks the script on any machine.")
    parser.add_argument("--images", type=int, default=20, help="Images captioned (default 20).")
    parser.add_argument("--side", type=int, default=1024, help="Their side in pixels (default 1024).")
    parser.add_argument("--wd-batch", type=int, default=8)
    parser.add_argument("--vlm-batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128, help="Tokens per VLM caption (default 128).")
    parser.add_argument("--only", choices=("wd", "vlm"), default=None)
    args = parser.parse_args()
    pictures = images(args.images, args.side)
    with tempfile.TemporaryDirectory(prefix="atelier-bench-caption-") as tmp:
        if args.only in (None, "wd"):
            bench_wd(Path(tmp), pictures, args.tiny, args.wd_batch)
        if args.only in (None, "vlm"):
            bench_vlm(Path(tmp), pictures, args.tiny, args.vlm_batch, args.new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
