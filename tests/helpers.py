"""Helpers shared by test modules (import them as ``from helpers import ...``)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Text to train a small byte-level BPE tokenizer on (no tokenizer is downloaded).
CORPUS = [
    "The cat sat on the mat. The dog sat on the log.",
    "A transformer attends to every earlier token of the text it reads.",
    "Keys and values are cached, so each new token costs one step.",
    "Once upon a time there was a small model that learned to count: one, two, three.",
    "Café, naïve, Zürich: bytes make every word spellable.",
]


def byte_bpe_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    """Train a GPT-2-style byte-level BPE tokenizer on :data:`CORPUS`; save it as ``path``
    (``tokenizer.json``) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path))
    return path


def random_gpt2(
    folder: Path,
    *,
    seed: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    vocab_size: int,
    n_positions: int = 64,
    scale: float = 1.0,
    **config,
):
    """A ``transformers`` ``GPT2LMHeadModel`` with every parameter random (biases and
    LayerNorm weights too, drawn after ``torch.manual_seed(seed)``), saved to ``folder``
    as safetensors; returns the torch model (eval mode, eager attention for the maps)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, bos_token_id=0, eos_token_id=0, **config)
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith(("wte.weight", "wpe.weight")):
                p.copy_(0.5 * scale * torch.randn_like(p))
            else:  # Conv1D (in, out)
                p.copy_(scale * torch.randn_like(p) / p.shape[0] ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model
