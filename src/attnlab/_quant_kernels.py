"""Compiled kernels of :mod:`attnlab.quant` (numba, the ``fast`` extra).

Block layout (one weight row of ``K`` columns is ``K / 32`` blocks of 32 values):

- ``Q8_0``: ``codes`` int8 ``(R, K)``; value = ``scale * code``.
- ``Q4_0``: ``codes`` uint8 ``(R, K / 2)``, 16 bytes a block, llama.cpp's order: byte ``j``
  holds value ``j`` in its low nibble and value ``j + 16`` in its high one;
  value = ``scale * (nibble - 8)``.
- ``Q4_1``: the same codes; value = ``scale * nibble + min``.

``scales`` and ``mins`` are float32 ``(R, K / 32)``.

The matrix-vector kernels (decode: a few rows of ``x``) run over output rows in parallel
(``prange``, numba's thread pool) and read each weight byte once. Per row, one loop over the
whole row multiplies each code by its ``x`` value and its block's scale
(``scales[r, k >> 4]``) into one float32 accumulator; Q4_1's min term is
``sum_b min_b * sum(x over block b)`` and Q4_0's ``- 8`` is ``-8 sum_b scale_b sum(x over
block b)``, with the block sums of ``x`` (and ``x`` split into the values the low and the
high nibbles multiply) computed once per call. ``fastmath`` lets LLVM reorder the float
sums (vectorised: AVX2/AVX-512), so results equal the dequantized product to float32
round-off, not bit for bit. Measured on one core of a 2-core AVX-512 EPYC, a 1536 x 576
weight: Q4_1 about 51 us (17 G values/s; 101 us when the nibbles were split with integer
operations, which numba widens to int64), Q8_0 about 47 us; loops of 16 or 32 steps per
block with a sum per block ran 2.5 to 4x slower.

A float32 weight (:func:`f32_matvec`: a float32 model's decoding step) is read the same
way, a row a dot product: on a 2-core Zen 4 EPYC, 35 GB/s against 21-30 for NumPy's
matrix-vector product (OpenBLAS) on SmolLM2's weights.

Importing this module imports numba; ``cache=True`` keeps the machine code on disk.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_JIT = {"nogil": True, "fastmath": True, "cache": True, "error_model": "numpy", "boundscheck": False}
_F = np.float32


# float32 weights: sums reordered (vectorised), but infinities and NaNs kept as IEEE has them
_JIT_FLOAT32 = {"nogil": True, "fastmath": {"reassoc", "contract", "nsz"}, "cache": True, "error_model": "numpy",
                "boundscheck": False}


@nb.njit(parallel=True, **_JIT_FLOAT32)
def f32_matvec(weight, x, out):
    """``out (N, R) = x (N, K) @ weight (R, K).T``, rows in parallel (each thread reads its
    own run of the weight's rows once, for every row of ``x``); each dot product summed in
    vector lanes, so not bit for bit BLAS's sum. ``x`` is taken in C order (a copy where it
    is strided, which would keep the compiler from vectorising)."""
    R, K = weight.shape
    N = x.shape[0]
    xc = np.ascontiguousarray(x)
    for r in nb.prange(R):
        w = weight[r]
        for n in range(N):
            xn = xc[n]
            acc = _F(0.0)
            for k in range(K):
                acc += w[k] * xn[k]
            out[n, r] = acc


@nb.njit(**_JIT)
def split_x(x, xlo, xhi, xsum):
    """For ``x (N, K)``: ``xlo``/``xhi (N, K / 2)`` the first and second 16 values of every
    block (the values a code byte's low and high nibble multiply), ``xsum (N, K / 32)`` the
    blocks' sums."""
    N, nblocks = xsum.shape
    for n in range(N):
        for b in range(nblocks):
            s = _F(0.0)
            for j in range(16):
                a = x[n, 32 * b + j]
                h = x[n, 32 * b + 16 + j]
                xlo[n, 16 * b + j] = a
                xhi[n, 16 * b + j] = h
                s += a + h
            xsum[n, b] = s


# The inner loops run over a whole row (K or K / 2 steps) with a scalar accumulator and
# the block's scale read as scales[r, k >> 5]: LLVM vectorises that (AVX-512: 16 lanes).
# Loops of 16 or 32 steps per block with a sum per block measured 2.5 to 4x slower (the
# short loops are not vectorised, or each block ends in a horizontal sum).
@nb.njit(parallel=True, **_JIT)
def q8_0_matvec(codes, scales, x, out):
    """``out (N, R) = x (N, K) @ dequantize(W).T`` for Q8_0 ``W``, rows in parallel."""
    R = scales.shape[0]
    N, K = x.shape
    for r in nb.prange(R):
        for n in range(N):
            acc = _F(0.0)
            for k in range(K):
                acc += _F(np.int32(codes[r, k])) * x[n, k] * scales[r, k >> 5]
            out[n, r] = acc


@nb.njit(parallel=True, **_JIT)
def q4_matvec(codes, scales, mins, x, out, has_min):
    """``out (N, R) = x (N, K) @ dequantize(W).T`` for Q4_1 (``has_min``: ``mins`` are
    the blocks' mins) or Q4_0 (``mins`` ignored: the offset is ``-8 scale``), rows in
    parallel (``x`` first split by :func:`split_x`, once)."""
    R, nblocks = scales.shape
    N, K = x.shape
    K2 = K // 2
    xlo = np.empty((N, K2), dtype=np.float32)
    xhi = np.empty((N, K2), dtype=np.float32)
    xsum = np.empty((N, nblocks), dtype=np.float32)
    split_x(x, xlo, xhi, xsum)
    for r in nb.prange(R):
        for n in range(N):
            acc = _F(0.0)
            for k in range(K2):
                # the two nibbles in float32 (exact): numba widens integer ops to int64, and
                # LLVM then converts 8 lanes at a time; this way it is 16 (2x faster)
                c = _F(codes[r, k])
                hi = np.floor(c * _F(0.0625))
                lo = c - _F(16.0) * hi
                acc += (lo * xlo[n, k] + hi * xhi[n, k]) * scales[r, k >> 4]
            m = _F(0.0)
            if has_min:
                for b in range(nblocks):
                    m += mins[r, b] * xsum[n, b]
            else:
                for b in range(nblocks):
                    m -= _F(8.0) * scales[r, b] * xsum[n, b]
            out[n, r] = acc + m


@nb.njit(**_JIT)
def q8_0_dequantize(codes, scales, out):
    """``out (R, K)`` = the Q8_0 rows ``codes (R, K)`` scaled."""
    R, nblocks = scales.shape
    for r in range(R):
        for b in range(nblocks):
            d = scales[r, b]
            for j in range(32):
                out[r, 32 * b + j] = d * _F(codes[r, 32 * b + j])


@nb.njit(**_JIT)
def q4_dequantize(codes, scales, mins, out, has_min):
    """``out (R, K)`` = the Q4_1 (``has_min``: ``scale * nibble + min``) or Q4_0
    (``scale * (nibble - 8)``) rows ``codes (R, K / 2)``, as llama.cpp computes them."""
    R, nblocks = scales.shape
    for r in range(R):
        for b in range(nblocks):
            d = scales[r, b]
            m = mins[r, b] if has_min else _F(0.0)
            off = 0 if has_min else 8
            for j in range(16):
                c = codes[r, 16 * b + j]
                out[r, 32 * b + j] = d * _F((c & 15) - off) + m
                out[r, 32 * b + 16 + j] = d * _F((c >> 4) - off) + m

