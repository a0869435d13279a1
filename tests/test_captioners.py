"""``python -m trainer caption`` with the WD taggers (ONNX) and the vision-language captioners, on tiny models built
here offline: a WD tagger exported with torch's ONNX exporter beside its ``selected_tags.csv`` (``tests/tiny_wd.py``:
scores set by its biases, two of them computed from the prepared image, so the thresholds, the order, the
replacements and the preprocessing are asserted exactly), and tiny random Qwen2.5-VL / Qwen3-VL / LLaVA checkpoints with their processors
(greedy decoding: the written caption is what the model says for the template and the images)."""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from PIL import Image

from tiny_wd import SIZE, weights, write_tags, write_tiny_wd_onnx

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


class TinyWd(torch.nn.Module):
    """tests/tiny_wd.py's tagger as a torch module, for torch's ONNX exporter."""

    def __init__(self):
        super().__init__()
        weight, bias = weights()
        self.register_buffer("weight", torch.from_numpy(weight))
        self.register_buffer("bias", torch.from_numpy(bias))

    def forward(self, x):  # [N, H, W, 3], 0-255
        return torch.sigmoid((x.mean(dim=(1, 2)) / 255.0) @ self.weight + self.bias)


def write_tiny_wd(folder: Path) -> Path:
    """The tiny WD tagger in the published layout: ``model.onnx`` (input [batch, 16, 16, 3]) + ``selected_tags.csv``."""
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation note
        torch.onnx.export(TinyWd(), (torch.zeros(1, SIZE, SIZE, 3),), str(folder / "model.onnx"), input_names=["input"],
                          output_names=["output"], dynamic_axes={"input": {0: "batch"}}, dynamo=False)
    write_tags(folder)
    return folder


@pytest.fixture(scope="module")
def wd(tmp_path_factory) -> Path:
    return write_tiny_wd(tmp_path_factory.mktemp("wd-tagger"))


def cli(*args: object) -> int:
    from trainer.__main__ import main
    return main([str(a) for a in args])


def _red(path: Path, size) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (255, 0, 0)).save(path)
    return path


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_wd_tagger_writes_kohyas_order_with_thresholds_replacements_and_preprocessing(wd, tmp_path, capsys):
    data = tmp_path / "data"
    _red(data / "sq.png", (40, 40))  # square: no padding, bgr_red scores high when the channels are BGR
    _red(data / "wide.png", (48, 16))  # padded on white to 48x48: green appears, red minus blue falls
    base = ("caption", data, "--model", wd, "--device", "cpu")
    assert cli(*base) == 0
    # the table's order (general, then character), >= 0.35, underscores as spaces but not in kaomoji
    assert _text(data / "sq.txt") == "1girl, long hair, bgr red, ^_^, shirt (red), solo, hatsune miku\n"
    assert _text(data / "wide.txt") == "1girl, long hair, white pad, ^_^, shirt (red), solo, hatsune miku\n"
    assert "captioned 2/2" in capsys.readouterr().err
    assert cli(*base, "--overwrite", "--character-tags-first", "--rating-tags", "--escape-brackets", "--prefix", "sks",
               "--exclude-tags", "solo, long hair", "--replace-tag", "1girl=one girl") == 0
    assert _text(data / "sq.txt") == "sks, sensitive, hatsune miku, one girl, bgr red, ^_^, shirt \\(red\\)\n"
    assert cli(*base, "--overwrite", "--threshold", 0.6, "--character-threshold", 0.85, "--keep-underscores") == 0
    assert _text(data / "wide.txt") == "1girl, long_hair, white_pad, solo\n"  # miku .82 < .85
    assert cli(*base, "--overwrite", "--tag-limit", 3) == 0  # the three best, written in the table's order
    assert _text(data / "sq.txt") == "1girl, bgr red, solo\n"
    assert cli(*base, "--overwrite", "--threshold", 0.99, "--use-mcut") == 0  # MCut replaces the fixed thresholds
    assert _text(data / "sq.txt") == "1girl, long hair, bgr red, ^_^, shirt (red), solo, hatsune miku\n"
    # the same network written with onnx's helpers (the browser test's, no torch there) tags the same
    assert cli("caption", data, "--model", write_tiny_wd_onnx(tmp_path / "helper-built"), "--overwrite") == 0
    assert _text(data / "wide.txt") == "1girl, long hair, white pad, ^_^, shirt (red), solo, hatsune miku\n"


def test_mcut_and_the_tag_rules():
    from trainer.tools.captioners.tags import TagOptions, TagTable, merge_tags, mcut, wd_tags
    assert math.isclose(mcut([0.1, 0.2, 0.8, 0.9]), 0.5) and mcut([0.7]) == 0.0
    table = TagTable(["safe", "a_b", "(o)_(o)", "c_(d)", "chara"], [9, 0, 0, 0, 4])
    scores = [0.9, 0.5, 0.36, 0.2, 0.14]
    assert wd_tags(scores, table, TagOptions()) == ["a b", "(o)_(o)"]
    # MCut: general 0.5/0.36/0.2 -> the widest gap is .36-.2: .28; characters never below 0.15
    assert wd_tags(scores, table, TagOptions(use_mcut=True, ratings=True)) == ["safe", "a b", "(o)_(o)"]
    assert merge_tags("x, a b", ["a b", "c"]) == "x, a b, c"


def test_batch_skips_appends_resumes_and_names_unreadable_images(wd, tmp_path, capsys, monkeypatch):
    import trainer.tools.caption as caption
    data = tmp_path / "data"
    for name in ("a", "b", "c"):
        _red(data / f"{name}.png", (40, 40))
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    (data / "c.txt").write_text("old tag, 1girl\n", encoding="utf-8")
    real = caption.atomic_write_bytes
    calls = []

    def stop_at_the_second(path, data_bytes):  # the run is stopped while it writes b's caption
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, data_bytes)
    monkeypatch.setattr(caption, "atomic_write_bytes", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        cli("caption", data, "--model", wd, "--device", "cpu", "--batch", 1)
    assert (data / "a.txt").is_file() and not (data / "b.txt").exists()
    assert not list(data.glob(".*")), "no temporary file left by the stop"
    monkeypatch.setattr(caption, "atomic_write_bytes", real)
    first = (data / "a.txt").stat().st_mtime_ns
    capsys.readouterr()
    assert cli("caption", data, "--model", wd, "--device", "cpu", "--batch", 1) == 0  # resumes: b only
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"wrote {data / 'b.txt'}"] and (data / "a.txt").stat().st_mtime_ns == first
    assert f"skipped '{data / 'broken.png'}'" in err and "would not open: broken.png" in err
    assert re.search(r"captioned 2/2 \(\d+\.\d+ images/s\)", err), err
    assert _text(data / "c.txt") == "old tag, 1girl\n"
    assert cli("caption", data, "--model", wd, "--device", "cpu", "--append", "--exclude-tags", "solo") == 0
    assert _text(data / "c.txt") == "old tag, 1girl, long hair, bgr red, ^_^, shirt (red), hatsune miku\n"


def test_a_hub_id_tags_from_the_local_cache_offline_and_says_how_to_download_what_is_not_there(wd, tmp_path, capsys,
                                                                                              monkeypatch):
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    for repo, files in (("SmilingWolf/wd-tiny-tagger-v3", ("model.onnx", "selected_tags.csv")),
                        ("SmilingWolf/wd-half-tagger-v3", ())):  # only its config.json was fetched
        snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        (snapshot.parent.parent / "refs").mkdir()
        (snapshot.parent.parent / "refs" / "main").write_text("abc123")
        (snapshot / "config.json").write_text('{"architecture": "vit_base_patch16_448", "num_classes": 14}')
        for name in files:
            (snapshot / name).write_bytes((wd / name).read_bytes())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    data = tmp_path / "data"
    _red(data / "sq.png", (24, 24))
    assert cli("caption", data, "--model", "SmilingWolf/wd-tiny-tagger-v3") == 0  # HF_HUB_OFFLINE is set
    assert _text(data / "sq.txt") == "1girl, long hair, bgr red, ^_^, shirt (red), solo, hatsune miku\n"
    assert cli("caption", data, "--model", "SmilingWolf/wd-half-tagger-v3", "--overwrite") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is not downloaded yet" in err[-1] and "hf download SmilingWolf/wd-half-tagger-v3" in err[-1]


def test_wd_tagger_bad_input_is_one_line(wd, tmp_path, capsys):
    data = tmp_path / "data"
    _red(data / "a.png", (20, 20))
    no_csv = tmp_path / "no-csv"
    no_csv.mkdir()
    (no_csv / "model.onnx").write_bytes((wd / "model.onnx").read_bytes())
    other = tmp_path / "other-csv"
    other.mkdir()
    (other / "model.onnx").write_bytes((wd / "model.onnx").read_bytes())
    (other / "selected_tags.csv").write_text("tag_id,name,category,count\n1,x,0,1\n", encoding="utf-8")
    for model, said in [(no_csv, "no selected_tags.csv"), (other, "lists 1 tags; the two files are not of one model"),
                        ("SmilingWolf/atelier-no-such-tagger", "is not downloaded yet")]:
        assert cli("caption", data, "--model", model, "--device", "cpu") == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("loading ")]
        assert len(err) == 1 and said in err[0], err
    assert cli("caption", data, "--model", wd, "--style", "short") == 2
    assert "--style applies to the vision-language models" in capsys.readouterr().err
    assert not (data / "a.txt").exists()


# ------------------------------------------------------------------------------------------------
# vision-language models
# ------------------------------------------------------------------------------------------------

VISION = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<image>")


def _template(image: str) -> str:
    """A ChatML template that writes ``image`` for each image part (as the real Qwen and JoyCaption templates do)."""
    return ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{%- if m['content'] is string %}"
            "{{ m['content'] }}{%- else %}{%- for c in m['content'] %}{%- if c['type'] == 'image' %}{{ '" + image +
            "' }}{%- else %}{{ c['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def _qwen_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer in Qwen2's format (every byte a token, Qwen's special tokens, the vision tokens),
    built with the tokenizers library (as trainer.families.common.tiny_text does, without its diffusers imports)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "pad_token": "<|endoftext|>",
        "eos_token": "<|im_end|>"}), encoding="utf-8")


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    from transformers import (AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from trainer.tools.captioners.vlm import image_only_processor_class
    root = tmp_path_factory.mktemp("vlms")
    _qwen_tokenizer(root / "tokenizer")
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    ids = dict(zip(VISION, tok.convert_tokens_to_ids(list(VISION))))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=eos,
                pad_token_id=tok.pad_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    qwen_images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8, merge_size=2,
                                           temporal_patch_size=2)
    qwen_template = _template("<|vision_start|><|image_pad|><|vision_end|>")
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(vision, fullatt_block_indexes=[0], window_size=16), **tokens)).save_pretrained(root / "q25")
    image_only_processor_class("qwen2_5_vl")(qwen_images, tok, chat_template=qwen_template).save_pretrained(root / "q25")
    torch.manual_seed(1)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(text, head_dim=8, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                         "mrope_interleaved": True}),
        vision_config=dict(vision, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        **tokens)).save_pretrained(root / "q3")
    image_only_processor_class("qwen3_vl")(qwen_images, tok, chat_template=qwen_template).save_pretrained(root / "q3")
    torch.manual_seed(2)
    LlavaForConditionalGeneration(LlavaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(text, model_type="llama"), image_token_index=ids["<image>"], vision_feature_layer=-1,
        vision_feature_select_strategy="full")).save_pretrained(root / "llava")
    LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"height": 32, "width": 32}, do_center_crop=False),
                   tokenizer=tok, patch_size=8, vision_feature_select_strategy="full", image_token="<image>",
                   num_additional_image_tokens=0, chat_template=_template("<image>")).save_pretrained(root / "llava")
    other = root / "paligemma"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "paligemma"}', encoding="utf-8")
    return {"qwen2_5_vl": root / "q25", "qwen3_vl": root / "q3", "llava": root / "llava", "other": other}


def _greedy(folder: Path, model_type: str, images, instruction: str, new_tokens: int) -> str:
    """What the model says, computed here with transformers: the checkpoint's template, the images, greedy."""
    import transformers

    from trainer.tools.captioners.vlm import VLM_CLASSES, image_only_processor_class
    proc = (image_only_processor_class(model_type) if model_type != "llava" else transformers.AutoProcessor) \
        .from_pretrained(folder)
    model = getattr(transformers, VLM_CLASSES[model_type]).from_pretrained(folder).eval()
    turns = [{"role": "system", "content": "You are a helpful image captioner."}] if model_type == "llava" else []
    turns.append({"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": instruction}]})
    prompt = proc.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert prompt.count("<image>" if model_type == "llava" else "<|vision_start|>") == len(images)
    inputs = proc(text=[prompt], images=list(images), return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return " ".join(proc.batch_decode(ids[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0].split())


def test_a_chat_template_that_takes_the_turn_as_a_string_gets_the_image_token_before_the_instruction():
    from trainer.tools.captioners.vlm import VlmCaptioner

    class StringTemplate:  # as a Llama template that adds message['content'] to a string
        image_token = "<image>"

        def __init__(self, places_image: bool):
            self.places_image = places_image

        def apply_chat_template(self, turns, tokenize, add_generation_prompt):
            text = turns[-1]["content"]
            if not isinstance(text, str):
                raise TypeError("can only concatenate str (not 'list') to str")
            return ("<image>" if self.places_image else "") + f"[{turns[0]['content']}] {text}"
    own = VlmCaptioner("llava", None, StringTemplate(False), "cpu", "Describe it.", 8, False)
    assert own.prompt(1) == "[You are a helpful image captioner.] <image>\nDescribe it."
    placed = VlmCaptioner("llava", None, StringTemplate(True), "cpu", "Describe it.", 8, False)
    assert placed.prompt(1) == "<image>[You are a helpful image captioner.] Describe it."


@pytest.mark.slow
def test_vlm_captioners_write_what_the_model_says_for_the_template_and_images(vlms, tmp_path, capsys, monkeypatch):
    from trainer.data.images import open_rgb
    from trainer.tools.captioners import vlm
    data, before = tmp_path / "data", tmp_path / "before"
    _red(data / "a.png", (40, 30))
    before.mkdir()
    Image.new("RGB", (30, 40), (20, 20, 200)).save(before / "a.png")
    _red(data / "lonely.png", (20, 20))
    for model_type in ("qwen2_5_vl", "qwen3_vl", "llava"):
        assert cli("caption", data, "--model", vlms[model_type], "--device", "cpu", "--style", "short",
                   "--max-new-tokens", 5, "--prefix", "sks", "--overwrite") == 0, capsys.readouterr().err
        said = _greedy(vlms[model_type], model_type, [open_rgb(data / "a.png")], vlm.STYLES["short"], 5)
        assert said and _text(data / "a.txt") == f"sks, {said}\n", model_type
    # an edit pair: the before image first, then the edited one, with the edit instruction
    assert cli("caption", data, "--model", vlms["qwen2_5_vl"], "--device", "cpu", "--style", "edit", "--control",
               before, "--max-new-tokens", 4, "--overwrite") == 0
    err = capsys.readouterr().err
    assert "1 images have no before image" in err and "lonely.png" in err
    said = _greedy(vlms["qwen2_5_vl"], "qwen2_5_vl", [open_rgb(before / "a.png"), open_rgb(data / "a.png")],
                   vlm.STYLES["edit"], 4)
    assert _text(data / "a.txt") == f"{said}\n"
    # refused in one line: edit pairs without pairs, an unsupported model, 4-bit on the CPU, a large model on the CPU
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    monkeypatch.setattr(vlm, "CPU_CONFIRM_PARAMS", 1)
    for args, said in [(("--model", vlms["qwen3_vl"], "--style", "edit", "--control", nothing), "no edit pairs"),
                       (("--model", vlms["other"]), "qwen2_5_vl, qwen3_vl, llava"),
                       (("--model", vlms["llava"], "--load-in-4bit"), "--load-in-4bit needs a CUDA GPU"),
                       (("--model", vlms["llava"], "--style", "edit", "--control", before), "reads one"),
                       (("--model", vlms["llava"]), "per image, ")]:
        assert cli("caption", data, "--device", "cpu", "--overwrite", *args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
        assert len(err) == 1 and said in err[0], err
    assert cli("caption", data, "--model", vlms["llava"], "--device", "cpu", "--overwrite", "--yes",
               "--max-new-tokens", 2) == 0
    assert "starting (--yes)" in capsys.readouterr().err
