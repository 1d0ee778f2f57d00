"""The compiled decoding step of one transformer block whose projections are kept quantized
(numba, the ``fast`` extra): :func:`decode_layer`, which
:meth:`attnlab.nn.TransformerBlock.forward` runs for one new token per row after a
key/value cache (see :meth:`~attnlab.nn.TransformerBlock.decode_record` for when).

A new token's block is a handful of matrix-vector products and a little arithmetic around
them. Run as NumPy calls through the modules it is some 40 small operations a block, and
the Python between them cost about as much as the products themselves (SmolLM2-135M on a
2-core EPYC: 17 ms a token, of which the quantized products took 10). Here one call does the
whole block: the products are :mod:`attnlab._quant_kernels`' (parallel over output rows),
the rest is loops over a few thousand values.

The kernel knows no model: each part of the block hands it a record of its own slots, built
by the module that owns them (plain tuples, which numba types quickly; the names below are
the fields in order):

- a product (:func:`attnlab.quant.product_record`): ``(codes, scales, mins, kind, bias)``,
  ``kind`` 0 ``Q8_0``, 1 ``Q4_0``, 2 ``Q4_1``, ``bias`` None for none;
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
  values, slot, start, key_mask)``.

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

from attnlab._quant_kernels import _F, q4_matvec, q8_0_matvec

# fastmath without "no infs, no NaNs": the softmax and SiLU meet large magnitudes (exp(-x)
# overflows to inf for x << 0, and x / inf must stay -0); reassociation lets sums vectorise.
_JIT = {"nogil": True, "fastmath": {"reassoc", "contract", "arcp", "nsz"}, "cache": True,
        "error_model": "numpy", "boundscheck": False}

@nb.njit(**_JIT)
def _product(weight, x, out):
    """``out (N, R) = x (N, K) @ W.T + bias`` for a product record ``weight``."""
    codes, scales, mins, kind, bias = weight
    if kind == 0:
        q8_0_matvec(codes, scales, x, out)
    else:
        q4_matvec(codes, scales, mins, x, out, kind == 2)
    _add_bias(out, bias)


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


@nb.njit(parallel=True, **_JIT)
def _attend(qkv, keys, values, start, stop, key_mask, n_heads, n_kv, Dh, scale, softcap, z):
    """Each row's one query per head over its keys ``start .. stop - 1`` (those ``key_mask``
    allows; an empty mask allows all): ``z (N, Hq Dh)``. Query head ``h`` reads key/value
    head ``h // (Hq / Hkv)``; ``qkv (N, ...)`` holds the rotated queries first. A
    ``softcap`` above 0 caps each scaled score ``s`` to ``softcap * tanh(s / softcap)``.
    One task per row and key/value head: the ``G = Hq / Hkv`` query heads of a group read
    each cached key and value row once (a long cache is read once a step, not G times)."""
    N = qkv.shape[0]
    G = n_heads // n_kv
    S = stop - start
    masked = key_mask.shape[0] > 0
    for t in nb.prange(N * n_kv):
        n, g = t // n_kv, t % n_kv
        q0 = g * G * Dh  # the group's first query column
        p = np.empty((G, S), dtype=np.float32)
        m = np.full(G, _F(-3.4e38), dtype=np.float32)
        for j in range(S):
            if masked and not key_mask[n, start + j]:
                continue
            for i in range(G):
                acc = _F(0.0)
                for d in range(Dh):
                    acc += qkv[n, q0 + i * Dh + d] * keys[n, g, start + j, d]
                acc *= scale
                if softcap > 0:
                    acc = _F(np.tanh(acc / softcap) * softcap)
                p[i, j] = acc
                if acc > m[i]:
                    m[i] = acc
        inv = np.empty(G, dtype=np.float32)
        for i in range(G):
            tot = 0.0
            for j in range(S):
                if masked and not key_mask[n, start + j]:
                    p[i, j] = _F(0.0)
                    continue
                e = np.exp(p[i, j] - m[i])
                p[i, j] = e
                tot += e
            inv[i] = _F(1.0 / tot)
        out = np.zeros((G, Dh), dtype=np.float32)
        for j in range(S):
            for i in range(G):
                w = p[i, j] * inv[i]
                if w != 0:
                    for d in range(Dh):
                        out[i, d] += w * values[n, g, start + j, d]
        for i in range(G):
            for d in range(Dh):
                z[n, q0 + i * Dh + d] = out[i, d]


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
def _attention(x, attn, rows, qkv, z, out):
    """The attention of one new token per row: ``out (N, D)`` from its input ``x (N, D)``
    (already normed), the new key and value written at the rows' ``slot``."""
    w_qkv, w_out, q_norm, k_norm, n_heads, n_kv, Dh, scale, softcap = attn
    cos, sin, keys, values, slot, start, key_mask = rows
    _product(w_qkv, x, qkv)
    Dq = n_heads * Dh
    Dkv = n_kv * Dh
    for n in range(x.shape[0]):
        for hh in range(n_heads):
            q = qkv[n:n + 1, hh * Dh: (hh + 1) * Dh]
            _norm_in_place(q, q_norm)
            _rotate(q[0], cos[n], sin[n])
        for g in range(n_kv):
            k = qkv[n:n + 1, Dq + g * Dh: Dq + (g + 1) * Dh]
            _norm_in_place(k, k_norm)
            _rotate(k[0], cos[n], sin[n])
            keys[n, g, slot] = k[0]
            values[n, g, slot] = qkv[n, Dq + Dkv + g * Dh: Dq + Dkv + (g + 1) * Dh]
    _attend(qkv, keys, values, start, slot + 1, key_mask, n_heads, n_kv, Dh, scale, softcap, z)
    _product(w_out, z, out)


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
def decode_layer(h, block, rows, scratch):
    """One token of a pre-norm block for each of ``N`` rows, in place on the residual ``h
    (N, D)``: ``h += ln_1_post(attention(ln_1(h)))``, then ``h +=
    ln_2_post(feed_forward(ln_2(h)))``.

    ``block`` and ``rows`` are the records of the module docstring; the rows' new key and
    value (the rotated key) are written at ``slot`` of ``keys``/``values (N, Hkv, C, Dh)``
    and the query attends to the keys ``start .. slot`` that ``key_mask (N, S)`` allows
    (``(0, 0)``: all); ``cos``/``sin (N, R)`` are the rotation of each row's position.
    ``scratch`` is ``(xn (N, D), qkv (N, (Hq + 2 Hkv) Dh), z (N, Hq Dh), o (N, D), gate
    (N, F), up (N, F))``.
    """
    ln_1, attn, ln_1_post, ln_2, mlp, ln_2_post = block
    w_gate, w_up, w_down, activation = mlp
    xn, qkv, z, o, gate, up = scratch
    _rms_norm(h, ln_1, xn)
    _attention(xn, attn, rows, qkv, z, o)
    _add_normed(h, o, ln_1_post)
    _rms_norm(h, ln_2, xn)
    _product(w_gate, xn, gate)
    _product(w_up, xn, up)
    _activate(gate, up, activation)
    _product(w_down, gate, o)
    _add_normed(h, o, ln_2_post)
