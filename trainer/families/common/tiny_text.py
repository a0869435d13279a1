"""Offline tokenizers for the tiny built-in models (no hub): a T5-style SentencePiece Unigram tokenizer and a
Qwen-style byte-level BPE one with a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from trainer.families.common.sd_kit.tiny import bytes_to_unicode

_WORDS = ["a", "photo", "of", "the", "sks", "dog", "cat", "red", "blue", "green", "square", "circle", "on",
          "white", "black", "background", "painting", "style", "in", "an", "with", "and", "triangle", "yellow"]


def write_tiny_t5_tokenizer(folder: Path, max_length: int = 64) -> None:
    """A T5-style (SentencePiece Unigram) tokenizer built offline with the ``tokenizers`` library:
    ``<pad>``=0, ``</s>``=1, ``<unk>``=2, a few whole words and every printable ASCII character."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("▁" + w, -2.0) for w in _WORDS] + [("▁", -3.0)]
    vocab += [(chr(c), -5.0) for c in range(33, 127)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5TokenizerFast", "model_max_length": max_length, "pad_token": "<pad>",
        "eos_token": "</s>", "unk_token": "<unk>", "extra_ids": 0, "additional_special_tokens": []}),
        encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}), encoding="utf-8")


# Qwen3's chat template cut to what Z-Image uses: one user turn, the generation prompt, thinking on (no empty
# think block)
CHAT_TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
                 "{%- endif %}{%- endif %}")


def write_tiny_qwen_tokenizer(folder: Path, max_length: int = 128, extra_special: Sequence[str] = ()) -> None:
    """A byte-level BPE tokenizer in Qwen2's format (every byte a token, Qwen's special tokens, the chat template);
    ``extra_special``: more special tokens after those (Qwen2.5-VL's vision tokens for a model that sees images)."""

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": max_length, "pad_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}), encoding="utf-8")


# Mistral Small 3.1's chat template cut to the text turns Flux.2 [dev] sends (a system prompt and one user turn, each
# a string or a list of {"type": "text"} parts)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set text = message['content'] %}{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', "
    "'text') | map(attribute='text') | join('') %}{%- endif %}{%- if message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}{{ '[INST]' + text + "
    "'[/INST]' }}{%- else %}{{ text + eos_token }}{%- endif %}{%- endfor %}")
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                   "[IMG_BREAK]", "[IMG_END]"]


def write_tiny_mistral_tokenizer(folder: Path, max_length: int = 512) -> None:
    """A byte-level BPE tokenizer with Mistral's special tokens (``[IMG]`` = id 8) and a text-only version of its chat
    template, where Flux.2 [dev] keeps its processor (the Pixtral image processor's config beside it)."""

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIAL)}
    for ch in sorted(set(bytes_to_unicode().values())):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(MISTRAL_SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "bos_token": "<s>",
        "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "chat_template": MISTRAL_CHAT_TEMPLATE}),
        encoding="utf-8")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": MISTRAL_CHAT_TEMPLATE}), encoding="utf-8")
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": 2, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}), encoding="utf-8")
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor",
        "patch_size": {"height": 8, "width": 8}, "size": {"longest_edge": 64}, "do_resize": True,
        "do_normalize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}),
        encoding="utf-8")


GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's ids 0-3


def write_tiny_gemma_tokenizer(folder: Path, max_length: int = 256) -> None:
    """A Gemma-style tokenizer (Lumina 2, Sana): every byte a token plus Gemma's ``▁``, Gemma's special tokens, ``<bos>`` before each text."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIAL)}
    for ch in ["\u2581", *sorted(set(bytes_to_unicode().values()))]:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(GEMMA_SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizerFast", "model_max_length": max_length, "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
        "add_eos_token": False}), encoding="utf-8")
