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

With int8 activations (:func:`q4_matvec_q8`, :func:`q8_0_matvec_q8`; see the section
below) ``x`` is first rounded block by block to int8 codes, and a 4-bit product becomes
integer dot products of codes with codes.

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


@nb.njit(inline="always", **_JIT)  # inlined: as a call it cost the kernels 1.3-3x
def _offsets(scales, mins, sums, r, n, has_min):
    """Row ``r``'s term from the blocks' offsets for row ``n`` of ``x``: ``sum_b min_b
    sums[n, b]`` (Q4_1, ``has_min``) or ``-8 sum_b scale_b sums[n, b]`` (Q4_0), ``sums`` the
    blocks' sums of ``x`` (or of the rounded ``x``)."""
    m = _F(0.0)
    if has_min:
        for b in range(scales.shape[1]):
            m += mins[r, b] * sums[n, b]
    else:
        for b in range(scales.shape[1]):
            m -= _F(8.0) * scales[r, b] * sums[n, b]
    return m


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
            out[n, r] = acc + _offsets(scales, mins, xsum, r, n, has_min)


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



# ---- int8 activations (QuantizedTensor.activations == "int8") --------------------------
#
# x is rounded block by block (32 values) to int8 codes q = rint(x / d), d = max|x| / 127,
# as llama.cpp rounds the inputs of its 4-bit products (its Q8_1 blocks, which keep d in
# float16 where these keep float32); a 4-bit product is then integer dot products of codes
# with codes, a block's sum of 32 products exact in int32, scaled by the weight block's
# scale times d. The Q4_1 min term is min * d * sum(q), Q4_0's offset -8 * scale * d *
# sum(q): every term is the product with the rounded x, x_hat = d * q
# (attnlab.quant.round_activations), to float32 round-off.
#
# The dot products are x86 vector instructions, picked when compiling from the features
# numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES; never the instructions a CPU
# lacks, which would stop LLVM): AVX512-VNNI's vpdpbusd on 256 bits (32 code bytes, two
# blocks a step), else AVX2's vpmaddubsw + vpmaddwd (the same sums: a pair of products is at
# most 2 * 15 * 127, far from int16's saturation), else a scalar loop in int32.
# Measured on one core of a 2-core Zen 4 EPYC, a 1536 x 576 Q4_1 weight in cache: 28-30 us
# with x's rounding and the prefetch below (the dot products alone: 22 us VNNI, 23 us AVX2)
# against 51 us for float x (q4_matvec).

def _target_features() -> str:
    """The CPU features numba compiles for (``+avx2,+avx512vnni,...``; empty if unknown)."""
    try:
        from numba.core.registry import cpu_target

        return str(cpu_target.target_context.codegen()._tm_features)
    except Exception:  # noqa: BLE001 - another numba's internals: no vector instructions then
        return ""


def _int8_dot_isa(features: str) -> str:
    """``"vnni"``, ``"avx2"`` or ``"scalar"``: the instructions the 4-bit-by-int8 dot
    products use for a target with ``features`` (LLVM's ``+name`` list)."""
    have = {f[1:] for f in features.split(",") if f.startswith("+")}
    if {"avx512vnni", "avx512vl"} <= have:
        return "vnni"
    if "avx2" in have:
        return "avx2"
    return "scalar"


#: the instructions the int8-activation dot products compile to on this process's target
INT8_DOT_ISA = _int8_dot_isa(_target_features())


def explain_int8_dots(isa: str = INT8_DOT_ISA) -> str:
    """Which instructions the int8-activation dot products use, and why, in words
    (``attnlab bench --explain-dispatch``)."""
    return {"vnni": "AVX512-VNNI's vpdpbusd on 256 bits (numba compiles for avx512vnni and avx512vl)",
            "avx2": "AVX2's vpmaddubsw + vpmaddwd (numba compiles for avx2, without avx512vnni and avx512vl)",
            "scalar": "a scalar int32 loop (numba compiles for no avx2)"}[isa]


# Bytes a software prefetch reaches ahead of what is being read (llvm.prefetch into every
# cache level), for the compiled kernels that stream int8 or 4-bit codes (these 4-bit
# products' codes; an int8 key/value cache's rows, attnlab._decode_kernels): half of a 4 KiB
# page, the span AMD's and Intel's L2 prefetchers keep within. Here, SmolLM2's 150 block
# products a token, 80 MB, on a 2-core Zen 4 EPYC, paired in one process: 0.85 of the time
# without it on 2 threads, 0.81 on 1; 1 KiB ahead 0.90, 4 KiB 0.84. Prefetching the scales
# and mins as well measured no faster.
PREFETCH_AHEAD = 2048


def prefetch_line(builder, address):
    """Emit a prefetch of the 64-byte line at ``address`` (an i8 pointer) into every cache
    level. A prefetch never faults: an address past an array's end is dropped."""
    from llvmlite import ir
    from numba.core import cgutils

    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [i32] * 3), "llvm.prefetch.p0")
    builder.call(fn, [address, i32(0), i32(3), i32(1)])  # (address, read, keep in every level, data)


def _pair_dots_intrinsic(isa: str):
    """An intrinsic ``(codes (K/2,) uint8, xlo, xhi (K/2,) int8, scales (nb,), dx4 (4 nb,),
    pairs) -> float32``: ``sum_b scales[b] d[b] sum_j code_j q_j`` over the first ``2 *
    pairs`` blocks (``dx4``: each block's ``d`` four times, a lane per four products)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8p = ir.IntType(8).as_pointer()
    v32b, v8i, v16s = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(32), 8), \
        ir.VectorType(ir.IntType(16), 16)
    v8f, v2f = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.FloatType(), 2)

    @intrinsic
    def pair_dots(typingctx, codes, xlo, xhi, scales, dx4, pairs):
        if any(a.layout != "C" for a in (codes, xlo, xhi, scales, dx4)):
            return None  # the loads below step through contiguous memory

        def codegen(context, builder, sig, args):
            cp, lp, hp, sp, dp = (builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data, i8p)
                                  for i in range(5))
            n = args[5]
            intp = n.type
            mod = builder.module
            accp = cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8))
            fma = cgutils.get_or_insert_function(mod, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
            if isa == "vnni":
                dpbusd = cgutils.get_or_insert_function(mod, ir.FunctionType(v8i, [v8i] * 3),
                                                        "llvm.x86.avx512.vpdpbusd.256")
            else:
                maddubs = cgutils.get_or_insert_function(mod, ir.FunctionType(v16s, [v32b, v32b]),
                                                         "llvm.x86.avx2.pmadd.ub.sw")
                maddwd = cgutils.get_or_insert_function(mod, ir.FunctionType(v8i, [v16s, v16s]),
                                                        "llvm.x86.avx2.pmadd.wd")
            with cgutils.for_range(builder, n) as loop:
                p = loop.index
                off = builder.mul(p, intp(32))

                def load(base, offset, ty, align):
                    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=align)

                prefetch_line(builder, builder.gep(cp, [builder.add(off, intp(PREFETCH_AHEAD))]))
                c = load(cp, off, v32b, 1)
                lo = builder.and_(c, ir.Constant(v32b, [15] * 32))
                hi = builder.lshr(c, ir.Constant(v32b, [4] * 32))
                xl, xh = load(lp, off, v32b, 1), load(hp, off, v32b, 1)
                if isa == "vnni":
                    s = ir.Constant(v8i, [0] * 8)
                    for codes_, x_ in ((lo, xl), (hi, xh)):
                        s = builder.call(dpbusd, [s, builder.bitcast(codes_, v8i), builder.bitcast(x_, v8i)])
                else:
                    t = builder.add(builder.call(maddubs, [lo, xl]), builder.call(maddubs, [hi, xh]))
                    s = builder.call(maddwd, [t, ir.Constant(v16s, [1] * 16)])
                two = load(sp, builder.mul(p, intp(8)), v2f, 4)
                sw = builder.shuffle_vector(two, two, ir.Constant(v8i, [0, 0, 0, 0, 1, 1, 1, 1]))
                d = load(dp, builder.mul(p, intp(32)), v8f, 4)
                acc = builder.call(fma, [builder.sitofp(s, v8f), builder.fmul(sw, d), builder.load(accp)])
                builder.store(acc, accp)
            acc = builder.load(accp)
            total = builder.extract_element(acc, ir.IntType(32)(0))
            for i in range(1, 8):
                total = builder.fadd(total, builder.extract_element(acc, ir.IntType(32)(i)))
            return total

        return types.float32(codes, xlo, xhi, scales, dx4, pairs), codegen

    return pair_dots


# The rounding is compiled without fastmath: the codes are those NumPy's float32 arithmetic
# gives (attnlab.quant.round_activations), and a NaN or an infinity is seen.
_JIT_EXACT = {"nogil": True, "cache": True, "error_model": "numpy", "boundscheck": False}
_TINY = _F(1.1754944e-38)  # float32's smallest normal: a block whose d is below it rounds to 0


@nb.njit(**_JIT_EXACT)
def _block_d(x, n, b):
    """A block's ``d = max|x| / 127`` (0 below float32's normal range) and whether its values
    are all finite."""
    top = _F(0.0)
    probe = _F(0.0)
    for j in range(32):
        v = x[n, 32 * b + j]
        top = max(top, abs(v))
        probe += v * _F(0.0)  # NaN if any value is NaN or infinite
    d = _F(top / _F(127.0))  # float32 arithmetic throughout, as NumPy's on float32 arrays
    if not d >= _TINY:
        d = _F(0.0)
    return d, probe == _F(0.0)


@nb.njit(**_JIT_EXACT)
def quantize_x(x, xlo, xhi, dx4, xs, finite):
    """Round ``x (N, K)`` block by block to int8: ``xlo``/``xhi (N, K / 2)`` the codes of
    each block's first and second 16 values (the values a code byte's low and high nibble
    multiply), ``dx4 (N, K / 8)`` each block's ``d`` four times, ``xs (N, K / 32)`` each
    block's ``d * sum(q)`` (the block sum of the rounded ``x``), ``finite (N,)`` whether
    each row's values are all finite (a block holding a NaN or an infinity gets zero codes;
    the caller multiplies such a row as it is)."""
    N, nblocks = xs.shape
    for n in range(N):
        finite[n] = True
        for b in range(nblocks):
            d, ok = _block_d(x, n, b)
            if not ok:
                finite[n] = False
                d = _F(0.0)
            inv = _F(_F(1.0) / d) if d > _F(0.0) else _F(0.0)
            qs = 0
            for j in range(16):
                a = np.int32(np.rint(_F(x[n, 32 * b + j] * inv)))
                h = np.int32(np.rint(_F(x[n, 32 * b + 16 + j] * inv)))
                xlo[n, 16 * b + j] = a
                xhi[n, 16 * b + j] = h
                qs += a + h
            for i in range(4):
                dx4[n, 4 * b + i] = d
            xs[n, b] = _F(d * _F(qs))


@nb.njit(**_JIT_EXACT)
def round_x(x, out):
    """``out (N, K)``: ``x`` rounded as :func:`quantize_x` rounds it, ``d * q`` (float32; a
    row holding a NaN or an infinity is kept as it is)."""
    N, K = x.shape
    for n in range(N):
        finite = True
        for b in range(K // 32):
            d, ok = _block_d(x, n, b)
            finite = finite and ok
            inv = _F(_F(1.0) / d) if d > _F(0.0) else _F(0.0)
            for j in range(32):
                out[n, 32 * b + j] = _F(d * np.rint(_F(x[n, 32 * b + j] * inv)))
        if not finite:
            for k in range(K):
                out[n, k] = x[n, k]


def _make_q4_matvec_q8(isa: str, *, cache: bool = True):
    """The 4-bit-by-int8 product in ``isa``'s instructions (``cache=False``: kept out of
    numba's disk cache, where one name holds one build: a test's build for another
    instruction set)."""
    pair_dots = None if isa == "scalar" else _pair_dots_intrinsic(isa)
    jit = {**_JIT, "cache": cache}

    @nb.njit(**jit)
    def block_dot(codes, xlo, xhi, r, n, b):
        """A block's integer dot product, in int32 (the odd last block, or every block on a
        target without vector dot products)."""
        s = np.int32(0)
        for j in range(16):
            c = np.int32(codes[r, 16 * b + j])
            s += (c & np.int32(15)) * np.int32(xlo[n, 16 * b + j]) + (c >> np.int32(4)) * np.int32(xhi[n, 16 * b + j])
        return s

    @nb.njit(parallel=True, **jit)
    def q4_matvec_q8(codes, scales, mins, x, out, has_min):
        """``out (N, R) = round_activations(x) @ dequantize(W).T`` for Q4_1 (``has_min``) or
        Q4_0 ``W``, in integer dot products (see above); rows of ``x`` that are not all finite
        are multiplied as they are (:func:`q4_matvec`: their products are not finite either)."""
        R, nblocks = scales.shape
        N, K = x.shape
        xlo = np.empty((N, K // 2), dtype=np.int8)
        xhi = np.empty((N, K // 2), dtype=np.int8)
        dx4 = np.empty((N, K // 8), dtype=np.float32)
        xs = np.empty((N, nblocks), dtype=np.float32)
        finite = np.empty(N, dtype=np.bool_)
        quantize_x(x, xlo, xhi, dx4, xs, finite)
        pairs = nblocks // 2 if pair_dots is not None else 0
        for r in nb.prange(R):
            for n in range(N):
                acc = _F(0.0)
                if pair_dots is not None:
                    acc = pair_dots(codes[r], xlo[n], xhi[n], scales[r], dx4[n], pairs)
                for b in range(2 * pairs, nblocks):
                    acc += _F(block_dot(codes, xlo, xhi, r, n, b)) * (scales[r, b] * dx4[n, 4 * b])
                out[n, r] = acc + _offsets(scales, mins, xs, r, n, has_min)
        for n in range(N):
            if not finite[n]:  # a NaN or an infinity: the row's products with x as it is
                q4_matvec(codes, scales, mins, x[n:n + 1], out[n:n + 1], has_min)

    return q4_matvec_q8


#: ``q4_matvec_q8(codes, scales, mins, x, out, has_min)``: the 4-bit product with ``x``
#: rounded to int8 (see above), in :data:`INT8_DOT_ISA`'s instructions
q4_matvec_q8 = _make_q4_matvec_q8(INT8_DOT_ISA)


@nb.njit(**_JIT)
def q8_0_matvec_q8(codes, scales, x, out):
    """``out (N, R) = round_activations(x) @ dequantize(W).T`` for Q8_0 ``W`` (the rounded
    ``x`` in float32, then :func:`q8_0_matvec`: the product reads the weight at memory
    speed already)."""
    xr = np.empty_like(x)
    round_x(x, xr)
    q8_0_matvec(codes, scales, xr, out)
