"""The functional core: pure functions that hold all of attnlab's attention math."""

from attnlab.core.attention import (
    attention_weights,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    simple_attention,
)
from attnlab.core.blockwise import (
    blockwise_attention,
    blockwise_attention_backward,
    blockwise_attention_forward,
)
from attnlab.core.masks import causal_mask, convert_mha_mask, mask_to_bias, padding_mask
from attnlab.core.softmax import softmax, softmax_backward

__all__ = [
    "attention_weights",
    "blockwise_attention",
    "blockwise_attention_backward",
    "blockwise_attention_forward",
    "causal_mask",
    "convert_mha_mask",
    "mask_to_bias",
    "padding_mask",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "simple_attention",
    "softmax",
    "softmax_backward",
]
