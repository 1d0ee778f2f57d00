"""Numerically stable softmax and its backward pass, for NumPy or any Array API library."""

from __future__ import annotations

import math

import numpy as np

from attnlab._validation import fmt_shape
from attnlab.core._namespace import float_array, namespace, where_scalar
from attnlab.core._reduce import row_max, row_sum


def _check_axis(x, axis: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(axis).__name__}")
    if not -x.ndim <= axis < max(x.ndim, 1):
        raise ValueError(f"{name}={axis} is out of range for an array of shape {fmt_shape(x.shape)}")
    return int(axis)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along ``axis``: ``exp(x - max) / sum(exp(x - max))``.

    Subtracting the row maximum keeps ``exp`` from overflowing; the result is unchanged
    because softmax is shift-invariant. A row whose entries are all ``-inf`` (nothing to
    attend to) gives zeros, never NaN. NaN in a row propagates, as in PyTorch.

    Args:
        x: any floating-point array, NumPy's or another Array API library's (torch, CuPy,
            JAX, ...); the dtype, the array type and the device are kept.
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
    xp = namespace(x)
    x = float_array(x, "x", xp, min_ndim=1, layout="at least 1-D")
    axis = _check_axis(x, axis)
    if x.shape[axis] == 0:
        return xp.zeros_like(x)
    last = axis in (-1, x.ndim - 1)
    if last and isinstance(x, np.ndarray):
        return softmax_(x.copy())
    m = row_max(x) if last else xp.max(x, axis=axis, keepdims=True)
    # An all -inf row has max -inf; shifting by 0 instead gives exp(-inf) = 0, not NaN.
    m = where_scalar(m == -math.inf, 0.0, m)
    e = xp.exp(x - m)
    total = row_sum(e) if last else xp.sum(e, axis=axis, keepdims=True, dtype=e.dtype)
    return e / where_scalar(total == 0, 1.0, total)


# In-place softmax works on this many elements at a time (1 MiB of float32), so that the
# max, subtract, exp, sum and divide passes find the rows still in cache. Measured on a
# (16, 12, 250, 250) float32 array, one thread: 28 ms in blocks, 36 ms in one piece, 55 ms
# out of place.
_SOFTMAX_BLOCK = 1 << 18


def softmax_(x):
    """Softmax along the last axis, in place for a NumPy array (returned): the scores of an
    attention, which nothing else holds. Another library's array gets a new one.

    The same arithmetic as :func:`softmax` (shift by the row max, ``exp``, divide by the
    row sum; all ``-inf`` rows give zeros), so the two agree bit for bit.

    >>> s = np.array([[0.0, np.log(3.0)], [-np.inf, -np.inf]])
    >>> softmax_(s) is s, s.round(4).tolist()
    (True, [[0.25, 0.75], [0.0, 0.0]])
    """
    if not isinstance(x, np.ndarray):
        return softmax(x, axis=-1)
    n = x.shape[-1] if x.ndim else 0
    if n == 0 or x.size == 0:
        return x
    if not x.flags.c_contiguous:
        _softmax_rows_(x)
        return x
    rows = x.reshape(-1, n)
    step = max(1, _SOFTMAX_BLOCK // n)
    for r0 in range(0, rows.shape[0], step):
        _softmax_rows_(rows[r0 : r0 + step])
    return x


def _softmax_rows_(x: np.ndarray) -> None:
    """NumPy softmax over the last axis of ``x``, in place."""
    m = row_max(x)
    m[m == -math.inf] = 0.0  # an all -inf row: exp(-inf - 0) = 0, not NaN
    x -= m
    np.exp(x, out=x)
    total = row_sum(x)
    total[total == 0] = 1.0
    x /= total


def softmax_backward(grad_output: np.ndarray, probs: np.ndarray, axis: int = -1) -> np.ndarray:
    """Gradient of a loss through ``probs = softmax(x, axis)`` with respect to ``x``.

    ``dx = p * (g - sum(g * p, axis))``. Rows that were fully masked (all-zero ``probs``)
    get a zero gradient.

    Args:
        grad_output: dLoss/dprobs, shape of ``probs`` (the same array library).
        probs: the forward pass's output.
        axis: the axis the forward pass normalised over.

    >>> p = softmax(np.array([0.0, 1.0]))
    >>> softmax_backward(np.array([1.0, 1.0]), p)  # a constant shift has no gradient
    array([0., 0.])
    """
    xp = namespace(grad_output, probs, names=("grad_output", "probs"))
    probs = float_array(probs, "probs", xp, min_ndim=1, layout="at least 1-D")
    grad_output = float_array(grad_output, "grad_output", xp)
    if grad_output.shape != probs.shape:
        raise ValueError(
            f"grad_output has shape {fmt_shape(grad_output.shape)}, but should be "
            f"{fmt_shape(probs.shape)} (the shape of probs)"
        )
    axis = _check_axis(probs, axis)
    prod = grad_output * probs
    last = axis in (-1, probs.ndim - 1)
    inner = row_sum(prod) if last else xp.sum(prod, axis=axis, keepdims=True, dtype=prod.dtype)
    return probs * (grad_output - inner)
