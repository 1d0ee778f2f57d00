"""Layers: parameters, initialisers, ``Linear`` and the attention layers."""

from attnlab.nn.attention import MultiheadAttention, SelfAttention
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module, Parameter
from attnlab.nn.layers import (  # noqa: I001  (after attention: layers builds on it)
    GELU,
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    ReLU,
    Sequential,
    TransformerBlock,
)
from attnlab.nn.loss import CrossEntropyLoss

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
