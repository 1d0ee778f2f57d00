"""Scaled dot-product attention: the reference ("naive") path, forward and backward.

Axis legend, used in every docstring of attnlab:

    ...  any leading batch dims (B)
    Hq   query heads            H   key/value heads (Hq == H unless enable_gqa)
    L    query (target) length  S   key (source) length
    E    query/key head dim     Ev  value head dim

``L != S`` is the normal case (cross-attention, seed 003). Boolean masks are True where a
query may attend to a key; float masks are added to the scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnlab._validation import (
    as_float_array,
    fmt_shape,
    generator,
    probability,
    same_dtype,
    shape_error,
)
from attnlab.core.masks import causal_mask
from attnlab.core.softmax import _last_axis_sum, softmax


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
    """Validate the arguments of :func:`scaled_dot_product_attention` (shared by every path)."""
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


def _scores(spec: AttentionSpec) -> np.ndarray:
    """Masked, scaled scores ``(..., Hq, L, S)``; forbidden entries are ``-inf``."""
    # The scale goes on the (L, E) queries, not on the (L, S) scores: one pass fewer.
    scores = np.matmul(_scaled(spec.query, spec.scale), np.swapaxes(spec.key, -1, -2))
    # Masks in place (the mask broadcasts to the scores' shape; validated).
    if spec.is_causal:
        np.copyto(scores, -np.inf, where=~causal_mask(spec.L, spec.S))
    elif spec.attn_mask is not None:
        if spec.attn_mask.dtype == np.bool_:
            np.copyto(scores, -np.inf, where=~spec.attn_mask)
        else:
            scores += spec.attn_mask
    return scores


def _scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """``x * scale`` in ``x``'s dtype."""
    return x * x.dtype.type(scale)


def _dropout_keep(spec: AttentionSpec, shape: tuple, rng) -> np.ndarray | None:
    """Scaled keep-mask ``keep / (1 - p)`` drawn from ``rng``, or None when p == 0."""
    if spec.dropout_p == 0.0:
        return None
    rng = generator(rng)
    keep = rng.random(shape) >= spec.dropout_p
    return keep.astype(spec.query.dtype) * spec.query.dtype.type(1.0 / (1.0 - spec.dropout_p))


def attend(spec: AttentionSpec, *, rng=None) -> tuple[np.ndarray, np.ndarray]:
    """Naive forward: ``(output (..., Hq, L, Ev), weights after dropout (..., Hq, L, S))``."""
    probs = softmax(_scores(spec), axis=-1)
    keep = _dropout_keep(spec, probs.shape, rng)
    if keep is not None:
        probs = probs * keep
    return np.matmul(probs, spec.value), probs


def _reduce_to(grad: np.ndarray, shape: tuple, groups: int) -> np.ndarray:
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


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Attention as ``torch.nn.functional.scaled_dot_product_attention`` computes it.

    Equivalent to::

        scores = query @ key.swapaxes(-1, -2) * scale     # (..., Hq, L, S)
        scores[~attn_mask] = -inf  or  scores += attn_mask # bool or float mask
        weights = softmax(scores, axis=-1)                 # rows sum to 1
        weights = dropout(weights, dropout_p, rng)         # only if dropout_p > 0
        return weights @ value                             # (..., Hq, L, Ev)

    A query with nothing to attend to (a fully masked row, or ``S == 0``) outputs zeros,
    never NaN. NaN or inf in the inputs propagate. float32 and float64 are kept.

    Args:
        query: ``(..., Hq, L, E)`` (any leading dims; ``(L, E)`` works too).
        key: ``(..., H, S, E)``; ``H == Hq`` unless ``enable_gqa``.
        value: ``(..., H, S, Ev)``.
        attn_mask: bool (True = takes part) or float (added to the scores), broadcastable
            to ``(..., Hq, L, S)``. Not together with ``is_causal``.
        dropout_p: probability of dropping a weight; dropout happens only if ``> 0``.
        is_causal: apply a top-left aligned causal mask (query ``i`` sees keys ``j <= i``).
            For bottom-right alignment pass ``causal_mask(L, S, align="bottom-right")``.
        scale: factor on the scores; ``None`` means ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: each of the ``H`` key/value heads serves
            ``Hq // H`` consecutive query heads (``repeat_interleave``, as in torch).
        rng: the ``np.random.Generator`` that draws the dropout mask; ``None`` takes a
            fresh unseeded one.

    Returns:
        ``(..., Hq, L, Ev)``, the dtype of ``query``.

    Raises:
        TypeError: non-float or mixed dtypes, a mask that is neither bool nor float.
        ValueError: shapes that do not fit (the message names the argument and both
            shapes), both ``attn_mask`` and ``is_causal``, ``dropout_p`` outside ``[0, 1)``.

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 4, 8))  # each (H=2, L=S=4, E=8)
    >>> scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 8)
    """
    spec = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )
    return _dispatch_forward(spec, rng)


# Blockwise beats materialising the scores from about this many scores per head, or from
# 256 x 256 per head when the whole batch holds this many (measured on 2 cores).
BLOCKWISE_MIN_SCORES_PER_HEAD = 512 * 512
BLOCKWISE_MIN_SCORES_TOTAL = 2**22


def _use_blockwise(spec: AttentionSpec) -> bool:
    """The blockwise kernel is exact for everything but dropout; pick it where it is faster."""
    if spec.dropout_p > 0 or spec.query.dtype not in (np.float32, np.float64):
        return False
    per_head = spec.L * spec.S
    total = per_head * math.prod(spec.batch_shape)
    return per_head >= BLOCKWISE_MIN_SCORES_PER_HEAD or (
        total >= BLOCKWISE_MIN_SCORES_TOTAL and per_head >= 256 * 256
    )


def _dispatch_forward(spec: AttentionSpec, rng) -> np.ndarray:
    if _use_blockwise(spec):
        from attnlab.core.blockwise import forward_spec

        return forward_spec(spec)
    return attend(spec, rng=rng)[0]


def attention_weights(
    query: np.ndarray,
    key: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> np.ndarray:
    """The attention probabilities ``softmax(query @ key^T * scale + mask)``: ``(..., Hq, L, S)``.

    The same arguments and semantics as :func:`scaled_dot_product_attention` (without
    dropout); for teaching, inspection and pictures. Each row sums to 1, or is all zeros
    when every key is masked.

    >>> q = k = np.eye(3)
    >>> attention_weights(q, k, is_causal=True).round(2)
    array([[1.  , 0.  , 0.  ],
           [0.36, 0.64, 0.  ],
           [0.26, 0.26, 0.47]])
    """
    dummy_v = np.empty((*np.shape(key)[:-1], 0), dtype=np.asarray(key).dtype)
    spec = check_attention_args(query, key, dummy_v, attn_mask, 0.0, is_causal, scale, enable_gqa)
    return softmax(_scores(spec), axis=-1)


def scaled_dot_product_attention_backward(
    grad_out: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of a loss through :func:`scaled_dot_product_attention`.

    Recomputes the forward pass's weights. With ``dropout_p > 0`` pass a Generator in the
    same state as the forward pass had (e.g. a fresh ``np.random.default_rng(seed)`` with
    the same seed): it draws the same dropout mask.

    Args:
        grad_out: dLoss/doutput, ``(..., Hq, L, Ev)``.
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng: as
            given to the forward pass.

    Returns:
        ``(grad_query, grad_key, grad_value)`` with the shapes of ``query``, ``key`` and
        ``value`` (GQA and broadcast dims summed back).

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 4, 8))
    >>> dq, dk, dv = scaled_dot_product_attention_backward(np.ones((4, 8)), q, k, v)
    >>> dq.shape, dk.shape, dv.shape
    ((4, 8), (4, 8), (4, 8))
    """
    spec = check_attention_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )
    grad_out = as_float_array(grad_out, "grad_out")
    out_shape = (*spec.batch_shape, spec.L, spec.value.shape[-1])
    if grad_out.shape != out_shape:
        raise shape_error("grad_out", grad_out.shape, f"{fmt_shape(out_shape)} (the output's shape)")
    same_dtype(grad_out=grad_out, query=spec.query)
    return _dispatch_backward(spec, grad_out, rng)


def _dispatch_backward(spec: AttentionSpec, grad_out: np.ndarray, rng):
    if _use_blockwise(spec):
        from attnlab.core.blockwise import backward_from_spec

        return backward_from_spec(spec, grad_out)
    return attend_backward(spec, grad_out, rng=rng)


def attend_backward(spec: AttentionSpec, grad_out: np.ndarray, *, rng=None):
    """Naive backward by recomputation (internal; see the public function)."""
    probs = softmax(_scores(spec), axis=-1)  # (..., Hq, L, S)
    keep = _dropout_keep(spec, probs.shape, rng)
    dropped = probs if keep is None else probs * keep
    grad_v = np.matmul(np.swapaxes(dropped, -1, -2), grad_out)  # (..., Hq, S, Ev)
    grad_p = np.matmul(grad_out, np.swapaxes(spec.value, -1, -2))  # (..., Hq, L, S)
    if keep is not None:
        grad_p *= keep
    grad_s = probs * (grad_p - _last_axis_sum(grad_p * probs))
    # scores = (q * scale) @ k^T: the scale lands on the (L, E) and (S, E) sides.
    grad_q = _scaled(np.matmul(grad_s, spec.key), spec.scale)  # (..., Hq, L, E)
    grad_k = np.matmul(np.swapaxes(grad_s, -1, -2), _scaled(spec.query, spec.scale))  # (..., Hq, S, E)
    return (
        _reduce_to(grad_q, spec.query.shape, 1),
        _reduce_to(grad_k, spec.key_shape, spec.gqa_groups),
        _reduce_to(grad_v, spec.value_shape, spec.gqa_groups),
    )


def simple_attention(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weight-free self-attention (seed 004): the inputs are their own queries, keys, values.

    ``scores = x @ x^T`` (no scaling), ``weights = softmax(scores)``, ``context = weights @ x``.

    Args:
        x: ``(..., T, D)`` token vectors.

    Returns:
        ``(context (..., T, D), weights (..., T, T))``.

    >>> x = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
    ...               [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
    >>> context, weights = simple_attention(x)   # "Your journey starts with one step"
    >>> weights[1].round(4)                       # how "journey" attends
    array([0.1385, 0.2379, 0.2333, 0.124 , 0.1082, 0.1581])
    >>> context[1].round(4)
    array([0.4419, 0.6515, 0.5683])
    """
    x = as_float_array(x, "x", min_ndim=2, layout="(..., T, D)")
    spec = check_attention_args(x, x, x, scale=1.0)
    context, weights = attend(spec)
    return context, weights
