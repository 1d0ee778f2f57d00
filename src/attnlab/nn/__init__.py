"""Layers: parameters, initialisers, ``Linear``, the attention layers, what a transformer
needs (embeddings, LayerNorm, activations, loss) and the blocks models are built from."""

from attnlab.nn.attention import Attention, KVCache, MultiheadAttention, SelfAttention
from attnlab.nn.blocks import FeedForward, TransformerBlock
from attnlab.nn.hooks import ActivationCache, HookPoint
from attnlab.nn.layers import (
    GELU,
    Dropout,
    Embedding,
    LayerNorm,
    ReLU,
    Sequential,
)
from attnlab.nn.linear import Linear
from attnlab.nn.loss import CrossEntropyLoss
from attnlab.nn.module import Module, Parameter

__all__ = [
    "ActivationCache",
    "Attention",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "FeedForward",
    "GELU",
    "HookPoint",
    "KVCache",
    "LayerNorm",
    "Linear",
    "Module",
    "MultiheadAttention",
    "Parameter",
    "ReLU",
    "SelfAttention",
    "Sequential",
    "TransformerBlock",
]

# Llama-style decoder pieces
from attnlab.nn.blocks import GatedFeedForward  # noqa: E402
from attnlab.nn.layers import RMSNorm, RotaryEmbedding, SiLU  # noqa: E402

__all__ += ["GatedFeedForward", "RMSNorm", "RotaryEmbedding", "SiLU"]
