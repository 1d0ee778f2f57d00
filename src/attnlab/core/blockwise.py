"""Blockwise attention on the CPU: FlashAttention's tiling with an online softmax.

The naive path materialises the ``(L, S)`` score matrix per head. Here queries are cut
into tiles of ``block_q`` rows and keys into tiles of ``block_k`` rows; each query tile
walks over the key tiles keeping, per query row, a running shift ``m`` (the row maximum so
far), the running sum ``l`` of ``exp(score - m)`` and an accumulator ``acc`` of
``exp(score - m) @ value``. When a tile raises the shift, ``l`` and ``acc`` are rescaled by
``exp(m_old - m_new)``, which is at most 1 and so never overflows, however negative the
scores (ALiBi biases, ``-1e9`` or ``finfo.min`` masks). The output is ``acc / l`` and the
forward pass also returns the log-sum-exp ``lse = m + log(l)`` of every row. The backward
pass recomputes each tile's probabilities as ``exp(score + mask - m - log(l))`` from those
two numbers per row (kept apart, so that ``log(l)`` survives next to a shift of ``-1e30``),
so neither pass ever holds more than one ``(block_q, block_k)`` tile per thread: extra
memory is ``O(L·E)``.

Numerics, as ``torch``: a float mask is added to the scaled scores before anything is
subtracted from them, so a row masked everywhere with the same finite value gives what
float rounding gives there (a uniform average for ``-1e9`` or ``finfo.min``, as in torch);
a row with nothing to attend to (``-inf`` or ``False`` everywhere) outputs 0. Inputs
narrower than float32 (float16) are computed in float32; the output has the input dtype.

Two implementations of the element-wise pass between the two matmuls of a tile give the
same numbers (to float32 rounding): compiled kernels (:mod:`attnlab.core._fused`, numba,
the ``fast`` extra) for large float32 problems, and NumPy otherwise. The NumPy pass lets
the shift lag behind the maximum to save passes over the tile (see
:func:`_forward_tile_numpy`).

Parallelism: the work is split into independent units (a query tile of one head in the
forward pass; a set of key tiles of one head in the backward pass) that a pool of threads
pulls from a shared queue; while it runs BLAS is held to one thread (see
:mod:`attnlab._threads`, which also keeps pools from nesting and concurrent calls from
disturbing each other).

Tile sizes and thresholds come from the machine (:func:`tuning`), not from constants tuned
on one CPU.

Axis legend (as everywhere in attnlab): ``...`` batch dims, ``Hq``/``H`` query/key-value
heads, ``L`` query length, ``S`` key length, ``E`` query/key head dim, ``Ev`` value head
dim. Boolean masks are True where a query may attend to a key; float masks are added to
the scores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import threading

import numpy as np

from attnlab._cpu import CPUInfo
from attnlab._threads import get_num_threads, pool_threads, run_units, set_num_threads
from attnlab._tuning import TYPICAL, Thresholds, derive, thresholds
from attnlab._validation import as_float_array, fmt_shape, positive_int, shape_error
from attnlab.core.masks import ALIGNMENTS
from attnlab.core.spec import AttentionSpec, check_attention_args, check_grad_out, reduce_to

__all__ = [
    "Tuning",
    "blockwise_attention",
    "blockwise_attention_backward",
    "blockwise_attention_forward",
    "fused_available",
    "get_num_threads",
    "set_num_threads",
    "tuned",
    "tuning",
]


# --------------------------------------------------------------------------- tuning


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Tile sizes and thresholds of the blockwise kernel (see :func:`tuning`).

    Attributes:
        block_q: query rows per tile.
        block_k: key rows per tile of the backward pass.
        forward_block_k: key rows per tile of the forward pass (``0``: ``block_k``).
        min_scores_per_thread: calls with fewer scores (all heads together) run in one
            thread; starting threads would cost more than it saves. Scores of heads with
            ``E + Ev < 128`` count in proportion in the rows kernel (E = 16: a quarter).
        fused_min_scores: float32 calls with at least this many scores use the compiled
            kernels when numba is installed (smaller ones stay on NumPy, whose first call
            costs nothing to import or compile).
        diag_rows: query rows per piece of a tile that a causal mask cuts (the diagonal):
            each piece computes only the keys its last row sees, so about
            ``diag_rows / 2`` keys per row are wasted instead of ``block_k / 2``.
        fused: ``None`` (compiled kernels where installed and the call is large enough),
            ``False`` (NumPy only) or ``True`` (compiled kernels for every float32 call;
            an error without numba).
        source: how the sizes were chosen (one line).
    """

    block_q: int
    block_k: int
    min_scores_per_thread: int
    fused_min_scores: int
    forward_block_k: int = 0
    diag_rows: int = 128
    fused: bool | None = None
    source: str = ""


# Tile sizes from the per-core L2 cache: the score tile (block_q x block_k float32) is
# twice the L2 in the backward pass, four times in the forward pass, with 512 query rows.
# Measured in CPU time on one thread of a 2-core AVX2 EPYC (512 KiB L2), L = S = 4096,
# E = 64, compiled pass, % of SGEMM: forward 256 x 256 63%, 256 x 512 67%, 512 x 512 70%,
# 512 x 1024 72%; forward+backward 70%, 74%, 76%, 74%; the NumPy pass 51%, 52%, 55%
# (forward). Forward alone against torch, 2 threads, time of 512 x 1024 over 512 x 512
# (compiled pass): L = 2048 1.00, causal 0.95; L = 4096 0.95, causal 0.98 (NumPy pass
# 0.98-1.01). Larger tiles amortise the per-tile cost (two BLAS calls packing their
# operands, a Python loop step) until the tile no longer stays in the cache levels below
# L3 (the backward pass holds more per tile); the range keeps causal diagonals (about
# block_q / 2 wasted keys per row) and tiny caches in bounds.
_TILE_L2_SHARE = 2.0
_FORWARD_TILE_L2_SHARE = 4.0
_BLOCK_Q = 512
_BLOCK_K_RANGE = (128, 2048)
# Causal diagonal tiles are cut into pieces of this many query rows (each up to its own
# last visible key): the rows where a (rows, E) x (E, cols) matmul still runs at the rate
# of a full tile (measured: 128 rows 82 GF/s, 512 rows 86 GF/s on one core), while the
# wasted work on the diagonal drops from block_k / 2 to 64 keys per row.
_DIAG_ROWS = 128
# The fewest scores worth starting a pool for come from the pool's cost and one thread's
# rate measured on this machine (attnlab._tuning: min_scores_per_thread).
# numba's import costs ~0.3 s per process: compiled kernels from about 0.1 s of work.
# (A policy about the import, the same on every CPU.)
_FUSED_MIN_SCORES = 2**23


def derive_tuning(info: CPUInfo, limits: Thresholds | None = None) -> Tuning:
    """Tile sizes from the CPU's caches (the rule is documented above this function); the
    threads' threshold from ``limits`` (:func:`attnlab._tuning.thresholds`; default: the
    typical figures on ``info``).

    >>> from attnlab._cpu import CPUInfo
    >>> t = derive_tuning(CPUInfo("x", frozenset({"avx2"}), 32768, 512 * 1024, 2**25, True))
    >>> t.block_q, t.block_k, t.forward_block_k
    (512, 512, 1024)
    >>> derive_tuning(CPUInfo("x", frozenset(), 32768, 2 * 2**20, 2**25, True)).block_k
    2048
    """

    def keys(share: float) -> int:
        k = int(info.l2 * share) // 4 // _BLOCK_Q
        k = 1 << max(0, k.bit_length() - 1)  # a power of two, rounded down
        return min(max(k, _BLOCK_K_RANGE[0]), _BLOCK_K_RANGE[1])

    block_k, forward_block_k = keys(_TILE_L2_SHARE), keys(_FORWARD_TILE_L2_SHARE)
    limits = derive(TYPICAL, info) if limits is None else limits
    return Tuning(
        block_q=_BLOCK_Q,
        block_k=block_k,
        forward_block_k=forward_block_k,
        min_scores_per_thread=limits.min_scores_per_thread,
        fused_min_scores=_FUSED_MIN_SCORES,
        diag_rows=min(_DIAG_ROWS, _BLOCK_Q),
        fused=False if os.environ.get("ATTNLAB_NO_NUMBA", "").strip() not in ("", "0") else None,
        source=f"{_BLOCK_Q} x {forward_block_k} forward, {_BLOCK_Q} x {block_k} backward "
        f"float32 score tiles ~ {_FORWARD_TILE_L2_SHARE:g}x and {_TILE_L2_SHARE:g}x the "
        f"{info.l2 // 1024} KiB L2{'' if info.from_os else ' (assumed)'}",
    )


_override: Tuning | None = None
_override_lock = threading.Lock()


def tuning() -> Tuning:
    """The tile sizes and thresholds in force: derived from this machine's caches and
    measured figures (:func:`derive_tuning`, :func:`attnlab._tuning.thresholds`), unless
    changed with :func:`tuned`.

    >>> tuning().block_q
    512
    """
    return _override if _override is not None else _machine_tuning()


_MACHINE: list = [None]  # [(Thresholds, Tuning)]: derived again when the thresholds change


def _machine_tuning() -> Tuning:
    limits = thresholds()
    last = _MACHINE[0]
    if last is not None and last[0] is limits:
        return last[1]
    found = derive_tuning(limits.cpu, limits)
    _MACHINE[0] = (limits, found)
    return found


@contextlib.contextmanager
def tuned(**changes):
    """Change fields of :func:`tuning` inside a ``with`` block (process-wide), e.g. small
    thresholds so that small problems also run on several threads or on the compiled
    kernels, as the tests do.

    >>> with tuned(block_k=64, min_scores_per_thread=0):
    ...     tuning().block_k
    64
    """
    global _override
    with _override_lock:
        before = _override
        _override = dataclasses.replace(tuning(), **changes)
    try:
        yield _override
    finally:
        with _override_lock:
            _override = before


def fused_available() -> bool:
    """True when numba is installed (the ``fast`` extra), so the compiled kernels can run.

    >>> isinstance(fused_available(), bool)
    True
    """
    return _numba_found()


@functools.cache
def _numba_found() -> bool:
    """Looked up once per process (``find_spec`` costs ~10 us: short calls ask every time)."""
    return importlib.util.find_spec("numba") is not None


def fused_planned(dtype, n: int, *, min_n: int | None = None, use: bool | None = None) -> bool:
    """Whether float work of ``n`` elements (scores) runs on compiled kernels: float32,
    numba installed and not turned off (``ATTNLAB_NO_NUMBA=1``, ``tuned(fused=False)``),
    and ``n >= min_n`` (default: :attr:`Tuning.fused_min_scores`; below it numba's
    import, ~0.3 s once per process, would cost more than it saves). The choice depends
    on the size alone, so a call gives the same numbers whatever ran before it. ``use``
    (or ``tuned(fused=True)``) forces the answer; forcing without numba fails at the
    import.

    >>> fused_planned(np.float64, 2**30)
    False
    """
    t = tuning()
    if np.dtype(dtype) != np.float32 or t.fused is False or use is False:
        return False
    if use is True or t.fused is True:
        return True
    if not fused_available():
        return False
    return n >= (t.fused_min_scores if min_n is None else min_n)


def _fused_kernels(use: bool | None, dtype, n_scores: int):
    """The compiled-kernel module for this call, or None for the NumPy pass."""
    if not fused_planned(dtype, n_scores, use=use):
        return None
    from attnlab.core import _fused  # imports numba; raises ImportError without it

    return _fused


def _buffer(scratch: dict, name: str, shape: tuple, dtype) -> np.ndarray:
    """A reusable per-thread buffer of at least ``shape``, viewed as exactly ``shape``."""
    size = math.prod(shape)
    buf = scratch.get(name)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = np.empty(max(size, 1), dtype=dtype)
        scratch[name] = buf
    return buf[:size].reshape(shape)


# Rows of scores a multiple of 2 KiB apart (512 float32 columns) slow BLAS's products that
# write them: the rows of a tile of the result fall into the same few sets of the L1 cache.
# One thread, float32, 256 query rows, E = 64, GFLOP/s of q k^T for S keys, rows packed /
# padded by 64 bytes: S = 512 92 / 99, 1024 78 / 97, 1536 87 / 97, 2048 70 / 96; other S
# from 128 to 896 within 2 either way (the product with the values 91-100 both ways).
_ALIASED_ROW_BYTES = 2048
_ROW_PAD_BYTES = 64


def score_stride(cols: int, itemsize: int = 4) -> int:
    """The row stride (in elements) of a scores buffer of ``cols`` columns: ``cols``, or 64
    bytes more where rows that far apart would alias in the L1 cache.

    >>> score_stride(1000), score_stride(1024), score_stride(1024, 8)
    (1000, 1040, 1032)
    """
    if cols and cols * itemsize % _ALIASED_ROW_BYTES == 0:
        return cols + _ROW_PAD_BYTES // itemsize
    return cols


def scores_buffer(scratch: dict, name: str, lead: tuple, cols: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A reusable per-thread scores buffer ``(*lead, cols)`` with rows :func:`score_stride`
    apart: ``(padded (*lead, stride), view (*lead, cols))``. The compiled passes take the
    first (C-contiguous) with ``cols``; the matmuls write and read the second."""
    full = _buffer(scratch, name, (*lead, score_stride(cols, np.dtype(dtype).itemsize)), dtype)
    return full, full[..., :cols]


def compute_dtype(dtype) -> np.dtype:
    """The dtype attention is computed in: float32 for narrower floats (float16), else
    ``dtype`` itself.

    >>> compute_dtype(np.float16), compute_dtype(np.float64)
    (dtype('float32'), dtype('float64'))
    """
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


# --------------------------------------------------------------------------- the plan

_NO_MASK = np.zeros((1, 1), dtype=np.float32)
_MODE_NONE, _MODE_CAUSAL, _MODE_BOOL, _MODE_FLOAT = 0, 1, 2, 3  # as in _fused


class _Plan:
    """Per-call constants: per-head 2-D views, tile sizes, mask access (internal)."""

    def __init__(
        self,
        spec: AttentionSpec,
        causal_offset: int | None,
        block_q: int | None,
        block_k: int | None,
        num_threads: int | None,
        fused: bool | None = None,
    ):
        t = tuning()
        self.spec = spec
        self.dtype = compute_dtype(spec.query.dtype)
        self.L, self.S = spec.L, spec.S
        self.E, self.Ev = spec.query.shape[-1], spec.value.shape[-1]
        self.batch = spec.batch_shape
        self.heads = list(np.ndindex(self.batch))
        self.q = np.broadcast_to(spec.query, (*self.batch, self.L, self.E))
        self.k = np.broadcast_to(spec.full_key, (*self.batch, self.S, self.E))
        self.v = np.broadcast_to(spec.full_value, (*self.batch, self.S, self.Ev))
        self.mask = None
        if spec.attn_mask is not None:
            self.mask = np.broadcast_to(spec.attn_mask, (*self.batch, self.L, self.S))
        self.bool_mask = self.mask is not None and self.mask.dtype == np.bool_
        self.float_mask = self.mask is not None and not self.bool_mask
        # Causal: query i sees key j iff j <= i + offset (0: top-left, S - L: bottom-right).
        self.offset = causal_offset
        self.scale = self.dtype.type(spec.scale)
        self.bq = t.block_q if block_q is None else positive_int(block_q, "block_q")
        self.bk = t.block_k if block_k is None else positive_int(block_k, "block_k")
        self.bk_forward = (t.forward_block_k or t.block_k) if block_k is None else self.bk
        self.threads = pool_threads(num_threads)
        self.min_scores_per_thread = t.min_scores_per_thread
        self.diag_rows = positive_int(t.diag_rows, "diag_rows")
        self.kernels = _fused_kernels(fused, self.dtype, len(self.heads) * self.L * self.S)
        self._per_head: dict = {}
        self._lock = threading.Lock()

    @property
    def fused(self) -> bool:
        return self.kernels is not None

    def head_array(self, which: str, n: int) -> np.ndarray:
        """Head ``n``'s keys or values in the compute dtype, built once per head and pass
        and dropped after the head's last unit (:meth:`unit_done`).

        ``"k"``/``"v"``: ``(S, E)``/``(S, Ev)``, C-contiguous (a view when the input already
        is). ``"ka"``/``"va"``: with a column of ones appended, ``(S, E + 1)``: a query row
        ``[q, -c]`` times ``[k, 1]`` gives ``q·k - c``, so the NumPy pass's shift (and in the
        backward pass ``-lse`` and ``-D``) rides along in the matmul instead of costing a
        pass over the tile.
        """
        key = (which, n)
        with self._lock:
            arr = self._per_head.get(key)
        if arr is None:
            src = (self.k if which[0] == "k" else self.v)[self.heads[n]]
            if len(which) == 1:
                arr = np.ascontiguousarray(src, dtype=self.dtype)
            else:
                arr = np.empty((src.shape[0], src.shape[1] + 1), dtype=self.dtype)
                arr[:, :-1] = src
                arr[:, -1] = 1
            with self._lock:
                arr = self._per_head.setdefault(key, arr)
        return arr

    def expect_units(self, per_head: int) -> None:
        """Each head will run ``per_head`` units; its cached arrays go after the last."""
        self._left = [per_head] * len(self.heads)

    def unit_done(self, n: int) -> None:
        with self._lock:
            self._left[n] -= 1
            if self._left[n] == 0:
                for which in ("k", "v", "ka", "va"):
                    self._per_head.pop((which, n), None)

    def threads_for(self, n_units: int) -> int:
        """Threads worth starting: none beyond the units, one for small problems."""
        if len(self.heads) * self.L * self.S < self.min_scores_per_thread:
            return 1
        return max(1, min(self.threads, n_units))

    def key_end(self, i1: int) -> int:
        """One past the last key any query row ``< i1`` may see."""
        if self.offset is None:
            return self.S
        return max(0, min(self.S, i1 + self.offset))

    def query_start(self, j0: int) -> int:
        """The first query row that may see key ``j0``."""
        if self.offset is None:
            return 0
        return min(self.L, max(0, j0 - self.offset))

    def pieces(self, i0: int, i1: int, j0: int, j1: int):
        """The tile (rows ``i0:i1``, keys ``j0:j1``) as ``(a0, a1, end)`` pieces: rows
        ``a0:a1`` against keys ``j0:end``. One piece, unless a causal mask hides part of
        the tile: then pieces of :attr:`Tuning.diag_rows` rows, each up to the last key its
        rows see (pieces that see none are left out)."""
        if self.offset is None or j1 <= self.key_end(i0 + 1) or i1 - i0 <= self.diag_rows:
            return [(i0, i1, j1)]
        out = []
        for a0 in range(i0, i1, self.diag_rows):
            a1 = min(a0 + self.diag_rows, i1)
            end = min(j1, self.key_end(a1))
            if end > j0:
                out.append((a0, a1, end))
        return out

    def mask_tile(self, h: tuple, i0: int, i1: int, j0: int, j1: int):
        """How the compiled kernels mask the tile (rows ``i0:i1``, keys ``j0:j1``):
        ``(mode, mask tile, lim0)``, or None when every entry is masked out (skip it)."""
        if self.offset is not None:
            lim0 = i0 + self.offset - j0 + 1  # row r sees the tile's columns < lim0 + r
            if lim0 + (i1 - i0) - 1 <= 0:
                return None
            if lim0 >= j1 - j0:
                return _MODE_NONE, _NO_MASK, 0
            return _MODE_CAUSAL, _NO_MASK, lim0
        if self.mask is None:
            return _MODE_NONE, _NO_MASK, 0
        tile = self.mask[h][i0:i1, j0:j1]
        if self.bool_mask:
            return (_MODE_BOOL, tile, 0) if tile.any() else None
        return _MODE_FLOAT, tile.astype(self.dtype, copy=False), 0

    def apply_mask(self, s: np.ndarray, h: tuple, i0: int, j0: int) -> bool:
        """Mask the score tile ``s`` (rows ``i0..``, cols ``j0..``) in place (NumPy pass).

        Returns False when every entry of the tile is masked out (the caller skips it).
        """
        bq, bk = s.shape
        if self.offset is not None:
            # Fully visible tiles (the last key <= the first row's limit) need nothing.
            if j0 + bk - 1 > i0 + self.offset:
                cols = np.arange(j0, j0 + bk)
                rows = np.arange(i0, i0 + bq) + self.offset
                np.copyto(s, -np.inf, where=cols[None, :] > rows[:, None])
        elif self.mask is not None:
            tile = self.mask[h][i0 : i0 + bq, j0 : j0 + bk]
            if self.bool_mask:
                if not tile.any():
                    return False
                np.copyto(s, -np.inf, where=~tile)
            else:
                s += tile
        return True


def _plan(
    spec: AttentionSpec, causal_align: str | None, block_q, block_k, num_threads, fused=None
) -> _Plan:
    offset = None
    if spec.is_causal:
        align = "top-left" if causal_align is None else causal_align
        offset = 0 if align == "top-left" else spec.S - spec.L
    return _Plan(spec, offset, block_q, block_k, num_threads, fused)


# --------------------------------------------------------------------------- forward


def _forward(plan: _Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(out (*batch, L, Ev), stats (*batch, L, 2))`` in the plan's compute dtype.

    ``stats[..., 0]`` is each row's shift ``m`` (``-inf`` for a row that sees nothing),
    ``stats[..., 1]`` its ``log(l)``: ``lse`` is their sum.
    """
    L, bq, dt = plan.L, plan.bq, plan.dtype
    out = np.zeros((*plan.batch, L, plan.Ev), dtype=dt)
    stats = np.zeros((*plan.batch, L, 2), dtype=dt)
    stats[..., 0] = -np.inf
    if out.size == 0 or plan.S == 0:
        return out, stats
    out_h = out.reshape(len(plan.heads), L, plan.Ev)
    stats_h = stats.reshape(len(plan.heads), L, 2)
    # Head after head (so only a few heads' key/value copies live at a time), the
    # longest query tiles first (causal: the last ones), so the threads finish together.
    tiles = list(reversed(range(0, L, bq)))
    units = [(n, i0) for n in range(len(plan.heads)) for i0 in tiles]
    plan.expect_units(len(tiles))
    tile_fn = _forward_tile_fused if plan.fused else _forward_tile_numpy

    def run(unit, scratch):
        n, i0 = unit
        i1 = min(i0 + bq, L)
        tile_fn(plan, n, i0, i1, out_h[n, i0:i1], stats_h[n, i0:i1], scratch)
        plan.unit_done(n)

    run_units(units, run, plan.threads_for(len(units)))
    return out, stats


def _forward_tile_fused(plan: _Plan, n: int, i0: int, i1: int, out, stats, scratch) -> None:
    """One query tile of one head with the compiled kernels: exact running maximum."""
    K = plan.kernels
    h = plan.heads[n]
    dt, rows = plan.dtype, i1 - i0
    qs = _buffer(scratch, "qs", (rows, plan.E), dt)  # q * scale
    np.multiply(plan.q[h][i0:i1], plan.scale, out=qs, casting="unsafe")
    k, v = plan.head_array("k", n), plan.head_array("v", n)
    m = np.full(rows, -np.inf, dtype=dt)
    l = np.zeros(rows, dtype=dt)
    alpha = np.empty(rows, dtype=dt)
    bad = np.zeros(rows, dtype=np.int32)
    pv = _buffer(scratch, "pv", (rows, plan.Ev), dt)
    kend = plan.key_end(i1)
    for j0 in range(0, kend, plan.bk_forward):
        for a0, a1, j1 in plan.pieces(i0, i1, j0, min(j0 + plan.bk_forward, kend)):
            how = plan.mask_tile(h, a0, a1, j0, j1)
            if how is None:
                continue
            r = slice(a0 - i0, a1 - i0)
            full, s = scores_buffer(scratch, "s", (a1 - a0,), j1 - j0, dt)
            np.matmul(qs[r], k[j0:j1].T, out=s)
            K.forward_tile(full, how[0], how[1], how[2], m[r], l[r], alpha[r], bad[r], j1 - j0)
            np.matmul(s, v[j0:j1], out=pv[r])
            K.accumulate(out[r], pv[r], alpha[r])
    K.finish_rows(out, stats, m, l, bad)


def _finish_rows(acc, stats, c, l, nan_rows) -> None:
    """``acc / l`` and ``stats = [c, log(l)]``; rows that saw nothing give 0 and
    ``[-inf, 0]``, rows that met a NaN give NaN."""
    seen = l > 0
    np.divide(acc, l[:, None], out=acc, where=seen[:, None])
    acc[~seen] = 0
    stats[:, 0] = np.where(seen, c, -np.inf)
    np.log(l, out=stats[:, 1], where=seen)
    stats[~seen, 1] = 0
    nan_rows = nan_rows | np.isnan(l)
    if nan_rows.any():
        acc[nan_rows] = np.nan
        stats[nan_rows] = np.nan


# The NumPy pass lets exp(score - shift) grow up to this before moving the shift up.
_RESCALE_ABOVE = 2.0**20


def _forward_tile_numpy(plan: _Plan, n: int, i0: int, i1: int, out, stats, scratch) -> None:
    """One query tile of one head with NumPy: rows ``i0:i1`` of ``out`` and ``stats``.

    Each row keeps a shift ``c`` (the running maximum of FlashAttention, but allowed to lag
    behind it), ``l = sum exp(score - c)`` and ``acc = sum exp(score - c) v``. The shift
    is folded into the score matmul (:meth:`_Plan.head_array`). It starts at the score of
    key 0 when there is no mask (else at the first tile's row max). A tile
    takes the exact path (row max, subtract, exp) while some row has no shift yet or when
    the fast path overflowed; otherwise the fast path is just ``exp`` of the shifted scores:
    they may then exceed ``c`` (exp up to ``e^88`` stays finite in float32; beyond, the tile
    is redone exactly), and ``c`` moves up by ``log(l)`` once ``l`` passes
    ``_RESCALE_ABOVE``, which keeps ``c`` within ``log(S)`` above the true maximum, so
    nothing that matters underflows. The exact path moves a row's shift only up (or, for
    a row without one, to its first finite maximum), so its rescale factor is at most 1.

    With a float mask the shift is the exact running maximum of ``score + mask``, and both
    are added before the shift is subtracted (torch's order of rounding): a lagging shift
    far from the scores (a first tile masked with ``-1e4``) would round them to its grid.
    """
    h = plan.heads[n]
    dt, rows, E = plan.dtype, i1 - i0, plan.E
    fold = not plan.float_mask  # the shift rides along in the matmul
    qa = _buffer(scratch, "qa", (rows, E + 1), dt)  # [q * scale, -c] ([q * scale, 0]: float mask)
    np.multiply(plan.q[h][i0:i1], plan.scale, out=qa[:, :E], casting="unsafe")
    qa[:, E] = 0
    ka = plan.head_array("ka", n)  # (S, E + 1): [k, 1]
    va = plan.head_array("va", n)  # (S, Ev + 1): [v, 1], so p @ va also sums p's rows
    c = np.zeros(rows, dtype=dt)  # the shift, valid where `have`
    have = np.zeros(rows, dtype=bool)
    if plan.mask is None and plan.key_end(i1) > 0:
        # Without a mask every row that sees anything sees key 0: its score is a shift
        # that cannot be above the row's max, so the first tile may take the fast path.
        np.matmul(qa[:, :E], ka[0, :E], out=c)
        have[:] = True
        if plan.offset is not None:
            c[np.arange(i0, i1) + plan.offset < 0] = 0  # rows that see no key at all
        qa[:, E] = -c
    settled = bool(have.all()) and rows > 0  # every row has a shift: fast path allowed
    l = np.zeros(rows, dtype=dt)
    acc = out  # (rows, Ev), zero on entry; written in place

    def scores(s, j0, j1) -> bool:
        np.matmul(qa, ka[j0:j1].T, out=s)  # (rows, bk): scores - c (folded) or scores
        return plan.apply_mask(s, h, i0, j0)

    kend = plan.key_end(i1)
    for j0 in range(0, kend, plan.bk_forward):
        j1 = min(j0 + plan.bk_forward, kend)
        s = _buffer(scratch, "s", (rows, j1 - j0), dt)
        if not scores(s, j0, j1):
            continue
        if not fold:  # float mask: s = score + mask; exact running max
            mt = s.max(axis=1)
            c_new = np.where(have, np.maximum(c, mt), mt)
            c_new = np.where(c_new == -np.inf, 0, c_new).astype(dt, copy=False)
            s -= c_new[:, None]
            np.exp(s, out=s)
            alpha = np.exp(np.where(have, c - c_new, 0)).astype(dt, copy=False)  # <= 1
            pv = s @ va[j0:j1]
            l *= alpha
            l += pv[:, -1]
            acc *= alpha[:, None]
            acc += pv[:, :-1]
            c = c_new
            have |= mt > -np.inf
            continue
        if settled:
            np.exp(s, out=s)
            pv = s @ va[j0:j1]  # (rows, Ev + 1): [p @ v, row sums of p]
            if np.isfinite(pv).all():
                l += pv[:, -1]
                acc += pv[:, :-1]
                big = l > _RESCALE_ABOVE
                if big.any():
                    grow = np.where(big, l, 1).astype(dt, copy=False)
                    acc /= grow[:, None]
                    l /= grow
                    c += np.log(grow)
                    qa[:, E] = -c
                continue
            scores(s, j0, j1)  # overflow or NaN: redo the tile exactly
        # Exact path: move each row's shift up to the tile's maximum where that is higher;
        # a row without a shift yet takes the tile's maximum (its l and acc are still 0).
        mt = s.max(axis=1)
        up = np.where(have, np.maximum(mt, 0), mt)
        up = np.where(up == -np.inf, 0, up).astype(dt, copy=False)  # nothing seen: keep
        s -= up[:, None]
        np.exp(s, out=s)
        alpha = np.exp(-np.where(have, up, 0)).astype(dt, copy=False)  # <= 1
        pv = s @ va[j0:j1]
        l *= alpha
        l += pv[:, -1]
        acc *= alpha[:, None]
        acc += pv[:, :-1]
        c += up
        have |= mt > -np.inf
        qa[:, E] = -c
        settled = bool(have.all())
    _finish_rows(acc, stats, c, l, np.zeros(rows, dtype=bool))


# --------------------------------------------------------------------------- backward


def _backward(
    plan: _Plan, grad_out: np.ndarray, out: np.ndarray, stats: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dq, dk, dv)`` per head ``(*batch, L|S, E|Ev)`` in the compute dtype, from the
    forward pass's ``out`` and ``stats`` (see :func:`_forward`)."""
    L, S, dt = plan.L, plan.S, plan.dtype
    dq = np.zeros((*plan.batch, L, plan.E), dtype=dt)
    dk = np.zeros((*plan.batch, S, plan.E), dtype=dt)
    dv = np.zeros((*plan.batch, S, plan.Ev), dtype=dt)
    if L == 0 or S == 0 or dq.size == 0 and dv.size == 0:
        return dq, dk, dv
    go = np.broadcast_to(grad_out, (*plan.batch, L, plan.Ev))
    # D_i = sum_e dO_ie O_ie = sum_j P_ij dP_ij: the softmax backward's row term.
    D = np.einsum("...le,...le->...l", go.astype(dt, copy=False), out.astype(dt, copy=False))
    stats = stats.astype(dt, copy=False)
    fused = plan.fused and bool(np.isfinite(D).all()) and not np.isnan(stats).any()
    if not fused:
        # A fully masked row (shift -inf) has every score at -inf already: shift it by 0.
        stats = np.where(stats == -np.inf, 0, stats).astype(dt, copy=False)
    H = len(plan.heads)
    dq_h, dk_h, dv_h = (a.reshape(H, *a.shape[-2:]) for a in (dq, dk, dv))
    D_h = D.reshape(H, L)
    shift_h = np.ascontiguousarray(stats[..., 0]).reshape(H, L)
    logl_h = np.ascontiguousarray(stats[..., 1]).reshape(H, L)
    # Units own key tiles (so dk, dv need no locks). With fewer heads than threads, each
    # head's key tiles are dealt round-robin to several units with their own partial dq.
    n_key_tiles = -(-S // plan.bk)
    split = max(1, min(n_key_tiles, -(-2 * plan.threads // H))) if plan.threads > 1 else 1
    partial = [
        [np.zeros((L, plan.E), dtype=dt) for _ in range(split - 1)] for _ in range(H)
    ]
    units = [(n, c) for n in range(H) for c in range(split)]
    plan.expect_units(split)

    def run(unit, scratch):
        n, c = unit
        target = dq_h[n] if c == 0 else partial[n][c - 1]
        tiles = range(c * plan.bk, S, split * plan.bk)
        unit_fn = _backward_unit_fused if fused else _backward_unit_numpy
        unit_fn(plan, n, tiles, go[plan.heads[n]], shift_h[n], logl_h[n], D_h[n], target,
                dk_h[n], dv_h[n], scratch)
        plan.unit_done(n)

    run_units(units, run, plan.threads_for(len(units)))
    for n in range(H):
        for p in partial[n]:
            dq_h[n] += p
    dq *= plan.scale
    return dq, dk, dv


def _backward_unit_fused(plan: _Plan, n, tiles, go, shift, logl, D, dq, dk, dv, scratch) -> None:
    """Key tiles ``tiles`` of head ``n`` against every query tile that sees them, with the
    compiled kernels; ``dq`` (all ``L`` rows, without the factor ``scale``), ``dk`` and
    ``dv`` (all ``S`` rows) are accumulated in place."""
    K = plan.kernels
    h = plan.heads[n]
    dt = plan.dtype
    qs = np.empty((plan.L, plan.E), dtype=dt)  # q * scale
    np.multiply(plan.q[h], plan.scale, out=qs, casting="unsafe")
    g = np.ascontiguousarray(go, dtype=dt)  # (L, Ev)
    k, v = plan.head_array("k", n), plan.head_array("v", n)
    for j0 in tiles:
        for i0 in range(plan.query_start(j0) // plan.bq * plan.bq, plan.L, plan.bq):
            for a0, a1, j1 in plan.pieces(i0, min(i0 + plan.bq, plan.L), j0, min(j0 + plan.bk, plan.S)):
                how = plan.mask_tile(h, a0, a1, j0, j1)
                if how is None:
                    continue
                rows, cols = a1 - a0, j1 - j0
                kt, vt = k[j0:j1], v[j0:j1]
                p_full, p = scores_buffer(scratch, "s", (rows,), cols, dt)
                np.matmul(qs[a0:a1], kt.T, out=p)
                K.backward_probs(p_full, how[0], how[1], how[2], shift[a0:a1], logl[a0:a1], cols)
                dv[j0:j1] += np.matmul(p.T, g[a0:a1], out=_buffer(scratch, "dv", (cols, plan.Ev), dt))
                dp_full, dp = scores_buffer(scratch, "dp", (rows,), cols, dt)
                np.matmul(g[a0:a1], vt.T, out=dp)
                K.backward_dscores(dp_full, p_full, D[a0:a1], cols)
                dq[a0:a1] += np.matmul(dp, kt, out=_buffer(scratch, "dq", (rows, plan.E), dt))
                dk[j0:j1] += np.matmul(dp.T, qs[a0:a1], out=_buffer(scratch, "dk", (cols, plan.E), dt))


def _backward_unit_numpy(plan: _Plan, n, tiles, go, shift, logl, D, dq, dk, dv, scratch) -> None:
    """As :func:`_backward_unit_fused`, with NumPy: ``[q * scale, -lse]`` and ``[dO, -D]``
    times ``[k, 1]`` and ``[v, 1]`` give ``score - lse`` and ``dP - D`` straight out of
    the matmuls. With a float mask the shift and ``log(l)`` are subtracted one after the
    other once the mask is added instead (torch's order of rounding; a shift of ``-1e30``
    would swallow ``log(l)``)."""
    h = plan.heads[n]
    dt = plan.dtype
    fold = not plan.float_mask
    qa = np.empty((plan.L, plan.E + 1), dtype=dt)
    np.multiply(plan.q[h], plan.scale, out=qa[:, :-1], casting="unsafe")
    qa[:, -1] = -(shift + logl) if fold else 0
    ga = np.empty((plan.L, plan.Ev + 1), dtype=dt)
    ga[:, :-1] = go
    ga[:, -1] = -D
    ka_all, va_all = plan.head_array("ka", n), plan.head_array("va", n)
    for j0 in tiles:
        for t0 in range(plan.query_start(j0) // plan.bq * plan.bq, plan.L, plan.bq):
            for i0, i1, j1 in plan.pieces(t0, min(t0 + plan.bq, plan.L), j0, min(j0 + plan.bk, plan.S)):
                rows, cols = i1 - i0, j1 - j0
                ka, va = ka_all[j0:j1], va_all[j0:j1]  # (cols, E + 1): [k, 1]; (cols, Ev + 1)
                s = _buffer(scratch, "s", (rows, cols), dt)
                np.matmul(qa[i0:i1], ka.T, out=s)  # scale * q·k - lse (or scale * q·k)
                if not plan.apply_mask(s, h, i0, j0):
                    continue
                if not fold:
                    s -= shift[i0:i1, None]
                    s -= logl[i0:i1, None]
                p = np.exp(s, out=s)  # (rows, cols) probabilities
                dv[j0:j1] += p.T @ ga[i0:i1, :-1]
                dp = _buffer(scratch, "dp", (rows, cols), dt)
                np.matmul(ga[i0:i1], va.T, out=dp)  # dP - D
                dp *= p  # dScores / scale
                dq[i0:i1] += dp @ ka[:, :-1]
                dk[j0:j1] += dp.T @ qa[i0:i1, :-1]


# --------------------------------------------------------------------------- public API


def _check(
    query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align
) -> AttentionSpec:
    spec = check_attention_args(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
    if causal_align is not None:
        if causal_align not in ALIGNMENTS:
            raise ValueError(f"causal_align must be one of {ALIGNMENTS} or None, got {causal_align!r}")
        if not spec.is_causal:
            raise ValueError("causal_align is only meaningful with is_causal=True")
    return spec


def blockwise_attention_forward(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise attention that also returns each row's log-sum-exp, for the backward pass.

    Same arguments as :func:`blockwise_attention`.

    Returns:
        ``(output (..., Hq, L, Ev), lse (..., Hq, L))`` where
        ``lse = log(sum_j exp(scale * q·k_j + mask_j))`` over the keys a row may see
        (``-inf`` for a row that sees none). The output in the dtype of ``query``, ``lse``
        in the dtype it was computed in (float32 for float16 inputs, so that the backward
        pass recomputes the probabilities from it exactly).

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 6, 4))
    >>> out, lse = blockwise_attention_forward(q, k, v, block_q=4, block_k=4)
    >>> out.shape, lse.shape
    ((6, 4), (6,))
    """
    spec = _check(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align)
    plan = _plan(spec, causal_align, block_q, block_k, num_threads)
    out, stats = _forward(plan)
    return out.astype(spec.query.dtype, copy=False), stats[..., 0] + stats[..., 1]


def blockwise_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    causal_align: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> np.ndarray:
    """Scaled dot-product attention in ``O(L·E)`` extra memory (online softmax over tiles).

    The same result as :func:`~attnlab.scaled_dot_product_attention` (without dropout),
    computed tile by tile so that no ``(L, S)`` array ever exists. Tiles that a causal
    mask hides entirely are skipped, so causal attention costs about half.

    Args:
        query: ``(..., Hq, L, E)`` (or ``(L, E)``).
        key: ``(..., H, S, E)``; ``H == Hq`` unless ``enable_gqa``.
        value: ``(..., H, S, Ev)``.
        attn_mask: bool (True = takes part) or float (added to the scores), broadcastable
            to ``(..., Hq, L, S)``; applied tile by tile. Not together with ``is_causal``.
        is_causal: query ``i`` sees keys ``j <= i`` (top-left) or ``j <= i + S - L``
            (bottom-right, see ``causal_align``).
        scale: factor on the scores; ``None`` means ``1 / sqrt(E)``.
        enable_gqa: each of the ``H`` key/value heads serves ``Hq // H`` query heads.
        causal_align: ``"top-left"`` (PyTorch's ``is_causal``; the default) or
            ``"bottom-right"`` (KV-cache decoding); only with ``is_causal=True``.
        block_q: query rows per tile (default: :func:`tuning`, derived from the CPU).
        block_k: key rows per tile (default: :func:`tuning`). Any sizes work, also ones that divide
            neither ``L`` nor ``S``.
        num_threads: threads to use; ``None`` means :func:`get_num_threads`.

    Returns:
        ``(..., Hq, L, Ev)`` in the dtype of ``query``; a row with no key to attend to
        (fully masked, or ``S == 0``) is 0.

    Raises:
        TypeError, ValueError: as :func:`~attnlab.scaled_dot_product_attention`, plus a
            bad ``causal_align``, ``block_q``, ``block_k`` or ``num_threads``.

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 10, 8))  # each (H=2, L=S=10, E=8)
    >>> from attnlab.core.naive import forward
    >>> from attnlab.core.spec import check_attention_args
    >>> out = blockwise_attention(q, k, v, is_causal=True, block_q=3, block_k=4)
    >>> bool(np.allclose(out, forward(check_attention_args(q, k, v, is_causal=True))))
    True
    """
    return blockwise_attention_forward(
        query, key, value, attn_mask, is_causal, scale, enable_gqa,
        causal_align=causal_align, block_q=block_q, block_k=block_k, num_threads=num_threads,
    )[0]


def blockwise_attention_backward(
    grad_out: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    out: np.ndarray | None = None,
    lse: np.ndarray | None = None,
    causal_align: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients through :func:`blockwise_attention`, recomputed tile by tile from ``lse``.

    Args:
        grad_out: dLoss/doutput, ``(..., Hq, L, Ev)``.
        query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align: as given
            to the forward pass.
        out, lse: the forward pass's ``(output, lse)`` from
            :func:`blockwise_attention_forward`; ``None`` recomputes them (one more
            forward pass). Pass both or neither.
        block_q, block_k, num_threads: as for :func:`blockwise_attention`.

    Returns:
        ``(grad_query, grad_key, grad_value)`` with the shapes of ``query``, ``key`` and
        ``value`` (GQA and broadcast dims summed back).

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 5, 4))
    >>> dq, dk, dv = blockwise_attention_backward(np.ones((5, 4)), q, k, v, block_k=2)
    >>> from attnlab.core import naive, spec
    >>> ref = naive.backward(spec.check_attention_args(q, k, v), np.ones((5, 4)))
    >>> all(np.allclose(a, b) for a, b in zip((dq, dk, dv), ref))
    True
    """
    spec = _check(query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_align)
    grad_out = check_grad_out(spec, grad_out)
    out_shape = tuple(grad_out.shape)
    if (out is None) != (lse is None):
        raise ValueError("pass both out and lse (from blockwise_attention_forward) or neither")
    if out is not None:
        out = as_float_array(out, "out")
        lse = as_float_array(lse, "lse")
        if out.shape != out_shape:
            raise shape_error("out", out.shape, f"{fmt_shape(out_shape)} (the output's shape)")
        if lse.shape != out_shape[:-1]:
            raise shape_error("lse", lse.shape, f"{fmt_shape(out_shape[:-1])} (one per query row)")
    plan = _plan(spec, causal_align, block_q, block_k, num_threads)
    return backward_spec(plan, grad_out, out, lse)


def backward_spec(plan: _Plan, grad_out, out=None, lse=None):
    """Backward on a validated plan; sums GQA and broadcast dims back (internal).

    Without ``out`` and ``lse`` the forward pass is recomputed, which keeps each row's
    shift and ``log(l)`` apart. A given ``lse`` serves as the shift with ``log(l) = 0``;
    where it is so large that float rounding swallowed ``log(l)`` (a row masked everywhere
    with ``-1e30``: its ulp exceeds 1), the forward pass is recomputed instead.
    """
    spec = plan.spec
    stats = None
    if out is not None:
        lse = np.asarray(lse, dtype=plan.dtype)
        big = 0.5 / np.finfo(plan.dtype).eps  # from here, ulp(lse) >= 1
        if not (np.isfinite(lse) & (np.abs(lse) >= big)).any():
            stats = np.stack([lse, np.zeros_like(lse)], axis=-1)
    if stats is None:
        out, stats = _forward(plan)
    dq, dk, dv = _backward(plan, grad_out, out, stats)
    dtype = spec.query.dtype
    return (
        reduce_to(dq, spec.query.shape, 1).astype(dtype, copy=False),
        reduce_to(dk, spec.key_shape, spec.gqa_groups).astype(dtype, copy=False),
        reduce_to(dv, spec.value_shape, spec.gqa_groups).astype(dtype, copy=False),
    )


def forward_spec(
    spec: AttentionSpec, *, block_q=None, block_k=None, num_threads=None
) -> np.ndarray:
    """Forward on a validated spec (``is_causal`` top-left), for the dispatcher (internal)."""
    out, _ = _forward(_plan(spec, None, block_q, block_k, num_threads))
    return out.astype(spec.query.dtype, copy=False)


def backward_from_spec(
    spec: AttentionSpec, grad_out, *, block_q=None, block_k=None, num_threads=None
):
    """Backward on a validated spec, recomputing the forward pass (internal)."""
    return backward_spec(_plan(spec, None, block_q, block_k, num_threads), grad_out)
