"""Argument checking for every attention call: one validated, normalised :class:`AttentionSpec`.

Axis legend, used in every docstring of attnlab:

    ...  any leading batch dims (B)
    Hq   query heads            H   key/value heads (Hq == H unless enable_gqa)
    L    query (target) length  S   key (source) length
    E    query/key head dim     Ev  value head dim

``L != S`` is the normal case (cross-attention). Boolean masks are True where a query may
attend to a key; float masks are added to the scores.

Every kernel (:mod:`attnlab.core.naive`, :mod:`attnlab.core.blockwise`) takes an
``AttentionSpec``; the public functions in :mod:`attnlab.core.dispatch` build it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnlab._validation import as_float_array, fmt_shape, probability, same_dtype, shape_error


@dataclass(frozen=True)
class AttentionSpec:
    """Validated inputs of one attention call (internal)."""

    query: np.ndarray  # (..., Hq, L, E)
    key: np.ndarray  # (..., Hq, S, E), GQA heads already repeated
    value: np.ndarray  # (..., Hq, S, Ev)
    attn_mask: np.ndarray | None  # bool or float, broadcastable to (..., Hq, L, S)
    is_causal: bool
    scale: float
    dropout_p: float
    gqa_groups: int  # Hq // H (1 without GQA)
    key_shape: tuple  # the caller's key shape, for reducing gradients
    value_shape: tuple
    batch_shape: tuple  # broadcast leading dims of the scores, (..., Hq)

    @property
    def L(self) -> int:
        return self.query.shape[-2]

    @property
    def S(self) -> int:
        return self.key.shape[-2]


def check_attention_args(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
) -> AttentionSpec:
    """Validate the arguments of :func:`~attnlab.scaled_dot_product_attention` (shared by every
    kernel and every public attention function)."""
    q = as_float_array(query, "query", min_ndim=2, layout="(..., L, E)")
    k = as_float_array(key, "key", min_ndim=2, layout="(..., S, E)")
    v = as_float_array(value, "value", min_ndim=2, layout="(..., S, Ev)")
    same_dtype(query=q, key=k, value=v)
    L, E = q.shape[-2:]
    S = k.shape[-2]
    if E == 0:
        raise shape_error("query", q.shape, "(..., L, E) with E >= 1")
    if k.shape[-1] != E:
        raise shape_error("key", k.shape, f"(..., S, E={E}) to match query {fmt_shape(q.shape)}")
    if v.shape[-2] != S or v.shape[:-2] != k.shape[:-2]:
        need = fmt_shape((*k.shape[:-2], S, "Ev"))
        raise shape_error("value", v.shape, f"{need} to match key {fmt_shape(k.shape)}")
    dropout_p = probability(dropout_p, "dropout_p")
    if not isinstance(is_causal, bool | np.bool_):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    elif isinstance(scale, bool) or not isinstance(scale, int | float | np.floating | np.integer):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)

    key_shape, value_shape = k.shape, v.shape
    groups = 1
    if enable_gqa:
        if q.ndim < 3 or k.ndim < 3:
            raise shape_error(
                "query" if q.ndim < 3 else "key",
                (q if q.ndim < 3 else k).shape,
                "(..., H, L_or_S, E): enable_gqa needs a head axis",
            )
        Hq, H = q.shape[-3], k.shape[-3]
        if H == 0 or Hq % H:
            raise shape_error(
                "key", k.shape, f"(..., H, S, E) with H dividing query's Hq={Hq} (enable_gqa)"
            )
        groups = Hq // H
        if groups > 1:
            k = np.repeat(k, groups, axis=-3)
            v = np.repeat(v, groups, axis=-3)
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except ValueError:
        hint = " (pass enable_gqa=True for grouped-query attention)" if q.ndim >= 3 else ""
        raise ValueError(
            f"query has shape {fmt_shape(q.shape)} and key has shape {fmt_shape(k.shape)}: "
            f"their leading (batch, head) dims must broadcast{hint}"
        ) from None

    mask = None
    if attn_mask is not None:
        if is_causal:
            raise ValueError("pass either attn_mask or is_causal=True, not both")
        mask = np.asarray(attn_mask)
        if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.floating):
            raise TypeError(
                f"attn_mask must be boolean (True = takes part) or floating-point (added to "
                f"the scores), got dtype {mask.dtype}"
            )
        full = (*batch, L, S)
        try:
            ok = np.broadcast_shapes(mask.shape, full) == full
        except ValueError:
            ok = False
        if not ok:
            raise shape_error(
                "attn_mask", mask.shape, f"broadcastable to (..., L, S) = {fmt_shape(full)}"
            )
        if mask.dtype != np.bool_ and mask.dtype != q.dtype:
            mask = mask.astype(q.dtype)
    return AttentionSpec(
        q, k, v, mask, bool(is_causal), scale, dropout_p, groups, key_shape, value_shape, batch
    )


def reduce_to(grad: np.ndarray, shape: tuple, groups: int) -> np.ndarray:
    """Sum a gradient over GQA head groups and broadcast batch dims back to ``shape``."""
    if groups > 1:
        *lead, hq, n, d = grad.shape
        grad = grad.reshape(*lead, hq // groups, groups, n, d).sum(axis=-3)
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape, strict=True)) if s == 1 and g != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad
