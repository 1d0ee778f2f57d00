"""Numerically stable softmax and its backward pass."""

from __future__ import annotations

import numpy as np

from attnlab._validation import as_float_array


def _check_axis(x: np.ndarray, axis: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(axis).__name__}")
    if not -x.ndim <= axis < max(x.ndim, 1):
        raise ValueError(f"{name}={axis} is out of range for an array of shape {x.shape}")
    return int(axis)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    Subtracting the row maximum keeps ``exp`` from overflowing; the result is unchanged
    because softmax is shift-invariant. A row whose entries are all ``-inf`` (nothing to
    attend to) gives zeros, never NaN. NaN in a row propagates, as in PyTorch.

    Args:
        x: any floating-point array; the dtype is kept.
        axis: the axis to normalise over.

    Returns:
        An array of ``x``'s shape and dtype whose slices along ``axis`` sum to 1 (or are 0).

    Raises:
        TypeError: ``x`` is not floating-point.

    >>> softmax(np.array([1.0, 2.0, 3.0])).round(4)
    array([0.09  , 0.2447, 0.6652])
    >>> softmax(np.array([-np.inf, -np.inf]))
    array([0., 0.])
    """
    x = as_float_array(x, "x", min_ndim=1, layout="at least 1-D")
    axis = _check_axis(x, axis)
    if x.shape[axis] == 0:
        return np.zeros_like(x)
    last = axis in (-1, x.ndim - 1)
    m = _last_axis_max(x) if last else np.max(x, axis=axis, keepdims=True)
    # An all -inf row has max -inf; shifting by 0 instead gives exp(-inf) = 0, not NaN.
    m = np.where(m == -np.inf, 0, m).astype(x.dtype, copy=False)
    e = np.exp(x - m)
    total = _last_axis_sum(e) if last else np.sum(e, axis=axis, keepdims=True)
    return e / np.where(total == 0, 1, total).astype(x.dtype, copy=False)


def _last_axis_max(x: np.ndarray) -> np.ndarray:
    """``x.max(-1, keepdims=True)`` by halving: NumPy's reduction over a short last axis is
    slow (one small loop per row); elementwise ``np.maximum`` of halves is vectorised.
    NaN propagates as with ``max``."""
    m = x
    while m.shape[-1] > 1:
        h = m.shape[-1] // 2
        top = np.maximum(m[..., :h], m[..., h : 2 * h])
        if m.shape[-1] % 2:
            top[..., :1] = np.maximum(top[..., :1], m[..., -1:])
        m = top
    return m if m is not x else m.copy()


def _last_axis_sum(x: np.ndarray) -> np.ndarray:
    """``x.sum(-1, keepdims=True)`` as one matrix-vector product (BLAS)."""
    n = x.shape[-1]
    if n == 0:  # reshape(-1, 0) is ambiguous; an empty sum is 0
        return np.zeros((*x.shape[:-1], 1), dtype=x.dtype)
    return (x.reshape(-1, n) @ np.ones(n, dtype=x.dtype)).reshape(*x.shape[:-1], 1)


def softmax_backward(grad_output: np.ndarray, probs: np.ndarray, axis: int = -1) -> np.ndarray:
    """Gradient of a loss through ``probs = softmax(x, axis)`` with respect to ``x``.

    ``dx = p * (g - sum(g * p, axis))``. Rows that were fully masked (all-zero ``probs``)
    get a zero gradient.

    Args:
        grad_output: dLoss/dprobs, shape of ``probs``.
        probs: the forward pass's output.
        axis: the axis the forward pass normalised over.

    >>> p = softmax(np.array([0.0, 1.0]))
    >>> softmax_backward(np.array([1.0, 1.0]), p)  # a constant shift has no gradient
    array([0., 0.])
    """
    probs = as_float_array(probs, "probs", min_ndim=1, layout="at least 1-D")
    grad_output = as_float_array(grad_output, "grad_output")
    if grad_output.shape != probs.shape:
        raise ValueError(
            f"grad_output has shape {grad_output.shape}, but should be {probs.shape} "
            "(the shape of probs)"
        )
    axis = _check_axis(probs, axis)
    inner = np.sum(grad_output * probs, axis=axis, keepdims=True)
    return probs * (grad_output - inner)
