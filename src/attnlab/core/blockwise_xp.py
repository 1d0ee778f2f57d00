"""Blockwise attention for arrays of other libraries (torch, CuPy, JAX, ...): the online
softmax of FlashAttention, forward and backward, written once against the Array API.

The NumPy kernel (:mod:`attnlab.core.blockwise`) has threads, compiled passes and a shift
that lags; this one is the plain algorithm, one tile of all heads at a time, so that another
library never holds the ``(..., L, S)`` score matrix: the queries are cut into tiles of
``block_q`` rows and the keys into tiles of ``block_k``; each query tile walks its key
tiles keeping per row the running maximum ``m``, the sum ``l`` of ``exp(score - m)`` and the
accumulator ``acc`` of ``exp(score - m) @ value``, rescaled by ``exp(m_old - m_new) <= 1``
when the maximum grows. The forward pass returns ``acc / l`` and, per row, the shift ``m``
and ``log(l)`` (kept apart, as in the NumPy kernel); the backward pass recomputes each
tile's probabilities ``exp(score - m - log(l))`` from them and accumulates the gradients
tile by tile. Extra memory: a few ``(..., block_q, block_k)`` tiles and ``O(L·E)`` arrays.

Numerics as :mod:`attnlab.core.naive` (and torch): a float mask is added to the scaled
scores; a row with nothing to attend to outputs 0; NaN propagates. Inputs narrower than
float32 (bfloat16, float16) are computed in float32, scores and softmax included, as
torch's CPU kernels accumulate them (:func:`widened`), and the result is cast back. JAX's
matrix products run at full float32 precision unless the caller chose another with
``jax.default_matmul_precision`` (:func:`matmul_precision`): on GPUs JAX's default is
TF32, about 1e-3 off.

Axis legend: see :mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

from attnlab.core._namespace import as_dtype, device, full_scalar, mT, on_accelerator
from attnlab.core.spec import AttentionSpec, reduce_to

__all__ = ["ACCELERATOR_TILE_MAX", "ACCELERATOR_TILE_SHARE", "MIN_SCORES", "backward", "forward", "matmul_precision",
           "tile_sizes", "use_blockwise", "widened"]

#: From this many scores (all heads together) the blockwise kernel runs: below it the naive
#: kernel's few large operations cost less (each tile is a handful of library calls) and its
#: ``(..., L, S)`` matrices are at most 64 MiB in float32.
MIN_SCORES = 1 << 24
#: Scores in one tile of all heads on a CPU: each tile-sized temporary holds at most this
#: many (1 MiB in float32; a step holds a few), so that a tile's passes stay in the caches.
TILE_SCORES = 1 << 18
#: On an accelerator (a GPU) a tile holds ``1 /`` this share of all the scores (at most
#: :data:`ACCELERATOR_TILE_MAX`): each tile step is about 20 library calls, and on small
#: tiles their launches cost more than their work. At L = S = 8192, B = 1, H = 8 (float32,
#: causal) an H200 took 322 ms with CPU-sized tiles and 9-11 ms with these (torch's fused
#: kernel: 2.7 ms); the few tiles a step holds came to 13% of the score matrix (the naive
#: kernel: 3x it).
ACCELERATOR_TILE_SHARE = 32
#: The largest tile on an accelerator: 64 Mi scores (256 MiB in float32).
ACCELERATOR_TILE_MAX = 1 << 26
_BLOCK_K = 512
_MIN_BLOCK = 16


def use_blockwise(spec: AttentionSpec) -> bool:
    """Whether the dispatcher runs this kernel for ``spec`` (arrays of another library):
    no dropout (the naive kernel draws it), and at least :data:`MIN_SCORES` scores."""
    return spec.dropout_p == 0 and math.prod(spec.batch_shape) * spec.L * spec.S >= MIN_SCORES


def widened(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with inputs narrower than float32 (bfloat16, float16) cast to float32, the
    dtype scores and softmax accumulate in; other specs unchanged. Callers cast back."""
    xp = spec.xp
    q = spec.query
    if xp.finfo(q.dtype).bits >= 32:
        return spec
    f32 = xp.float32
    mask = spec.attn_mask
    if mask is not None and not xp.isdtype(mask.dtype, "bool"):
        mask = xp.astype(mask, f32)
    return dataclasses.replace(spec, query=xp.astype(q, f32), key=xp.astype(spec.key, f32),
                               value=xp.astype(spec.value, f32), attn_mask=mask)


def matmul_precision(xp):
    """A context in which JAX's matrix products run at full float32 precision, unless the
    caller set ``jax.default_matmul_precision`` (a context or the config); a no-op for
    other libraries."""
    if not getattr(xp, "__name__", "").startswith("jax"):
        return contextlib.nullcontext()
    import jax

    if jax.config.jax_default_matmul_precision is not None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision("highest")


def tile_sizes(heads: int, L: int, S: int, *, accelerator: bool = False) -> tuple[int, int]:
    """``(block_q, block_k)``: key tiles of 512 (or ``S``), query tiles so that a tile of all
    ``heads`` holds at most :data:`TILE_SCORES` scores (at least 16 rows); on an
    ``accelerator``, at most the larger of that and ``1 /`` :data:`ACCELERATOR_TILE_SHARE`
    of all ``heads * L * S`` scores (at most :data:`ACCELERATOR_TILE_MAX`).

    >>> tile_sizes(2, 8192, 8192)
    (256, 512)
    >>> tile_sizes(64, 8192, 8192)
    (16, 512)
    >>> tile_sizes(8, 8192, 8192, accelerator=True)   # 16 Mi scores: 1/32 of 512 Mi
    (4096, 512)
    """
    bk = max(1, min(S, _BLOCK_K))
    budget = TILE_SCORES
    if accelerator:
        budget = max(budget, min(ACCELERATOR_TILE_MAX, heads * L * S // ACCELERATOR_TILE_SHARE))
    bq = max(_MIN_BLOCK, budget // max(1, heads * bk))
    bq = 1 << (bq.bit_length() - 1)  # a power of two, rounded down
    return max(1, min(L, bq)), bk


def _mask_tile(mask, i0: int, i1: int, j0: int, j1: int, xp):
    """The part of a broadcastable mask for rows ``i0:i1`` and keys ``j0:j1`` (its axes of
    size 1 kept whole: they broadcast)."""
    if mask.ndim < 2:
        mask = xp.reshape(mask, (1,) * (2 - mask.ndim) + tuple(mask.shape))
    rows = slice(None) if mask.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if mask.shape[-1] == 1 else slice(j0, j1)
    return mask[..., rows, cols]


class _Tiles:
    """The per-call constants of both passes."""

    def __init__(self, spec: AttentionSpec, block_q: int | None, block_k: int | None):
        self.spec, self.xp = spec, spec.xp
        self.q, self.k, self.v = spec.query, spec.full_key, spec.full_value
        self.L, self.S = spec.L, spec.S
        self.device = device(self.q)
        bq, bk = tile_sizes(math.prod(spec.batch_shape), self.L, self.S, accelerator=on_accelerator(self.q))
        self.bq, self.bk = block_q or bq, block_k or bk
        self.dtype = self.q.dtype
        self.neg_inf = full_scalar(-math.inf, self.q)

    def key_end(self, i1: int) -> int:
        """One past the last key rows ``< i1`` may see (causal: top-left aligned)."""
        return min(self.S, i1) if self.spec.is_causal else self.S

    def scores(self, qs, i0: int, i1: int, j0: int, j1: int):
        """The masked, scaled scores of rows ``i0:i1`` (``qs``: their scaled queries) and keys
        ``j0:j1``: ``(..., i1 - i0, j1 - j0)``."""
        xp, spec = self.xp, self.spec
        s = qs @ mT(self.k[..., j0:j1, :])
        if spec.is_causal:
            if j1 - 1 > i0:  # some key of the tile lies after some row
                rows = xp.arange(i0, i1, device=self.device)[:, None]
                cols = xp.arange(j0, j1, device=self.device)[None, :]
                s = xp.where(cols <= rows, s, self.neg_inf)
        elif spec.attn_mask is not None:
            tile = _mask_tile(spec.attn_mask, i0, i1, j0, j1, xp)
            if xp.isdtype(tile.dtype, "bool"):
                s = xp.where(tile, s, self.neg_inf)
            else:
                s = s + tile
        return s

    def scaled_queries(self, i0: int, i1: int):
        return self.q[..., i0:i1, :] * self.spec.scale


def _forward(t: _Tiles):
    """``(out (..., L, Ev), shift (..., L, 1), logl (..., L, 1))`` in the compute dtype."""
    xp = t.xp
    outs, shifts, logls = [], [], []
    lead = tuple(t.spec.batch_shape)
    neg_inf, zero, one = t.neg_inf, full_scalar(0.0, t.q), full_scalar(1.0, t.q)
    Ev = t.v.shape[-1]
    for i0 in range(0, t.L, t.bq):
        i1 = min(i0 + t.bq, t.L)
        qs = t.scaled_queries(i0, i1)
        m = xp.full((*lead, i1 - i0, 1), -math.inf, dtype=t.dtype, device=t.device)
        l = xp.zeros((*lead, i1 - i0, 1), dtype=t.dtype, device=t.device)
        acc = xp.zeros((*lead, i1 - i0, Ev), dtype=t.dtype, device=t.device)
        for j0 in range(0, t.key_end(i1), t.bk):
            j1 = min(j0 + t.bk, t.key_end(i1))
            s = t.scores(qs, i0, i1, j0, j1)
            # the new maximum (NaN propagates through max, not through a comparison)
            m_new = xp.max(xp.concat([xp.broadcast_to(m, (*s.shape[:-1], 1)), xp.max(s, axis=-1, keepdims=True)],
                                     axis=-1), axis=-1, keepdims=True)
            shift = xp.where(m_new == neg_inf, zero, m_new)  # nothing seen yet: exp(-inf - 0) = 0
            p = xp.exp(s - shift)
            alpha = xp.exp(m - shift)  # <= 1; 0 where m was -inf
            l = l * alpha + xp.sum(p, axis=-1, keepdims=True, dtype=t.dtype)
            acc = acc * alpha + p @ t.v[..., j0:j1, :]
            m = m_new
        seen = l > zero
        outs.append(acc / xp.where(seen, l, one))
        shifts.append(xp.where(m == neg_inf, zero, m))
        logls.append(xp.log(xp.where(seen, l, one)))
    return xp.concat(outs, axis=-2), xp.concat(shifts, axis=-2), xp.concat(logls, axis=-2)


def forward(spec: AttentionSpec, *, block_q: int | None = None, block_k: int | None = None):
    """``softmax(q k^T * scale + mask) @ v`` without the score matrix: ``(..., Hq, L, Ev)``
    in ``spec``'s dtype (float32 or float64: widen narrower inputs first, :func:`widened`).
    No dropout (the naive kernel draws it)."""
    xp = spec.xp
    if spec.L == 0 or spec.S == 0:
        shape = (*spec.batch_shape, spec.L, spec.value.shape[-1])
        return xp.zeros(shape, dtype=spec.query.dtype, device=device(spec.query))
    return _forward(_Tiles(spec, block_q, block_k))[0]


def backward(spec: AttentionSpec, grad_out, *, block_q: int | None = None, block_k: int | None = None):
    """``(grad_query, grad_key, grad_value)`` of :func:`forward`, tile by tile (the forward
    pass's per-row statistics recomputed first); GQA and broadcast dims summed back to the
    caller's shapes, as :func:`attnlab.core.naive.backward` does."""
    xp = spec.xp
    t = _Tiles(spec, block_q, block_k)
    dt, dev = t.dtype, t.device
    lead = tuple(spec.batch_shape)
    E, Ev = t.q.shape[-1], t.v.shape[-1]
    if spec.L == 0 or spec.S == 0:
        dq = xp.zeros((*lead, spec.L, E), dtype=dt, device=dev)
        dk = xp.zeros((*lead, spec.S, E), dtype=dt, device=dev)
        dv = xp.zeros((*lead, spec.S, Ev), dtype=dt, device=dev)
    else:
        out, shift, logl = _forward(t)
        grad_out = as_dtype(grad_out, dt)
        D = xp.sum(grad_out * out, axis=-1, keepdims=True, dtype=dt)  # (..., L, 1): sum_j P dP
        n_tiles = -(-spec.S // t.bk)
        dks: list = [None] * n_tiles
        dvs: list = [None] * n_tiles
        dqs = []
        for i0 in range(0, t.L, t.bq):
            i1 = min(i0 + t.bq, t.L)
            qs = t.scaled_queries(i0, i1)
            go = grad_out[..., i0:i1, :]
            D_t, shift_t, logl_t = D[..., i0:i1, :], shift[..., i0:i1, :], logl[..., i0:i1, :]
            dq = xp.zeros((*lead, i1 - i0, E), dtype=dt, device=dev)
            for n, j0 in enumerate(range(0, t.key_end(i1), t.bk)):
                j1 = min(j0 + t.bk, spec.S)  # whole key tiles (the causal mask hides the rest): one shape a tile
                p = xp.exp(t.scores(qs, i0, i1, j0, j1) - shift_t - logl_t)  # the forward's weights
                dv = xp.matmul(mT(p), go)  # (..., bk, Ev)
                ds = p * (xp.matmul(go, mT(t.v[..., j0:j1, :])) - D_t)
                dk = xp.matmul(mT(ds), qs)  # scores = (q * scale) k^T: the scale rides on qs
                dq = dq + xp.matmul(ds, t.k[..., j0:j1, :])
                dks[n] = dk if dks[n] is None else dks[n] + dk
                dvs[n] = dv if dvs[n] is None else dvs[n] + dv
            dqs.append(dq * spec.scale)
        for n in range(n_tiles):  # key tiles no query saw (none, unless causal with L < S)
            rows = min(spec.S, (n + 1) * t.bk) - n * t.bk
            if dks[n] is None:
                dks[n] = xp.zeros((*lead, rows, E), dtype=dt, device=dev)
                dvs[n] = xp.zeros((*lead, rows, Ev), dtype=dt, device=dev)
        dq, dk, dv = xp.concat(dqs, axis=-2), xp.concat(dks, axis=-2), xp.concat(dvs, axis=-2)
    return (reduce_to(dq, spec.query.shape, 1), reduce_to(dk, spec.key_shape, spec.gqa_groups),
            reduce_to(dv, spec.value_shape, spec.gqa_groups))
