"""The trained reference model used by kvtopo's quality benchmark.

``load_reference_model()`` loads the small Llama (``LlamaForCausalLM``,
GQA, RoPE, sdpa attention) and its character-level tokenizer from
``models/reference/`` (shipped inside the ``kvtopo.models`` package), offline,
in eval mode and float32.

The tokenizer is one token per character (a ``tokenizers`` WordLevel model
over single characters), so prompt lengths in tokens equal lengths in
characters. ``VOCAB`` fixes the id of every character; characters outside it
map to ``<unk>``.
"""
from __future__ import annotations

import os

__all__ = ["REFERENCE_DIR", "VOCAB", "build_tokenizer", "save_tokenizer", "load_tokenizer", "load_reference_model", "encode"]

REFERENCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference")

SPECIAL = ["<pad>", "<unk>", "<eos>"]
_EXTRA = "\u2019\u201d\u201c\u2018\u2026\u2014\u2013\u00df\u00b0"  # ’ ” “ ‘ … — – ß ° (seen in pydoc topics)
_MARKERS = "\u00ab\u00bb\u00bf"  # « » ¿
_GREEK = "".join(chr(c) for c in range(0x03B1, 0x03CA) if c != 0x03C2) + "".join(
    chr(c) for c in range(0x0391, 0x03AA) if c != 0x03A2
)
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127)) + _EXTRA + _MARKERS + _GREEK + "\u00b9\u00b2\u00b3"  # ¹ ² ³
VOCAB = {t: i for i, t in enumerate(SPECIAL + list(CHARS))}
PAD_ID, UNK_ID, EOS_ID = 0, 1, 2


def encode(text: str) -> list[int]:
    """Fast pure-Python char -> id encoding, identical to the saved tokenizer."""
    get = VOCAB.get
    return [get(c, UNK_ID) for c in text]


def build_tokenizer():
    """Character-level ``tokenizers.Tokenizer`` (WordLevel over single chars)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    return tok


def save_tokenizer(out_dir: str) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    build_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "eos_token": "<eos>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"pad_token": "<pad>", "unk_token": "<unk>", "eos_token": "<eos>"}, f, indent=2)


def load_tokenizer(path: str = REFERENCE_DIR):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(path, "tokenizer.json"),
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
        clean_up_tokenization_spaces=False,
    )


def load_reference_model(path: str = REFERENCE_DIR, attn_implementation: str = "sdpa"):
    """Return ``(model, tokenizer)``: LlamaForCausalLM in eval mode, float32, offline."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"no model.safetensors in {path}")
    config = LlamaConfig.from_pretrained(path, local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(
        path,
        config=config,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
    )
    model.eval()
    return model, load_tokenizer(path)
