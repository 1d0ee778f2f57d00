"""The reference ("naive") attention kernel: the whole ``(..., Hq, L, S)`` score matrix.

This is the "equivalent to" math of :func:`~attnlab.scaled_dot_product_attention`, forward
and backward, written once against the arrays' namespace ``spec.xp``: NumPy (with in-place
updates where NumPy allows them) or any other Array API library, whose arrays stay in that
library and on their device. It is what the dispatcher runs for small problems, for dropout,
for every non-NumPy array, and whenever the weights themselves are wanted
(:func:`~attnlab.attention_weights`, the trace, the layers' ``need_weights=True``). Axis
legend: see :mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import generator
from attnlab.core._namespace import add_, as_dtype, fill_forbidden, from_host, is_bool, mT, mul_
from attnlab.core._reduce import row_sum
from attnlab.core.masks import causal_mask
from attnlab.core.softmax import softmax_
from attnlab.core.spec import AttentionSpec, reduce_to


def scaled(x, scale: float):
    """``x * scale`` in ``x``'s dtype."""
    return x * x.dtype.type(scale) if isinstance(x, np.ndarray) else x * scale


def scores(spec: AttentionSpec):
    """Masked, scaled scores ``(..., Hq, L, S)``; forbidden entries are ``-inf``."""
    # The scale goes on the (L, E) queries, not on the (L, S) scores: one pass fewer.
    s = spec.xp.matmul(scaled(spec.query, spec.scale), mT(spec.full_key))
    # Masks in place for NumPy (the mask broadcasts to the scores' shape; validated).
    if spec.is_causal:
        return fill_forbidden(s, causal_mask(spec.L, spec.S, like=s))
    if spec.attn_mask is None:
        return s
    if is_bool(spec.attn_mask):
        return fill_forbidden(s, spec.attn_mask)
    return add_(s, spec.attn_mask)


def dropout_keep(spec: AttentionSpec, shape: tuple, rng):
    """Scaled keep-mask ``keep / (1 - p)`` drawn from ``rng``, or None when p == 0.

    The mask is drawn on the host by the NumPy Generator (the same mask for the same seed in
    every library) and moved once to the arrays' device.
    """
    return dropout_mask(spec.query, spec.dropout_p, shape, rng)


def dropout_mask(like, p: float, shape: tuple, rng):
    """Scaled keep-mask ``keep / (1 - p)`` of ``shape`` in ``like``'s library, device and
    dtype, or None when p == 0 (what :func:`dropout_keep` draws, for a layer that holds its
    own weights)."""
    if p == 0.0:
        return None
    keep = generator(rng).random(tuple(shape)) >= p
    return scaled(as_dtype(from_host(keep, like), like.dtype), 1.0 / (1.0 - p))


def weights(spec: AttentionSpec, *, rng=None):
    """The attention weights after dropout, ``(..., Hq, L, S)``."""
    probs = softmax_(scores(spec))  # the scores are fresh: in place
    keep = dropout_keep(spec, probs.shape, rng)
    return probs if keep is None else mul_(probs, keep)


def forward(spec: AttentionSpec, *, rng=None):
    """``weights @ value``: ``(..., Hq, L, Ev)``."""
    return spec.xp.matmul(weights(spec, rng=rng), spec.full_value)


def backward(spec: AttentionSpec, grad_out, *, rng=None):
    """``(grad_query, grad_key, grad_value)`` by recomputing the weights; GQA and broadcast
    dims are summed back to the caller's shapes. Plain array math (no autograd), so it runs
    in every namespace."""
    xp = spec.xp
    probs = softmax_(scores(spec))  # (..., Hq, L, S), fresh: in place
    keep = dropout_keep(spec, probs.shape, rng)
    dropped = probs if keep is None else probs * keep
    grad_v = xp.matmul(mT(dropped), grad_out)  # (..., Hq, S, Ev)
    grad_p = xp.matmul(grad_out, mT(spec.full_value))  # (..., Hq, L, S)
    if keep is not None:
        grad_p = mul_(grad_p, keep)
    grad_s = probs * (grad_p - row_sum(grad_p * probs))
    # scores = (q * scale) @ k^T: the scale lands on the (L, E) and (S, E) sides.
    grad_q = scaled(xp.matmul(grad_s, spec.full_key), spec.scale)  # (..., Hq, L, E)
    grad_k = xp.matmul(mT(grad_s), scaled(spec.query, spec.scale))  # (..., Hq, S, E)
    return (
        reduce_to(grad_q, spec.query.shape, 1),
        reduce_to(grad_k, spec.key_shape, spec.gqa_groups),
        reduce_to(grad_v, spec.value_shape, spec.gqa_groups),
    )
