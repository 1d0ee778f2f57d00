"""Layers: parameters, initialisers, ``Linear`` and the attention layers."""

from attnlab.nn.attention import MultiheadAttention, SelfAttention
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module, Parameter

__all__ = ["Linear", "Module", "MultiheadAttention", "Parameter", "SelfAttention"]
