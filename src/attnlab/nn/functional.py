"""Stateless layer math shared by modules: each forward has its backward beside it."""

from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight.T + bias``: ``(..., in) -> (..., out)``, weight ``(out, in)`` as in torch."""
    # One GEMM over all batch rows: (..., in) -> (N, in) -> (N, out) -> (..., out)
    y = np.matmul(x.reshape(-1, x.shape[-1]), weight.T).reshape(*x.shape[:-1], weight.shape[0])
    if bias is not None:
        y += bias
    return y


def linear_backward(
    grad_y: np.ndarray, x: np.ndarray, weight: np.ndarray, *, has_bias: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(grad_x, grad_weight, grad_bias)`` for :func:`linear`; batch dims are summed."""
    g2 = grad_y.reshape(-1, grad_y.shape[-1])
    grad_w = g2.T @ x.reshape(-1, x.shape[-1])
    grad_b = np.ones(g2.shape[0], dtype=g2.dtype) @ g2 if has_bias else None  # BLAS: fast
    grad_x = (g2 @ weight).reshape(*grad_y.shape[:-1], weight.shape[1])
    return grad_x, grad_w, grad_b


# ---- erf and GELU ---------------------------------------------------------------------
# erf without SciPy: two Chebyshev expansions fitted once, at import, to ``math.erf`` /
# ``math.erfc`` at Chebyshev nodes (accurate to a few ulp in float64).
#   |x| <= 2:    erf(x) = x * P(x^2)               (P smooth on [0, 4])
#   |x| >  2:    erf(x) = 1 - exp(-x^2) / x * Q(1/x^2)   (Q smooth on [1/36, 1/4])
# Beyond |x| = 6, erf(x) rounds to +-1 in float64.
_ERF_SPLIT = 2.0
_ERF_CLIP = 6.0


def _cheb_fit(f, lo: float, hi: float, degree: int) -> tuple[np.ndarray, float, float]:
    import math

    n = degree + 1
    u = np.cos(np.pi * (np.arange(n) + 0.5) / n)  # Chebyshev nodes on [-1, 1]
    t = 0.5 * (hi - lo) * u + 0.5 * (hi + lo)
    fx = np.array([f(float(v)) for v in t])
    j2 = 2 * np.arange(n) + 1  # reduce k (2j + 1) modulo 4n first: exact cosine arguments
    coef = np.array(
        [(2.0 / n) * math.fsum(fx * np.cos(np.pi * ((k * j2) % (4 * n)) / (2 * n))) for k in range(n)]
    )
    coef[0] /= 2
    return coef, lo, hi


def _erf_small(t: float) -> float:  # erf(x) / x as a function of t = x^2
    import math

    if t == 0.0:
        return 2.0 / math.sqrt(math.pi)
    x = math.sqrt(t)
    return math.erf(x) / x


def _erf_tail(s: float) -> float:  # erfc(x) * x * exp(x^2) as a function of s = 1/x^2
    import math

    x = 1.0 / math.sqrt(s)
    return math.erfc(x) * x * math.exp(x * x)


_ERF_P = _cheb_fit(_erf_small, 0.0, _ERF_SPLIT**2, 20)
_ERF_Q = _cheb_fit(_erf_tail, 1.0 / _ERF_CLIP**2, 1.0 / _ERF_SPLIT**2, 24)


def _clenshaw(fit, t: np.ndarray) -> np.ndarray:
    coef, lo, hi = fit
    tiny = np.finfo(t.dtype).eps / 16  # float32 needs fewer terms than float64
    coef = coef[: int(np.nonzero(np.abs(coef) > tiny)[0].max()) + 1].astype(t.dtype)
    u = (t * t.dtype.type(2.0 / (hi - lo))) - t.dtype.type((hi + lo) / (hi - lo))
    u2 = u + u
    b1 = np.full_like(u, coef[-1])
    b2 = np.zeros_like(u)
    for c in coef[-2:0:-1]:
        b1, b2 = u2 * b1 - b2 + c, b1
    return u * b1 - b2 + coef[0]


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, in the dtype of ``x`` (float64: within a few ulp).

    >>> erf(np.array([0.0, 0.5, -3.0])).round(6)
    array([ 0.      ,  0.5205  , -0.999978])
    """
    x = np.asarray(x)
    if x.dtype.type not in (np.float32, np.float64):
        x = x.astype(np.float64)
    a = np.minimum(np.abs(x), x.dtype.type(_ERF_CLIP))
    small = a <= _ERF_SPLIT
    if small.all():
        return x * _clenshaw(_ERF_P, a * a)
    out = np.empty_like(a)
    out[small] = a[small] * _clenshaw(_ERF_P, a[small] ** 2)
    big = ~small
    ab = a[big]
    out[big] = 1 - np.exp(-ab * ab) / ab * _clenshaw(_ERF_Q, 1 / (ab * ab))
    out = np.copysign(out, x)
    out[np.isnan(x)] = np.nan
    return out


_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def gelu(x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    """``x * Phi(x)`` (``approximate="none"``, erf) or torch's ``"tanh"`` approximation."""
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
        return (0.5 * x * (1.0 + np.tanh(inner))).astype(x.dtype, copy=False)
    return (0.5 * x * (1.0 + erf(x * _INV_SQRT_2))).astype(x.dtype, copy=False)


def gelu_backward(grad_y: np.ndarray, x: np.ndarray, *, approximate: str = "none") -> np.ndarray:
    """dLoss/dx for :func:`gelu`."""
    if approximate == "tanh":
        x2 = x * x
        inner = _SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x2)
        t = np.tanh(inner)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x2)
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
    else:
        cdf = 0.5 * (1.0 + erf(x * _INV_SQRT_2))
        pdf = _INV_SQRT_2PI * np.exp(-0.5 * x * x)
        d = cdf + x * pdf
    return (grad_y * d).astype(x.dtype, copy=False)


# ---- layer norm ----------------------------------------------------------------------
def _row_mean(a: np.ndarray) -> np.ndarray:
    """``a.mean(-1, keepdims=True)`` as one BLAS matrix-vector product (NumPy's reduction
    over a short last axis loops per row)."""
    n = a.shape[-1]
    w = np.full(n, 1.0 / n, dtype=a.dtype)
    return (a.reshape(-1, n) @ w).reshape(*a.shape[:-1], 1)


def _col_sum(a2: np.ndarray) -> np.ndarray:
    """``a2.sum(0)`` for a 2-D array, as one matrix-vector product."""
    return np.ones(a2.shape[0], dtype=a2.dtype) @ a2


def layer_norm(
    x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalise over the last axis: ``(y, x_hat, rstd)`` with ``y = x_hat * weight + bias``
    (biased variance, as torch)."""
    xc = x - _row_mean(x)
    rstd = 1.0 / np.sqrt(_row_mean(xc * xc) + x.dtype.type(eps))
    x_hat = xc * rstd
    y = x_hat * weight if weight is not None else x_hat.copy()
    if bias is not None:
        y += bias
    return y, x_hat, rstd


def layer_norm_backward(
    grad_y: np.ndarray, x_hat: np.ndarray, rstd: np.ndarray, weight: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """``(grad_x, grad_weight, grad_bias)`` for :func:`layer_norm` (batch dims summed)."""
    D = x_hat.shape[-1]
    g2 = grad_y.reshape(-1, D)
    grad_b = _col_sum(g2)
    grad_w = _col_sum(g2 * x_hat.reshape(-1, D)) if weight is not None else None
    gx_hat = grad_y * weight if weight is not None else grad_y
    grad_x = (gx_hat - _row_mean(gx_hat) - x_hat * _row_mean(gx_hat * x_hat)) * rstd
    return grad_x, grad_w, grad_b


# ---- cross-entropy -------------------------------------------------------------------
def cross_entropy(
    logits: np.ndarray, target: np.ndarray, *, ignore_index: int = -100
) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over the targets that are not ``ignore_index`` and its gradient.

    Args:
        logits: ``(N, C)`` scores.
        target: ``(N,)`` class indices.

    Returns:
        ``(loss, grad_logits)``; ``loss`` is NaN when every target is ignored (as torch).
    """
    m = logits.max(axis=-1, keepdims=True)
    shifted = logits - m
    e = np.exp(shifted)
    total = e.sum(axis=-1, keepdims=True)
    logp = shifted - np.log(total)
    keep = target != ignore_index
    n = int(keep.sum())
    safe = np.where(keep, target, 0)
    picked = np.take_along_axis(logp, safe[:, None], axis=-1)[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = float(-(picked * keep).sum() / n) if n else float("nan")
    grad = e / total
    rows = np.nonzero(keep)[0]
    grad[rows, target[rows]] -= 1.0
    grad *= (keep / max(n, 1)).astype(logits.dtype)[:, None]
    return loss, grad.astype(logits.dtype, copy=False)
