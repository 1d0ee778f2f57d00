"""Stateless layer math shared by modules: each forward has its backward beside it.

The forwards also take arrays of another Array API library (the layers after
:meth:`~attnlab.nn.Module.to`) and compute in its namespace; the backwards are NumPy-only.
"""

from __future__ import annotations

import sys

import numpy as np

from attnlab._threads import matmul, matmuls
from attnlab.core._namespace import add_, full_scalar, is_numpy, mT, namespace
from attnlab.core._reduce import col_sum, row_mean
from attnlab.nn import _context
from attnlab.quant import QuantizedTensor, float32_matvec, quantized_linear


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight.T + bias``: ``(..., in) -> (..., out)``, weight ``(out, in)`` as in torch.

    Every weight product of the layers and models goes through here: a
    :class:`~attnlab.quant.QuantizedTensor` weight is multiplied without being dequantized
    (:func:`attnlab.quant.quantized_linear`); a few float32 rows (decoding) times a float32
    weight take the compiled matrix-vector kernel (:func:`attnlab.quant.float32_matvec`);
    any other array takes one matrix product."""
    if type(weight) is QuantizedTensor:
        return quantized_linear(x, weight, bias)
    if not isinstance(x, np.ndarray):  # another array library: one broadcast matrix product there
        y = x @ mT(weight)  # the standard's operator: no wrapper around the library's product
        return y if bias is None else y + bias
    y = float32_matvec(x, weight)  # a few float32 rows (decoding): the compiled kernel, where it applies
    if y is None:
        # One GEMM over all batch rows: (..., in) -> (N, in) -> (N, out) -> (..., out), split
        # over attnlab's threads when large (attnlab._threads.matmul)
        y = matmul(x.reshape(-1, x.shape[-1]), weight.T).reshape(*x.shape[:-1], weight.shape[0])
    if bias is not None:
        y += bias
    return y


def linear_backward(
    grad_y: np.ndarray, x: np.ndarray | None, weight: np.ndarray, *, has_bias: bool, weight_grad: bool = True
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(grad_x, grad_weight, grad_bias)`` for :func:`linear`; batch dims are summed.
    With the parameters frozen (:func:`attnlab.nn._context.frozen_parameters`) only
    ``grad_x`` is computed (the others are None).

    ``weight_grad=False`` (a frozen weight): ``grad_weight`` is None and not computed, one
    product instead of two (``x`` may then be None: nothing reads it).

    Raises:
        TypeError: a quantized weight (those are for inference only).
    """
    if type(weight) is QuantizedTensor:
        raise TypeError(f"no backward pass through a quantized weight ({weight.kind} {weight.shape}): quantized "
                        "models are for inference; load the model in float32 to train it")
    g2 = grad_y.reshape(-1, grad_y.shape[-1])
    if not weight_grad or _context.parameters_frozen():
        grad_x = matmul(g2, weight, tokens=g2.shape[0])
        grad_b = col_sum(g2) if has_bias and not _context.parameters_frozen() else None
        return grad_x.reshape(*grad_y.shape[:-1], weight.shape[1]), None, grad_b
    # Both products on one wake of the pool (its threads' wake-up is paid once).
    grad_w, grad_x = matmuls([(g2.T, x.reshape(-1, x.shape[-1])), (g2, weight)], tokens=g2.shape[0])
    grad_b = col_sum(g2) if has_bias else None  # a BLAS matrix-vector product: fast
    return grad_x.reshape(*grad_y.shape[:-1], weight.shape[1]), grad_w, grad_b


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
    """The Chebyshev series ``fit`` at ``t`` (in ``t``'s dtype and namespace)."""
    coef, lo, hi = fit
    xp = namespace(t)
    tiny = xp.finfo(t.dtype).eps / 16  # float32 needs fewer terms than float64
    coef = coef[: int(np.nonzero(np.abs(coef) > tiny)[0].max()) + 1].tolist()  # Python floats: keep t's dtype
    u = t * (2.0 / (hi - lo)) - (hi + lo) / (hi - lo)
    u2 = u + u
    b1 = xp.full_like(u, coef[-1])
    b2 = xp.zeros_like(u)
    for c in coef[-2:0:-1]:
        b1, b2 = u2 * b1 - b2 + c, b1
    return u * b1 - b2 + coef[0]


# float32 (and float16): a rational fit erf(z) ~ z * P(z^2) / Q(z^2) on |z| <= 4, +-1 beyond
# (1 - erf(4) = 1.5e-8), fitted for attnlab against math.erf and evaluated in float64: within
# 2e-9 on |z| <= 4 and 1.6e-8 beyond, below float32's half ulp at 1 (3e-8), and about five
# times faster than the float64 path. Lowest order first.
_ERF32_P = (
    1.1283791821064386,
    0.1847101651603075,
    0.054332382681132364,
    0.0038394972567964343,
    0.0003826838314562762,
    4.780316316316258e-06,
    -1.366559645998855e-08,
)
_ERF32_Q = (
    1.0,
    0.49702866724721617,
    0.11382606480858387,
    0.01545342242910161,
    0.0013095613291608317,
    6.400716824566614e-05,
)
_ERF32_CLIP = 4.0
# float32 data is computed in float64 block by block, in scratch arrays reused from block
# to block (fresh temporaries of 128 KiB or more are each a fresh mmap). Measured on a
# 2-core AVX2 EPYC, GELU of 6M elements: 46 ms in reused blocks of 32768; 57 ms in fresh
# ones of 8192, 98 ms of 16384.
_BLOCK = 1 << 15
# float32 GELUs run on the compiled loop when numba is installed (attnlab.nn._compiled:
# the same numbers bit for bit, about five times faster) once the work pays for numba's
# import (~0.5 s, once per process): for an array of _GELU_COMPILED_MIN elements, or for
# any array of _GELU_COMPILED_SMALL or more once this process has run _GELU_COMPILED_AFTER
# elements (~0.25 s) through the NumPy loop (a model run on many small batches), or once
# another compiled kernel has run (the attention kernels: numba is started, and the loop
# then starts in about 2 ms).
_GELU_COMPILED_MIN = 1 << 21
_GELU_COMPILED_SMALL = 1 << 12
_GELU_COMPILED_AFTER = 1 << 25
_gelu_numpy_elements = 0
# float32 SiLUs and tanh GELUs of at least this many elements run on the compiled loops
# (attnlab.nn._compiled.silu32_ and gelu_tanh32_, numba installed; see _takes_loop): a
# gated feed-forward of 512 tokens x 1536 took 1.8 ms in NumPy's four passes, 0.3 ms
# there; GPT-2's 512 x 3072 tanh GELU 1.57 ms in NumPy's blocks, 0.80 there. Not NumPy's
# numbers bit for bit (a few ulp), so the choice goes by the size alone: a call gives the
# same numbers whatever ran before.
_LOOP_COMPILED_MIN = 1 << 18
# attnlab's compiled modules: once one is loaded, numba is started.
_COMPILED_MODULES = ("attnlab.core._fused", "attnlab.nn._compiled", "attnlab._quant_kernels")


def _numba_started() -> bool:
    return any(name in sys.modules for name in _COMPILED_MODULES)


def _erf32_inplace(z: np.ndarray, scratch: list[np.ndarray] | None = None) -> np.ndarray:
    """Overwrite the float64 array ``z`` with erf(z) to float32 accuracy (see above).
    ``scratch``: three float64 arrays of ``z``'s shape to work in (else fresh ones)."""
    u, p, q = (None, None, None) if scratch is None else scratch
    np.clip(z, -_ERF32_CLIP, _ERF32_CLIP, out=z)
    u = np.multiply(z, z, out=u)
    # Horner, started from the leading coefficient without a fill pass; Q made monic.
    # (attnlab.nn._compiled repeats these operations in this order.)
    lead = _ERF32_Q[-1]
    p = np.multiply(u, _ERF32_P[-1] / lead, out=p)
    for c in _ERF32_P[-2:0:-1]:
        p += c / lead
        p *= u
    p += _ERF32_P[0] / lead
    q = np.add(u, _ERF32_Q[-2] / lead, out=q)
    for c in _ERF32_Q[-3::-1]:
        q *= u
        q += c / lead
    p /= q
    z *= p
    return z


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, in the dtype of ``x``.

    float64: within a few ulp (Chebyshev fits of ``erf(x)/x`` and of the tail). float32:
    a rational fit evaluated in float64 and rounded once (absolute error below 1.6e-8).
    Other inputs are computed in float64. An array of another library is computed in its
    namespace and dtype with the Chebyshev fits, using only the Array API standard.

    >>> erf(np.array([0.0, 0.5, -3.0])).round(6)
    array([ 0.      ,  0.5205  , -0.999978])
    """
    if not is_numpy(x):
        return _erf_namespace(x)
    x = np.asarray(x)
    if x.dtype.type in (np.float32, np.float16):
        return _erf32_inplace(x.astype(np.float64)).astype(x.dtype)
    if x.dtype.type is not np.float64:
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


def _erf_namespace(x):
    """:func:`erf` of another library's array: both Chebyshev fits evaluated everywhere, each
    on arguments kept inside its range, and picked with ``where`` (no boolean indexing)."""
    xp = namespace(x)
    a = xp.abs(x)
    small = a <= _ERF_SPLIT
    t = xp.where(small, a * a, full_scalar(0.0, x))  # |x| <= 2: erf = |x| P(x^2)
    c = xp.where(small, full_scalar(_ERF_SPLIT, x), xp.where(a > _ERF_CLIP, full_scalar(_ERF_CLIP, x), a))
    tail = 1.0 - xp.exp(-c * c) / c * _clenshaw(_ERF_Q, 1.0 / (c * c))  # 2 < |x|: erfc from Q
    return xp.where(small, a * _clenshaw(_ERF_P, t), tail) * xp.sign(x)  # NaN stays NaN


_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_INV_SQRT_2 = 0.7071067811865476
# Below x = -4 sqrt(2) (erf's argument past the float32 fit's clip) the float32 GELU is 0,
# as torch's: the exact value is under 4e-8 in size there (x * (1 + erf(-4)) / 2 would
# instead grow with |x|).
_GELU32_ZERO_BELOW = _ERF32_CLIP * 1.4142135623730951
_INV_SQRT_2PI = 0.3989422804014327


def gelu(x: np.ndarray, *, approximate: str = "none", out: np.ndarray | None = None) -> np.ndarray:
    """``x * Phi(x)`` (``approximate="none"``, erf) or torch's ``"tanh"`` approximation.

    The exact form of a float32 array is evaluated in float64 block by block and rounded
    once: within one ulp of the exact GELU for ``x >= -2`` and within 2.5e-7 everywhere
    (torch's float32 GELU: 1.1e-6); 0 below ``-4 sqrt(2)``, as torch's float32 GELU, and
    for ``-inf``. Large arrays run on a compiled loop when numba is installed (the
    ``fast`` extra), with the same numbers bit for bit. The tanh form of a large
    C-contiguous float32 array runs on one too (:func:`attnlab.nn._compiled.gelu_tanh32_`:
    within a few ulp of torch's; the choice goes by the size alone).

    Args:
        x: ``(...)`` float array (of any Array API library: see :func:`erf`).
        approximate: ``"none"`` or ``"tanh"``.
        out: optional NumPy array of ``x``'s shape and dtype to write into (may be ``x``).

    >>> gelu(np.array([-1.0, 0.0, 1.0], dtype=np.float32))
    array([-0.15865526,  0.        ,  0.8413448 ], dtype=float32)
    """
    if not is_numpy(x):  # another array library: the same formulas in its namespace
        if approximate == "tanh":
            return 0.5 * x * (1.0 + namespace(x).tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))
        return 0.5 * x * (1.0 + erf(x * _INV_SQRT_2))
    x = np.asarray(x)
    if out is None:
        out = np.empty_like(x)
    if approximate == "tanh":
        if _takes_loop(x, out):
            _run_compiled("gelu_tanh32_", x, out)
        else:
            _gelu_tanh_blocks(x, out)
    elif x.dtype.type is np.float64:
        out[...] = 0.5 * x * (1.0 + erf(x * _INV_SQRT_2))
    elif _gelu_compiled(x, out):
        pass
    else:
        flat_x, flat_out = x.reshape(-1), out.reshape(-1)
        n = min(_BLOCK, flat_x.size)
        xb, z, *scratch = (np.empty(n) for _ in range(5))
        for start in range(0, flat_x.size, _BLOCK):
            m = min(_BLOCK, flat_x.size - start)
            if m < n:
                xb, z, scratch = xb[:m], z[:m], [a[:m] for a in scratch]
            xb[...] = flat_x[start : start + m]
            r = _erf32_inplace(np.multiply(xb, _INV_SQRT_2, out=z), scratch)  # erf(x / sqrt(2))
            r += 1.0
            r *= xb
            r *= 0.5
            if r.size and not xb.min() >= -_GELU32_ZERO_BELOW:  # rare (or NaN): a min costs less
                np.copyto(r, 0.0, where=xb < -_GELU32_ZERO_BELOW)
            flat_out[start : start + m] = r
    return out


#: Element-wise work on at least this many elements is split over attnlab's threads
#: (NumPy's loops release the GIL; a pool costs about 0.1-0.4 ms to start, and more on a
#: busy machine, where a second thread waits for a core: smaller arrays stay on one).
_PARALLEL_MIN = 1 << 20


def _row_views(a: np.ndarray) -> np.ndarray | None:
    """``a`` as a 1-D view (contiguous) or a 2-D view of rows of its last axis; None when
    neither exists without a copy."""
    if a.flags.c_contiguous:
        return a.reshape(-1)
    if a.ndim == 0:
        return None
    r = a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a
    return r if np.shares_memory(r, a) else None


def _elementwise(fn, arrays: tuple[np.ndarray, ...], n_scratch: int) -> None:
    """``fn(blocks, scratch)`` over blocks of :data:`_BLOCK` elements of ``arrays`` (one
    shape; the last may be written, and may be one of the others), so that the work on a
    block stays in the cache; ``scratch`` holds ``n_scratch`` arrays of a block's shape,
    reused. Large arrays are split over attnlab's threads (:func:`attnlab.get_num_threads`);
    a block's numbers do not depend on the split."""
    from attnlab._threads import get_num_threads, in_pool, run_units

    views = [_row_views(a) for a in arrays]
    if any(v is None for v in views) or views[0].size == 0:
        fn(arrays, [np.empty_like(arrays[-1]) for _ in range(n_scratch)])
        return
    flat = all(v.ndim == 1 for v in views)
    if not flat:  # rows of the last axis for every array (views: see _row_views)
        views = [a.reshape(-1, a.shape[-1]) for a in arrays]
    rows = views[0].shape[0]
    step = _BLOCK if flat else max(1, _BLOCK // max(1, views[0].shape[-1]))
    starts = range(0, rows, step)

    def unit(start, scratch):
        blocks = tuple(v[start : start + step] for v in views)
        have = scratch.get("s")
        if have is None or (have and have[0].shape != blocks[-1].shape):
            have = scratch["s"] = [np.empty_like(blocks[-1]) for _ in range(n_scratch)]
        fn(blocks, have)

    threads = 1 if in_pool() or arrays[0].size < _PARALLEL_MIN else min(get_num_threads(), len(starts))
    run_units(starts, unit, threads)


def _gelu_tanh_blocks(x: np.ndarray, out: np.ndarray) -> None:
    """``out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` block by block, with
    torch's (and ``transformers``' ``gelu_new``'s) operations in their order, in ``x``'s
    dtype (``out`` may be ``x``)."""

    def fn(blocks, scratch):
        xb, ob = blocks
        t, u = scratch
        np.multiply(xb, xb, out=t)
        t *= xb  # x^3
        t *= 0.044715
        t += xb
        t *= _SQRT_2_OVER_PI
        np.tanh(t, out=t)
        t += 1.0
        np.multiply(xb, 0.5, out=u)  # before ob is written: ob may be xb
        np.multiply(u, t, out=ob)

    _elementwise(fn, (x, out), 2)


def _gelu_compiled(x: np.ndarray, out: np.ndarray) -> bool:
    """The exact float32 GELU of ``x`` into ``out`` on the compiled loop (True), where numba
    is installed and the arrays are large and contiguous; else False (nothing written)."""
    global _gelu_numpy_elements
    if x.dtype != np.float32 or out.dtype != np.float32:
        return False
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        return False
    small = _gelu_numpy_elements >= _GELU_COMPILED_AFTER or _numba_started()
    if not _compiled_planned(x.size, _GELU_COMPILED_SMALL if small else _GELU_COMPILED_MIN):
        _gelu_numpy_elements += x.size  # a count, not a lock: an estimate is enough
        return False
    from attnlab.nn import _compiled  # imports numba

    if out is not x:
        np.copyto(out, x)
    _compiled.gelu_erf32_(out.reshape(-1))
    return True


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
def layer_norm(
    x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, eps: float, *, keep_x_hat: bool = True
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Normalise over the last axis: ``(y, x_hat, rstd)`` with ``y = x_hat * weight + bias``
    (biased variance, as torch). With ``keep_x_hat=False`` (NumPy) ``y`` is computed in
    place in one fresh array (the same numbers) and ``x_hat`` is None. float32 and float64
    NumPy arrays take one compiled pass per row where numba is installed (mean and
    variance accumulated in float64), with or without ``x_hat``: the same numbers either
    way."""
    fused = _layer_norm_fused(x, weight, bias, eps, keep_x_hat)
    if fused is not None:
        return fused
    xp = namespace(x)
    xc = x - row_mean(x)
    rstd = 1.0 / xp.sqrt(row_mean(xc * xc) + eps)  # a Python eps keeps x's dtype
    if not keep_x_hat and xp is np:
        xc *= rstd
        if weight is not None:
            xc *= weight
        if bias is not None:
            xc += bias
        return xc, None, rstd
    x_hat = xc * rstd
    if weight is not None:
        y = x_hat * weight
    else:
        y = x_hat.copy() if xp is np else x_hat  # NumPy adds the bias in place
    if bias is not None:
        y = add_(y, bias)
    return y, x_hat, rstd


def layer_norm_backward(
    grad_y: np.ndarray, x_hat: np.ndarray, rstd: np.ndarray, weight: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """``(grad_x, grad_weight, grad_bias)`` for :func:`layer_norm` (batch dims summed).

    float32 and float64 NumPy arrays take one compiled pass per row where numba is
    installed (the ``fast`` extra; row means and the weight and bias gradients summed in
    float64), else NumPy's eight passes over the array."""
    D = x_hat.shape[-1]
    fused = _layer_norm_backward_fused(grad_y, x_hat, rstd, weight)
    if fused is not None:
        return fused
    g2 = grad_y.reshape(-1, D)
    grad_b = col_sum(g2)
    grad_w = col_sum(g2 * x_hat.reshape(-1, D)) if weight is not None else None
    gx_hat = grad_y * weight if weight is not None else grad_y
    grad_x = (gx_hat - row_mean(gx_hat) - x_hat * row_mean(gx_hat * x_hat)) * rstd
    return grad_x, grad_w, grad_b


# A LayerNorm backward of at least this many elements takes the compiled pass (numba's
# import, ~0.3 s once per process, is not worth it for a few rows).
_LN_FUSED_MIN = 1 << 14


def _row_pass_applies(x, *params) -> bool:
    """Whether a norm of ``x`` over its last axis takes a compiled row pass: a float32 or
    float64 NumPy array of at least :data:`_LN_FUSED_MIN` elements, its parameters (None
    or arrays of its dtype) alike, numba installed and not turned off."""
    from attnlab.core.blockwise import fused_planned

    dtype = getattr(x, "dtype", None)
    return (type(x) is np.ndarray and dtype in (np.float32, np.float64) and x.size >= _LN_FUSED_MIN and x.ndim > 0
            and all(p is None or (type(p) is np.ndarray and p.dtype == dtype) for p in params)
            and fused_planned(np.float32, x.size, min_n=0))


def _layer_norm_fused(x, weight, bias, eps, keep_x_hat):
    """:func:`layer_norm` in one compiled pass per row, or None where it does not apply."""
    if not _row_pass_applies(x, weight, bias):
        return None
    dtype = x.dtype
    from attnlab.core import _fused

    D = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, D)
    none = np.zeros(0, dtype=dtype)
    y = np.empty_like(x2)
    x_hat = np.empty_like(x2) if keep_x_hat else np.zeros((0, 0), dtype=dtype)
    rstd = np.empty(x2.shape[0], dtype=dtype)
    _fused.layer_norm_forward(x2, none if weight is None else np.ascontiguousarray(weight),
                              none if bias is None else np.ascontiguousarray(bias), float(eps), y, x_hat, rstd)
    shape = x.shape
    return (y.reshape(shape), x_hat.reshape(shape) if keep_x_hat else None, rstd.reshape(*shape[:-1], 1))


def _layer_norm_backward_fused(grad_y, x_hat, rstd, weight):
    """:func:`layer_norm_backward` in one compiled pass per row, or None where it does not
    apply (another array library, other dtypes, numba absent or turned off, small)."""
    if not (_row_pass_applies(x_hat, grad_y) and grad_y.shape == x_hat.shape):
        return None
    dtype = x_hat.dtype
    D = x_hat.shape[-1]
    from attnlab.core import _fused

    g2 = np.ascontiguousarray(grad_y).reshape(-1, D)
    xh = np.ascontiguousarray(x_hat).reshape(-1, D)
    r = np.ascontiguousarray(rstd, dtype=dtype).reshape(-1)
    w = np.zeros(0, dtype=dtype) if weight is None else np.ascontiguousarray(weight, dtype=dtype)
    gx = np.empty_like(g2)
    gw = np.zeros(D, dtype=np.float64)
    gb = np.zeros(D, dtype=np.float64)
    _fused.layer_norm_backward(g2, xh, r, w, gx, gw, gb)
    return (gx.reshape(grad_y.shape), None if weight is None else gw.astype(dtype, copy=False),
            gb.astype(dtype, copy=False))


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
    keep = target != ignore_index
    n = int(keep.sum())
    safe = np.where(keep, target, 0)
    e = logits - logits.max(axis=-1, keepdims=True)  # shifted; then exp in place
    # log p of each target alone: its shifted score minus log(sum exp) of its row
    picked = np.take_along_axis(e, safe[:, None], axis=-1)[:, 0]
    np.exp(e, out=e)
    total = e.sum(axis=-1, keepdims=True)
    picked = picked - np.log(total[:, 0])
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = float(-(picked * keep).sum() / n) if n else float("nan")
    grad = np.divide(e, total, out=e)
    rows = np.nonzero(keep)[0]
    grad[rows, target[rows]] -= 1.0
    if n and n == len(target):  # every target counts: one factor 1/n for all rows
        grad *= (keep[:1] / n).astype(logits.dtype)
    else:
        grad *= (keep / max(n, 1)).astype(logits.dtype)[:, None]
    return loss, grad.astype(logits.dtype, copy=False)


# ---- SiLU and RMSNorm ------------------------------------------------------------------
def silu(x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """``x * sigmoid(x)`` (torch's ``F.silu``), elementwise, in the dtype of ``x``; with
    ``out`` (a NumPy array of ``x``'s shape and dtype, may be ``x``) written there, block by
    block. A C-contiguous float32 array of 2^18 elements or more runs on a compiled loop
    where numba is installed (within a few float32 ulp of NumPy's ``x / (1 + exp(-x))``;
    the choice goes by the size alone).

    >>> silu(np.array([-1.0, 0.0, 2.0], dtype=np.float32))
    array([-0.2689414,  0.       ,  1.761594 ], dtype=float32)
    """
    if not is_numpy(x):
        xp = namespace(x)
        return x / (1.0 + xp.exp(-x))
    x = np.asarray(x)
    if _takes_loop(x, out):
        return _run_compiled("silu32_", x, np.empty_like(x) if out is None else out)
    if out is None:
        # exp(-x) overflows to inf for x << 0: x / inf = -0; -inf / inf = NaN, as torch
        with np.errstate(over="ignore", invalid="ignore"):
            d = np.exp(-x)
            d += 1
            return np.divide(x, d, out=d)
    _elementwise(_silu_block, (x, out), 1)
    return out


def _compiled_planned(n: int, min_n: int) -> bool:
    """Whether ``n`` float32 elements go to a compiled element-wise loop from ``min_n`` on
    (:func:`attnlab.core.blockwise.fused_planned`: numba installed and not turned off)."""
    from attnlab.core.blockwise import fused_planned

    return fused_planned(np.float32, n, min_n=min_n)


def _takes_loop(x: np.ndarray, out: np.ndarray | None) -> bool:
    """Whether an element-wise op of ``x`` into ``out`` (None: a new array) runs on a
    compiled loop of :func:`_run_compiled`: both C-contiguous float32, at least
    :data:`_LOOP_COMPILED_MIN` elements, compiled kernels available."""
    return (x.dtype == np.float32 and x.flags.c_contiguous
            and (out is None or (out.dtype == np.float32 and out.flags.c_contiguous))
            and _compiled_planned(x.size, _LOOP_COMPILED_MIN))


def _run_compiled(kernel: str, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The in-place loop ``kernel`` of :mod:`attnlab.nn._compiled` on the C-contiguous
    float32 ``x`` into ``out`` (may be ``x``), block by block (large arrays over attnlab's
    threads)."""
    from attnlab.nn import _compiled  # imports numba

    loop = getattr(_compiled, kernel)
    copy = out is not x

    def fn(blocks, _scratch):
        xb, ob = blocks
        if copy:
            np.copyto(ob, xb)
        loop(ob)

    _elementwise(fn, (x, out), 0)
    return out


def _silu_block(blocks, scratch):
    """:func:`silu`'s operations on one block."""
    xb, ob = blocks
    d = scratch[0]
    np.negative(xb, out=d)
    # exp(-x) overflows to inf for x << 0: x / inf = -0; -inf / inf = NaN, as torch
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp(d, out=d)
        d += 1
        np.divide(xb, d, out=ob)


def silu_backward(grad_y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dLoss/dx for :func:`silu`: ``grad_y * s * (1 + x * (1 - s))``, ``s = sigmoid(x)``."""
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    return (grad_y * (s * (1.0 + x * (1.0 - s)))).astype(x.dtype, copy=False)


def rms_normalize(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(x_hat, rstd)``: ``x_hat = x * rstd``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` over the
    last axis (``rstd`` ``(..., 1)``). float16 input is computed in float32 and ``x_hat``
    cast back, as Hugging Face's ``LlamaRMSNorm`` does; float32 and float64 stay as they are.

    >>> x_hat, rstd = rms_normalize(np.array([[3.0, 4.0]], dtype=np.float32), 0.0)
    >>> x_hat
    array([[0.84852815, 1.1313709 ]], dtype=float32)
    """
    fused = _rms_normalize_fused(x, eps)
    if fused is not None:
        return fused
    xp = namespace(x)
    dtype = x.dtype
    if xp is np and dtype == np.float16:
        x = x.astype(np.float32)
    rstd = 1.0 / xp.sqrt(row_mean(x * x) + eps)  # a Python eps keeps x's dtype
    x_hat = x * rstd
    if xp is np and x_hat.dtype != dtype:
        x_hat = x_hat.astype(dtype)
    return x_hat, rstd


def _rms_normalize_fused(x, eps: float, weight=None):
    """:func:`rms_normalize` in one compiled pass per row (:func:`attnlab.core._fused.rms_normalize`),
    or None where it does not apply (another array library, other dtypes, numba absent or
    turned off, fewer than :data:`_LN_FUSED_MIN` elements). With ``weight`` (of ``x``'s
    dtype) the first array is ``x_hat * weight`` instead of ``x_hat``, in the same pass.
    Against the NumPy path ``rstd`` may differ in its last bit (its mean is summed in
    float64 here); the products are NumPy's. 512 x 576 float32 (SmolLM2's prompt of 512
    tokens), one thread, on a 2-core AVX-512 EPYC: the whole eval-mode ``RMSNorm`` 0.22-0.34
    ms through NumPy's passes, 0.07 ms here."""
    if not _row_pass_applies(x, weight):
        return None
    from attnlab.core import _fused

    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    y = np.empty_like(x2)
    rstd = np.empty(x2.shape[0], dtype=x.dtype)
    w = np.zeros(0, dtype=x.dtype) if weight is None else np.ascontiguousarray(weight)
    _fused.rms_normalize(x2, float(eps), w, y, rstd)
    return y.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)


def rms_norm(
    x: np.ndarray, weight: np.ndarray | None, eps: float, *, add_unit_offset: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RMS normalisation over the last axis: ``(y, x_hat, rstd)``, ``y = x_hat * weight``
    (``x_hat * (1 + weight)`` with ``add_unit_offset``, Gemma's convention); see
    :func:`rms_normalize`.

    >>> y, _, _ = rms_norm(np.array([[3.0, 4.0]]), np.array([1.0, 2.0]), 0.0)
    >>> y.round(4)
    array([[0.8485, 2.2627]])
    """
    x_hat, rstd = rms_normalize(x, eps)
    return rms_scale(x_hat, weight, add_unit_offset=add_unit_offset), x_hat, rstd


def rms_scale(x_hat: np.ndarray, weight: np.ndarray | None, *, add_unit_offset: bool = False) -> np.ndarray:
    """``x_hat * weight`` (or ``x_hat * (1 + weight)``); a copy of ``x_hat`` without weight."""
    if weight is None:
        return x_hat.copy() if isinstance(x_hat, np.ndarray) else x_hat
    return x_hat * (1.0 + weight) if add_unit_offset else x_hat * weight


def rms_norm_backward(
    grad_y: np.ndarray, x_hat: np.ndarray, rstd: np.ndarray, weight: np.ndarray | None,
    *, add_unit_offset: bool = False, weight_grad: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(grad_x, grad_weight)`` for :func:`rms_norm` (batch dims summed):
    ``grad_x = rstd * (g - x_hat * mean(g * x_hat))`` with ``g = grad_y * weight``
    (``grad_weight`` None for a frozen weight, ``weight_grad=False``)."""
    D = x_hat.shape[-1]
    grad_w = col_sum(grad_y.reshape(-1, D) * x_hat.reshape(-1, D)) if weight is not None and weight_grad else None
    if weight is None:
        g = grad_y
    else:
        g = grad_y * ((1.0 + weight) if add_unit_offset else weight)
    grad_x = (g - x_hat * row_mean(g * x_hat)) * rstd
    return grad_x.astype(x_hat.dtype, copy=False), grad_w
