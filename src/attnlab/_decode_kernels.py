"""The compiled decoding step of one transformer block whose projections are kept quantized
or are float32 NumPy matrices (numba, the ``fast`` extra): :func:`decode_layer`, which
:meth:`attnlab.nn.TransformerBlock.forward` runs for one new token per row after a
key/value cache (see :meth:`~attnlab.nn.TransformerBlock.decode_record` for when).

A new token's block is a handful of matrix-vector products and a little arithmetic around
them. Run as NumPy calls through the modules it is some 40 small operations a block, and
the Python between them cost about as much as the products themselves (SmolLM2-135M on a
2-core EPYC: 17 ms a token, of which the quantized products took 10). Here one call does the
whole block: the products are :mod:`attnlab._quant_kernels`' (parallel over output rows),
the rest is loops over a few thousand values. The float32 SmolLM2 went from 31-33 ms a token
on the modules' path to 18-19 ms here (with its output layer on the same matrix-vector
kernel: :func:`attnlab.quant.float32_matvec`), about 540 MB read a token at 29 GB/s.

The kernel knows no model: each part of the block hands it a record of its own slots, built
by the module that owns them (plain tuples, which numba types quickly; the names below are
the fields in order):

- a product (:func:`attnlab.quant.product_record`): ``(codes, scales, mins, kind, bias)``,
  ``kind`` 0 ``Q8_0``, 1 ``Q4_0``, 2 ``Q4_1``, 3 a float32 weight (``codes``), 4 to 6 the
  quantized three with ``x`` rounded to int8 (:func:`attnlab.quant.round_activations`),
  ``bias`` None for none;
- a norm (:meth:`attnlab.nn.RMSNorm.decode_record`): ``(weight (D,), eps, offset)``, scaling
  by ``weight + offset`` (1 with a unit offset); None where a block has no such norm;
- the attention (:meth:`attnlab.nn.Attention.decode_record`): ``(qkv, out, q_norm, k_norm,
  num_heads, num_kv_heads, head_dim, scale, softcap)``, two products, two norms (QK-norm of
  each head, or None), ``softcap`` 0 for none;
- the feed-forward network (:meth:`attnlab.nn.GatedFeedForward.decode_record`): ``(gate,
  up, down, activation)``, activation 0 SiLU, 1 GELU (tanh), 2 GELU (erf), 3 ReLU;
- the block (:meth:`attnlab.nn.TransformerBlock.decode_record`): ``(ln_1, attention,
  ln_1_post, ln_2, feed_forward, ln_2_post)``, the sandwich norms None for none;
- the rows of one call (:meth:`attnlab.nn.Attention.decode_rows`): ``(cos, sin, keys,
  values, key_scales, value_scales, slot, start, key_mask)``, ``keys``/``values`` the
  cache's storage: float32, a float16 cache's bits as uint16 (read and written through
  :func:`_widen`/:func:`_narrow`), or an int8 cache's codes, with their scales ``(N, Hkv,
  C)`` (None for a float cache; written by :func:`_quantize`).

Axes: ``N`` rows (sequences), ``D`` model width, ``Hq``/``Hkv`` query and key/value heads,
``Dh`` head width, ``R`` rotated dims (``<= Dh``), ``C`` the cache's capacity, ``S`` keys,
``F`` the feed-forward width.

Each step computes what the module path computes, in the same order, to float32 round-off
(the norms' mean of squares and the softmax's sum are accumulated in float64). An absent
slot is None, which numba compiles away (and which costs the call nothing to pass).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from attnlab._quant_kernels import (
    _F,
    PREFETCH_AHEAD,
    f32_matvec,
    prefetch_line,
    q4_matvec,
    q4_matvec_q8,
    q8_0_matvec,
    q8_0_matvec_q8,
)

# fastmath without "no infs, no NaNs": the softmax and SiLU meet large magnitudes (exp(-x)
# overflows to inf for x << 0, and x / inf must stay -0); reassociation lets sums vectorise.
_JIT = {"nogil": True, "fastmath": {"reassoc", "contract", "arcp", "nsz"}, "cache": True,
        "error_model": "numpy", "boundscheck": False}

# A float16 cache (KVCache(dtype="float16")) reaches the kernels as its bits, uint16 arrays
# (numba has no float16 type): _widen reads a cached value as float32 and _narrow writes
# one, both as the CPU's own conversions (F16C's vcvtph2ps/vcvtps2ph, which LLVM
# vectorises; round to nearest even, as NumPy's astype). A float32 cache passes through.
# Code for a target without such instructions (an x86 CPU without F16C, none since 2013, or
# numba told to compile for one: NUMBA_CPU_NAME=generic, as for a cache shared between
# machines) calls a library function that numba does not link, and LLVM aborts the process:
# there a float16 cache takes the modules' path (HALF_CONVERSIONS). Whether it would is read
# off the code numba's own target machine makes of the two conversions. An int8 cache
# (KVCache(dtype="int8")) reaches them as its codes, int8, with a float32 scale a row.
def _half_conversions() -> bool:
    from llvmlite import binding

    try:
        from numba.core.registry import cpu_target

        machine = cpu_target.target_context.codegen()._tm  # numba's target (NUMBA_CPU_NAME, _FEATURES)
    except Exception:  # noqa: BLE001 - another numba's internals: the host's features decide
        machine = None
    if machine is None:
        import platform

        if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
            return True  # AArch64 and the like convert half precision in their base instruction set
        try:
            return bool(binding.get_host_cpu_features().get("f16c"))
        except RuntimeError:  # features unknown
            return False
    return _converts_in_instructions(machine)


def _converts_in_instructions(machine) -> bool:
    """Whether the target ``machine`` (an llvmlite TargetMachine) widens and narrows half
    precision without calling a function (compiled to assembly only, never linked)."""
    from llvmlite import binding

    module = ir.Module()
    for name, half_in in (("widen", True), ("narrow", False)):
        f32, f16 = ir.FloatType(), ir.HalfType()
        fn = ir.Function(module, ir.FunctionType(f32 if half_in else ir.IntType(16),
                                                 [ir.IntType(16) if half_in else f32]), name)
        b = ir.IRBuilder(fn.append_basic_block())
        x = fn.args[0]
        b.ret(b.fpext(b.bitcast(x, f16), f32) if half_in else b.bitcast(b.fptrunc(x, f16), ir.IntType(16)))
    parsed = binding.parse_assembly(str(module))
    parsed.triple = machine.triple
    asm = machine.emit_assembly(parsed)
    return not any(word in asm for word in ("call", "jmp", "hfsf", "sfhf", "h2f", "f2h"))


#: Whether the step can read and write a float16 cache with the code numba makes (see above).
HALF_CONVERSIONS = _half_conversions()


@intrinsic
def _half_to_float(typingctx, h):
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def _float_to_half(typingctx, f):
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(f), codegen


def _widen(x):
    """A cached value (float32, or float16 bits as uint16) as float32."""


@overload(_widen, jit_options=_JIT)
def _widen_impl(x):
    if x == types.uint16:
        return lambda x: _half_to_float(x)
    if x == types.float32:
        return lambda x: x
    if x == types.int8:  # an int8 cache's code (its row's scale applied by the caller)
        return lambda x: np.float32(x)
    return None


def _narrow(x, like):
    """The float32 ``x`` in the cache's type, that of ``like`` (uint16: float16 bits)."""


@overload(_narrow, jit_options=_JIT)
def _narrow_impl(x, like):
    if like == types.uint16:
        return lambda x, like: _float_to_half(x)
    if like == types.float32:
        return lambda x, like: x
    return None


def _put(rows, scales, slot, x):
    """Store ``x (Dh,)`` at ``rows[slot]`` (``rows (C, Dh)``): in the cache's float type
    (``scales`` None), or as int8 codes with their scale at ``scales[slot]`` (``scales
    (C,)``, :func:`_quantize`). Returns how many values could not be stored (:func:`_store`;
    int8: the non-finite ones)."""


@overload(_put, jit_options=_JIT)
def _put_impl(rows, scales, slot, x):
    if isinstance(scales, types.NoneType):
        return lambda rows, scales, slot, x: _store(rows[slot], x)
    return lambda rows, scales, slot, x: _quantize(rows[slot], scales[slot:slot + 1], x)


def _scales_of(scales, n, g):
    """``scales[n, g]`` (an int8 cache's scales of one row and head), or None for None."""


@overload(_scales_of, jit_options=_JIT)
def _scales_of_impl(scales, n, g):
    if isinstance(scales, types.NoneType):
        return lambda scales, n, g: None
    return lambda scales, n, g: scales[n, g]


# Plain IEEE arithmetic (no fast-math): the codes must be NumPy's own
# (attnlab.nn.attention.quantize_int8, whose INT8_SMALLEST is the 1e-30 here).
@nb.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
def _quantize(codes, scale, x):
    """``x (Dh,)`` float32 as int8 ``codes (Dh,)`` and ``scale[0]``: ``top = max |x|``,
    ``scale = top * (1 / 127)``, ``codes = rint(x * (127 / top))``; all zero where ``top`` is
    below :data:`attnlab.nn.attention.INT8_SMALLEST`. Returns how many values are not
    finite (then nothing is meaningful: the caller refuses the token)."""
    top = _F(0.0)
    bad = 0
    for d in range(x.shape[0]):
        a = abs(x[d])
        if not a <= _F(3.4028235e38):
            bad += 1
        elif a > top:
            top = a
    if bad or top < _F(1e-30):
        for d in range(x.shape[0]):
            codes[d] = 0
        scale[0] = _F(0.0)
        return bad
    inv = _F(127.0) / top
    for d in range(x.shape[0]):
        codes[d] = np.int8(min(max(np.rint(x[d] * inv), _F(-127.0)), _F(127.0)))
    scale[0] = top * _F(1.0 / 127.0)
    return 0


@nb.njit(**_JIT)
def _store(row, x):
    """``row (Dh,) = x (Dh,)`` in the cache's type; returns how many finite values became
    infinite there (beyond float16's range)."""
    lost = 0
    for d in range(x.shape[0]):
        row[d] = _narrow(x[d], row[d])
        lost += np.isinf(_widen(row[d])) and not np.isinf(x[d])
    return lost


# Explicit vectors for the attention's two passes over a long cache. Written as loops, each
# key's dot products end in a horizontal sum of 16 lanes per query head (some 8 shuffles and
# adds each, as many as the multiplications), and the weighted sum of values reads and
# writes its accumulators in memory at every row. Here, in LLVM's own vectors of 16 floats
# (AVX-512: one register; AVX2: two; any other target: what LLVM makes of them):
# - _lane_dots: the dot products of 16 keys at once; each key's 16 partial sums are folded
#   with those of the others, two vectors into one at each of four steps, so that the last
#   vector holds the 16 keys' sums (15 folds of two shuffles and an add for 16 keys, where
#   16 horizontal sums take some 128 operations);
# - _lane_weigh: the weighted sum of a run's value rows into accumulators held in
#   registers (at most 16 vectors: the heads taken a few at a time) and written once.
# Both are intrinsics: numba has no vector type. They take a head width of 64 or 128
# (a literal, the loops over it unrolled; _lanes_done decides) with every row's values
# contiguous; other widths take the loops. Each width costs compile time on first use (a
# cold `attnlab generate --quantized` took 25 s against 20 before them; with 256, Gemma's
# width, 30). Alone in L1 on the 2-core Zen 4, three heads of 64, in TSC cycles a key: the
# dot products 14-16 against 22-23, the weighted sum 11-12 against 16-20 (float16 cache;
# float32: 14-15 against 21-26, 9-10 against 19-23); compiled for Haswell (AVX2) and run
# there, 15 against 24 and 11-12 against 16-21. Their sums are float32's, in orders of
# their own (a fused multiply-add a row, in order, for the weighted sum). An int8 cache's
# codes are widened to float32 as they are loaded (two instructions a vector where float16
# takes one, which costs on one thread about what the halved bytes save).
#
# Not done: integer dot products with an int8 cache's keys (AVX512-VNNI), which need the
# query in integers too, one scale a head. Prototypes on the 2-core Zen 4, three heads of 64
# over int8 keys: the dot products took 1.59 ns a key with int8 queries (vpdpbusd; the keys
# transposed 4 by 4 in 16-byte blocks) and 3.3 with int16 queries (vpdpwssd), against 5.0
# here; the attention of 30 such layers over 3,008 keys, 1.98 and 2.20 ms against 2.49. But
# int8 queries (what llama.cpp does with a quantized cache) raise the int8 cache's distance
# from a float32 cache by half (SmolLM2 teacher-forced over 700 tokens: mean KL 1.33e-3
# against 8.3e-4, the same top token 97.0% of the time against 97.9%; over 1,317: 1.36e-3
# against 9.1e-4), and int16 queries move the output off the modules' path by about 5e-5
# relative, past float32 round-off, to save 12% of the attention. The queries stay float32.
_LANES = 16
_VEC = ir.VectorType(ir.FloatType(), _LANES)
_I8P = ir.IntType(8).as_pointer()


def _lane_mask(lanes):
    return ir.Constant(ir.VectorType(ir.IntType(32), _LANES), lanes)


def _fold_masks(w):
    """The two shuffles that fold vectors ``a`` and ``b`` (each ``16 / w`` keys of ``w``
    partial sums, in order) into one of ``w / 2`` sums a key, ``a``'s keys first: the first
    and the second halves of every key's sums, to be added."""
    lo, hi = [], []
    for g in range(2 * _LANES // w):
        lo += [g * w + t for t in range(w // 2)]
        hi += [g * w + w // 2 + t for t in range(w // 2)]
    return _lane_mask(lo), _lane_mask(hi)


# An int8 cache's rows are prefetched PREFETCH_AHEAD bytes ahead of the row being read
# (attnlab._quant_kernels: half a page, the same rule as the 4-bit products' codes), by the
# explicit-vector passes (:func:`_lane_dots`, :func:`_lane_weigh`). An int8
# row (64 bytes a key for SmolLM2) takes as many multiply-adds as a float32 one but a
# quarter of its bytes, and the hardware's own prefetch fell behind it. On the 2-core Zen
# 4, each step's time over the same step without prefetching, the two in turns in one
# process: SmolLM2 quantized, a token after 3,000 cached (int8), median of 15 paired
# rounds: 0.91 on two threads (the rate over a token after 100 went from 0.71 to 0.77),
# 0.97 on one; its attention alone, 30 layers over 3,040 keys (37 MB, out of the last-level
# cache), median of 61: 0.86-0.92 on two threads, 0.89 on one, 0.91 over 300 keys; 1,024,
# 2,048 and 4,096 bytes ahead within 3% of each other. A float cache is left to the
# hardware: its passes are bound by the memory itself, and prefetching them was 3-5% slower.


def _prefetch(builder, row, stride, nbytes):
    """Prefetch the ``nbytes`` of the row about :data:`PREFETCH_AHEAD` bytes past ``row``
    (an i8 pointer; rows ``stride`` bytes apart, ``nbytes`` of values each), a 64-byte line
    at a time (:func:`attnlab._quant_kernels.prefetch_line`)."""
    ahead = builder.gep(row, [builder.mul(stride, stride.type(max(1, PREFETCH_AHEAD // nbytes)))])
    for offset in range(0, nbytes, 64):
        prefetch_line(builder, builder.gep(ahead, [stride.type(offset)]))


def _vector_fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _load_lanes(builder, row, offset, size):
    """16 floats at byte ``offset`` of ``row`` (an i8 pointer), ``size`` bytes a value:
    float32 (4), float16 bits widened (2), or int8 codes converted (1)."""
    ptr = builder.gep(row, [offset])
    if size == 2:
        bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), _LANES).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), _LANES)), _VEC)
    if size == 1:
        codes = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(8), _LANES).as_pointer()), align=1)
        return builder.sitofp(codes, _VEC)
    return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)


def _rows(context, builder, aty, arr):
    """``(data, row stride)`` of a 2-D array: an i8 pointer and bytes (a constant for a
    C-contiguous type)."""
    a = context.make_array(aty)(context, builder, arr)
    stride = builder.extract_value(a.strides, 0)
    if aty.layout == "C":
        stride = builder.mul(builder.extract_value(a.shape, 1), stride.type(aty.dtype.bitwidth // 8))
    return builder.bitcast(a.data, _I8P), stride


def _by_heads(builder, h, emit):
    """``emit(H)`` under a switch on the runtime head count ``h`` (1 to 4)."""
    end = builder.append_basic_block("heads_end")
    switch = builder.switch(h, end)
    for H in range(1, 5):
        block = builder.append_basic_block(f"heads_{H}")
        switch.add_case(h.type(H), block)
        builder.position_at_end(block)
        emit(H)
        builder.branch(end)
    builder.position_at_end(end)


def _lane_width(rows, dh):
    """``(Dh, bytes a value)`` of the rows an intrinsic reads (float32; float16 bits, uint16;
    int8 codes), for a literal head width ``dh`` that is a multiple of 16; else None (not
    typed)."""
    if not isinstance(dh, types.IntegerLiteral) or dh.literal_value % _LANES:
        return None
    return dh.literal_value, rows.dtype.bitwidth // 8


@intrinsic
def _lane_dots(typingctx, q, h, keys, j, p, pj, dh):
    """``p[i, pj + t] = q[i] . keys[j + t]`` for ``t < 16`` and the first ``h <= 4`` rows
    of ``q (>= h, Dh)``; ``keys (C, Dh)`` float32 or float16 bits, ``Dh`` the literal
    ``dh`` (a multiple of 16); each row's values contiguous."""
    if (width := _lane_width(keys, dh)) is None:
        return None
    Dh, size = width

    def codegen(context, builder, sig, args):
        (qbase, qs), (kbase, ks), (pbase, ps) = (_rows(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))
        intp = ks.type
        kbase = builder.gep(kbase, [builder.mul(args[3], ks)])
        pbase = builder.gep(pbase, [builder.mul(args[5], intp(4))])
        masks = [_fold_masks(w) for w in (16, 8, 4, 2)]

        def emit(H):
            qrows = [builder.gep(qbase, [builder.mul(intp(i), qs)]) for i in range(H)]
            folds = [[] for _ in range(H)]  # per head: (level, vector), a binary counter of folds
            for t in range(_LANES):
                krow = builder.gep(kbase, [builder.mul(intp(t), ks)])
                if size == 1:
                    _prefetch(builder, krow, ks, Dh)
                acc = [None] * H
                for c in range(0, Dh, _LANES):
                    k = _load_lanes(builder, krow, intp(c * size), size)
                    for i in range(H):
                        qv = _load_lanes(builder, qrows[i], intp(c * 4), 4)
                        acc[i] = builder.fmul(qv, k) if acc[i] is None else _vector_fma(builder, qv, k, acc[i])
                for i in range(H):
                    stack = folds[i]
                    stack.append((0, acc[i]))
                    while len(stack) > 1 and stack[-1][0] == stack[-2][0]:
                        (level, b), (_, a) = stack.pop(), stack.pop()
                        lo, hi = masks[level]
                        stack.append((level + 1, builder.fadd(builder.shuffle_vector(a, b, lo),
                                                              builder.shuffle_vector(a, b, hi))))
            for i in range(H):
                (_, sums), = folds[i]
                row = builder.gep(pbase, [builder.mul(intp(i), ps)])
                builder.store(sums, builder.bitcast(row, _VEC.as_pointer()), align=4)

        _by_heads(builder, args[1], emit)
        return context.get_dummy_value()

    return types.void(q, h, keys, j, p, pj, dh), codegen


@intrinsic
def _lane_weigh(typingctx, p, h, values, scales, j0, n, out, dh):
    """``out[i] += sum_{j < n} p[i, j] values[j0 + j]`` for the ``h <= 4`` rows of ``out (>=
    h, Dh)``, a fused multiply-add a row in order of ``j``; ``values (C, Dh)`` float32,
    float16 bits or int8 codes (then each weight times the row's scale, ``scales[j0 + j]``;
    ``scales (C,)`` float32, None for a float cache), ``Dh`` the literal ``dh`` (a multiple
    of 16); each row's values contiguous."""
    if (width := _lane_width(values, dh)) is None:
        return None
    Dh, size = width
    scaled = not isinstance(scales, types.NoneType)

    def codegen(context, builder, sig, args):
        (pbase, ps), (vbase, vs), (obase, os_) = (_rows(context, builder, sig.args[i], args[i]) for i in (0, 2, 6))
        intp = vs.type
        if scaled:
            sbase = builder.bitcast(context.make_array(sig.args[3])(context, builder, args[3]).data,
                                    ir.FloatType().as_pointer())
            sbase = builder.gep(sbase, [args[4]])
        vbase = builder.gep(vbase, [builder.mul(args[4], vs)])
        chunks = range(0, Dh, _LANES)

        def emit(H):
            orows = [builder.gep(obase, [builder.mul(intp(i), os_)]) for i in range(H)]
            prows = [builder.gep(pbase, [builder.mul(intp(i), ps)]) for i in range(H)]
            acc = [[cgutils.alloca_once(builder, _VEC) for _ in chunks] for _ in range(H)]
            for i in range(H):
                for a, c in zip(acc[i], chunks, strict=True):
                    builder.store(_load_lanes(builder, orows[i], intp(c * 4), 4), a)
            with cgutils.for_range(builder, args[5]) as loop:
                j = loop.index
                vrow = builder.gep(vbase, [builder.mul(j, vs)])
                if size == 1:
                    _prefetch(builder, vrow, vs, Dh)
                scale = builder.load(builder.gep(sbase, [j]), align=4) if scaled else None
                weights = []
                for i in range(H):
                    w = builder.load(builder.bitcast(builder.gep(prows[i], [builder.mul(j, intp(4))]),
                                                     ir.FloatType().as_pointer()), align=4)
                    if scaled:
                        w = builder.fmul(w, scale)
                    w = builder.insert_element(ir.Constant(_VEC, ir.Undefined), w, ir.IntType(32)(0))
                    weights.append(builder.shuffle_vector(w, ir.Constant(_VEC, ir.Undefined), _lane_mask([0] * _LANES)))
                for k, c in enumerate(chunks):
                    v = _load_lanes(builder, vrow, intp(c * size), size)
                    for i in range(H):
                        builder.store(_vector_fma(builder, weights[i], v, builder.load(acc[i][k])), acc[i][k])
            for i in range(H):
                for a, c in zip(acc[i], chunks, strict=True):
                    builder.store(builder.load(a), builder.bitcast(builder.gep(orows[i], [intp(c * 4)]),
                                                                   _VEC.as_pointer()), align=4)

        _by_heads(builder, args[1], emit)
        return context.get_dummy_value()

    return types.void(p, h, values, scales, j0, n, out, dh), codegen


@nb.njit(**_JIT)
def _product(weight, x, out):
    """``out (N, R) = x (N, K) @ W.T + bias`` for a product record ``weight``."""
    codes, scales, mins, kind, bias = weight
    _matvec(codes, scales, mins, kind, x, out)
    _add_bias(out, bias)


def _matvec(codes, scales, mins, kind, x, out):
    """``out = x @ W.T`` for a record's weight: float32 (chosen when compiling, by the
    codes' type) or quantized (by ``kind``)."""


@overload(_matvec, jit_options=_JIT)
def _matvec_impl(codes, scales, mins, kind, x, out):
    if isinstance(codes, types.Array) and codes.dtype == types.float32:
        return lambda codes, scales, mins, kind, x, out: f32_matvec(codes, x, out)

    def quantized(codes, scales, mins, kind, x, out):
        if kind == 0:
            q8_0_matvec(codes, scales, x, out)
        elif kind < 3:
            q4_matvec(codes, scales, mins, x, out, kind == 2)
        elif kind == 4:  # kinds 4-6: int8 activations (attnlab.quant.quantize_activations)
            q8_0_matvec_q8(codes, scales, x, out)
        else:
            q4_matvec_q8(codes, scales, mins, x, out, kind == 6)
    return quantized


@nb.njit(**_JIT)
def _add_bias(out, bias):
    """``out (N, R) += bias (R,)``; None is no bias (compiled away)."""
    if bias is not None:
        for n in range(out.shape[0]):
            out[n] += bias


@nb.njit(**_JIT)
def _rms_norm(x, norm, out):
    """``out (N, D) = x / sqrt(mean(x^2) + eps) * (weight + offset)``, row by row, for a
    norm record."""
    weight, eps, offset = norm
    N, D = x.shape
    for n in range(N):
        s = 0.0
        for i in range(D):
            s += np.float64(x[n, i]) * np.float64(x[n, i])
        r = _F(1.0) / np.sqrt(_F(s / D) + eps)
        for i in range(D):
            out[n, i] = (x[n, i] * r) * (weight[i] + offset)


@nb.njit(**_JIT)
def _rotate(x, cos, sin):
    """Rotary positions in place on one head ``x (Dh,)``: its first ``R`` dims in split
    halves, ``x1 cos - x2 sin`` and ``x2 cos + x1 sin`` (``cos``/``sin (R,)``)."""
    F2 = cos.shape[0] // 2
    for i in range(F2):
        a, b = x[i], x[F2 + i]
        x[i] = a * cos[i] - b * sin[i]
        x[F2 + i] = b * cos[F2 + i] + a * sin[F2 + i]


# How :func:`_attend` cuts each row's keys into runs, one task a run (see :func:`_runs`): as
# few runs as give every thread the same number of tasks (numba's parallel loop hands each
# thread an equal share of them), no run longer than _MAX_KEYS_PER_RUN (its scores, 8 KiB a
# query head, stay in any x86 core's L2 cache while they are softmaxed and weighed) and
# none shorter than _MIN_KEYS_PER_RUN (a task's own cost, its partial softmax merged,
# outweighs fewer keys). Few, long runs are what a long cache wants: each task streams its
# keys, then its values, from memory, and a long stream is one the hardware's prefetchers
# keep ahead of. SmolLM2 (three key/value heads), 30 layers over 3,040 cached float16
# tokens, on the quiet 2-core Zen 4, three times in turns with the fixed runs of 256 keys
# this replaced (12 a head): 3.1-3.2 against 4.1-4.5 ms on two threads, 5.8-6.0 against
# 7.9-8.1 on one (float32 cache: 4.8 against 5.4, 8.7 against 10.3).
_MAX_KEYS_PER_RUN = 2048
_MIN_KEYS_PER_RUN = 64
# Query heads of one group that a pass over a run's keys (and values) serves: each key and
# value row is read (and widened) once for all of them, each head keeping one accumulator
# (_dots and _accumulate have a loop for 1, 2, 3 and 4 heads). SmolLM2's three heads a
# group, a token after 3,040 cached ones, in turns on the quiet 2-core Zen 4: 10.6-12.0 ms
# against 11.7-13.8 with one head a pass (float16 cache), 13.1-13.9 against 15.4-15.8
# (float32); after 140, the same 6.2-7.5 ms.
_HEADS_PER_PASS = 4


@nb.njit(**_JIT)
def _exp_sub(p, m, n):
    """``p[:n] = exp(p[:n] - m)`` in place (``p <= m``; ``-inf`` gives 0), returning their sum
    (float64). A loop the compiler vectorises, where a call of the C library's ``expf`` per
    value does not: Cody and Waite's reduction ``x = k ln 2 + r`` (``ln 2`` in two parts),
    ``exp(r)`` by a degree-6 polynomial (Cephes' ``expf`` coefficients), and ``2^k`` added to
    the exponent bits; within 1.2e-7 relative of the exact value on ``[-87, 0]`` (NumPy's
    float32 ``exp``: 2.0e-7), 0 below -87 (where float32 leaves the normal numbers)."""
    bits = p.view(np.int32)
    k = np.empty(n, np.int32)
    for j in range(n):
        x0 = p[j] - m
        x = max(x0, _F(-87.0))
        t = np.floor(x * _F(1.4426950408889634) + _F(0.5))
        r = x - t * _F(0.693359375)
        r = r + t * _F(2.12194440e-4)
        y = _F(1.9875691500e-4)
        y = y * r + _F(1.3981999507e-3)
        y = y * r + _F(8.3333301110e-3)
        y = y * r + _F(4.1665795894e-2)
        y = y * r + _F(1.6666665459e-1)
        y = y * r + _F(5.0000001201e-1)
        y = y * r * r + r + _F(1.0)
        low = x0 < _F(-87.0)
        p[j] = _F(0.0) if low else y
        k[j] = 0 if low else np.int32(t)
    total = 0.0
    for j in range(n):
        bits[j] += k[j] << 23
        total += p[j]
    return total


@nb.njit(**_JIT)
def _lanes_done(rows, n, *steps):
    """How many of ``n`` keys the explicit vectors take (whole 16s): all but the last
    ``n % 16`` where ``rows (C, Dh)`` is 64 or 128 wide (the widths :func:`_dots` and
    :func:`_accumulate` call the intrinsics with) and it and every other array
    (``steps``: their last axis' strides in bytes) holds each row's values contiguously;
    else none."""
    Dh = rows.shape[1]
    if Dh != 64 and Dh != 128 or rows.strides[1] != rows.itemsize:
        return 0
    for step in steps:
        if step != 4:
            return 0
    return n - n % _LANES


@nb.njit(**_JIT)
def _dots(q, h, keys, j0, n, p):
    """``p[i, j] = q[i] . keys[j0 + j]`` for the first ``h <= 4`` query heads of ``q (>= h,
    Dh)``, over ``j < n``: each key row read once for all of them, one accumulator a head
    (``keys (C, Dh)``: float32, or float16 bits). The heads are taken as rows indexed from
    0 (a loop index that may be negative would keep LLVM from vectorising). Whole 16s of
    keys go through :func:`_lane_dots` where it takes the head width (see
    :func:`_lanes_done`); the rest, and any other width, through the loops here."""
    Dh = keys.shape[1]
    done = _lanes_done(keys, n, q.strides[1], p.strides[1])
    for j in range(0, done, _LANES):  # 16 keys at a time in explicit vectors
        if Dh == 64:
            _lane_dots(q, h, keys, j0 + j, p, j, 64)
        else:
            _lane_dots(q, h, keys, j0 + j, p, j, 128)
    q0, q1, q2, q3 = q[0], q[min(1, h - 1)], q[min(2, h - 1)], q[min(3, h - 1)]
    if h == 4:
        for j in range(done, n):
            kr = keys[j0 + j]
            a0 = _F(0.0)
            a1 = _F(0.0)
            a2 = _F(0.0)
            a3 = _F(0.0)
            for d in range(Dh):
                k = _widen(kr[d])
                a0 += q0[d] * k
                a1 += q1[d] * k
                a2 += q2[d] * k
                a3 += q3[d] * k
            p[0, j], p[1, j], p[2, j], p[3, j] = a0, a1, a2, a3
    elif h == 3:
        for j in range(done, n):
            kr = keys[j0 + j]
            a0 = _F(0.0)
            a1 = _F(0.0)
            a2 = _F(0.0)
            for d in range(Dh):
                k = _widen(kr[d])
                a0 += q0[d] * k
                a1 += q1[d] * k
                a2 += q2[d] * k
            p[0, j], p[1, j], p[2, j] = a0, a1, a2
    elif h == 2:
        for j in range(done, n):
            kr = keys[j0 + j]
            a0 = _F(0.0)
            a1 = _F(0.0)
            for d in range(Dh):
                k = _widen(kr[d])
                a0 += q0[d] * k
                a1 += q1[d] * k
            p[0, j], p[1, j] = a0, a1
    else:
        for j in range(done, n):
            kr = keys[j0 + j]
            a0 = _F(0.0)
            for d in range(Dh):
                a0 += q0[d] * _widen(kr[d])
            p[0, j] = a0


@nb.njit(**_JIT)
def _finish_scores(p, j0, n, scale, softcap, mask, key_scales):
    """``p[:n]`` (one head's dot products with keys ``j0 ..``) scaled, soft-capped where
    ``softcap > 0``, and ``-inf`` where ``mask (S,)`` (empty: none) forbids a key; returns
    their maximum (-3.4e38 when every key is forbidden). ``key_scales (C,)``: an int8
    cache's, each key's own scale (None: a float cache). Each step a loop of its own, which
    the compiler vectorises (one loop with them all, and the maximum in it, was not)."""
    for j in range(n):
        p[j] = p[j] * _scale_at(key_scales, j0 + j) * scale
    if softcap > 0:
        for j in range(n):
            p[j] = _F(np.tanh(p[j] / softcap) * softcap)
    if mask.shape[0] > 0:
        for j in range(n):
            p[j] = p[j] if mask[j0 + j] else _F(-np.inf)
    return _largest(p, n)


@intrinsic
def _lane_top(typingctx, p, n):
    """The largest of -3.4e38 and ``p[:n - n % 16]`` (``p`` a contiguous float32 row), 16 at a
    time in an explicit vector (``llvm.maxnum``: a NaN is passed over). The compiler does not
    vectorise the loop's maximum itself (its comparison may meet a NaN)."""
    if not (isinstance(p, types.Array) and p.ndim == 1 and p.layout == "C" and p.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        base = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, _I8P)
        intp = args[1].type
        fmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 2), "llvm.maxnum.v16f32")
        top = cgutils.alloca_once_value(builder, ir.Constant(_VEC, [-3.4e38] * _LANES))
        with cgutils.for_range(builder, builder.sdiv(args[1], intp(_LANES))) as loop:
            v = _load_lanes(builder, base, builder.mul(loop.index, intp(4 * _LANES)), 4)
            builder.store(builder.call(fmax, [builder.load(top), v]), top)
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [_VEC]),
                                                "llvm.vector.reduce.fmax.v16f32")
        return builder.call(reduce, [builder.load(top)])

    return types.float32(p, n), codegen


@nb.njit(**_JIT)
def _largest(p, n):
    """The largest of ``p[:n]`` and -3.4e38 (``p`` a contiguous float32 row)."""
    top = _lane_top(p, n)
    for j in range(n - n % _LANES, n):
        top = max(top, p[j])
    return top


def _scale_at(scales, j):
    """``scales[j]``, an int8 cache's scale of row ``j``; 1 for None (a float cache: LLVM
    drops the multiplication by it)."""


@overload(_scale_at, jit_options=_JIT)
def _scale_at_impl(scales, j):
    if isinstance(scales, types.NoneType):
        return lambda scales, j: _F(1.0)
    return lambda scales, j: scales[j]


@nb.njit(**_JIT)
def _accumulate(p, values, scales, j0, n, out):
    """``out[i] += sum_j p[i, j] values[j0 + j]`` for the ``h <= 4`` rows of ``out (h, Dh)``
    and ``p (h, >= n)``: each value row read once for all of them, and two rows a pass (each
    output value read and written once for both) where a group has two heads or more (on
    the Zen 4 the same numbers as a row a pass, bit for bit: LLVM adds them in the same
    order). Alone in L1 there, three heads took 15-25 cycles a row against 24-41 a row a
    pass. A head width :func:`_lane_weigh` takes goes through it instead. An int8 cache's
    codes come with their rows' ``scales (C,)`` (None: a float cache): each weight is
    multiplied by its row's scale."""
    h, Dh = out.shape
    if _lanes_done(values, _LANES, out.strides[1], p.strides[1]) == _LANES:  # accumulators in registers
        per = min(h, 256 // Dh)  # at most 16 vectors of them: four heads of 64, two of 128
        for i in range(0, h, per):
            if Dh == 64:
                _lane_weigh(p[i:], min(per, h - i), values, scales, j0, n, out[i:], 64)
            else:
                _lane_weigh(p[i:], min(per, h - i), values, scales, j0, n, out[i:], 128)
        return
    pairs = n - n % 2 if h > 1 else 0  # one head: a row a pass is as fast
    if h == 4:
        for j in range(0, pairs, 2):
            va, vb = values[j0 + j], values[j0 + j + 1]
            sa, sb = _scale_at(scales, j0 + j), _scale_at(scales, j0 + j + 1)
            w0, w1, w2, w3 = p[0, j] * sa, p[1, j] * sa, p[2, j] * sa, p[3, j] * sa
            u0, u1, u2, u3 = p[0, j + 1] * sb, p[1, j + 1] * sb, p[2, j + 1] * sb, p[3, j + 1] * sb
            for d in range(Dh):
                x = _widen(va[d])
                y = _widen(vb[d])
                out[0, d] += w0 * x + u0 * y
                out[1, d] += w1 * x + u1 * y
                out[2, d] += w2 * x + u2 * y
                out[3, d] += w3 * x + u3 * y
    elif h == 3:
        for j in range(0, pairs, 2):
            va, vb = values[j0 + j], values[j0 + j + 1]
            sa, sb = _scale_at(scales, j0 + j), _scale_at(scales, j0 + j + 1)
            w0, w1, w2 = p[0, j] * sa, p[1, j] * sa, p[2, j] * sa
            u0, u1, u2 = p[0, j + 1] * sb, p[1, j + 1] * sb, p[2, j + 1] * sb
            for d in range(Dh):
                x = _widen(va[d])
                y = _widen(vb[d])
                out[0, d] += w0 * x + u0 * y
                out[1, d] += w1 * x + u1 * y
                out[2, d] += w2 * x + u2 * y
    elif h == 2:
        for j in range(0, pairs, 2):
            va, vb = values[j0 + j], values[j0 + j + 1]
            sa, sb = _scale_at(scales, j0 + j), _scale_at(scales, j0 + j + 1)
            w0, w1 = p[0, j] * sa, p[1, j] * sa
            u0, u1 = p[0, j + 1] * sb, p[1, j + 1] * sb
            for d in range(Dh):
                x = _widen(va[d])
                y = _widen(vb[d])
                out[0, d] += w0 * x + u0 * y
                out[1, d] += w1 * x + u1 * y
    for j in range(pairs, n):
        vr = values[j0 + j]
        sa = _scale_at(scales, j0 + j)
        for i in range(h):
            w = p[i, j] * sa
            o = out[i]
            for d in range(Dh):
                o[d] += w * _widen(vr[d])


@nb.njit(**_JIT)
def _runs(S, rows, threads):
    """How many runs :func:`_attend` cuts ``S`` keys into for each of its ``rows`` (rows
    times key/value heads) on ``threads`` threads: the fewest that make the tasks a multiple
    of the threads, and of at most :data:`_MAX_KEYS_PER_RUN` keys each, but none of fewer
    than :data:`_MIN_KEYS_PER_RUN` (at least one run)."""
    step = threads // math.gcd(rows, threads)
    need = -(-S // _MAX_KEYS_PER_RUN)
    return max(1, min(-(-need // step) * step, S // _MIN_KEYS_PER_RUN))


@nb.njit(**_JIT)
def _merge_runs(tops, sums, parts, runs, n_kv, z):
    """``z (N, Hq Dh)`` from the runs' partial softmaxes of :func:`_attend` (``tops``/``sums
    (T, G)``, ``parts (T, G, Dh)``, ``T = N Hkv runs``): each run rescaled to the row's
    maximum, summed and divided by the summed weights. Not in the parallel function: there
    numba turns each array expression into a parallel loop of its own (a thread wake-up
    each, 20-30 us a call)."""
    T, G, Dh = parts.shape
    N = T // (n_kv * runs)
    for n in range(N):
        for g in range(n_kv):
            t0 = (n * n_kv + g) * runs
            for i in range(G):
                top = tops[t0, i]
                for c in range(1, runs):
                    top = max(top, tops[t0 + c, i])
                total = 0.0
                col = (g * G + i) * Dh
                for d in range(Dh):
                    z[n, col + d] = _F(0.0)
                for c in range(runs):
                    f = np.exp(np.float64(tops[t0 + c, i]) - np.float64(top))
                    total += sums[t0 + c, i] * f
                    for d in range(Dh):
                        z[n, col + d] += _F(f) * parts[t0 + c, i, d]
                inv = _F(1.0 / total)
                for d in range(Dh):
                    z[n, col + d] *= inv


@nb.njit(parallel=True, **_JIT)
def _attend(qkv, keys, values, key_scales, value_scales, start, stop, key_mask, n_heads, n_kv, Dh, scale, softcap,
            z, threads):
    """Each row's one query per head over its keys ``start .. stop - 1`` (those ``key_mask``
    allows; an empty mask allows all): ``z (N, Hq Dh)``. An int8 cache's ``keys``/``values``
    are codes, each row's with its scale in ``key_scales``/``value_scales (N, Hkv, C)``
    (None for a float cache): a score is the dot product with the codes times the key's
    scale, and a weight is multiplied by its value's scale before it weighs the codes. Query head ``h`` reads key/value
    head ``h // (Hq / Hkv)``; ``qkv (N, ...)`` holds the rotated queries first. A
    ``softcap`` above 0 caps each scaled score ``s`` to ``softcap * tanh(s / softcap)``.
    ``threads``: how many threads numba's parallel loops run on (``numba.get_num_threads()``,
    which a cached function cannot call).

    The keys of each row and key/value head are cut into runs (:func:`_runs`): one task a
    run, which takes the group's query heads through it, up to :data:`_HEADS_PER_PASS` at a
    time (each key and value row read once for them) and keeps each head's partial softmax
    (its maximum, its sum, its weighted values); the partials are then merged, as a
    split-key ("flash decoding") attention does. The passes are functions of their own,
    which the compiler vectorises (inlined in a parallel loop's body they ran 3.8 times
    slower)."""
    N = qkv.shape[0]
    G = n_heads // n_kv
    S = stop - start
    runs = _runs(S, N * n_kv, threads)
    size = -(-S // runs)
    T = N * n_kv * runs
    tops = np.empty((T, G), np.float32)
    sums = np.empty((T, G), np.float64)
    parts = np.empty((T, G, Dh), np.float32)
    for t in nb.prange(T):
        n, g, c = t // (n_kv * runs), (t // runs) % n_kv, t % runs
        j0 = start + c * size
        m = max(0, min(size, stop - j0))
        p = np.empty((G, size), dtype=np.float32)
        mask = key_mask[n] if key_mask.shape[0] > 0 else key_mask.ravel()
        heads = qkv[n, :n_heads * Dh].reshape(n_heads, Dh)  # the row's queries, a head a row
        for c0 in range(0, G, _HEADS_PER_PASS):  # the group's query heads, up to four a pass
            _dots(heads[g * G + c0:], min(_HEADS_PER_PASS, G - c0), keys[n, g], j0, m, p[c0:])
        ks, vs = _scales_of(key_scales, n, g), _scales_of(value_scales, n, g)
        for i in range(G):
            top = _finish_scores(p[i], j0, m, scale, softcap, mask, ks)
            tops[t, i] = top
            for d in range(Dh):
                parts[t, i, d] = _F(0.0)
            if top == _F(-3.4e38):  # every key of the run forbidden: it adds nothing
                sums[t, i] = 0.0
                for j in range(m):
                    p[i, j] = _F(0.0)
            else:
                sums[t, i] = _exp_sub(p[i], top, m)
        for c0 in range(0, G, _HEADS_PER_PASS):
            _accumulate(p[c0:], values[n, g], vs, j0, m, parts[t, c0:min(G, c0 + _HEADS_PER_PASS)])
    _merge_runs(tops, sums, parts, runs, n_kv, z)


@nb.njit(**_JIT)
def _activate(gate, up, activation):
    """``gate (N, F) = act(gate) * up`` in place, ``act`` by its code (0 SiLU, 1 GELU tanh, 2 GELU erf, 3 ReLU)."""
    for n in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            a = gate[n, i]
            if activation == 0:
                a = a / (_F(1.0) + np.exp(-a))
            elif activation == 1:
                a = _F(0.5) * a * (_F(1.0) + np.tanh(_F(0.7978845608028654) * (a + _F(0.044715) * a * a * a)))
            elif activation == 2:
                a = _F(0.5 * a * (1.0 + math.erf(a * 0.7071067811865476)))
            elif a < 0:
                a = _F(0.0)
            gate[n, i] = a * up[n, i]


@nb.njit(**_JIT)
def _attention(x, attn, rows, qkv, z, out, threads):
    """The attention of one new token per row: ``out (N, D)`` from its input ``x (N, D)``
    (already normed), the new key and value written at the rows' ``slot``; returns how
    many of their values the cache's type could not hold (:func:`_store`)."""
    w_qkv, w_out, q_norm, k_norm, n_heads, n_kv, Dh, scale, softcap = attn
    cos, sin, keys, values, key_scales, value_scales, slot, start, key_mask = rows
    _product(w_qkv, x, qkv)
    Dq = n_heads * Dh
    Dkv = n_kv * Dh
    lost = 0
    for n in range(x.shape[0]):
        for hh in range(n_heads):
            q = qkv[n:n + 1, hh * Dh: (hh + 1) * Dh]
            _norm_in_place(q, q_norm)
            _rotate(q[0], cos[n], sin[n])
        for g in range(n_kv):
            k = qkv[n:n + 1, Dq + g * Dh: Dq + (g + 1) * Dh]
            _norm_in_place(k, k_norm)
            _rotate(k[0], cos[n], sin[n])
            lost += _put(keys[n, g], _scales_of(key_scales, n, g), slot, k[0])
            lost += _put(values[n, g], _scales_of(value_scales, n, g), slot,
                         qkv[n, Dq + Dkv + g * Dh: Dq + Dkv + (g + 1) * Dh])
    _attend(qkv, keys, values, key_scales, value_scales, start, slot + 1, key_mask, n_heads, n_kv, Dh, scale,
            softcap, z, threads)
    _product(w_out, z, out)
    return lost


@nb.njit(**_JIT)
def _norm_in_place(x, norm):
    """``x = norm(x)``; None is no norm (compiled away)."""
    if norm is not None:
        _rms_norm(x, norm, x)


@nb.njit(**_JIT)
def _add_normed(h, y, norm):
    """``h += norm(y)`` (``y`` itself for no norm, None), ``y`` overwritten."""
    _norm_in_place(y, norm)
    h += y


@nb.njit(**_JIT)
def decode_layer(h, block, rows, scratch, threads):
    """One token of a pre-norm block for each of ``N`` rows, in place on the residual ``h
    (N, D)``: ``h += ln_1_post(attention(ln_1(h)))``, then ``h +=
    ln_2_post(feed_forward(ln_2(h)))``.

    ``block`` and ``rows`` are the records of the module docstring; the rows' new key and
    value (the rotated key) are written at ``slot`` of ``keys``/``values (N, Hkv, C, Dh)``
    and the query attends to the keys ``start .. slot`` that ``key_mask (N, S)`` allows
    (``(0, 0)``: all); ``cos``/``sin (N, R)`` are the rotation of each row's position.
    ``keys``/``values`` are float32, a float16 cache's bits (uint16), or an int8 cache's
    codes (with ``key_scales``/``value_scales (N, Hkv, C)``). ``scratch`` is
    ``(xn (N, D), qkv (N, (Hq + 2 Hkv) Dh), z (N, Hq Dh), o (N, D), gate (N, F), up (N,
    F))``; ``threads`` numba's thread count (:func:`_attend`).

    Returns how many of the new key's and value's values the cache's type could not hold
    (finite ones beyond float16's range, stored as infinities; for an int8 cache, the ones
    that are not finite; 0 for a float32 cache).
    """
    ln_1, attn, ln_1_post, ln_2, mlp, ln_2_post = block
    w_gate, w_up, w_down, activation = mlp
    xn, qkv, z, o, gate, up = scratch
    _rms_norm(h, ln_1, xn)
    lost = _attention(xn, attn, rows, qkv, z, o, threads)
    _add_normed(h, o, ln_1_post)
    _rms_norm(h, ln_2, xn)
    _product(w_gate, xn, gate)
    _product(w_up, xn, up)
    _activate(gate, up, activation)
    _product(w_down, gate, o)
    _add_normed(h, o, ln_2_post)
    return lost
