"""The functional core: pure functions that hold all of attnlab's attention math.

Modules, imported one way (each only imports those above it):

- ``_namespace``: which array library a call computes in (NumPy, or any Array API library
  such as torch, through ``array_api_compat``) and the few operations that differ;
- ``_reduce``: row and column reductions (BLAS tricks written once);
- ``masks``, ``softmax``: mask builders and converters; softmax and its backward;
- ``spec``: argument checking, one :class:`~attnlab.core.spec.AttentionSpec` per call;
- ``naive``: the full score matrix, forward and backward (the reference math);
- ``blockwise``: online-softmax tiles in ``O(L·E)`` memory, forward and backward;
- ``dispatch``: the public functions, which pick a kernel.
"""

from attnlab.core.blockwise import (
    blockwise_attention,
    blockwise_attention_backward,
    blockwise_attention_forward,
)
from attnlab.core.dispatch import (
    apply_attention_weights,
    apply_attention_weights_backward,
    attention_scores,
    attention_scores_backward,
    attention_weights,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    simple_attention,
)
from attnlab.core.masks import causal_mask, convert_mha_mask, mask_to_bias, padding_mask
from attnlab.core.softmax import softmax, softmax_backward

__all__ = [
    "apply_attention_weights",
    "apply_attention_weights_backward",
    "attention_scores",
    "attention_scores_backward",
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
