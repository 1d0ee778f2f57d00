"""The reference ("naive") attention kernel: the whole ``(..., Hq, L, S)`` score matrix.

This is the "equivalent to" math of :func:`~attnlab.scaled_dot_product_attention`, forward
and backward, written once against the arrays' namespace ``spec.xp``: NumPy (with in-place
updates where NumPy allows them) or any other Array API library, whose arrays stay in that
library and on their device. It is what the dispatcher runs for small problems, for dropout,
for every non-NumPy array, and whenever the weights themselves are wanted
(:func:`~attnlab.attention_weights`, the trace, the layers' ``need_weights=True``) or the
scores are soft-capped (``spec.softcap``). Axis legend: see :mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import generator
from attnlab.core._namespace import (
    add_,
    as_dtype,
    fill_forbidden,
    from_host,
    is_bool,
    mT,
    mul_,
    namespace,
    where_scalar,
)
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


def _reshape(x, shape: tuple):
    return x.reshape(shape) if isinstance(x, np.ndarray) else namespace(x).reshape(x, shape)


def grouped_matmul(a, kv, groups: int):
    """``a (..., Hq, L, X) @ kv (..., H, X, Y)`` with ``Hq = groups * H``: query head ``h``
    meets key/value head ``h // groups`` (torch's ``enable_gqa``), each ``kv`` head serving
    its group by broadcasting, never repeated: ``(..., Hq, L, Y)``. Any namespace; leading
    dims broadcast."""
    if groups == 1:
        return a @ kv
    *lead, Hq, L, X = a.shape
    kv = kv[..., None, :, :] if isinstance(kv, np.ndarray) else namespace(kv).expand_dims(kv, axis=-3)
    out = _reshape(a, (*lead, Hq // groups, groups, L, X)) @ kv  # (..., H, G, L, Y)
    return _reshape(out, (*out.shape[:-4], Hq, L, out.shape[-1]))


def _matmul_kv(spec: AttentionSpec, a, kv):
    """``a (..., Hq, L, X) @ kv`` for ``kv (..., H, X, Y)``, the caller's key/value heads
    (transposed as needed), each serving its group of query heads: ``(..., Hq, L, Y)``, or
    None where the heads must be repeated instead (:func:`_grouped`)."""
    return grouped_matmul(a, kv, spec.gqa_groups) if _grouped(spec) else None


def _raw_scores(spec: AttentionSpec):
    """The scaled scores ``q k^T * scale``, ``(..., Hq, L, S)``: no cap, no mask; fresh."""
    # The scale goes on the (L, E) queries, not on the (L, S) scores: one pass fewer.
    q = scaled(spec.query, spec.scale)
    s = _matmul_kv(spec, q, mT(spec.key))
    return q @ mT(spec.full_key) if s is None else s


def _capped(spec: AttentionSpec, s):
    """``(softcap * tanh(s / softcap), tanh(s / softcap))`` for fresh scaled scores ``s``
    (overwritten for NumPy), as ``transformers``' Gemma 2 computes them; ``(s, None)`` when
    ``spec.softcap`` is None."""
    cap = spec.softcap
    if cap is None:
        return s, None
    if isinstance(s, np.ndarray):
        t = np.tanh(np.divide(s, cap, out=s), out=s)
        return scaled(t, cap), t
    t = spec.xp.tanh(s / cap)
    return t * cap, t


def _masked(spec: AttentionSpec, s):
    """The mask on fresh scores ``s``, in place for NumPy (the mask broadcasts to the
    scores' shape; validated): ``-inf`` where a bool mask is False or a key lies in the
    causal future, a float mask added."""
    if spec.is_causal:
        return fill_forbidden(s, causal_mask(spec.L, spec.S, like=s))
    if spec.attn_mask is None:
        return s
    if is_bool(spec.attn_mask):
        return fill_forbidden(s, spec.attn_mask)
    return add_(s, spec.attn_mask)


def scores(spec: AttentionSpec):
    """Masked, scaled (and soft-capped) scores ``(..., Hq, L, S)``; forbidden entries are
    ``-inf``."""
    return _masked(spec, _capped(spec, _raw_scores(spec))[0])


def scores_backward(spec: AttentionSpec, grad_s, tanh=None, *, through_mask: bool = True):
    """``(grad_query, grad_key)`` from ``grad_s (..., Hq, L, S)``, the gradient of
    :func:`scores`; the caller's shapes (grouped-query and broadcast dims summed back).

    The soft-cap's derivative ``1 - tanh^2`` uses ``tanh`` (the forward pass's
    ``tanh(s / softcap)``; None: recomputed). ``through_mask``: entries that a bool mask or
    the causal future set to ``-inf`` take no gradient (a float mask passes it on); off
    where ``grad_s`` is already zero there (the softmax's backward)."""
    xp = spec.xp
    if through_mask:
        forbidden = None
        if spec.is_causal:
            forbidden = ~causal_mask(spec.L, spec.S, like=grad_s)
        elif spec.attn_mask is not None and is_bool(spec.attn_mask):
            forbidden = ~spec.attn_mask
        if forbidden is not None:
            grad_s = where_scalar(forbidden, 0.0, grad_s)
    if spec.softcap is not None:
        if tanh is None:
            tanh = _capped(spec, _raw_scores(spec))[1]
        slope = tanh * tanh  # fresh: 1 - tanh^2 in place, then times grad_s
        slope = (np.subtract(1.0, slope, out=slope) if isinstance(slope, np.ndarray) else 1.0 - slope)
        grad_s = mul_(slope, grad_s)
    # scores = (q * scale) @ k^T: the scale lands on the (L, E) and (S, E) sides.
    grad_q = _matmul_kv(spec, grad_s, spec.key)
    grad_q = scaled(xp.matmul(grad_s, spec.full_key) if grad_q is None else grad_q, spec.scale)  # (..., Hq, L, E)
    grad_k = xp.matmul(mT(grad_s), scaled(spec.query, spec.scale))  # (..., Hq, S, E)
    return reduce_to(grad_q, spec.query.shape, 1), reduce_to(grad_k, spec.key_shape, spec.gqa_groups)


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
    return w @ spec.full_value if out is None else out


def backward(spec: AttentionSpec, grad_out, *, rng=None):
    """``(grad_query, grad_key, grad_value)`` by recomputing the weights; GQA and broadcast
    dims are summed back to the caller's shapes. Plain array math (no autograd), so it runs
    in every namespace."""
    xp = spec.xp
    s, tanh = _capped(spec, _raw_scores(spec))
    probs = softmax_(_masked(spec, s))  # (..., Hq, L, S), fresh: in place
    keep = dropout_keep(spec, probs.shape, rng)
    dropped = probs if keep is None else probs * keep
    grad_v = xp.matmul(mT(dropped), grad_out)  # (..., Hq, S, Ev)
    grad_p = _matmul_kv(spec, grad_out, mT(spec.value))  # (..., Hq, L, S)
    if grad_p is None:
        grad_p = xp.matmul(grad_out, mT(spec.full_value))
    if keep is not None:
        grad_p = mul_(grad_p, keep)
    grad_s = probs * (grad_p - row_sum(grad_p * probs))  # zero where probs are (masked keys)
    grad_q, grad_k = scores_backward(spec, grad_s, tanh, through_mask=False)
    return grad_q, grad_k, reduce_to(grad_v, spec.value_shape, spec.gqa_groups)
