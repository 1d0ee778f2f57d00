"""Compiled element-wise passes of the attention kernels (numba, the ``fast`` extra), and
the rotary rotation of their queries and keys (:func:`rotate32`).

The blockwise kernel spends its time in two matmuls per tile (BLAS) and in the pass between
them: mask, row maximum, ``exp`` and row sums. NumPy runs that pass as four or five
separate loops over the tile, each on one core, and its ``exp`` is scalar; here each is one
loop, vectorised by LLVM (AVX2 or AVX-512, whatever the CPU has), with ``exp`` as a
polynomial (``2^n * p(r)``, ``|r| <= ln(2) / 2``, relative error about 1e-7, exactly 0
below ``e^-87.3``). Measured on a 2-core AVX2 EPYC for a 256 x 512 float32 tile in cache:
row max + exp + row sums 0.057 ms here against 0.25 ms with NumPy.

Importing this module imports numba and compiles on first use (``cache=True``: the machine
code is kept on disk next to this file, or in numba's user cache directory, so a later
process loads it in well under a second). :mod:`attnlab.core.blockwise` imports it only
for large float32 problems, and only when numba is installed.

Every kernel works in place on float32 tiles and releases the GIL. The rows kernel's
blocks (:func:`forward_rows`, :func:`backward_rows`) also run
their matrix products here, through NumPy's own BLAS ``sgemm`` called from compiled code
(:func:`_sgemm`), so that a block is one call.

Mask modes (``mode``): 0 none; 1 causal (row ``r`` sees columns ``< lim0 + r``); 2 a bool
tile (True = takes part); 3 a float tile added to the scores.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# Fast-math without "nnan"/"ninf": -inf (masked scores) and NaN keep their meaning;
# "reassoc" lets LLVM vectorise the row sums.
_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}
_JIT = {"nogil": True, "fastmath": _FM, "cache": True, "error_model": "numpy", "boundscheck": False}
# Without "reassoc" where the order of subtraction matters: (x - shift) - log(l) must not
# become x - (shift + log(l)), which loses log(l) next to a shift of -1e30.
_JIT_ORDERED = {**_JIT, "fastmath": _FM - {"reassoc"}}

MODE_NONE, MODE_CAUSAL, MODE_BOOL, MODE_FLOAT = 0, 1, 2, 3

_F = np.float32
_LOG2E = _F(1.4426950408889634)
_LN2_HI = _F(0.693359375)  # ln 2 in two parts (Cody and Waite): n * _LN2_HI is exact
_LN2_LO = _F(-2.12194440e-4)
# exp(r) ~ 1 + r + r^2 (C2 + C3 r + C4 r^2 + C5 r^3 + C6 r^4) on |r| <= ln(2) / 2: a
# least-squares fit weighted towards the minimax error (max relative error 1e-7 in float32).
_C2, _C3, _C4 = _F(0.49999991059303284), _F(0.16666419804096222), _F(0.04166823625564575)
_C5, _C6 = _F(0.008374813012778759), _F(0.0013836275320500135)
_NEG_INF = _F(-np.inf)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret an int32 as a float32 (no conversion)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _maxnum(typingctx, a, b):
    """``llvm.maxnum``: LLVM vectorises a row maximum written with it (NaN is skipped)."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f], ir.FunctionType(f, [f, f]))
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _rint(typingctx, a):
    """``llvm.rint``: round to nearest (one vector instruction, ``vroundps``)."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.rint", [f], ir.FunctionType(f, [f]))
        return builder.call(fn, args)

    return sig, codegen


_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS's enums


@intrinsic
def _sgemm(typingctx, addr, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """``c = op(a) @ op(b) + beta * c`` (``op(x)`` is ``x`` or, where its flag is not 0,
    ``x^T``; row-major, leading dimensions ``lda``, ``ldb``, ``ldc`` in elements, ``m x k
    @ k x n``) through the CBLAS ``sgemm`` with 64-bit integers at ``addr``
    (:func:`attnlab.core._blas.sgemm_address`), called from compiled code: no NumPy call,
    no GIL, no floating-point error check. The arrays only give their first element."""
    sig = types.void(addr, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        fp = f32.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32, fp, i64, fp, i64, f32, fp, i64])
        tys = signature.args

        def as_i64(i):
            return context.cast(builder, args[i], tys[i], types.int64)

        def trans(i):
            return builder.select(builder.icmp_signed("!=", as_i64(i), ir.Constant(i64, 0)),
                                  ir.Constant(i32, _TRANS), ir.Constant(i32, _NO_TRANS))

        def data(i):
            return builder.bitcast(context.make_array(tys[i])(context, builder, args[i]).data, fp)

        fn = builder.inttoptr(as_i64(0), fnty.as_pointer())
        builder.call(fn, [ir.Constant(i32, _ROW_MAJOR), trans(1), trans(2), as_i64(3), as_i64(4), as_i64(5),
                          ir.Constant(f32, 1.0), data(6), as_i64(7), data(8), as_i64(9),
                          context.cast(builder, args[10], tys[10], types.float32), data(11), as_i64(12)])
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(inline="always", fastmath=_FM)
def _exp(x):
    """``exp(x)`` in float32 for ``x <= 0`` (and the small positive ``x`` that rounding
    leaves); exactly 0 for ``x <= -87.3`` and ``-inf``; NaN for NaN.

    ``x = n ln 2 + r`` with ``n`` rounded to nearest, so ``exp(x) = 2^n exp(r)``; ``2^n``
    is built in the exponent bits. Out-of-range ``n`` (from ``-inf``) only reaches the
    discarded side of the final select. The polynomial is evaluated in Estrin's scheme
    (shorter dependency chains than Horner's: measured 9% faster on a 512 x 512 tile,
    the same maximum relative error, 2.9e-7 against float64 on [-87, 0]).
    """
    n = _rint(x * _LOG2E)
    r = x - n * _LN2_HI - n * _LN2_LO
    r2 = r * r
    a = _C2 + _C3 * r
    b = _C4 + _C5 * r + _C6 * r2
    p = (a + b * r2) * r2 + r + _F(1.0)
    y = p * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)
    return _F(0.0) if x <= _F(-87.3) else y


@nb.njit(inline="always", fastmath=_FM)
def _visible(mode, lim0, r, cols):
    """Columns ``0..n`` of row ``r`` that a causal mask leaves (all of them otherwise)."""
    if mode == MODE_CAUSAL:
        return min(max(lim0 + r, 0), cols)
    return cols


@nb.njit(**_JIT)
def forward_tile(s, mode, mask, lim0, m, l, alpha, bad, cols):
    """One key tile of the online softmax, in place.

    ``s`` (rows, ld) holds in its first ``cols`` columns (``ld >= cols``: rows may be
    padded, see :func:`attnlab.core.blockwise.score_stride`) scaled scores and leaves
    holding ``exp(score + mask - m_new)`` (0 where masked); per row ``m`` becomes the new
    running max, ``l`` the rescaled running sum, ``alpha = exp(m_old - m_new)`` (<= 1,
    never overflowing) the factor the caller applies to its accumulator; ``bad`` becomes 1
    for rows that met a NaN score.
    """
    rows = s.shape[0]
    for r in range(rows):
        row = s[r]
        n = _visible(mode, lim0, r, cols)
        mt = _NEG_INF
        if mode == MODE_BOOL:
            mk = mask[r]
            for j in range(cols):
                x = row[j] if mk[j] else _NEG_INF
                row[j] = x
                mt = _maxnum(mt, x)
        elif mode == MODE_FLOAT:
            mk = mask[r]
            for j in range(cols):
                x = row[j] + mk[j]
                row[j] = x
                mt = _maxnum(mt, x)
        else:
            for j in range(n):
                mt = _maxnum(mt, row[j])
        m_old = m[r]
        m_new = max(m_old, mt)
        if m_new == _NEG_INF:  # nothing visible so far (or only NaN): l, acc stay 0
            alpha[r] = 1.0
            for j in range(n):
                if row[j] != row[j]:
                    bad[r] = 1
            for j in range(cols):
                row[j] = 0.0
            continue
        total = _F(0.0)
        for j in range(n):
            y = _exp(row[j] - m_new)
            row[j] = y
            total += y
        for j in range(n, cols):
            row[j] = 0.0
        a = _exp(m_old - m_new)
        alpha[r] = a
        l[r] = l[r] * a + total
        m[r] = m_new
        if total != total:  # a NaN score (exp keeps NaN; the row max skips it)
            bad[r] = 1


@nb.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)  # no fast-math: IEEE / and log
def finish_rows(acc, stats, m, l, bad):
    """The end of a query tile, in one loop (NumPy's version, ``blockwise._finish_rows``,
    takes a dozen passes): ``acc /= l`` and ``stats = [m, log(l)]``; rows that saw
    nothing give 0 and ``[-inf, 0]``, rows that met a NaN (``bad``, or ``l`` NaN) NaN."""
    rows, width = acc.shape
    nan = _F(np.nan)
    for r in range(rows):
        lr = l[r]
        if bad[r] != 0 or lr != lr:
            for e in range(width):
                acc[r, e] = nan
            stats[r, 0] = nan
            stats[r, 1] = nan
        elif lr > 0:
            for e in range(width):
                acc[r, e] = acc[r, e] / lr
            stats[r, 0] = m[r]
            stats[r, 1] = np.log(lr)
        else:
            for e in range(width):
                acc[r, e] = 0.0
            stats[r, 0] = _NEG_INF
            stats[r, 1] = 0.0


@nb.njit(**_JIT)
def accumulate(acc, pv, alpha):
    """``acc = acc * alpha[:, None] + pv`` (rows whose alpha is 1 skip the product)."""
    rows, width = acc.shape
    for r in range(rows):
        a = alpha[r]
        if a == 1.0:
            for e in range(width):
                acc[r, e] += pv[r, e]
        else:
            for e in range(width):
                acc[r, e] = acc[r, e] * a + pv[r, e]


@nb.njit(**_JIT_ORDERED)
def backward_probs(s, mode, mask, lim0, shift, logl, cols):
    """``s`` (rows, ld: scaled scores in the first ``cols`` columns) becomes ``exp(score +
    mask - shift - logl)``: the forward pass's probabilities, recomputed from two numbers
    per row (0 where masked or the row saw nothing, ``shift = -inf``)."""
    rows = s.shape[0]
    for r in range(rows):
        row = s[r]
        c = shift[r]
        ll = logl[r]
        if c == _NEG_INF:
            for j in range(cols):
                row[j] = 0.0
            continue
        n = _visible(mode, lim0, r, cols)
        if mode == MODE_BOOL:
            mk = mask[r]
            for j in range(cols):
                row[j] = _exp((row[j] - c) - ll) if mk[j] else _F(0.0)
        elif mode == MODE_FLOAT:
            mk = mask[r]
            for j in range(cols):
                row[j] = _exp(((row[j] + mk[j]) - c) - ll)
        else:
            for j in range(n):
                row[j] = _exp((row[j] - c) - ll)
            for j in range(n, cols):
                row[j] = 0.0


@nb.njit(**_JIT)
def backward_dscores(dp, p, d, cols):
    """``dp = p * (dp - d[:, None])`` over the first ``cols`` columns of ``dp`` and ``p``
    (rows, ld): the scores' gradient (without the factor ``scale``)."""
    rows = dp.shape[0]
    for r in range(rows):
        dr = d[r]
        for j in range(cols):
            dp[r, j] = p[r, j] * (dp[r, j] - dr)


@nb.njit(**_JIT)
def softmax_rows(s, mode, mask, lim0, inv, scale, cols):
    """Softmax along the first ``cols`` columns of ``s`` (n, rows, ld), in place, mask
    included: the row pass of :mod:`attnlab.core.rows` between its two matmuls (``ld >=
    cols``: rows may be padded, see :func:`attnlab.core.blockwise.score_stride`; the columns
    past ``cols`` are neither read nor written).

    ``s`` holds unscaled scores ``q k^T`` and leaves holding the probabilities of
    ``scale * s + mask`` (the factor goes on the scores here, in the pass that reads them
    anyway, as torch's CPU flash kernel does, instead of on a scaled copy of the
    queries); per row one loop for the mask and the maximum, one for ``exp`` and the sum,
    one for the product with ``1 / sum``. Mask modes as :func:`forward_tile` (``mask`` (n, rows, cols), any strides;
    causal: row ``r`` sees columns ``< lim0 + r``). A row with nothing visible gives zeros,
    a row with a NaN score (visible) NaN everywhere, as NumPy's path and torch.

    ``inv`` (n * rows,), or empty: where given, the rows are left unnormalised (``exp``
    only) and ``inv`` receives each row's ``1 / sum``, for the caller to apply to the
    ``(rows, Ev)`` product with the values instead of the ``(rows, cols)`` probabilities
    (0 for a row with nothing visible, NaN for a NaN row).
    """
    defer = inv.shape[0] > 0
    n, rows = s.shape[0], s.shape[1]
    nan = _F(np.nan)
    for b in range(n):
        for r in range(rows):
            row = s[b, r]
            vis = _visible(mode, lim0, r, cols)
            mt = _NEG_INF
            sc = scale  # the factor still to apply in the exp loop
            if mode == MODE_BOOL:
                mk = mask[b, r]
                for j in range(cols):
                    x = row[j] * scale if mk[j] else _NEG_INF
                    row[j] = x
                    mt = _maxnum(mt, x)
                sc = _F(1.0)
            elif mode == MODE_FLOAT:
                mk = mask[b, r]
                for j in range(cols):
                    x = row[j] * scale + mk[j]
                    row[j] = x
                    mt = _maxnum(mt, x)
                sc = _F(1.0)
            elif scale > _F(0.0):  # max(scale * s) = scale * max(s), exactly
                for j in range(vis):
                    mt = _maxnum(mt, row[j])
                mt = mt * scale
            else:  # a zero, negative or NaN factor: apply it first
                for j in range(vis):
                    x = row[j] * scale
                    row[j] = x
                    mt = _maxnum(mt, x)
                sc = _F(1.0)
            if mt == _NEG_INF:  # nothing visible, or only NaN beside -inf
                fill = _F(0.0)
                for j in range(vis):
                    if row[j] != row[j]:
                        fill = nan
                for j in range(cols):
                    row[j] = fill
                if defer:
                    inv[b * rows + r] = fill
                continue
            total = _F(0.0)
            for j in range(vis):
                y = _exp(row[j] * sc - mt)
                row[j] = y
                total += y
            for j in range(vis, cols):
                row[j] = 0.0
            if defer:
                inv[b * rows + r] = _F(1.0) / total
            else:
                rt = _F(1.0) / total
                for j in range(vis):
                    row[j] *= rt


@nb.njit(**_JIT)
def softmax_rows_backward(dp, p, cols):
    """``dp = p * (dp - sum(p * dp))`` row by row over the first ``cols`` columns, in place
    (``dp``, ``p``: (rows, ld), ``ld >= cols``): the scores' gradient from the
    probabilities' (without the factor ``scale``)."""
    rows = dp.shape[0]
    for r in range(rows):
        d = _F(0.0)
        for j in range(cols):
            d += p[r, j] * dp[r, j]
        for j in range(cols):
            dp[r, j] = p[r, j] * (dp[r, j] - d)


@nb.njit(**_JIT)  # fast-math "reassoc": the row sums vectorise
def layer_norm_backward(g, x_hat, rstd, w, gx, gw, gb):
    """LayerNorm's backward pass over rows, in one compiled pass per row: ``gx`` (rows, D)
    gets ``(g w - mean(g w) - x_hat mean(g w x_hat)) * rstd``; ``gw`` and ``gb`` (D,)
    float64 accumulate ``sum(g x_hat)`` and ``sum(g)`` over the rows. Row means are
    accumulated in float64; ``w`` of length 0 means no weight (ones)."""
    rows, D = g.shape
    has_w = w.shape[0] > 0
    for i in range(rows):
        a = 0.0
        c = 0.0
        for j in range(D):
            gj = g[i, j]
            xh = x_hat[i, j]
            gb[j] += gj
            gw[j] += gj * xh
            if has_w:
                gj = gj * w[j]
            a += gj
            c += gj * xh
        a /= D
        c /= D
        r = rstd[i]
        for j in range(D):
            gj = g[i, j] * w[j] if has_w else g[i, j]
            gx[i, j] = (gj - a - x_hat[i, j] * c) * r


@nb.njit(**_JIT)  # fast-math "reassoc": the row sums vectorise
def layer_norm_forward(x, w, b, eps, y, x_hat, rstd):
    """LayerNorm over rows in one compiled pass per row: ``rstd`` (rows,) gets
    ``1 / sqrt(var + eps)`` (biased variance of the row about its mean, both accumulated in
    float64), ``x_hat`` (rows, D; or (0, 0): not kept) ``(x - mean) * rstd``, ``y`` (rows,
    D) ``x_hat * w + b``; ``w``/``b`` of length 0 mean none. ``y`` may be ``x``."""
    rows, D = x.shape
    has_w = w.shape[0] > 0
    has_b = b.shape[0] > 0
    keep = x_hat.shape[0] > 0
    for i in range(rows):
        s = 0.0
        for j in range(D):
            s += x[i, j]
        mean = s / D
        v = 0.0
        for j in range(D):
            d = x[i, j] - mean
            v += d * d
        r = 1.0 / np.sqrt(v / D + eps)
        rstd[i] = r
        for j in range(D):
            h = (x[i, j] - mean) * r
            if keep:
                x_hat[i, j] = h
            if has_w:
                h = h * w[j]
            if has_b:
                h = h + b[j]
            y[i, j] = h


@nb.njit(**_JIT)  # fast-math "reassoc": the row sums vectorise
def rms_normalize(x, eps, w, y, rstd):
    """RMS normalisation over rows in one compiled pass per row: ``rstd`` (rows,) gets
    ``1 / sqrt(mean(x^2) + eps)`` (the mean accumulated in float64, then rounded to
    ``x``'s dtype), ``y`` (rows, D) ``x * rstd`` in ``x``'s dtype (NumPy's product of the
    two), then times ``w`` (D,) unless ``w`` is empty (NumPy's ``x_hat * w``). ``y`` may
    be ``x``."""
    rows, D = x.shape
    has_w = w.shape[0] > 0
    for i in range(rows):
        s = 0.0
        for j in range(D):
            v = np.float64(x[i, j])
            s += v * v
        rstd[i] = 1.0 / np.sqrt(s / D + eps)
        r = rstd[i]
        if has_w:
            for j in range(D):
                y[i, j] = (x[i, j] * r) * w[j]
        else:
            for j in range(D):
                y[i, j] = x[i, j] * r


@nb.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)  # no fast-math: NumPy's rounding
def rotate32(x, cos, sin, sign, out):
    """Rotary positions (:func:`attnlab.core.rotary.apply_rotary`) of ``x (N, H, T, D)``
    (any strides) by ``cos``/``sin (Nc, T, R)`` (``Nc`` 1 or ``N``) into the C-contiguous
    ``out``: ``x1 cos - (sign x2) sin`` and ``x2 cos + (sign x1) sin`` on the halves of the
    first ``R`` dims, the rest copied; float32 ``sign`` (+1 forward, -1 the transpose). The
    NumPy path's operations in its order, each rounded to float32: the same numbers bit for
    bit, in one pass instead of eight."""
    N, H, T, D = x.shape
    R = cos.shape[2]
    F2 = R // 2
    for n in range(N):
        c = n if cos.shape[0] > 1 else 0
        for h in range(H):
            for t in range(T):
                for i in range(F2):
                    x1 = x[n, h, t, i]
                    x2 = x[n, h, t, F2 + i]
                    out[n, h, t, i] = x1 * cos[c, t, i] - (sign * x2) * sin[c, t, i]
                    out[n, h, t, F2 + i] = x2 * cos[c, t, F2 + i] + (sign * x1) * sin[c, t, F2 + i]
                for i in range(R, D):
                    out[n, h, t, i] = x[n, h, t, i]


@nb.njit(**_JIT)
def backward_rows(sgemm, q, k, v, go, dq, dk, dv, p, dp, chunks, causal, no_mask, scale):
    """The backward pass of :mod:`attnlab.core.rows` for a block of heads, all in compiled
    code (the products through NumPy's ``sgemm`` at ``sgemm``, see :func:`_sgemm`): no
    NumPy call, so the pool's threads never wait for the GIL between the products. For
    each head ``h`` and each block of query rows ``a0:a1`` in ``chunks`` (n, 2), keys
    ``0:kend`` (``kend = min(S, a1)`` when ``causal``, else ``S``), per query head ``g``
    of the group: ``p = softmax(scale * q k^T)`` (:func:`softmax_rows`), ``dv += p^T go``,
    ``dp = go v^T``, then ``dp = p * (dp - sum(p * dp))`` (:func:`softmax_rows_backward`),
    ``dk += dp^T q`` (without the factor ``scale``, which the caller applies once) and
    ``dq = scale * dp k``.

    ``q`` (nh, G, L, E), ``go`` (nh, G, L, Ev), ``dq`` (nh, G, L, E); ``k`` (nh, S, E),
    ``v`` (nh, S, Ev), ``dk`` (nh, S, E), ``dv`` (nh, S, Ev) accumulated into; all with
    unit strides along their last axis. ``p`` and ``dp`` (G * rows, ld) C-contiguous
    scratch, ``ld >= S``.
    """
    nh, G, _, E = q.shape
    S, Ev = k.shape[1], v.shape[2]
    ld = p.shape[1]
    lq, lg, ldq = q.strides[2] // 4, go.strides[2] // 4, dq.strides[2] // 4
    lk, lv, ldk, ldv = k.strides[1] // 4, v.strides[1] // 4, dk.strides[1] // 4, dv.strides[1] // 4
    normalise = np.empty(0, dtype=np.float32)
    mode = MODE_CAUSAL if causal else MODE_NONE
    one, zero = _F(1.0), _F(0.0)
    for h in range(nh):
        for ci in range(chunks.shape[0]):
            a0, a1 = chunks[ci, 0], chunks[ci, 1]
            rows = a1 - a0
            kend = min(S, a1) if causal else S
            pb, dpb = p[: G * rows], dp[: G * rows]
            for g in range(G):
                _sgemm(sgemm, 0, 1, rows, kend, E, q[h, g, a0:], lq, k[h], lk, zero, pb[g * rows:], ld)
            softmax_rows(pb.reshape(G, rows, ld), mode, no_mask, a0 + 1 if causal else 0, normalise, scale, kend)
            for g in range(G):
                _sgemm(sgemm, 1, 0, kend, Ev, rows, pb[g * rows:], ld, go[h, g, a0:], lg, one, dv[h], ldv)
                _sgemm(sgemm, 0, 1, rows, kend, Ev, go[h, g, a0:], lg, v[h], lv, zero, dpb[g * rows:], ld)
            softmax_rows_backward(dpb, pb, kend)
            for g in range(G):
                _sgemm(sgemm, 1, 0, kend, E, rows, dpb[g * rows:], ld, q[h, g, a0:], lq, one, dk[h], ldk)
                _sgemm(sgemm, 0, 0, rows, E, kend, dpb[g * rows:], ld, k[h], lk, zero, dq[h, g, a0:], ldq)
                for r in range(a0, a1):
                    for e in range(E):
                        dq[h, g, r, e] *= scale


@nb.njit(**_JIT)
def forward_rows(sgemm, q, k, v, out, s, inv, kt, a0, a1, causal, no_mask, scale):
    """One block of :mod:`attnlab.core.rows`'s forward pass (or a whole short call), query
    rows ``a0:a1`` of a block of heads, in compiled code (the products through NumPy's ``sgemm`` at
    ``sgemm``, see :func:`_sgemm`): per head ``h`` and query head ``g`` of its group,
    ``s = q k[:kend]^T`` (through the transposed copy ``kt`` (E, S) where it is not empty),
    :func:`softmax_rows` (rows left unnormalised, ``1 / sum`` into ``inv``), ``out =
    s v[:kend]`` times each row's ``1 / sum``; ``kend = min(S, a1)`` when ``causal``, else
    ``S``.

    ``q`` (nh, G, L, E), ``k`` (nh, S, E), ``v`` (nh, S, Ev), ``out`` (nh, G, L, Ev): unit
    strides along their last axis. ``s`` (nh, G * rows, ld) C-contiguous scratch, ``ld >=
    kend``; ``inv`` (nh * G * rows,). Against NumPy's blocks the numbers differ by float32
    rounding: LLVM vectorises the inlined row sums in an order of its own, and a group's
    query heads are multiplied one by one, not stacked into one product.
    """
    nh, G, _, E = q.shape
    S, Ev = k.shape[1], v.shape[2]
    ld = s.shape[2]
    rows = a1 - a0
    kend = min(S, a1) if causal else S
    lq, lo = q.strides[2] // 4, out.strides[2] // 4
    lk, lv = k.strides[1] // 4, v.strides[1] // 4
    copy = kt.shape[0] > 0
    zero = _F(0.0)
    for h in range(nh):
        if copy:
            for e in range(E):
                for j in range(kend):
                    kt[e, j] = k[h, j, e]
        for g in range(G):
            if copy:
                _sgemm(sgemm, 0, 0, rows, kend, E, q[h, g, a0:], lq, kt, kt.shape[1], zero, s[h, g * rows:], ld)
            else:
                _sgemm(sgemm, 0, 1, rows, kend, E, q[h, g, a0:], lq, k[h], lk, zero, s[h, g * rows:], ld)
    mode = MODE_CAUSAL if causal else MODE_NONE
    softmax_rows(s.reshape(nh * G, rows, ld), mode, no_mask, a0 + 1 if causal else 0, inv, scale, kend)
    for h in range(nh):
        for g in range(G):
            _sgemm(sgemm, 0, 0, rows, Ev, kend, s[h, g * rows:], ld, v[h], lv, zero, out[h, g, a0:], lo)
            base = (h * G + g) * rows
            for r in range(rows):
                f = inv[base + r]
                for e in range(Ev):
                    out[h, g, a0 + r, e] *= f


# The per-entry kernels call these names (not the public ones, which tests may replace with
# Python functions that numba could not compile against).
_forward_rows, _backward_rows = forward_rows, backward_rows


@nb.njit(**_JIT)
def forward_rows_by_entry(sgemm, q, k, v, out, s, inv, kt, a0, a1, causal, no_mask, scale):
    """:func:`forward_rows` on a block of whole batch entries, ``q`` (nn, Hkv, G, L, E),
    ``k`` (nn, Hkv, S, E), ``v`` (nn, Hkv, S, Ev), ``out`` (nn, Hkv, G, L, Ev): one
    :func:`forward_rows` per entry (heads transposed out of a ``(N, L, H, D)`` projection
    have no flat head axis), its scratch ``s[:Hkv]`` and ``inv``."""
    Hkv = q.shape[1]
    for n in range(q.shape[0]):
        _forward_rows(sgemm, q[n], k[n], v[n], out[n], s[:Hkv], inv, kt, a0, a1, causal, no_mask, scale)


@nb.njit(**_JIT)
def backward_rows_by_entry(sgemm, q, k, v, go, dq, dk, dv, p, dp, chunks, causal, no_mask, scale):
    """:func:`backward_rows` on a block of whole batch entries (the arrays with a leading
    entry axis, as :func:`forward_rows_by_entry`'s)."""
    for n in range(q.shape[0]):
        _backward_rows(sgemm, q[n], k[n], v[n], go[n], dq[n], dk[n], dv[n], p, dp, chunks, causal, no_mask, scale)

