"""Elementwise and row-wise math for the pretrained encoders: erf, exact GELU, LayerNorm.

NumPy has no ``erf`` (SciPy does, but attnlab's runtime is NumPy only), so :func:`erf` is a
rational approximation ``erf(z) ~ z * P(z^2) / Q(z^2)`` on ``|z| <= 4`` (and ``+-1`` beyond,
where ``1 - erf(4) = 1.5e-8``). The coefficients were fitted for attnlab against
``math.erf`` (a linearised least-squares rational fit, reweighted towards the minimax
solution, in float64). The float64 evaluation is within ``2e-9`` of ``erf`` on
``|z| <= 4`` and within ``1.6e-8`` beyond (the clip), below float32's half-ulp at 1
(``3e-8``), which is why :func:`gelu` evaluates in float64 and rounds once at the end.
"""

from __future__ import annotations

import math

import numpy as np

# erf(z) ~ z * P(z^2) / Q(z^2) for |z| <= _ERF_CLIP; lowest order first.
_ERF_P = (
    1.1283791821064386,
    0.1847101651603075,
    0.054332382681132364,
    0.0038394972567964343,
    0.0003826838314562762,
    4.780316316316258e-06,
    -1.366559645998855e-08,
)
_ERF_Q = (
    1.0,
    0.49702866724721617,
    0.11382606480858387,
    0.01545342242910161,
    0.0013095613291608317,
    6.400716824566614e-05,
)
_ERF_CLIP = 4.0
_SQRT1_2 = 1.0 / math.sqrt(2.0)
# GELU is evaluated in blocks of this many elements, so the float64 temporaries stay in cache.
_BLOCK = 1 << 14


def _rational(z: np.ndarray) -> np.ndarray:
    """``P(z^2) / Q(z^2)`` for a float64 array ``z`` already clipped to ``|z| <= 4``."""
    u = z * z
    # Horner, started from the leading coefficient without a fill pass; Q made monic.
    lead = _ERF_Q[-1]
    p = u * (_ERF_P[-1] / lead)
    for c in _ERF_P[-2:0:-1]:
        p += c / lead
        p *= u
    p += _ERF_P[0] / lead
    q = u + _ERF_Q[-2] / lead
    for c in _ERF_Q[-3::-1]:
        q *= u
        q += c / lead
    p /= q
    return p


def _erf_inplace(z: np.ndarray) -> np.ndarray:
    """Overwrite the float64 array ``z`` with ``erf(z)`` (max abs error < 1.6e-8)."""
    np.clip(z, -_ERF_CLIP, _ERF_CLIP, out=z)
    z *= _rational(z)
    return z


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, to within ``1.6e-8`` absolute (computed in float64).

    Args:
        x: any real array.

    Returns:
        ``erf(x)`` with ``x``'s shape, as float64 (float32 in, float32 out).

    >>> erf(np.array([0.0, 0.5, -1.0, 10.0])).round(6)
    array([ 0.      ,  0.5205  , -0.842701,  1.      ])
    """
    x = np.asarray(x)
    z = np.array(x, dtype=np.float64)  # a copy: evaluated in place
    out = _erf_inplace(z)
    return out.astype(np.float32) if x.dtype == np.float32 else out


def gelu(x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Exact (erf) GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``, as ``torch.nn.functional.gelu``.

    Evaluated in float64 block by block and rounded once to ``x``'s dtype. A float32
    result is within one ulp of the exact GELU for ``x >= -2``; in the negative tail, where
    GELU is tiny, the error is erf's absolute error times ``|x| / 2`` (at most 2.5e-7 on
    ``[-12, 12]``; torch's float32 GELU: 1.1e-6).

    Args:
        x: ``(...)`` float32 or float64 array.
        out: optional array of ``x``'s shape and dtype to write into (may be ``x`` itself).

    Returns:
        ``(...)``, ``x``'s dtype.

    >>> gelu(np.array([-1.0, 0.0, 1.0], dtype=np.float32))
    array([-0.15865526,  0.        ,  0.8413448 ], dtype=float32)
    """
    x = np.asarray(x)
    if out is None:
        out = np.empty_like(x)
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_x.size, _BLOCK):
        xb = flat_x[start : start + _BLOCK].astype(np.float64)
        z = xb * _SQRT1_2
        np.clip(z, -_ERF_CLIP, _ERF_CLIP, out=z)
        r = _rational(z)
        r *= z  # erf(x / sqrt(2))
        r += 1.0
        r *= xb
        r *= 0.5
        flat_out[start : start + _BLOCK] = r
    return out


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """``torch.nn.functional.layer_norm`` over the last axis (biased variance).

    Args:
        x: ``(..., D)``.
        weight, bias: ``(D,)``.
        eps: added to the variance.

    Returns:
        ``(..., D)``, ``x``'s dtype.

    >>> layer_norm(np.array([[1.0, 3.0]]), np.ones(2), np.zeros(2), 1e-12)
    array([[-1.,  1.]])
    """
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = np.einsum("...d,...d->...", centred, centred)[..., None]
    var /= x.shape[-1]
    var += eps
    centred *= 1.0 / np.sqrt(var)
    centred *= weight
    centred += bias
    return centred
