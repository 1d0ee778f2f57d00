"""Compiled element-wise layer math (numba, the ``fast`` extra): the exact and tanh GELUs
and SiLU.

NumPy evaluates the float32 GELU (:func:`attnlab.nn.functional.gelu`) as some twenty-five
float64 passes over each block, about 8 ns per element on a 2-core AVX2 EPYC; this loop
does the same operations, in the same order and in float64, once per element, vectorised
by LLVM (no fast-math, so no reordering and no fused multiply-adds): the result is the
NumPy path's, bit for bit, at about 0.7 ns per element.

Imported only when numba is installed and an array is large enough
(:func:`attnlab.core.blockwise.fused_planned`); ``cache=True`` keeps the machine code on
disk, so a later process loads it in well under a second.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from attnlab.core._fused import _FM, _exp
from attnlab.nn.functional import _ERF32_CLIP, _ERF32_P, _ERF32_Q, _GELU32_ZERO_BELOW, _INV_SQRT_2, _SQRT_2_OVER_PI

# The monic form the NumPy path evaluates (see functional._erf32_inplace).
_LEAD = _ERF32_Q[-1]
_P6, _P5, _P4, _P3, _P2, _P1, _P0 = (c / _LEAD for c in _ERF32_P[::-1])
_Q4, _Q3, _Q2, _Q1, _Q0 = (c / _LEAD for c in _ERF32_Q[-2::-1])
_CLIP = float(_ERF32_CLIP)
_ZERO_BELOW = -_GELU32_ZERO_BELOW


@nb.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
def gelu_erf32_(a):
    """``a[i] = gelu(a[i])`` for a 1-D float32 array, in place (one array: with two that may
    alias, LLVM leaves the loop scalar, 5x slower)."""
    for i in range(a.size):
        xb = np.float64(a[i])
        z = xb * _INV_SQRT_2
        if z > _CLIP:
            z = _CLIP
        elif z < -_CLIP:
            z = -_CLIP
        u = z * z
        p = u * _P6
        p = (p + _P5) * u
        p = (p + _P4) * u
        p = (p + _P3) * u
        p = (p + _P2) * u
        p = (p + _P1) * u
        p = p + _P0
        q = u + _Q4
        q = q * u + _Q3
        q = q * u + _Q2
        q = q * u + _Q1
        q = q * u + _Q0
        r = z * (p / q) + 1.0
        a[i] = np.float32(0.0) if xb < _ZERO_BELOW else np.float32(r * xb * 0.5)


@nb.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False, fastmath=_FM)
def silu32_(a):
    """``a[i] = silu(a[i]) = a[i] * sigmoid(a[i])`` for a 1-D float32 array, in place, with
    ``exp`` only of ``-|x|`` (no overflow): ``x / (1 + e)`` for ``x >= 0``, ``x e / (1 + e)``
    below, ``e = exp(-|x|)`` (:func:`attnlab.core._fused._exp`, float32, relative error
    under 3e-7). Not bit for bit NumPy's ``x / (1 + exp(-x))``: within a few float32 ulp.
    NaN stays NaN; ``+inf`` gives ``inf`` and ``-inf`` NaN, as torch."""
    for i in range(a.size):
        x = a[i]
        e = _exp(-abs(x))
        d = np.float32(1.0) + e
        a[i] = (x if x >= np.float32(0.0) else x * e) / d  # one division: 0.44 -> 0.21 ms a 786432-value call


_GELU_CUBIC = np.float32(0.044715)
_GELU_SCALE = np.float32(2.0 * _SQRT_2_OVER_PI)


@nb.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False, fastmath=_FM)
def gelu_tanh32_(a):
    """``a[i] = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` for a 1-D float32 array,
    in place. ``1 + tanh(u) = 2 sigmoid(2u)``, so this is ``x sigmoid(2u)`` with ``exp``
    only of ``-|2u|`` (:func:`attnlab.core._fused._exp`): no overflow, and none of the
    cancellation in ``1 + tanh(u)`` for ``u << 0`` that NumPy's and torch's form have
    there (where both round the result to within about 1e-7 of zero). Elsewhere within a
    few float32 ulp of them. NaN stays NaN; ``+inf`` gives ``inf`` and ``-inf`` NaN, as
    torch."""
    for i in range(a.size):
        x = a[i]
        u = (x + _GELU_CUBIC * (x * x * x)) * _GELU_SCALE
        e = _exp(-abs(u))
        d = np.float32(1.0) + e
        a[i] = (x if u >= np.float32(0.0) else x * e) / d  # one division, as silu32_
