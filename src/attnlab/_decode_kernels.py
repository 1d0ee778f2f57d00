"""A compiled decoding step of one pre-norm Llama block with quantized weights (numba, the
``fast`` extra): :func:`decode_layer`, used by :mod:`attnlab.models._decode_step`.

A new token's block is a handful of matrix-vector products and a little arithmetic around
them. Run as NumPy calls through the modules it is some 40 small operations a block, and
the Python between them cost about as much as the products themselves (SmolLM2-135M on a
2-core EPYC: 17 ms a token, of which the quantized products took 10). Here one call does the
whole block: the products are :mod:`attnlab._quant_kernels`' (parallel over output rows),
the rest is loops over a few thousand values.

Axes: ``N`` rows (sequences), ``D`` model width, ``Hq``/``Hkv`` query and key/value heads,
``Dh`` head width, ``R`` rotated dims (``<= Dh``), ``C`` the cache's capacity, ``S`` keys.

Each step computes what the module path computes, in the same order, to float32 round-off
(the norms' mean of squares and the softmax's sum are accumulated in float64).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from attnlab._quant_kernels import _F, q4_matvec, q8_0_matvec

# fastmath without "no infs, no NaNs": the softmax and SiLU meet large magnitudes (exp(-x)
# overflows to inf for x << 0, and x / inf must stay -0); reassociation lets sums vectorise.
_JIT = {"nogil": True, "fastmath": {"reassoc", "contract", "arcp", "nsz"}, "cache": True,
        "error_model": "numpy", "boundscheck": False}


@nb.njit(**_JIT)
def _product(codes, scales, mins, kind, x, out):
    """``out (N, R) = x (N, K) @ W.T`` for a quantized ``W`` of ``kind`` (0 ``Q8_0``, 1
    ``Q4_0``, 2 ``Q4_1``; ``mins`` read only for 2), plus nothing else."""
    if kind == 0:
        q8_0_matvec(codes, scales, x, out)
    else:
        q4_matvec(codes, scales, mins, x, out, kind == 2)


@nb.njit(**_JIT)
def _add_bias(y, bias):
    """``y (N, R) += bias (R,)``; an empty ``bias`` is no bias."""
    if bias.shape[0]:
        for n in range(y.shape[0]):
            y[n] += bias


@nb.njit(**_JIT)
def _rms_norm(x, weight, eps, out):
    """``out (N, D) = x / sqrt(mean(x^2) + eps) * weight``, row by row."""
    N, D = x.shape
    for n in range(N):
        s = 0.0
        for i in range(D):
            s += np.float64(x[n, i]) * np.float64(x[n, i])
        r = _F(1.0) / np.sqrt(_F(s / D) + eps)
        for i in range(D):
            out[n, i] = (x[n, i] * r) * weight[i]


@nb.njit(**_JIT)
def _rotate(x, cos, sin):
    """Rotary positions in place on one head ``x (Dh,)``: its first ``R`` dims in split
    halves, ``x1 cos - x2 sin`` and ``x2 cos + x1 sin`` (``cos``/``sin (R,)``)."""
    F2 = cos.shape[0] // 2
    for i in range(F2):
        a, b = x[i], x[F2 + i]
        x[i] = a * cos[i] - b * sin[i]
        x[F2 + i] = b * cos[F2 + i] + a * sin[F2 + i]


@nb.njit(parallel=True, **_JIT)
def _attend(qkv, keys, values, start, stop, key_mask, n_heads, n_kv, Dh, scale, z):
    """Each row's one query per head over its keys ``start .. stop - 1`` (those ``key_mask``
    allows; an empty mask allows all): ``z (N, Hq Dh)``. Query head ``h`` reads key/value
    head ``h // (Hq / Hkv)``; ``qkv (N, ...)`` holds the rotated queries first."""
    N = qkv.shape[0]
    G = n_heads // n_kv
    S = stop - start
    masked = key_mask.shape[0] > 0
    for t in nb.prange(N * n_heads):
        n, h = t // n_heads, t % n_heads
        g = h // G
        p = np.empty(S, dtype=np.float32)
        m = _F(-3.4e38)
        for j in range(S):
            if masked and not key_mask[n, start + j]:
                continue
            acc = _F(0.0)
            for d in range(Dh):
                acc += qkv[n, h * Dh + d] * keys[n, g, start + j, d]
            acc *= scale
            p[j] = acc
            if acc > m:
                m = acc
        tot = 0.0
        for j in range(S):
            if masked and not key_mask[n, start + j]:
                p[j] = _F(0.0)
                continue
            e = np.exp(p[j] - m)
            p[j] = e
            tot += e
        inv = _F(1.0 / tot)
        for d in range(Dh):
            z[n, h * Dh + d] = _F(0.0)
        for j in range(S):
            w = p[j] * inv
            if w != 0:
                for d in range(Dh):
                    z[n, h * Dh + d] += w * values[n, g, start + j, d]


@nb.njit(**_JIT)
def decode_layer(h, ln_1, eps_1, ln_2, eps_2,
                 qkv_codes, qkv_scales, qkv_mins, qkv_kind, qkv_bias,
                 o_codes, o_scales, o_mins, o_kind, o_bias,
                 g_codes, g_scales, g_mins, g_kind, g_bias,
                 u_codes, u_scales, u_mins, u_kind, u_bias,
                 d_codes, d_scales, d_mins, d_kind, d_bias,
                 q_norm, q_eps, k_norm, k_eps,
                 cos, sin, keys, values, slot, start, key_mask, n_heads, n_kv, Dh, scale,
                 xn, qkv, z, o, gate, up):
    """One token of a pre-norm Llama block for each of ``N`` rows, in place on the residual
    ``h (N, D)``.

    ``h += o_proj(attention(rope(qkv_proj(rms_norm(h, ln_1)))))``, then ``h +=
    down_proj(silu(gate_proj(x2)) * up_proj(x2))`` with ``x2 = rms_norm(h, ln_2)``. The new
    key and value (rotated key) are written at ``slot`` of ``keys``/``values (N, Hkv, C,
    Dh)`` and the query attends to the keys ``start .. slot`` that ``key_mask (N, S)`` allows
    (``(0, 0)``: all). Each weight is ``codes, scales, mins, kind`` (see :func:`_product`)
    and a bias (empty: none); ``q_norm``/``k_norm (Dh,)`` an RMSNorm of each query and key
    head before the rotation (QK-norm; empty: none); ``cos``/``sin (N, R)`` the rotation of each row's position.
    ``xn (N, D)``, ``qkv (N, (Hq + 2 Hkv) Dh)``, ``z (N, Hq Dh)``, ``o (N, D)``, ``gate`` and
    ``up (N, F)`` are scratch.
    """
    N = h.shape[0]
    _rms_norm(h, ln_1, eps_1, xn)
    _product(qkv_codes, qkv_scales, qkv_mins, qkv_kind, xn, qkv)
    _add_bias(qkv, qkv_bias)
    Dq = n_heads * Dh
    Dkv = n_kv * Dh
    for n in range(N):
        for hh in range(n_heads):
            q = qkv[n:n + 1, hh * Dh: (hh + 1) * Dh]
            if q_norm.shape[0]:
                _rms_norm(q, q_norm, q_eps, q)
            _rotate(q[0], cos[n], sin[n])
        for g in range(n_kv):
            k = qkv[n, Dq + g * Dh: Dq + (g + 1) * Dh]
            if k_norm.shape[0]:
                _rms_norm(qkv[n:n + 1, Dq + g * Dh: Dq + (g + 1) * Dh], k_norm, k_eps,
                          qkv[n:n + 1, Dq + g * Dh: Dq + (g + 1) * Dh])
            _rotate(k, cos[n], sin[n])
            keys[n, g, slot] = k
            values[n, g, slot] = qkv[n, Dq + Dkv + g * Dh: Dq + Dkv + (g + 1) * Dh]
    _attend(qkv, keys, values, start, slot + 1, key_mask, n_heads, n_kv, Dh, scale, z)
    _product(o_codes, o_scales, o_mins, o_kind, z, o)
    _add_bias(o, o_bias)
    h += o
    _rms_norm(h, ln_2, eps_2, xn)
    _product(g_codes, g_scales, g_mins, g_kind, xn, gate)
    _add_bias(gate, g_bias)
    _product(u_codes, u_scales, u_mins, u_kind, xn, up)
    _add_bias(up, u_bias)
    for n in range(N):
        for i in range(gate.shape[1]):
            a = gate[n, i]
            gate[n, i] = a / (_F(1.0) + np.exp(-a)) * up[n, i]
    _product(d_codes, d_scales, d_mins, d_kind, gate, o)
    _add_bias(o, d_bias)
    h += o
