"""Row and column reductions that NumPy does slowly, each written once.

NumPy reduces a short last axis with one small loop per row; a matrix-vector product with
a vector of ones (BLAS) is several times faster there. Every reduction in attnlab that runs
over the last axis of a large array goes through these helpers. Arrays of other libraries
(see :mod:`attnlab.core._namespace`) take their own namespace's reduction instead.
"""

from __future__ import annotations

import numpy as np

from attnlab.core._namespace import namespace

# A matrix-vector product this large with at least this many rows runs on one BLAS thread:
# OpenBLAS would thread it (from 9216 elements) and leave its idle threads spinning beside
# attnlab's pool (see attnlab._threads.matmul); a decoding step's single rows keep BLAS's
# threads.
_ONE_THREAD_MIN_SIZE = 9216
_ONE_THREAD_MIN_ROWS = 64


def _gemv(a: np.ndarray, w: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``a @ w``, one of them the vector and ``matrix`` the other.

    NumPy reports the floating-point flags that the BLAS call leaves, and BLAS kernels can
    raise the invalid-operation flag on data without an inf or a NaN (NumPy and OpenBLAS
    have had such reports; here a full test run once warned "invalid value encountered in
    matmul" on a softmax's row sums, values in [0, 1] times ones). The flag is not reported
    here (about 1 us a call); a NaN the data does produce still comes out in the sum."""
    with np.errstate(invalid="ignore"):
        if matrix.shape[0] >= _ONE_THREAD_MIN_ROWS and matrix.size >= _ONE_THREAD_MIN_SIZE:
            from attnlab._threads import one_blas_thread

            with one_blas_thread():
                return a @ w
        return a @ w

# Below this many columns the halving max beats ``x.max(-1)``; from about 32 on NumPy's own
# reduction is 1.6-4x faster (measured on float32 rows), so the shortcut stops there.
_HALVING_MAX_BELOW = 32


def row_sum(x: np.ndarray, *, scale: float = 1.0) -> np.ndarray:
    """``x.sum(-1, keepdims=True) * scale`` as one BLAS matrix-vector product."""
    if not isinstance(x, np.ndarray):
        # dtype= keeps float32 (the 2022.12 standard would sum in the default float type).
        total = namespace(x).sum(x, axis=-1, keepdims=True, dtype=x.dtype)
        return total if scale == 1.0 else total * scale
    n = x.shape[-1]
    if n == 0:  # reshape(-1, 0) is ambiguous; an empty sum is 0
        return np.zeros((*x.shape[:-1], 1), dtype=x.dtype)
    w = np.full(n, scale, dtype=x.dtype)
    x2 = x.reshape(-1, n)
    return _gemv(x2, w, x2).reshape(*x.shape[:-1], 1)


def row_mean(x: np.ndarray) -> np.ndarray:
    """``x.mean(-1, keepdims=True)`` (see :func:`row_sum`)."""
    return row_sum(x, scale=1.0 / x.shape[-1])


def col_sum(x2: np.ndarray) -> np.ndarray:
    """``x2.sum(0)`` of a 2-D array as one vector-matrix product."""
    return _gemv(np.ones(x2.shape[0], dtype=x2.dtype), x2, x2)


def row_max(x: np.ndarray) -> np.ndarray:
    """``x.max(-1, keepdims=True)``; NaN propagates as with ``max``.

    For rows shorter than 32 it takes the elementwise maximum of halves (vectorised over
    all rows at once); for longer rows NumPy's reduction is faster and is used.
    """
    if not isinstance(x, np.ndarray):
        return namespace(x).max(x, axis=-1, keepdims=True)
    n = x.shape[-1]
    if n >= _HALVING_MAX_BELOW:
        return x.max(axis=-1, keepdims=True)
    m = x
    while m.shape[-1] > 1:
        h = m.shape[-1] // 2
        top = np.maximum(m[..., :h], m[..., h : 2 * h])
        if m.shape[-1] % 2:
            top[..., :1] = np.maximum(top[..., :1], m[..., -1:])
        m = top
    return m if m is not x else m.copy()
