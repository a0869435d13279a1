"""The dataset tools (``python -m trainer caption|mask``) on tiny models built here from configs, with seeded
random weights, saved with ``save_pretrained`` (offline, CPU). The captions are nonsense; the plumbing is real:
which files are written and kept, prefix/suffix, broken images, the tagger's threshold, the masks' size and
values, and that training's dataset scan reads what was written."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

BLIP_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]", "a", "photo", "of", "red", "square", "blue",
              "circle", "on", "white", "background", "the", "cat", "dog"]
TAGS = ["general", "sensitive", "questionable", "explicit", "red_hair", "blue_sky", "^_^", "low_score"]
TAG_BIAS = [5.0, 5.0, 5.0, 5.0, 4.0, 2.0, 0.5, -4.0]  # sigmoid: .99 (ratings), .982, .881, .622, .018


def cli(*args: object) -> int:
    from trainer.__main__ import main
    return main([str(a) for a in args])


def _tiny_vision(**extra) -> dict:
    return {**dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                   patch_size=8), **extra}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    from transformers import (BertTokenizerFast, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor,
                              BlipProcessor, CLIPSegConfig, CLIPSegForImageSegmentation, CLIPSegProcessor,
                              CLIPTokenizer, ViTConfig, ViTForImageClassification, ViTImageProcessor)

    from trainer.families.common.sd_kit.tiny import write_tiny_tokenizer
    root = tmp_path_factory.mktemp("dataset-models")

    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(BLIP_WORDS)}, do_lower_case=True, model_max_length=32)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    torch.manual_seed(0)
    blip = BlipForConditionalGeneration(BlipConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=64, bos_token_id=tok.bos_token_id,
                         sep_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id),
        vision_config=_tiny_vision(), projection_dim=32))
    blip.save_pretrained(root / "blip")
    BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok) \
        .save_pretrained(root / "blip")

    torch.manual_seed(1)
    vit = ViTForImageClassification(ViTConfig(
        **_tiny_vision(), id2label=dict(enumerate(TAGS)), label2id={t: i for i, t in enumerate(TAGS)},
        problem_type="multi_label_classification"))
    with torch.no_grad():  # the scores do not depend on the image: known tags score high
        vit.classifier.weight.zero_()
        vit.classifier.bias.copy_(torch.tensor(TAG_BIAS))
    vit.save_pretrained(root / "tagger")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root / "tagger")

    write_tiny_tokenizer(root / "clip-tokenizer")
    ctok = CLIPTokenizer.from_pretrained(root / "clip-tokenizer")
    torch.manual_seed(2)
    seg = CLIPSegForImageSegmentation(CLIPSegConfig(
        text_config=dict(vocab_size=len(ctok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=ctok.bos_token_id,
                         eos_token_id=ctok.eos_token_id, pad_token_id=ctok.pad_token_id),
        vision_config=_tiny_vision(num_hidden_layers=2), projection_dim=32, extract_layers=[1], reduce_dim=16,
        decoder_num_attention_heads=2, decoder_intermediate_size=32))
    seg.save_pretrained(root / "clipseg")
    CLIPSegProcessor(image_processor=ViTImageProcessor(size={"height": 32, "width": 32}), tokenizer=ctok) \
        .save_pretrained(root / "clipseg")

    # Florence-2 (transformers-native): a byte-level BART tokenizer with the image token, a tiny DaViT
    from transformers import (BartTokenizer, CLIPImageProcessor, Florence2Config, Florence2ForConditionalGeneration,
                              Florence2Processor)

    from trainer.families.common.sd_kit.tiny import bytes_to_unicode
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for c in bytes_to_unicode().values():
        vocab.setdefault(c, len(vocab))
    vocab["<mask>"], vocab["<image>"] = len(vocab), len(vocab) + 1
    btok = BartTokenizer(vocab=vocab, merges=[], extra_special_tokens={"image_token": "<image>"})
    torch.manual_seed(3)
    flo = Florence2ForConditionalGeneration(Florence2Config(
        text_config=dict(model_type="bart", vocab_size=len(btok), d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37,
                         max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                         init_std=1.0, decoder_start_token_id=2, forced_bos_token_id=0, forced_eos_token_id=2),
        vision_config=dict(depths=[1, 1, 1, 1], embed_dim=[8, 16, 16, 32], num_heads=[1, 2, 2, 2],
                           num_groups=[1, 2, 2, 2], window_size=2, projection_dim=32, drop_path_rate=0.0),
        image_token_id=btok.image_token_id)).eval()
    with torch.no_grad():
        tokens = flo.get_image_features(pixel_values=torch.zeros(1, 3, 32, 32)).pooler_output.shape[1]
    flo.save_pretrained(root / "florence")
    fip = CLIPImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False)
    fip.image_seq_length = tokens
    Florence2Processor(image_processor=fip, tokenizer=btok).save_pretrained(root / "florence")

    from transformers import (SamConfig, SamImageProcessor, SamMaskDecoderConfig, SamModel, SamProcessor,
                              SamPromptEncoderConfig, SamVisionConfig)
    torch.manual_seed(4)
    sam = SamModel(SamConfig(
        vision_config=SamVisionConfig(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2,
                                      image_size=64, patch_size=8, mlp_dim=64, global_attn_indexes=[1],
                                      window_size=4, num_pos_feats=8).to_dict(),
        prompt_encoder_config=SamPromptEncoderConfig(hidden_size=16, image_size=64, patch_size=8,
                                                     mask_input_channels=4).to_dict(),
        mask_decoder_config=SamMaskDecoderConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                 mlp_dim=32, iou_head_hidden_dim=16).to_dict()))
    sam.save_pretrained(root / "sam")
    SamProcessor(image_processor=SamImageProcessor(size={"longest_edge": 64}, pad_size={"height": 64, "width": 64})) \
        .save_pretrained(root / "sam")

    timm = root / "wd-tagger-onnx"  # as the WD taggers are published: timm config + ONNX weights
    timm.mkdir()
    (timm / "config.json").write_text('{"architecture": "vit_base_patch16_224", "num_classes": 10861}')
    (timm / "model.onnx").write_bytes(b"onnx")
    return {"blip": root / "blip", "tagger": root / "tagger", "clipseg": root / "clipseg", "timm": timm,
            "florence": root / "florence", "sam": root / "sam"}


def _image(path: Path, size=(40, 30), color=(200, 30, 30), **save) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, color)
    img.paste((20, 40, 220), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    img.save(path, **save)
    return path


def _dataset(folder: Path) -> Path:
    _image(folder / "a.png")
    _image(folder / "b.jpg", (24, 48), (30, 200, 30))
    _image(folder / "c.png", (32, 32), (30, 30, 200))
    (folder / "c.txt").write_text("keep me\n", encoding="utf-8")
    return folder


def _blip_caption(model: Path, image: Path, max_tokens: int) -> str:
    """What the tiny BLIP says about ``image``, computed here with transformers directly."""
    from transformers import BlipForConditionalGeneration, BlipProcessor

    from trainer.data.images import open_rgb
    proc = BlipProcessor.from_pretrained(model, local_files_only=True)
    blip = BlipForConditionalGeneration.from_pretrained(model, local_files_only=True).eval()
    with torch.no_grad():
        ids = blip.generate(**proc(images=[open_rgb(image)], return_tensors="pt"), max_new_tokens=max_tokens,
                            num_beams=3)
    return proc.batch_decode(ids, skip_special_tokens=True)[0].strip()


# ------------------------------------------------------------------------------------------------
# caption
# ------------------------------------------------------------------------------------------------

def test_caption_writes_missing_captions_keeps_existing_and_overwrites_when_asked(models, tmp_path, capsys):
    data = _dataset(tmp_path / "data")
    args = ("caption", data, "--model", models["blip"], "--device", "cpu", "--max-tokens", 5, "--batch", 2,
            "--prefix", "sks", "--suffix", "studio photo")
    assert cli(*args) == 0
    out, err = capsys.readouterr()
    assert out.split("\n")[:2] == [f"wrote {data / 'a.txt'}", f"wrote {data / 'b.txt'}"]
    assert "captioned 2/2" in err and "1 of 3 images already have captions" in err
    assert (data / "c.txt").read_text(encoding="utf-8") == "keep me\n"
    for name in ("a", "b"):
        said = _blip_caption(models["blip"], next(data.glob(f"{name}.*g")), 5)
        assert said, "the tiny BLIP says something"
        text = (data / f"{name}.txt").read_text(encoding="utf-8")
        assert text == f"sks, {said}, studio photo\n"
    # nothing left to do: nothing loaded, nothing touched
    before = {p.name: p.stat().st_mtime_ns for p in data.glob("*.txt")}
    assert cli("caption", data, "--model", tmp_path / "no-such-model") == 0
    assert "already have captions; nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in data.glob("*.txt")} == before
    # --overwrite replaces all of them, the kept one included
    assert cli("caption", data, "--model", models["blip"], "--device", "cpu", "--max-tokens", 5, "--overwrite",
               "--prefix", "photo of sks,") == 0
    assert "wrote" in capsys.readouterr().out
    said = _blip_caption(models["blip"], data / "c.png", 5)
    assert (data / "c.txt").read_text(encoding="utf-8") == f"photo of sks, {said}\n"
    assert not list(data.glob(".*")), "no temporary files left"


def test_caption_with_florence2_uses_the_task_prompt(models, tmp_path, capsys):
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    from trainer.data.images import open_rgb
    data = tmp_path / "data"
    _image(data / "a.png", (50, 40))
    proc = AutoProcessor.from_pretrained(models["florence"], local_files_only=True)
    flo = Florence2ForConditionalGeneration.from_pretrained(models["florence"], local_files_only=True).eval()
    written = []
    for task, token in (("caption", "<CAPTION>"), ("more-detailed", "<MORE_DETAILED_CAPTION>")):
        assert cli("caption", data, "--model", models["florence"], "--device", "cpu", "--max-tokens", 6,
                   "--task", task, "--overwrite") == 0
        with torch.no_grad():
            ids = flo.generate(**proc(text=[token], images=[open_rgb(data / "a.png")], return_tensors="pt"),
                               max_new_tokens=6, num_beams=3)
        said = " ".join(proc.batch_decode(ids, skip_special_tokens=True)[0].split())
        assert said and (data / "a.txt").read_text(encoding="utf-8") == said + "\n"
        written.append(said)
    assert written[0] != written[1], "the task prompt reaches the model"
    assert "captioned 1/1" in capsys.readouterr().err


def test_caption_names_and_skips_an_image_that_will_not_open(models, tmp_path, capsys):
    data = tmp_path / "data"
    _image(data / "good.png")
    _image(data / "sub" / "deep.png")
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    full = _image(tmp_path / "full.jpg", (64, 64)).read_bytes()
    (data / "cut.jpg").write_bytes(full[: len(full) // 2])  # truncated: training would skip it too
    assert cli("caption", data, "--model", models["blip"], "--device", "cpu", "--max-tokens", 3,
               "--recursive", "--extension", "caption") == 0
    out, err = capsys.readouterr()
    assert (data / "good.caption").is_file() and (data / "sub" / "deep.caption").is_file()
    assert not (data / "broken.caption").exists() and not (data / "cut.caption").exists()
    assert "skipped" in err and str(data / "broken.png") in err and str(data / "cut.jpg") in err
    assert "captioned 2 of 4 images" in err and "2 skipped (would not open: broken.png, cut.jpg)" in err
    assert sorted(out.splitlines()) == [f"wrote {data / 'good.caption'}", f"wrote {data / 'sub' / 'deep.caption'}"]
    # only broken images left: one line, exit code 2
    only = tmp_path / "only-broken"
    only.mkdir()
    (only / "x.png").write_bytes(b"nope")
    assert cli("caption", only, "--model", models["blip"], "--device", "cpu") == 2
    assert "none of the 1 images to caption" in capsys.readouterr().err


def test_caption_refuses_bad_input_with_one_line(models, tmp_path, capsys):
    empty = tmp_path / "no images here"
    empty.mkdir()
    (empty / "notes.md").write_text("hi")
    assert cli("caption", empty, "--model", models["blip"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{empty}' has no images" in err
    _image(empty / "inside" / "x.png")
    assert cli("caption", empty) == 2
    assert "add --recursive" in capsys.readouterr().err

    data = tmp_path / "data"
    _image(data / "a.png")
    cases = [
        (models["timm"], "transformers image-classification export"),
        (tmp_path / "missing-model", "no such folder"),
        ("nobody/atelier-no-such-model", "--model FOLDER"),  # offline (HF_HUB_OFFLINE): how to give a folder
        (models["blip"] / "config.json", "is a file"),
        (models["clipseg"], "is a clipseg model; caption runs BLIP and Florence-2"),
    ]
    for model, said in cases:
        assert cli("caption", data, "--model", model, "--device", "cpu") == 2, model
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert cli("caption", data, "--model", models["blip"], "--task", "caption", "--device", "cpu") == 2
    assert "--task applies to Florence-2" in capsys.readouterr().err
    assert not (data / "a.txt").exists()


def test_tagger_keeps_the_tags_above_the_threshold_best_first(models, tmp_path, capsys):
    data = tmp_path / "data"
    _image(data / "wide.png", (60, 20))
    _image(data / "tall.webp", (20, 50))
    base = ("caption", data, "--model", models["tagger"], "--device", "cpu")
    assert cli(*base) == 0  # default threshold 0.35; the rating labels are no tags
    for name in ("wide", "tall"):
        assert (data / f"{name}.txt").read_text(encoding="utf-8") == "red hair, blue sky, ^_^\n"
    assert cli(*base, "--overwrite", "--threshold", 0.9, "--prefix", "sks") == 0
    assert (data / "wide.txt").read_text(encoding="utf-8") == "sks, red hair\n"
    assert cli(*base, "--overwrite", "--threshold", 0.01, "--tag-limit", 2) == 0
    assert (data / "tall.txt").read_text(encoding="utf-8") == "red hair, blue sky\n"
    assert cli(*base, "--overwrite", "--threshold", 0.99) == 0  # no tag at all: nothing written, said so
    assert "no tag scored above --threshold 0.99" in capsys.readouterr().err
    assert (data / "tall.txt").read_text(encoding="utf-8") == "red hair, blue sky\n"
    assert cli(*base, "--threshold", 1.5) == 2


def test_caption_helpers():
    from trainer.tools.captioners.tags import compose, pick_tags, tag_text
    assert compose("a cat\non a mat", "sks", "photo") == "sks, a cat on a mat, photo"
    assert compose("a cat", "photo of sks,", ", 4k") == "photo of sks, a cat, 4k"
    assert compose("a cat", "sks:", ". Studio") == "sks: a cat. Studio"
    assert compose("", "sks", "") == "sks" and compose("  ", "", "") == ""
    assert tag_text("long_hair") == "long hair" and tag_text("^_^") == "^_^"
    labels = {0: "a_b", 1: "c", 2: "d", 3: "general"}
    assert pick_tags([0.5, 0.9, 0.2, 0.99], labels, 0.35, skip=("general",)) == ["c", "a b"]
    assert pick_tags([0.5, 0.5, 0.6, 0.1], labels, 0.35, limit=2) == ["d", "a b"]


# ------------------------------------------------------------------------------------------------
# mask
# ------------------------------------------------------------------------------------------------

def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        assert img.format == "PNG" and img.mode == "L"
        return np.asarray(img).copy()


def test_mask_writes_binary_masks_of_the_image_size(models, tmp_path, capsys):
    data = tmp_path / "data"
    _image(data / "a.png", (40, 30))
    _image(data / "b.jpg", (25, 50))
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated by 90 degrees: training sees it 30 wide, 44 high
    _image(data / "turned.jpg", (44, 30), exif=exif)
    Image.new("L", (32, 32), 128).save(data / "kept-masklabel.png")
    _image(data / "kept.png", (32, 32))
    base = ("mask", data, "--model", models["clipseg"], "--device", "cpu", "--prompt", "a red square")
    assert cli(*base, "--batch", 2) == 0
    out, err = capsys.readouterr()
    made = {"a": (30, 40), "b": (50, 25), "turned": (44, 30)}
    assert sorted(out.split("\n")[:3]) == sorted(f"wrote {data / (n + '-masklabel.png')}" for n in made)
    assert "masked 3/3" in err and "1 of 4 images already have masks" in err
    masks = {n: _pixels(data / f"{n}-masklabel.png") for n in made}
    for n, shape in made.items():
        assert masks[n].shape == shape and set(np.unique(masks[n])) <= {0, 255}
    values = np.concatenate([m.ravel() for m in masks.values()])
    assert (values == 0).any() and (values == 255).any(), "the prompt covers part of the images"
    assert (_pixels(data / "kept-masklabel.png") == 128).all(), "an existing mask is kept"

    assert cli(*base, "--invert", "--overwrite") == 0
    for n in made:
        assert (_pixels(data / f"{n}-masklabel.png") == 255 - masks[n]).all()
    assert not (_pixels(data / "kept-masklabel.png") == 128).all(), "--overwrite replaces it"

    assert cli(*base, "--overwrite", "--expand", 2) == 0
    grown = {n: _pixels(data / f"{n}-masklabel.png") for n in made}
    for n in made:
        assert set(np.unique(grown[n])) <= {0, 255} and (grown[n][masks[n] == 255] == 255).all()
    assert sum((g == 255).sum() for g in grown.values()) > sum((m == 255).sum() for m in masks.values())
    assert cli(*base, "--overwrite", "--expand", -2) == 0
    for n in made:
        assert not (_pixels(data / f"{n}-masklabel.png")[masks[n] == 0]).any()
    assert cli(*base, "--overwrite", "--prompt", "a dog") == 0  # two prompts: white where either one is
    for n in made:
        assert (_pixels(data / f"{n}-masklabel.png")[masks[n] == 255] == 255).all()
    assert cli(*base, "--overwrite", "--threshold", 0.999999) == 0
    assert "masks are black everywhere" in capsys.readouterr().err
    assert not list(data.glob(".*")), "no temporary files left"


def test_mask_refuses_bad_input(models, tmp_path, capsys):
    data = tmp_path / "data"
    _image(data / "a.png")
    for extra, said in [((), "give --prompt"), (("--prompt", "x", "--threshold", 1), "--threshold 1"),
                        (("--prompt", "x", "--model", models["blip"]), "needs a CLIPSeg model")]:
        assert cli("mask", data, "--device", "cpu", *extra) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert cli("mask", tmp_path / "nowhere", "--prompt", "x") == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err
    assert not (data / "a-masklabel.png").exists()


def test_mask_subject_keeps_the_thing_at_the_centre_whole(models, tmp_path, capsys):
    """Background removal (Segment Anything, a point at each image's centre): the written mask is SAM's largest
    good candidate at the image's size (EXIF-rotated as training sees it); no prompt; a non-SAM model is refused."""
    from transformers import SamModel, SamProcessor

    from trainer.tools.mask import choose_candidate
    data = tmp_path / "data"
    _image(data / "a.png", (40, 30))
    exif = Image.Exif()
    exif[0x0112] = 6
    _image(data / "turned.jpg", (44, 30), exif=exif)
    # the tiny random SAM's logits are ~1e-6: at 0.5 the mask is their sign, a mask with both colours
    assert cli("mask", data, "--method", "subject", "--model", models["sam"], "--device", "cpu", "--threshold", 0.5) == 0
    assert "masked 2/2" in capsys.readouterr().err
    sam, proc = SamModel.from_pretrained(models["sam"]).eval(), SamProcessor.from_pretrained(models["sam"])
    for name, source in (("a", data / "a.png"), ("turned", data / "turned.jpg")):
        image = ImageOps.exif_transpose(Image.open(source)).convert("RGB")
        inputs = proc(images=image, input_points=[[[image.width / 2, image.height / 2]]], return_tensors="pt")
        with torch.no_grad():
            out = sam(pixel_values=inputs["pixel_values"], input_points=inputs["input_points"])
        logits = proc.image_processor.post_process_masks(out.pred_masks, inputs["original_sizes"],
                                                         inputs["reshaped_input_sizes"], binarize=False)[0][0]
        want = (choose_candidate(logits, out.iou_scores[0, 0]) > 0.5).numpy().astype(np.uint8) * 255
        got = _pixels(data / f"{name}-masklabel.png")
        assert got.shape == (image.height, image.width) and (got == want).all()
        assert (got == 0).any() and (got == 255).any()
    for extra, said in [(("--prompt", "a dog"), "takes no --prompt"), (("--model", models["clipseg"]), "needs a Segment")]:
        assert cli("mask", data, "--method", "subject", "--device", "cpu", "--overwrite", *extra) == 2
        assert said in capsys.readouterr().err


def test_choose_candidate_prefers_the_whole_object_unless_it_is_much_worse():
    from trainer.tools.mask import choose_candidate
    logits = torch.full((3, 4, 4), -10.0)
    logits[0, 1:2, 1:2] = 10  # a part
    logits[1, 1:3, 1:3] = 10  # more of it
    logits[2, :, :] = 10  # the whole picture
    assert choose_candidate(logits, torch.tensor([0.9, 0.85, 0.5]))[1:3, 1:3].gt(0.5).all()  # whole is too poor
    assert choose_candidate(logits, torch.tensor([0.9, 0.85, 0.5])).gt(0.5).sum() == 4
    assert choose_candidate(logits, torch.tensor([0.8, 0.85, 0.82])).gt(0.5).all()  # whole, nearly as good


def test_grow_and_shrink():
    from trainer.tools.mask import grow
    dot = torch.zeros(9, 9, dtype=torch.bool)
    dot[4, 4] = True
    big = grow(dot, 2)
    assert big.sum() == 25 and big[2:7, 2:7].all()
    assert torch.equal(grow(big, -1), grow(dot, 1)) and torch.equal(grow(dot, 0), dot)


def test_the_dataset_scan_reads_the_masks_and_captions_written(models, tmp_path, capsys):
    from trainer.config.checks import load_config
    from trainer.data.report import build_report
    data = _dataset(tmp_path / "data")
    assert cli("mask", data, "--model", models["clipseg"], "--device", "cpu", "--prompt", "square",
               "--threshold", 0.01) == 0
    assert cli("caption", data, "--model", models["tagger"], "--device", "cpu") == 0
    capsys.readouterr()
    cfg = load_config(None, [f"data.concepts=[{{path: '{data}'}}]", "data.masks=true",
                               "data.max_upscale=0"])  # tiny images train too
    rep = build_report(cfg)
    concept = rep["concepts"][0]
    assert concept["images_used"] == 3 and concept["masks_found"] == 3 and concept["masks_missing"] == 0
    assert concept["masks_bad"] == [] and concept["captions_missing"] == 0
    from trainer.data.concepts import scan_concepts
    items, _ = scan_concepts(cfg.data, warn=lambda _: None)
    by_name = {it.path.name: it for it in items}
    assert by_name["a.png"].mask == data / "a-masklabel.png"
    assert by_name["a.png"].captions == ["red hair, blue sky, ^_^"] and by_name["c.png"].captions == ["keep me"]


@pytest.mark.slow  # several seconds (a subprocess, a compile or an estimate): the full suite runs it
def test_the_tools_tab_captions_and_masks_a_folder_in_a_subprocess(models, tmp_path):
    from webui.app import build_app
    data = _dataset(tmp_path / "data")
    ctx = build_app(tmp_path / "ws", browse_roots=[tmp_path, models["blip"].parent], start_scheduler=False).atelier
    def run(*args):  # the page's handler yields progress, then the result: the last update counts
        return list(ctx.handlers["tools_dataset_run"](*args))[-1]
    msg, tail = run("caption", str(data), str(models["blip"]), "sks", "", "", None, False, False, False)
    assert msg.startswith("OK:"), (msg, tail)
    assert (data / "a.txt").read_text().startswith("sks") and (data / "c.txt").read_text() == "keep me\n"
    msg, tail = run("mask", str(data), str(models["clipseg"]), "", "", "dog", None, False, False, False)
    assert msg.startswith("OK:"), (msg, tail)
    assert (data / "a-masklabel.png").is_file() and (data / "b-masklabel.png").is_file()
    assert "give what to mask" in run("mask", str(data), "", "", "", "", None, False, False, False)[0]
    from webui.tabs.tools import MASK_METHODS
    subject = next(k for k, v in MASK_METHODS.items() if v == "subject")  # background removal: no prompt
    msg, tail = run("mask", str(data), str(models["sam"]), "", "", "", None, False, False, True, subject)
    assert msg.startswith("OK:"), (msg, tail)
    assert (data / "a-masklabel.png").is_file()
    assert "outside the folders" in run("caption", "/etc", "", "", "", "", None, False, False, False)[0]
