"""attnlab: transformer self-attention from scratch in NumPy.

Exact (PyTorch's numbers), fast, trainable, real and visual. The functional core lives in
:mod:`attnlab.core` (naive and blockwise attention, masks, softmax), the layers in
:mod:`attnlab.nn`, optimizers and the recall task in :mod:`attnlab.train`, models (a tiny
transformer, a pretrained BERT) in :mod:`attnlab.models`, the text pipeline in
:mod:`attnlab.text`, plots and the HTML report in :mod:`attnlab.viz`, the logit lens,
attribution, ablation, patching, head detectors and attention rollout (all through the hook
points) in :mod:`attnlab.inspect`.

Axis legend (every docstring): ``...`` batch dims, ``Hq``/``H`` query/key-value heads,
``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head dim.
Boolean masks are True where a query may attend to a key.
"""

from attnlab._memory import freed_memory_kept, keep_freed_memory
from attnlab._threads import get_num_threads, set_num_threads
from attnlab.core import (
    apply_attention_weights,
    apply_attention_weights_backward,
    attention_scores,
    attention_scores_backward,
    attention_weights,
    blockwise_attention,
    blockwise_attention_backward,
    blockwise_attention_forward,
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
from attnlab.nn import (
    GELU,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    Linear,
    Module,
    MultiheadAttention,
    Parameter,
    ReLU,
    SelfAttention,
    Sequential,
    TransformerBlock,
)
from attnlab.trace import Trace, TraceStep, trace

__version__ = "0.1.0"

__all__ = [
    # functional core
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
    # layers
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
    # threads of attnlab's own parallel loops (like torch.set_num_threads), and memory reuse
    "get_num_threads",
    "set_num_threads",
    "keep_freed_memory",
    "freed_memory_kept",
    # step-by-step record of one attention call
    "Trace",
    "TraceStep",
    "trace",
]
