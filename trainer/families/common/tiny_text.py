"""Offline tokenizers for the tiny built-in models (no hub): a T5-style SentencePiece Unigram tokenizer and a
Qwen-style byte-level BPE one with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

_WORDS = ["a", "photo", "of", "the", "sks", "dog", "cat", "red", "blue", "green", "square", "circle", "on",
          "white", "black", "background", "painting", "style", "in", "an", "with", "and", "triangle", "yellow"]


def write_tiny_t5_tokenizer(folder: Path, max_length: int = 64) -> None:
    """A T5-style (SentencePiece Unigram) tokenizer built offline with the ``tokenizers`` library:
    ``<pad>``=0, ``</s>``=1, ``<unk>``=2, a few whole words and every printable ASCII character."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
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


def write_tiny_qwen_tokenizer(folder: Path, max_length: int = 128) -> None:
    """A byte-level BPE tokenizer in Qwen2's format (every byte a token, Qwen's special tokens, the chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from trainer.families.common.sd_kit.tiny import _bytes_to_unicode
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(set(_bytes_to_unicode().values())))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": max_length, "pad_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}), encoding="utf-8")
