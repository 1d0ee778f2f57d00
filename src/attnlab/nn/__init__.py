"""Layers: parameters, initialisers, ``Linear`` and the attention layers."""

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

__all__ = ["Linear", "Module", "MultiheadAttention", "Parameter", "SelfAttention"]
__all__ += [
    "GELU",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "FeedForward",
    "LayerNorm",
    "ReLU",
    "Sequential",
    "TransformerBlock",
]
