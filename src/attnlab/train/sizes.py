"""How big a :class:`~attnlab.models.TinyTransformer` and its training run are, computed from
the configs alone (nothing is allocated), so that a size that cannot fit is refused before
any array exists: a checkpoint whose header asks for far more weights than the file holds,
or ``attnlab train --d-model 100000``.
"""

from __future__ import annotations

import os

import numpy as np

from attnlab.models.tiny import TinyTransformerConfig

__all__ = ["available_memory", "parameter_count", "training_bytes"]


def parameter_count(config: TinyTransformerConfig) -> int:
    """The number of weights of ``TinyTransformer(config)``, without building it.

    Token and position embeddings (none with rotary positions), per block two norms
    (LayerNorm: weight and bias; RMSNorm: weight), the fused Q/K/V projection (``n_heads``
    query heads, ``n_kv_heads`` key and value heads), the output projection and the
    feed-forward linears (two, or three when gated; biases when ``config.bias``), then the
    final norm and the bias-free LM head.

    >>> parameter_count(TinyTransformerConfig(vocab_size=32, context_length=32, d_model=64,
    ...                                       n_layers=2, d_ff=128))
    73216
    >>> parameter_count(TinyTransformerConfig.llama(vocab_size=32, d_model=64, n_layers=2, d_ff=128))
    78144
    """
    c = config
    V, C, D, F, N = c.vocab_size, c.context_length, c.d_model, c.d_ff, c.n_layers
    b = 1 if c.bias else 0
    norm = 2 * D if c.norm == "layernorm" else D
    qkv = D + 2 * c.kv_heads * (D // c.n_heads)
    attn = qkv * D + b * qkv + D * D + b * D
    mlp = 3 * D * F + b * (2 * F + D) if c.mlp == "gated" else D * F + b * F + F * D + b * D
    positions = C * D if c.position == "learned" else 0
    return V * D + positions + N * (2 * norm + attn + mlp) + norm + V * D


def training_bytes(config: TinyTransformerConfig, *, batch_size: int, seq_len: int,
                   eval_chunk: int = 500) -> int:
    """A rough upper estimate of the memory one training run needs, in bytes.

    Weights, gradients, AdamW's two moments, the last-good copy and a checkpoint's copy
    (6 x the weights), plus the activations a training step keeps for its backward pass
    (per block and token: about 12 widths ``D``, 3 hidden widths ``F`` (5 gated) and 3 rows of
    scores per head) and the logits, for the larger of the batch and the evaluation chunk.

    >>> cfg = TinyTransformerConfig(d_model=100_000, d_ff=200_000)
    >>> training_bytes(cfg, batch_size=64, seq_len=32) > 10**12      # about 4 TB
    True
    """
    c = config
    itemsize = np.dtype(c.dtype).itemsize
    rows = max(batch_size, eval_chunk) * seq_len
    per_token = c.n_layers * (12 * c.d_model + (5 if c.mlp == "gated" else 3) * c.d_ff
                              + 3 * c.n_heads * seq_len) + 3 * c.vocab_size
    return itemsize * (6 * parameter_count(c) + rows * per_token)


def available_memory() -> int | None:
    """Bytes of memory this process can still get (Linux ``MemAvailable``), or None when the
    system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
