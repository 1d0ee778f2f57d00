"""Layers: parameters, initialisers, ``Linear``, the attention layers and what a small
transformer needs (embeddings, LayerNorm, activations, feed-forward, blocks, loss)."""

from attnlab.nn.attention import MultiheadAttention, SelfAttention
from attnlab.nn.layers import (
    GELU,
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    ReLU,
    Sequential,
    TransformerBlock,
)
from attnlab.nn.linear import Linear
from attnlab.nn.loss import CrossEntropyLoss
from attnlab.nn.module import Module, Parameter

__all__ = [
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "FeedForward",
    "GELU",
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
