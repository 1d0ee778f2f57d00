"""Helpers shared by test modules: tiny random models written as checkpoint folders."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np

from attnlab.io import save_tensors
from attnlab.models.bert import BertConfig, expected_shapes

# A BERT small enough to build in milliseconds, and a word-piece vocabulary that spells
# any lower-case ASCII text (letters, "##" letters, a few whole words, punctuation).
TINY_BERT = dict(vocab_size=80, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=16, max_position_embeddings=16)
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [*string.ascii_lowercase, *("##" + c for c in string.ascii_lowercase),
         "the", "bank", "river", "money", "cat", "sat", "on", "mat", ".", ",", "!", "?"]


def tiny_tokenizer(*, lowercase: bool = True, extra: int = 0):
    """A BERT word-piece ``tokenizers.Tokenizer`` over :data:`WORDS` (ids 0..68, plus
    ``extra`` more tokens)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    words = SPECIALS + WORDS + [f"extra{i}" for i in range(extra)]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return tok


def tiny_bert_weights(config: dict | None = None, *, seed: int = 0, prefix: str = "") -> dict:
    """Random ``transformers``-named tensors for a BERT of ``config`` (default :data:`TINY_BERT`)."""
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(BertConfig(**(config or TINY_BERT)))
    return {prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_tiny_bert(folder: Path, *, config: dict | None = None, tensors: dict | None = None,
                    prefix: str = "") -> Path:
    """A random tiny BERT checkpoint folder: config.json, model.safetensors, tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(TINY_BERT, model_type="bert") if config is None else config))
    save_tensors(folder / "model.safetensors", tiny_bert_weights(prefix=prefix) if tensors is None else tensors)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return folder
