"""The reference ("naive") attention kernel: the whole ``(..., Hq, L, S)`` score matrix.

This is the "equivalent to" math of :func:`~attnlab.scaled_dot_product_attention`, forward
and backward, written once. It is what the dispatcher runs for small problems, for dropout,
and whenever the weights themselves are wanted (:func:`~attnlab.attention_weights`, the
trace, the layers' ``need_weights=True``). Axis legend: see :mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import generator
from attnlab.core._reduce import row_sum
from attnlab.core.masks import causal_mask
from attnlab.core.softmax import softmax
from attnlab.core.spec import AttentionSpec, reduce_to


def scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """``x * scale`` in ``x``'s dtype."""
    return x * x.dtype.type(scale)


def scores(spec: AttentionSpec) -> np.ndarray:
    """Masked, scaled scores ``(..., Hq, L, S)``; forbidden entries are ``-inf``."""
    # The scale goes on the (L, E) queries, not on the (L, S) scores: one pass fewer.
    s = np.matmul(scaled(spec.query, spec.scale), np.swapaxes(spec.key, -1, -2))
    # Masks in place (the mask broadcasts to the scores' shape; validated).
    if spec.is_causal:
        np.copyto(s, -np.inf, where=~causal_mask(spec.L, spec.S))
    elif spec.attn_mask is not None:
        if spec.attn_mask.dtype == np.bool_:
            np.copyto(s, -np.inf, where=~spec.attn_mask)
        else:
            s += spec.attn_mask
    return s


def dropout_keep(spec: AttentionSpec, shape: tuple, rng) -> np.ndarray | None:
    """Scaled keep-mask ``keep / (1 - p)`` drawn from ``rng``, or None when p == 0."""
    if spec.dropout_p == 0.0:
        return None
    rng = generator(rng)
    keep = rng.random(shape) >= spec.dropout_p
    return keep.astype(spec.query.dtype) * spec.query.dtype.type(1.0 / (1.0 - spec.dropout_p))


def weights(spec: AttentionSpec, *, rng=None) -> np.ndarray:
    """The attention weights after dropout, ``(..., Hq, L, S)``."""
    probs = softmax(scores(spec), axis=-1)
    keep = dropout_keep(spec, probs.shape, rng)
    if keep is not None:
        probs *= keep
    return probs


def forward(spec: AttentionSpec, *, rng=None) -> np.ndarray:
    """``weights @ value``: ``(..., Hq, L, Ev)``."""
    return np.matmul(weights(spec, rng=rng), spec.value)


def backward(spec: AttentionSpec, grad_out: np.ndarray, *, rng=None):
    """``(grad_query, grad_key, grad_value)`` by recomputing the weights; GQA and broadcast
    dims are summed back to the caller's shapes."""
    probs = softmax(scores(spec), axis=-1)  # (..., Hq, L, S)
    keep = dropout_keep(spec, probs.shape, rng)
    dropped = probs if keep is None else probs * keep
    grad_v = np.matmul(np.swapaxes(dropped, -1, -2), grad_out)  # (..., Hq, S, Ev)
    grad_p = np.matmul(grad_out, np.swapaxes(spec.value, -1, -2))  # (..., Hq, L, S)
    if keep is not None:
        grad_p *= keep
    grad_s = probs * (grad_p - row_sum(grad_p * probs))
    # scores = (q * scale) @ k^T: the scale lands on the (L, E) and (S, E) sides.
    grad_q = scaled(np.matmul(grad_s, spec.key), spec.scale)  # (..., Hq, L, E)
    grad_k = np.matmul(np.swapaxes(grad_s, -1, -2), scaled(spec.query, spec.scale))  # (..., Hq, S, E)
    return (
        reduce_to(grad_q, spec.query.shape, 1),
        reduce_to(grad_k, spec.key_shape, spec.gqa_groups),
        reduce_to(grad_v, spec.value_shape, spec.gqa_groups),
    )
