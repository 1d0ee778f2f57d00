"""attnlab: transformer self-attention from scratch in NumPy.

Exact (PyTorch's numbers), fast, trainable, real and visual. The functional core lives in
:mod:`attnlab.core`, the layers in :mod:`attnlab.nn`.

Axis legend (every docstring): ``...`` batch dims, ``Hq``/``H`` query/key-value heads,
``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head dim.
Boolean masks are True where a query may attend to a key.
"""

from attnlab.core import (
    attention_weights,
    causal_mask,
    convert_mha_mask,
    mask_to_bias,
    padding_mask,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    simple_attention,
    softmax,
    softmax_backward,
)
from attnlab.nn import Linear, Module, MultiheadAttention, Parameter, SelfAttention
from attnlab.trace import Trace, TraceStep, trace

__version__ = "0.1.0"

__all__ = [
    "Linear",
    "Module",
    "MultiheadAttention",
    "Parameter",
    "SelfAttention",
    "attention_weights",
    "causal_mask",
    "convert_mha_mask",
    "mask_to_bias",
    "padding_mask",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "simple_attention",
    "softmax",
    "softmax_backward",
    "Trace",
    "TraceStep",
    "trace",
]

# Training (issue 4): layers for small models, optimizers live in attnlab.train.
from attnlab.nn import (  # noqa: E402
    GELU,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    ReLU,
    Sequential,
    TransformerBlock,
)

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

# Fast attention (blockwise online softmax, O(L·E) memory).
from attnlab.core.blockwise import (  # noqa: E402
    blockwise_attention,
    blockwise_attention_backward,
    blockwise_attention_forward,
)

__all__ += ["blockwise_attention", "blockwise_attention_backward", "blockwise_attention_forward"]
