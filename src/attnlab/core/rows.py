"""Attention by blocks of query rows, each against all the keys it sees (the "rows" kernel).

For the sequence lengths most models run (``S`` up to a few thousand keys) a block of
query rows times all its keys fits in the per-core L2 cache, so there is no need for the
online softmax of :mod:`attnlab.core.blockwise`: each block computes its scores with one
matmul, turns them into probabilities in one compiled pass (:func:`attnlab.core._fused.
softmax_rows`: mask, row maximum, ``exp``, sum and ``1 / sum`` while the block is in
cache) and multiplies them by the values. The naive kernel's math, with three changes:

- **Cache-sized blocks.** A block is several heads' full score matrices when they are
  small (BERT's 128 x 128) or a slice of one head's rows when they are not; its size
  comes from the CPU's L2 cache (:func:`attnlab._cpu.cpu_info`), never from a constant
  tuned on one machine.
- **Causal blocks skip the hidden keys.** A block of rows ``a0:a1`` multiplies only keys
  ``0:a1`` (top-left), so about half the work of a causal call is never done.
- **Grouped-query attention without repeated keys.** The ``G`` query heads of one key/value
  head are stacked into ``G * rows`` rows of one matmul, so each key/value head serves its
  group directly; in the backward pass the same stacking sums the group's key and value
  gradients inside the matmul. Every score is still one query row times one key row:
  the stacking changes no arithmetic.

Blocks are independent units that attnlab's thread pool runs (:mod:`attnlab._threads`,
BLAS held to one thread meanwhile); the backward pass's units own key/value heads (so
their gradients need no locks), split by rows with partial gradients when there are
fewer heads than threads.

Where NumPy's BLAS is its wheels' OpenBLAS (:func:`attnlab.core._blas.sgemm_address`), a
block with no mask or a causal one is a single compiled call that runs the products
through that BLAS's ``sgemm`` itself (:func:`attnlab.core._fused.forward_rows`,
:func:`attnlab.core._fused.backward_rows`): the pool's threads then never queue for the
GIL between two products. Elsewhere the blocks are NumPy calls, with the same numbers to
float32 rounding.

Runs for float32 NumPy arrays when numba is installed (the ``fast`` extra); the
dispatcher (:mod:`attnlab.core.dispatch`) picks it. Axis legend: see
:mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import itertools
import math
from contextlib import nullcontext

import numpy as np

from attnlab._cpu import cpu_info
from attnlab._threads import (
    POOL_MATMUL_MIN_TOKENS,
    ScratchPool,
    one_blas_thread,
    pool_matmul_min,
    pool_threads,
    run_units,
)
from attnlab._tuning import thresholds
from attnlab.core._blas import sgemm_address
from attnlab.core.blockwise import fused_planned, score_stride, scores_buffer, tuning
from attnlab.core.spec import AttentionSpec, reduce_to

_MODE_NONE, _MODE_CAUSAL, _MODE_BOOL, _MODE_FLOAT = 0, 1, 2, 3  # as in _fused
_NO_MASK = np.zeros((1, 1, 1), dtype=np.float32)
_NO_KT = np.zeros((0, 0), dtype=np.float32)  # forward_rows: no transposed copy of the keys
_NORMALISE = np.zeros(0, dtype=np.float32)  # softmax_rows: normalise the rows in place
_SCRATCH = ScratchPool()  # the blocks' buffers, kept between calls
_CALLS = itertools.count()  # tells one call's cached transposes from another's

# Calls with fewer scores (all heads together) stay on the naive NumPy path: they cost
# microseconds either way, take no numba import (~0.3 s once per process), and give
# exactly the numbers of the weights path (attention_weights(...) @ v), which the layers'
# maps and traces use. A training batch of 64 x 4 heads of 32 x 32 (262144 scores), or 8
# heads at L = 64 (32768), take the rows kernel.
_MIN_SCORES = 2**15
# A block's float32 scores take this multiple of the per-core L2 cache (forward: one array
# of scores; backward: two, the probabilities and their gradient, each half of it): larger
# blocks amortise BLAS's packing of the keys and values over more query rows, as in the
# blockwise kernel's forward tiles. Measured in CPU time on one thread of a 2-core AVX-512
# EPYC (1 MiB L2), B=1, H=8, E=64, ms for multiples 0.25 / 0.5 / 1 / 2 / 4: L = 1024
# forward 50.5 / 35.1 / 34.2 / 32.0 / 31.9, backward 97.8 / 101.1 / 92.7 / 89.4 / 83.2;
# L = 2048 forward 152 / 157 / 136 / 124 / 128, backward 403 / 412 / 408 / 372 / 345;
# BERT-like B=32, H=12, L=128 within noise (33-35 ms forward, 82-90 backward).
_BLOCK_L2_SHARE = 4.0
# Several heads share a block while their scores together fit in the L2 cache (each head is
# its own matmul, so a larger block saves no packing, only cache). One thread, B=32, H=12,
# L=128, E=64, ms forward / backward for 1/8, 1/2, 1 and 4 times the L2: 29.5 / 64.6,
# 28.3 / 62.4, 27.6 / 63.4, 28.4 / 70.6 (E=32 and a training batch, 64 x 4 heads of 32 x
# 32, alike).
_HEADS_L2_SHARE = 1.0
# Fewest query rows per block: below this the matmuls lose their rate. Where a block of
# this many rows no longer holds all the keys, the blockwise kernel takes over. Against
# it, one thread, same machine, rows time / blockwise time (forward, backward): L = S =
# 1024 1.03, 0.71; 2048 0.95, 0.76; 4096 1.07, 0.84 (causal 1.00, 0.73; 1.04, 0.74;
# 1.11, 0.76): the forward pass goes blockwise beyond 2048 keys, the backward beyond 4096.
_MIN_ROWS = 64
_FORWARD_MIN_ROWS = 512
_BACKWARD_MIN_ROWS = 128
# A causal block is cut to about L / 8 rows (so that the keys hidden inside a block, about
# rows / 2 per row, stay near 1/8 of a row's average L / 2), within these bounds (below 64
# rows the matmuls lose their rate). One thread, ms forward / backward for 32, 64, 128,
# 256 rows: B=32, H=12, L=128, E=64: 64 rows 30.4 / 63.8, 128 rows 36.2 / 81.1; SmolLM2
# prefill (9 over 3 heads, L=512): 5.8 / 13.0, 5.5 / 12.1, 5.7 / 13.0, 6.6 / 15.6; GPT-2
# (12 heads, L=1024): 46.4 / 104, 35.7 / 84.0, 35.4 / 82.1, 36.0 / 90.6; L=2048, 8 heads:
# 86.2 / 214, 72.4 / 172, 65.9 / 169, 69.9 / 184.
_CAUSAL_ROWS_RANGE = (64, 128)
_CAUSAL_DIV = 8
# A causal forward block's rows are cut short (above), and its heads then count again: as
# many as fit the L2 share of several heads (_HEADS_L2_SHARE), a block's keys counted at
# their average S / 2 (a block of rows a0:a1 sees keys 0:a1). Fewer, larger blocks: each
# head is still its own product inside one batched matmul, but the Python between the
# products (which holds the GIL, so that the pool's threads queue for it) runs once a
# block, not once a head. Measured on a 2-core AVX-512 EPYC, 2 threads, ms, one head a
# block / heads that fit: GPT-2-like 12 heads at L = 512 5.4 / 4.1, L = 1024 14.1 / 12.9;
# SmolLM2 (9 over 3 heads, L = 512) 3.0 / 2.8; 4 x 4 heads of E = 16 at L = 512 7.5 /
# 2.2. The backward pass keeps one head a block: there 2 to 12 heads a block gave 9 to 38
# ms for 12 heads at L = 512, changing from one run to the next (one head: 19-25).
_CAUSAL_MEAN_KEYS_DIV = 2  # a causal block sees S / 2 keys on average


def max_keys(*, backward: bool = False) -> int:
    """The longest key sequence this kernel takes: a block of ``_FORWARD_MIN_ROWS``
    (``_BACKWARD_MIN_ROWS``) query rows of float32 scores still fits in a block
    (:func:`_block_bytes`, half of it for each of the backward pass's two arrays). Beyond,
    the blockwise kernel's online softmax over key tiles is faster.

    >>> max_keys() >= 64 and max_keys(backward=True) >= 64
    True
    """
    rows = _BACKWARD_MIN_ROWS if backward else _FORWARD_MIN_ROWS
    return max(64, _block_bytes() // (2 if backward else 1) // (4 * rows))


def planned(spec: AttentionSpec, *, backward: bool = False, why: list | None = None) -> bool:
    """Whether the dispatcher runs this kernel for ``spec`` (already widened to its compute
    dtype): float32 NumPy arrays, no dropout, compiled kernels available and not turned off
    (:func:`attnlab.core.blockwise.fused_planned`), keys that fit (:func:`max_keys`), and
    nothing empty, at least :data:`_MIN_SCORES` scores. ``why``: a list that gets the
    reason, in words (``attnlab bench --explain-dispatch``)."""
    if spec.dropout_p > 0 or spec.query.dtype != np.float32:
        return _because(why, False, "rows kernel: float32 without dropout only")
    L, S, Ev = spec.L, spec.S, spec.value.shape[-1]
    if L == 0 or S == 0 or Ev == 0 or math.prod(spec.batch_shape) == 0:
        return _because(why, False, "rows kernel: nothing to compute")
    keys = max_keys(backward=backward)
    if S > keys:
        return _because(why, False, f"rows kernel: {S} keys > {keys}, the most whose scores for "
                        f"{_BACKWARD_MIN_ROWS if backward else _FORWARD_MIN_ROWS} query rows fit "
                        f"{_BLOCK_L2_SHARE / (2 if backward else 1):g}x the {cpu_info().l2 // 1024} KiB L2")
    scores = math.prod(spec.batch_shape) * L * S
    if scores < _MIN_SCORES:
        return _because(why, False, f"rows kernel: {scores} scores < {_MIN_SCORES} (a call of microseconds: the "
                        "naive path, no numba import)")
    if not fused_planned(np.float32, 0, min_n=0):
        return _because(why, False, "rows kernel: needs numba (the fast extra), not installed or turned off")
    return _because(why, True, f"rows kernel: {S} keys <= {keys} (the scores of "
                    f"{_BACKWARD_MIN_ROWS if backward else _FORWARD_MIN_ROWS} query rows fit "
                    f"{_BLOCK_L2_SHARE / (2 if backward else 1):g}x the {cpu_info().l2 // 1024} KiB L2), "
                    f"{scores} scores >= {_MIN_SCORES}, numba there")


def _because(why: list | None, answer: bool, reason: str) -> bool:
    if why is not None:
        why.append(reason)
    return answer


def describe_blocks(spec: AttentionSpec, *, backward: bool = False) -> str:
    """How a call runs here (``spec`` as :func:`planned` takes it): its blocks, units and
    threads, in words."""
    lay = _Layout(spec, backward=backward)
    work = lay.scores * min(lay.E + lay.Ev, 128) // 128
    units = len(lay.head_chunks) * len(lay.row_chunks)
    nh = max(f1 - f0 for f0, f1 in lay.head_chunks)
    threads = lay.threads if lay.threads == 1 else min(lay.threads, units)
    return (f"blocks of {lay.rows} query row(s) x {nh} head(s) ({units} block(s)); {threads} thread(s): "
            f"work {work} scores {'>=' if work >= _min_scores_per_thread() else '<'} "
            f"{_min_scores_per_thread()} (min_scores_per_thread); keys transposed into a copy: "
            f"{'yes' if lay.copy_transposed else 'no'}")


def _broadcast(a: np.ndarray, shape: tuple) -> np.ndarray:
    return a if a.shape == shape else np.broadcast_to(a, shape)


def _merged(a: np.ndarray, shape: tuple) -> np.ndarray | None:
    """``a`` reshaped to ``shape`` as a view, or None where that would need a copy."""
    try:
        return a.reshape(shape, copy=False)
    except ValueError:
        return None


def _heads(a: np.ndarray, flat_ndim: int, f0: int, f1: int, hkv: int, bd: tuple) -> np.ndarray:
    """Heads ``f0:f1`` of a per-head array as ``(*bd, ...)``: ``a`` is flat ``(NH, ...)``
    (``flat_ndim`` dims) or two-level ``(NB, Hkv, ...)``, and ``bd`` is ``(nh,)`` (heads of
    one batch entry) or ``(nn, Hkv)`` (whole batch entries); always a view."""
    if a.ndim == flat_ndim:
        return a[f0:f1].reshape(*bd, *a.shape[1:])
    n0, h0 = divmod(f0, hkv)
    return a[n0, h0 : h0 + bd[0]] if len(bd) == 1 else a[n0 : n0 + bd[0]]


def _buf(scratch: dict, name: str, shape: tuple) -> np.ndarray:
    """A reusable per-thread float32 buffer viewed as ``shape``."""
    size = math.prod(shape)
    buf = scratch.get(name)
    if buf is None or buf.size < size:
        buf = scratch[name] = np.empty(max(size, 1), dtype=np.float32)
    return buf[:size].reshape(shape)


def _block_bytes() -> int:
    """Bytes of float32 scores one block may hold (a share of the per-core L2)."""
    return int(cpu_info().l2 * _BLOCK_L2_SHARE)


def _heads_bytes() -> int:
    """Bytes of float32 scores that several heads share in one block (see _HEADS_L2_SHARE)."""
    return int(cpu_info().l2 * _HEADS_L2_SHARE)


def _copies_transposed(E: int, S: int) -> bool:
    """Whether heads of ``S`` keys of width ``E`` multiply by contiguous transposed copies
    of the keys and values (see :meth:`_Layout.transposed`): ``E >= 32`` and a head's keys
    within half the L1 data cache (:attr:`attnlab._tuning.Thresholds.transpose_copy_bytes`;
    on a 32 KiB L1d, 4096 floats, where it was measured to pay)."""
    return E >= 32 and 4 * E * S <= thresholds().transpose_copy_bytes


def _min_scores_per_thread() -> int:
    return tuning().min_scores_per_thread


class _Layout:
    """Per-call arrays (internal), with the leading batch dims and the key/value heads
    flattened into ``NH`` heads: queries ``(NH, G, L, E)`` (unscaled: the row pass applies
    the scale to the scores) and keys/values ``(NH, S, E|Ev)`` (views where the strides
    allow), mask ``(NH, G, L, S)`` (a view, or per leading index where it cannot be
    flattened)."""

    def __init__(self, spec: AttentionSpec, *, backward: bool = False):
        self.spec = spec
        self.dtype = np.dtype(np.float32)
        batch = spec.batch_shape or (1,)
        self.batch = spec.batch_shape
        self.G = G = spec.gqa_groups
        self.L, self.S = L, S = spec.L, spec.S
        self.E, self.Ev = E, Ev = spec.query.shape[-1], spec.value.shape[-1]
        self.Hkv = Hkv = batch[-1] // G
        self.lead = lead = batch[:-1]
        self.NH = NH = math.prod(lead) * Hkv
        self.NB = math.prod(lead)
        self.scale = np.float32(spec.scale)  # applied to the scores by the row pass
        self.call = next(_CALLS)
        # Small heads multiply by contiguous transposed copies of the keys and values (see
        # transposed()), where measured to pay: an (E, S) head of at most 4096 floats, E >=
        # 32 (E = 32, S = 128: MiniLM's heads, 7% off a call; E = 64, S = 64: 5%). Larger
        # heads lost up to 5% (E = 32, S = 512 causal), and E = 16 heads of a projection
        # 2-5% (many tiny strided copies).
        self.copy_transposed = _copies_transposed(self.E, S)
        self.two_level = False  # set by per_head: some array keeps its batch and head axes apart
        self.q = self.per_head(_broadcast(spec.query, (*batch, L, E)), (G, L, E))
        # The caller's key/value heads, each serving G consecutive query heads.
        self.k = self.per_head(_broadcast(spec.key, (*lead, Hkv, S, E)), (S, E))
        self.v = self.per_head(_broadcast(spec.value, (*lead, Hkv, S, Ev)), (S, Ev))
        self.mode, self.mask, self.mask_by_lead = _MODE_NONE, None, None
        if spec.is_causal:
            self.mode = _MODE_CAUSAL
        elif spec.attn_mask is not None:
            m = _broadcast(spec.attn_mask, (*batch, L, S))
            self.mode = _MODE_BOOL if m.dtype == np.bool_ else _MODE_FLOAT
            self.mask = _merged(m, (NH, G, L, S))
            if self.mask is None:  # e.g. a key-padding mask (N, 1, 1, S): per batch entry
                self.mask_by_lead = m.reshape(*lead, Hkv, G, L, S)
        self.scores = math.prod(batch) * L * S
        # Threads from min_scores_per_thread scores of E = Ev = 64 heads; smaller heads do
        # less work a score (2 (E + Ev) flops in the two products) and need more scores
        # (E = 16: four times as many). Inside a layer a pool also starts beside BLAS's
        # spinning threads: the TinyTransformer training step (E = 16, 262144 scores a
        # call) ran at 0.996x torch's step time with its attention on one thread, 1.115x
        # on two, though the call alone is faster on two. Larger heads count as E = 64
        # (E = 128, 131072 scores: one thread 0.95 ms forward, two 1.03).
        work = self.scores * min(E + Ev, 128) // 128
        self.threads = pool_threads(None) if work >= _min_scores_per_thread() else 1
        # Block sizes: heads per block (nh) and rows per block.
        budget = _block_bytes() // (2 if backward else 1)
        per_row = 4 * G * S  # bytes of one query row of all G heads
        # Heads per block; blocks never straddle two batch entries when the mask is kept
        # per batch entry.
        span = Hkv if self.mask_by_lead is not None else NH
        if per_row * L <= budget:
            rows = L
            nh = max(1, min(span, _heads_bytes() // (per_row * L)))
        else:
            nh = 1
            rows = _rows_within(budget, per_row)
        if spec.is_causal:
            rows = min(rows, causal_block_rows(L))
        rows = min(rows, L)
        if spec.is_causal and not backward:  # shorter blocks leave room for more heads (see _CAUSAL_DIV)
            nh = max(nh, min(span, _CAUSAL_MEAN_KEYS_DIV * _heads_bytes() // (per_row * rows)))
        n_row_blocks = -(-L // rows)
        # Enough units for the threads (two each, so that they finish together).
        if self.threads > 1:
            while nh > 1 and (NH // span) * -(-span // nh) * n_row_blocks < 2 * self.threads:
                nh = -(-nh // 2)
        n_chunks = -(-span // nh)
        nh = -(-span // n_chunks)  # even chunks: 12 heads as 6 + 6, not 8 + 4
        if self.two_level and span == NH:  # blocks of whole batch entries, or within one
            span = Hkv if nh < Hkv else NH
            nh = min(nh, Hkv) if nh < Hkv else nh // Hkv * Hkv
        self.head_chunks = [(f + h, f + min(h + nh, span)) for f in range(0, NH, span) for h in range(0, span, nh)]
        self.rows = rows
        self.row_chunks = [(a, min(a + rows, L)) for a in range(0, L, rows)]

    def per_head(self, a: np.ndarray, tail: tuple) -> np.ndarray:
        """``a`` (``(*lead, Hkv, *tail)``, ``Hkv`` the key/value heads) as a flat ``(NH,
        *tail)`` view where the strides allow; else as a two-level ``(NB, Hkv, *tail)`` view
        (heads transposed out of a ``(N, L, H, D)`` projection: blocks then take whole batch
        entries, and nothing is copied); else copied flat."""
        flat = _merged(a, (self.NH, *tail))
        if flat is not None:
            return flat
        if not hasattr(self, "head_chunks") or self.two_level:  # chunks not made yet, or aligned
            two = _merged(a, (self.NB, self.Hkv, *tail))
            if two is not None:
                self.two_level = True
                return two
        return np.ascontiguousarray(a).reshape(self.NH, *tail)

    def block_dims(self, f0: int, f1: int) -> tuple:
        """The batch dims of heads ``f0:f1``: ``(nh,)``, or ``(nn, Hkv)`` for whole batch
        entries of a two-level layout."""
        nh = f1 - f0
        if not self.two_level or (nh <= self.Hkv and f0 // self.Hkv == (f1 - 1) // self.Hkv):
            return (nh,)
        return (nh // self.Hkv, self.Hkv)

    def key_end(self, a1: int) -> int:
        return min(self.S, a1) if self.spec.is_causal else self.S

    def mask_block(self, f0, f1, a0, a1, kend):
        """``(mode, mask (nh * G, rows, kend), lim0)`` for the compiled row pass."""
        if self.mode == _MODE_CAUSAL:
            return self.mode, _NO_MASK, a0 + 1
        if self.mode == _MODE_NONE:
            return self.mode, _NO_MASK, 0
        if self.mask is not None:
            m = self.mask[f0:f1, :, a0:a1, :kend]
        else:
            idx = np.unravel_index(f0 // self.Hkv, self.lead) if self.lead else ()
            h0 = f0 % self.Hkv
            m = self.mask_by_lead[tuple(int(i) for i in idx)][h0 : h0 + f1 - f0, :, a0:a1, :kend]
        return self.mode, m.reshape((f1 - f0) * self.G, a1 - a0, kend), 0

    def transposed(self, name: str, a: np.ndarray, f0: int, f1: int, bd: tuple, scratch: dict) -> np.ndarray:
        """Heads ``f0:f1`` of the keys or values ``a`` transposed, ``(*bd, E, S)``: for
        small heads (:attr:`copy_transposed`) copied once per call, thread and block of
        heads into the thread's scratch (its row blocks reuse it), else a view. BLAS
        multiplies by a contiguous ``(E, S)`` much faster than by the transposed view of
        ``(S, E)`` at small sizes (one thread, one product: 8 heads of 64 x 64, E = 64, 60
        against 38 us, the copy 10 us; 12 heads of 128 x 128, E = 32, 108 against 78, the
        copy 10 us; 4 heads of 128 x 128, E = 64, 102 against 89, the copy 11 us)."""
        rows = _heads(a, 3, f0, f1, self.Hkv, bd)
        if not self.copy_transposed:
            return rows.swapaxes(-1, -2)
        key = (self.call, f0, f1)
        t = _buf(scratch, name, (*bd, rows.shape[-1], self.S))
        if scratch.get(name + " of") != key:
            np.copyto(t, rows.swapaxes(-1, -2))
            scratch[name + " of"] = key
        return t

    def probs(self, K, f0, f1, a0, a1, kend, scratch, inv=_NORMALISE):
        """``(q (*bd, G * rows, E), probabilities (*bd, G * rows, kend), the same padded)``
        of a block, the last two in the thread's scratch buffer (rows
        :func:`attnlab.core.blockwise.score_stride` apart); with ``inv`` (nh * G * rows,)
        the rows are left unnormalised and ``inv`` gets their ``1 / sum``."""
        nh, rows, G = f1 - f0, a1 - a0, self.G
        bd = self.block_dims(f0, f1)
        q4 = _heads(self.q, 4, f0, f1, self.Hkv, bd)[..., a0:a1, :]
        q = _merged(q4, (*bd, G * rows, self.E))
        if q is None:  # a group's rows are not one run of memory: stack them
            q = np.ascontiguousarray(q4).reshape(*bd, G * rows, self.E)
        full, s = scores_buffer(scratch, "s", (*bd, G * rows), kend, np.float32)
        np.matmul(q, self.transposed("k^T", self.k, f0, f1, bd, scratch)[..., :kend], out=s)
        mode, mask, lim0 = self.mask_block(f0, f1, a0, a1, kend)
        K.softmax_rows(full.reshape(nh * G, rows, -1), mode, mask, lim0, inv, self.scale, kend)
        return q, s, full


# OpenBLAS multiplies a product of at most 65536 x 4 multiply-adds on one thread whatever
# its thread count (interface/gemm.c: SMP_THRESHOLD_MIN x GEMM_MULTITHREAD_THRESHOLD).
_BLAS_ONE_THREAD_MACS = 65536 * 4


def _blas_for(G: int, rows: int, S: int, E: int, Ev: int):
    """One BLAS thread for a block's products (BLAS's own threads would stay spinning
    beside the pool of the layer that comes next, see :func:`attnlab._threads.matmul`),
    except where no product is large enough for BLAS to thread: the switch costs two calls
    into the library (5 us back to back, about 0.1 ms after a pause, a sixth of an L=64
    call)."""
    return nullcontext() if G * rows * S * max(E, Ev) <= _BLAS_ONE_THREAD_MACS else one_blas_thread()


def _run(units: list, run, lay: _Layout) -> None:
    """The units on the pool of ``lay.threads`` (:func:`attnlab._threads.run_units`), or, on
    one thread, in a plain loop (a short call's fixed cost: no pool bookkeeping, no
    error-state switch) on one BLAS thread."""
    threads = min(lay.threads, len(units))
    if threads > 1:
        run_units(units, run, threads, scratch=_SCRATCH)
        return
    scratch = _SCRATCH.take()
    try:
        with _blas_for(lay.G, lay.rows, lay.S, lay.E, lay.Ev):
            for unit in units:
                run(unit, scratch)
    finally:
        _SCRATCH.give(scratch)


def _kernels():
    """:mod:`attnlab.core._fused` (imports numba: :func:`planned` checked it is installed),
    kept after the first call (an import statement costs tens of us in a short call after
    the machine idled)."""
    global _FUSED
    if _FUSED is None:
        from attnlab.core import _fused

        _FUSED = _fused
    return _FUSED


_FUSED = None


def forward(spec: AttentionSpec) -> np.ndarray:
    """``softmax(q k^T * scale + mask) @ v``: ``(..., Hq, L, Ev)`` float32 (see
    :func:`planned` for what ``spec`` must be)."""
    out = _forward_one_block(spec)
    if out is not None:
        return out
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # inf and NaN propagate
        return _forward(spec)


def _forward_one_block(spec: AttentionSpec) -> np.ndarray | None:
    """A short call as one block on one thread, without the general layout, or None when
    the call is not one (then :func:`_forward` runs it): contiguous arrays without a mask
    or broadcast leading dims, all heads' scores within the L2 cache, too little work for a
    second thread, and at most one causal block of rows. The same operations as
    :func:`_forward` on such a call, so the same numbers. At such sizes the fixed cost of a
    call is as large as its arithmetic, most of all after the machine idled (every object
    the call touches is then cold): H=8, L=S=64, with the plain spec
    (:func:`attnlab.core.spec.check_attention_args`), 162 -> 139 us back to back and
    525 -> 445 us after a 0.1 s pause.

    Where NumPy's BLAS has a CBLAS ``sgemm`` with 64-bit integers (its wheels:
    :func:`attnlab.core._blas.sgemm_address`), the whole block is one compiled call, as
    the general blocks are (:func:`attnlab.core._fused.forward_rows`), that calls that
    ``sgemm`` itself: no NumPy call between the products, and no floating-point error
    state to set, since no NumPy call checks it. Same machine: 138 -> 123 us back to
    back, 446 -> 380 us after a pause."""
    q, k, v = spec.query, spec.key, spec.value
    if spec.attn_mask is not None or q.ndim < 3 \
            or not (q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous):
        return None
    *lead, Hq, L, E = q.shape
    S, Ev, G = k.shape[-2], v.shape[-1], spec.gqa_groups
    if tuple(q.shape[:-2]) != spec.batch_shape or k.shape[:-2] != (*lead, Hq // G) \
            or (spec.is_causal and L > _CAUSAL_ROWS_RANGE[0]):
        return None
    NH = math.prod(lead) * (Hq // G)
    scores = NH * G * L * S
    if 4 * scores > _heads_bytes() or 4 * G * L * S > _block_bytes() \
            or scores * min(E + Ev, 128) // 128 >= _min_scores_per_thread():
        return None
    K = _kernels()
    kend = min(S, L) if spec.is_causal else S
    sgemm = sgemm_address()
    scratch = _SCRATCH.take()
    try:
        copy = _copies_transposed(E, S)
        full, p = scores_buffer(scratch, "s", (NH, G * L), kend, np.float32)
        inv = _buf(scratch, "inv", (NH * G * L,))
        out = np.empty((*lead, Hq, L, Ev), dtype=np.float32)
        o = out.reshape(NH, G * L, Ev)
        q3, k3, v3 = q.reshape(NH, G * L, E), k.reshape(NH, S, E), v.reshape(NH, S, Ev)
        with _blas_for(G, L, S, E, Ev):
            if sgemm:  # one compiled call: no NumPy call between the products
                _compiled_forward(K, sgemm, q.reshape(NH, G, L, E), k3, v3, out.reshape(NH, G, L, Ev), full, inv,
                                  0, L, kend, spec.is_causal, np.float32(spec.scale), copy, scratch)
                return out
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # inf and NaN propagate
                kt = k3[:, :kend].swapaxes(-1, -2)
                if copy:
                    scratch["k^T of"] = None  # no longer the copy _Layout.transposed made
                    buf = _buf(scratch, "k^T", (NH, E, kend))
                    np.copyto(buf, kt)
                    kt = buf
                np.matmul(q3, kt, out=p)
                K.softmax_rows(full.reshape(NH * G, L, -1), _MODE_CAUSAL if spec.is_causal else _MODE_NONE,
                               _NO_MASK, int(spec.is_causal), inv, np.float32(spec.scale), kend)
                np.matmul(p, v3[:, :kend], out=o)
                o *= inv.reshape(NH, G * L, 1)
    finally:
        _SCRATCH.give(scratch)
    return out


def _compiled_forward(K, sgemm, q, k, v, out, s, inv, a0, a1, kend, causal, scale, copy, scratch) -> None:
    """:func:`attnlab.core._fused.forward_rows` on one block (query rows ``a0:a1``, keys
    ``0:kend``); with ``copy`` (small heads, see :func:`_copies_transposed`) the keys'
    transposed copy goes in the thread's ``"k^T"`` buffer, which then no longer holds
    :meth:`_Layout.transposed`'s copy."""
    kt = _NO_KT
    if copy:
        kt = _buf(scratch, "k^T", (q.shape[-1], kend))
        scratch["k^T of"] = None
    kernel = K.forward_rows if q.ndim == 4 else K.forward_rows_by_entry  # (nn, Hkv, G, L, E): whole entries
    kernel(sgemm, q, k, v, out, s, inv, kt, a0, a1, causal, _NO_MASK, scale)


def _forward(spec: AttentionSpec) -> np.ndarray:
    K = _kernels()
    lay = _Layout(spec)
    G, L, Ev = lay.G, lay.L, lay.Ev
    out = np.empty((lay.NH, G, L, Ev), dtype=np.float32)
    units = [(f0, f1, a0, a1) for f0, f1 in lay.head_chunks
             for a0, a1 in reversed(lay.row_chunks)]  # causal: the longest blocks first

    sgemm = _compiled_blocks(lay)

    def run(unit, scratch):
        f0, f1, a0, a1 = unit
        nh, rows = f1 - f0, a1 - a0
        bd = lay.block_dims(f0, f1)
        kend = lay.key_end(a1)
        if sgemm:
            _compiled_forward(K, sgemm, _heads(lay.q, 4, f0, f1, lay.Hkv, bd), _heads(lay.k, 3, f0, f1, lay.Hkv, bd),
                              _heads(lay.v, 3, f0, f1, lay.Hkv, bd), out[f0:f1].reshape(*bd, G, L, Ev),
                              _buf(scratch, "s", (nh, G * rows, score_stride(kend))),
                              _buf(scratch, "inv", (nh * G * rows,)), a0, a1, kend, lay.mode == _MODE_CAUSAL,
                              lay.scale, lay.copy_transposed, scratch)
            return
        # Unnormalised probabilities; 1 / sum goes on the (rows, Ev) product instead.
        inv = _buf(scratch, "inv", (nh * G * rows,))
        _, p, _ = lay.probs(K, f0, f1, a0, a1, kend, scratch, inv)
        v = _heads(lay.v, 3, f0, f1, lay.Hkv, bd)[..., :kend, :]
        if rows == L or G == 1:  # the block's output rows are one (nh, G * rows) view
            o = out[f0:f1, :, a0:a1].reshape((*bd, G * rows, Ev), copy=False)
            np.matmul(p, v, out=o)
            o *= inv.reshape(*bd, G * rows, 1)
        else:
            o = _buf(scratch, "o", (*bd, G * rows, Ev))
            np.matmul(p, v, out=o)
            o *= inv.reshape(*bd, G * rows, 1)
            out[f0:f1, :, a0:a1] = o.reshape(nh, G, rows, Ev)

    _run(units, run, lay)
    return out.reshape(*spec.batch_shape, L, Ev)


def backward(spec: AttentionSpec, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(grad_query, grad_key, grad_value)`` in the caller's shapes (GQA groups and
    broadcast dims summed back), recomputing the probabilities block by block."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # inf and NaN propagate
        return _backward(spec, grad_out)


def _compiled_blocks(lay: _Layout, go: np.ndarray | None = None) -> int:
    """The address of NumPy's ``sgemm`` where the blocks run as compiled calls
    (:func:`attnlab.core._fused.forward_rows`, :func:`attnlab.core._fused.backward_rows`),
    else 0: no mask or a causal one, every head in one flat axis, rows of unit stride
    (``go``: the backward pass's gradient of the output, per head). A backward block of
    the NumPy path makes about ten NumPy calls, each a moment where the other pool thread
    may wait for the GIL; here a unit of work is one call. Measured on a 2-core AVX-512
    EPYC, 2 threads, ms, NumPy blocks / compiled, backward: 12 heads at L = 512 causal
    12.1-14.2 / 8.2-9.3, L = 1024 31.8-33.6 / 28.3-29.2; BERT-like 32 x 12 heads of 128 x
    128, E = 64, 32.2-34.8 / 29.0-29.4; 8 heads at L = 1024 33.7-33.9 / 31.9-32.3;
    forward: 12 heads at L = 512 causal 4.2-4.6 / 3.8-3.9, BERT-like E = 32 7.2-7.4 /
    6.5, 8 heads at L = 256 causal 1.0 / 0.77. Heads transposed out of a projection (the
    two-level layout) run so too, a block of whole batch entries one call per entry
    (:func:`attnlab.core._fused.forward_rows_by_entry`), ms, NumPy blocks / compiled:
    a TinyTransformer training step's 64 x 4 heads of 32 x 32, E = 16, causal, one
    thread, forward 0.76 / 0.66, backward 1.31 / 1.13; 32 x 12 heads of 20 x 20, E = 32,
    0.75 / 0.69 and 1.44 / 1.32; BERT-like E = 32, two threads, 8.97 / 7.29 and 17.3 /
    16.6."""
    if lay.mode not in (_MODE_NONE, _MODE_CAUSAL):
        return 0
    arrays = (lay.q, lay.k, lay.v) + (() if go is None else (go,))
    # Flat (NH, ...) or two-level (NB, Hkv, ...) arrays (see _Layout.per_head). BLAS takes a
    # matrix as rows of unit stride at least a row apart: never reversed, repeated (a
    # broadcast row) or overlapping rows.
    if any(a.ndim not in (n, n + 1) or a.strides[-1] != 4 or a.strides[-2] < 4 * a.shape[-1]
           for a, n in zip(arrays, (4, 3, 3, 4), strict=False)):
        return 0
    return sgemm_address()


def _backward(spec: AttentionSpec, grad_out: np.ndarray):
    K = _kernels()
    lay = _Layout(spec, backward=True)
    G, L, S, E, Ev, NH = lay.G, lay.L, lay.S, lay.E, lay.Ev, lay.NH
    batch = spec.batch_shape or (1,)
    go = lay.per_head(_broadcast(grad_out, (*batch, L, Ev)), (G, L, Ev))
    dq = np.empty((NH, G, L, E), dtype=np.float32)
    dk = np.zeros((NH, S, E), dtype=np.float32)
    dv = np.zeros((NH, S, Ev), dtype=np.float32)
    heads = lay.head_chunks
    # Units own key/value heads; with fewer head blocks than twice the threads, each one's
    # row blocks are dealt round-robin to `split` units, all but the first with partial
    # dk, dv.
    split = 1
    if lay.threads > 1 and len(heads) < 2 * lay.threads:
        split = max(1, min(len(lay.row_chunks), -(-2 * lay.threads // len(heads))))
    partial = {}
    for n, (f0, f1) in enumerate(heads):
        for c in range(1, split):
            partial[n, c] = (np.zeros((f1 - f0, S, E), np.float32), np.zeros((f1 - f0, S, Ev), np.float32))
    units = [(n, c) for n in range(len(heads)) for c in range(split)]
    sgemm = _compiled_blocks(lay, go)

    def run(unit, scratch):
        n, c = unit
        f0, f1 = heads[n]
        nh = f1 - f0
        bd = lay.block_dims(f0, f1)
        dk_h, dv_h = (dk[f0:f1], dv[f0:f1]) if c == 0 else partial[n, c]
        if sgemm:
            ld = score_stride(S)
            p, dp = _buf(scratch, "p", (G * lay.rows, ld)), _buf(scratch, "dp", (G * lay.rows, ld))
            chunks = np.array(lay.row_chunks[c::split], dtype=np.int64).reshape(-1, 2)
            kernel = K.backward_rows if len(bd) == 1 else K.backward_rows_by_entry  # whole batch entries
            kernel(sgemm, _heads(lay.q, 4, f0, f1, lay.Hkv, bd), _heads(lay.k, 3, f0, f1, lay.Hkv, bd),
                   _heads(lay.v, 3, f0, f1, lay.Hkv, bd), _heads(go, 4, f0, f1, lay.Hkv, bd),
                   dq[f0:f1].reshape(*bd, G, L, E), dk_h.reshape(*bd, S, E), dv_h.reshape(*bd, S, Ev),
                   p, dp, chunks, lay.mode == _MODE_CAUSAL, _NO_MASK, lay.scale)
            return
        dk_h, dv_h = dk_h.reshape(*bd, S, E), dv_h.reshape(*bd, S, Ev)
        k = _heads(lay.k, 3, f0, f1, lay.Hkv, bd)
        go_h = _heads(go, 4, f0, f1, lay.Hkv, bd)
        for a0, a1 in lay.row_chunks[c::split]:
            rows = a1 - a0
            kend = lay.key_end(a1)
            q, p, p_full = lay.probs(K, f0, f1, a0, a1, kend, scratch)
            g = go_h[..., a0:a1, :]
            g = g.reshape(*bd, G * rows, Ev) if rows == L or G == 1 else \
                np.ascontiguousarray(g).reshape(*bd, G * rows, Ev)
            dv_h[..., :kend, :] += np.matmul(p.swapaxes(-1, -2), g, out=_buf(scratch, "dv", (*bd, kend, Ev)))
            dp_full, dp = scores_buffer(scratch, "dp", (*bd, G * rows), kend, np.float32)
            np.matmul(g, lay.transposed("v^T", lay.v, f0, f1, bd, scratch)[..., :kend], out=dp)
            K.softmax_rows_backward(dp_full.reshape(-1, dp_full.shape[-1]), p_full.reshape(-1, p_full.shape[-1]), kend)
            # dk without the factor scale (applied once at the end)
            dk_h[..., :kend, :] += np.matmul(dp.swapaxes(-1, -2), q, out=_buf(scratch, "dk", (*bd, kend, E)))
            dq_b = dq[f0:f1, :, a0:a1]
            if rows == L or G == 1:
                dq_b = dq_b.reshape((*bd, G * rows, E), copy=False)
                np.matmul(dp, k[..., :kend, :], out=dq_b)
                dq_b *= lay.scale
            else:
                o = _buf(scratch, "dq", (*bd, G * rows, E))
                np.matmul(dp, k[..., :kend, :], out=o)
                o *= lay.scale
                dq_b[...] = o.reshape(nh, G, rows, E)

    _run(units, run, lay)
    for (n, _), (pk, pv) in partial.items():
        f0, f1 = heads[n]
        dk[f0:f1] += pk
        dv[f0:f1] += pv
    dk *= lay.scale
    dq = dq.reshape(*batch, L, E)
    dk = dk.reshape(*batch[:-1], lay.Hkv, S, E)
    dv = dv.reshape(*batch[:-1], lay.Hkv, S, Ev)
    if not spec.batch_shape:  # 2-D call: drop the head axis added above
        dq, dk, dv = dq[0], dk[0], dv[0]
    return (
        reduce_to(dq, spec.query.shape, 1),
        reduce_to(dk, spec.key_shape, 1),
        reduce_to(dv, spec.value_shape, 1),
    )


# ---- a whole self-attention layer's forward pass in one pool call ----------------------
# A layer's forward pass otherwise wakes the pool three times (the in-projection, the
# attention of the heads, the out-projection), with the in-projection's bias, the heads'
# merge and the Python between them on one thread. Here each thread takes a group of heads
# through all three: its columns of the in-projection (bias included), its heads'
# attention, their merge, and the out-projection's product over its heads' columns (a
# partial output, the first group's with the bias; the caller sums the groups' partials).
# Measured on a 2-core AVX-512 EPYC (Zen 4), one sequence, 2 threads, ms, median / min of
# 40 calls 0.1 s apart in turns, one call against the usual path, two runs each:
# - MultiheadAttention(512, 8), L = 512: 11.1 / 10.2 against 11.9 / 10.7, 11.1 / 10.2
#   against 11.8 / 10.6 (torch: 22.5 / 11.1, 22.7 / 13.0);
# - the same at L = 256: 5.6 / 4.9 against 5.9 / 5.3, 5.6 / 4.9 against 6.1 / 5.3;
# - MultiheadAttention(256, 4), L = 512: 5.3 / 4.2 against 5.6 / 4.5, 4.9 / 4.1 against
#   5.8 / 4.4;
# - GPT-2-like (768, 12), causal, L = 512: 18.3 / 17.6 against 18.8 / 17.5, 19.1 / 17.7
#   against 19.3 / 17.8;
# - MultiheadAttention(512, 8), L = 1024: 30.6 / 25.8 against 30.9 / 25.7, 31.2 / 26.1
#   against 31.9 / 26.9.


def _rows_within(budget: int, per_row: int) -> int:
    """The most query rows, a power of two (at least ``_MIN_ROWS``), whose scores of
    ``per_row`` bytes fit in ``budget`` bytes."""
    return max(_MIN_ROWS, 1 << (max(1, budget // per_row).bit_length() - 1))


def causal_block_rows(L: int) -> int:
    """Query rows of one causal block (see ``_CAUSAL_DIV``): about ``L / 8``, within
    ``_CAUSAL_ROWS_RANGE``, at most ``L``.

    >>> causal_block_rows(512), causal_block_rows(4096), causal_block_rows(40)
    (64, 128, 40)
    """
    lo, hi = _CAUSAL_ROWS_RANGE
    return min(L, max(lo, min(hi, L // _CAUSAL_DIV)))


def self_attention_threads(N: int, L: int, E_in: int, H: int, D: int) -> int:
    """The threads :func:`self_attention` runs on for a layer of ``H`` heads of width ``D``
    over ``N`` sequences of ``L`` tokens of width ``E_in``, or 0 where the layer's usual
    path (three pool calls, or none) is the one to take: more than one sequence, the
    compiled kernels unavailable, one thread or a pool inside a pool, heads that do not
    split evenly over the threads, an in-projection :func:`attnlab._threads.matmul` would
    not split (too few tokens, or too narrow a layer for them), or keys beyond this
    kernel's reach (:func:`max_keys`).

    One sequence only: there the pool's two saved wake-ups and the Python between them are
    a share of the call worth having. With several, each thread's products cover one
    sequence at a time and lose the rate that the usual path's products over all of them
    keep. ``MultiheadAttention(512, 8)`` on a 2-core AVX-512 EPYC, ms, median of 40 calls
    0.1 s apart, one call / usual: N = 2, L = 512 21.5 / 21.4 and 22.0 / 21.5; N = 4, L =
    256 19.3 / 18.7 and 19.0 / 18.5 (N = 1: see the comment above)."""
    threads = pool_threads(None)
    if N != 1 or threads < 2 or H % threads or L < POOL_MATMUL_MIN_TOKENS or L > max_keys():
        return 0
    width = min(E_in, 3 * H * D)  # the in-projection's narrower side, as matmul counts it
    if L * width * width < pool_matmul_min() or not fused_planned(np.float32, 0, min_n=0):
        return 0
    return threads if sgemm_address() else 0


def self_attention(x: np.ndarray, w_in: np.ndarray, b_in: np.ndarray | None, w_out: np.ndarray,
                   b_out: np.ndarray | None, *, num_heads: int, scale: float, is_causal: bool,
                   threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Multi-head self-attention's forward pass over one sequence, projections included,
    in one pool call: ``(out (1, L, E_out), qkv (1, L, 3 H D), z (1, L, H D))``, where ``qkv = x w_in^T +
    b_in`` (the queries', keys' and values' heads side by side, as torch's fused
    ``in_proj_weight`` makes them), ``z`` the heads' attention outputs merged, and ``out = z
    w_out^T + b_out``.

    ``x`` (1, L, E_in) float32 (any strides with unit stride along its last axis), ``w_in``
    (3 H D, E_in), ``w_out`` (E_out, H D); ``threads`` from :func:`self_attention_threads`,
    which must have allowed the call. The same operations as the projections and the rows
    kernel apart, so the same numbers to float32 rounding: the out-projection's sum over
    the heads is split by head group.
    """
    L = x.shape[1]
    H = num_heads
    HD = w_in.shape[0] // 3
    D = HD // H
    K = _kernels()
    sgemm = sgemm_address()
    qkv = np.empty((1, L, 3 * HD), dtype=np.float32)
    z = np.empty((1, L, HD), dtype=np.float32)
    parts = np.empty((threads, 1, L, w_out.shape[0]), dtype=np.float32)  # each group's partial output
    per = H // threads
    if is_causal:
        rows = causal_block_rows(L)
    else:  # as _Layout cuts a head: all its rows while their scores fit a block
        rows = L if 4 * L * L <= _block_bytes() else _rows_within(_block_bytes(), 4 * L)
    chunks = [(a, min(a + rows, L)) for a in range(0, L, rows)]
    scale = np.float32(scale)
    copy = _copies_transposed(D, L)

    def run(g, scratch):
        h0, h1 = g * per, (g + 1) * per
        xn, qkv_n = x[0], qkv[0]
        for off in (0, HD, 2 * HD):  # this group's query, key and value columns
            a, c = off + h0 * D, off + h1 * D
            np.matmul(xn, w_in[a:c].T, out=qkv_n[:, a:c])
            if b_in is not None:
                qkv_n[:, a:c] += b_in[a:c]
        o = _buf(scratch, "o", (per, 1, L, D))
        for j in range(h0, h1):
            q = qkv_n[:, j * D:(j + 1) * D][None, None]
            k = qkv_n[None, :, HD + j * D:HD + (j + 1) * D]
            v = qkv_n[None, :, 2 * HD + j * D:2 * HD + (j + 1) * D]
            for a0, a1 in chunks:
                kend = a1 if is_causal else L
                s = _buf(scratch, "s", (1, a1 - a0, score_stride(kend)))
                _compiled_forward(K, sgemm, q, k, v, o[j - h0:j - h0 + 1], s, _buf(scratch, "inv", (a1 - a0,)),
                                  a0, a1, kend, is_causal, scale, copy, scratch)
        zg = z[0, :, h0 * D:h1 * D]
        np.copyto(zg.reshape(L, per, D), o.reshape(per, L, D).transpose(1, 0, 2))
        np.matmul(zg, w_out[:, h0 * D:h1 * D].T, out=parts[g, 0])
        if g == 0 and b_out is not None:  # on the pool, not after it
            parts[g, 0] += b_out

    run_units(range(threads), run, threads, scratch=_SCRATCH)
    out = parts[0]
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN propagate, as in the units
        for p in parts[1:]:
            out += p
    return out, qkv, z
