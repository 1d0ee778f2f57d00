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


def _grouped(spec: AttentionSpec) -> bool:
    """Whether NumPy can serve each group of query heads from its key/value head by
    broadcasting (no repeated copy of the keys and values): the same per-head matrix
    products, so the same numbers as with the heads repeated."""
    G = spec.gqa_groups
    return (G > 1 and spec.xp is np and spec.query.ndim >= 3 and spec.key.ndim >= 3
            and spec.key.shape[-3] * G == spec.query.shape[-3])


def _by_group(a: np.ndarray, G: int) -> np.ndarray:
    """``(..., Hq, N, D) -> (..., Hq / G, G, N, D)``."""
    return a.reshape(*a.shape[:-3], a.shape[-3] // G, G, *a.shape[-2:])


def _matmul_kv(spec: AttentionSpec, a, kv):
    """``a (..., Hq, L, X) @ kv`` for ``kv (..., H, X, Y)``, the caller's key/value heads
    (transposed as needed), each serving its group of query heads: ``(..., Hq, L, Y)``, or
    None where the heads must be repeated instead (:func:`_grouped`)."""
    if not _grouped(spec):
        return None
    out = np.matmul(_by_group(a, spec.gqa_groups), kv[..., :, None, :, :])  # (..., H, G, L, Y)
    *lead, H, G, L, Y = out.shape
    return out.reshape(*lead, H * G, L, Y)


def scores(spec: AttentionSpec):
    """Masked, scaled scores ``(..., Hq, L, S)``; forbidden entries are ``-inf``."""
    # The scale goes on the (L, E) queries, not on the (L, S) scores: one pass fewer.
    q = scaled(spec.query, spec.scale)
    s = _matmul_kv(spec, q, mT(spec.key))
    if s is None:
        s = spec.xp.matmul(q, mT(spec.full_key))
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
    w = weights(spec, rng=rng)
    out = _matmul_kv(spec, w, spec.value)
    return spec.xp.matmul(w, spec.full_value) if out is None else out


def backward(spec: AttentionSpec, grad_out, *, rng=None):
    """``(grad_query, grad_key, grad_value)`` by recomputing the weights; GQA and broadcast
    dims are summed back to the caller's shapes. Plain array math (no autograd), so it runs
    in every namespace."""
    xp = spec.xp
    probs = softmax_(scores(spec))  # (..., Hq, L, S), fresh: in place
    keep = dropout_keep(spec, probs.shape, rng)
    dropped = probs if keep is None else probs * keep
    grad_v = xp.matmul(mT(dropped), grad_out)  # (..., Hq, S, Ev)
    grad_p = _matmul_kv(spec, grad_out, mT(spec.value))  # (..., Hq, L, S)
    if grad_p is None:
        grad_p = xp.matmul(grad_out, mT(spec.full_value))
    if keep is not None:
        grad_p = mul_(grad_p, keep)
    grad_s = probs * (grad_p - row_sum(grad_p * probs))
    # scores = (q * scale) @ k^T: the scale lands on the (L, E) and (S, E) sides.
    grad_q = _matmul_kv(spec, grad_s, spec.key)
    grad_q = scaled(xp.matmul(grad_s, spec.full_key) if grad_q is None else grad_q, spec.scale)  # (..., Hq, L, E)
    grad_k = xp.matmul(mT(grad_s), scaled(spec.query, spec.scale))  # (..., Hq, S, E)
    return (
        reduce_to(grad_q, spec.query.shape, 1),
        reduce_to(grad_k, spec.key_shape, spec.gqa_groups),
        reduce_to(grad_v, spec.value_shape, spec.gqa_groups),
    )
