"""Timing attention: naive NumPy, attnlab's dispatcher and ``torch`` SDPA, side by side.

The library part of ``attnlab bench`` and ``benchmarks/attention.py``: it measures and
returns numbers; the command line formats and prints them. Nothing here is a test.

Every cell is timed twice, the implementations taking turns in the same run: once after a
settle pause before each call (:data:`SETTLE_SECONDS`: a thread pool's idle threads have
stopped spinning, so each call starts from an idle machine) and once back to back (blocks
of consecutive calls of one implementation, then the next: warm thread pools, as in a
training loop). Two layer-level rows compare whole layers the same way:
``MultiheadAttention(need_weights=False)`` against ``torch.nn.MultiheadAttention`` and
MiniLM's ``encode`` against sentence-transformers, at the same thread count.

FLOPs follow the FlashAttention papers' convention: a forward pass is the two matmuls,
``4·B·H·L·S·E`` (``S·E`` replaced by the average ``S·E / 2`` under a causal mask, the work
that is not masked away), a backward pass ``2.5x`` the forward (five matmuls instead of
two), so forward+backward is ``3.5x``. Recomputation is not counted as useful work.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from attnlab._threads import have_threadpoolctl
from attnlab._validation import positive_int

# The configuration of the table: fp32, B=1, H=8, E=64, L = S.
BATCH, HEADS, HEAD_DIM = 1, 8, 64
FULL_SIZES = (512, 1024, 2048, 4096, 8192)
QUICK_SIZES = (512, 1024, 2048)


@dataclass
class Row:
    """One line of the table: a size, causal or not, a pass, and a time per implementation."""

    L: int
    causal: bool
    passes: str  # "fwd" or "fwd+bwd"
    flops: float
    seconds: dict[str, float | None] = field(default_factory=dict)  # None: skipped
    notes: dict[str, str] = field(default_factory=dict)
    back_to_back: dict[str, float] = field(default_factory=dict)  # the same, without pauses

    def gflops(self, impl: str) -> float | None:
        s = self.seconds.get(impl)
        if s is None:
            return None
        return (SGEMM_FLOPS if impl == "sgemm" else self.flops) / s / 1e9

    def ratio(self, impl: str, to: str = "torch", *, back_to_back: bool = False) -> float | None:
        """``impl``'s time over ``to``'s (< 1: ``impl`` is faster)."""
        times = self.back_to_back if back_to_back else self.seconds
        a, b = times.get(impl), times.get(to)
        return None if a is None or b is None else a / b


def attention_flops(L: int, S: int, *, causal: bool, passes: str) -> float:
    """Useful FLOPs of one call at the benchmark's ``B, H, E`` (see the module docstring)."""
    fwd = 4.0 * BATCH * HEADS * L * S * HEAD_DIM
    if causal:
        fwd /= 2
    return fwd * (3.5 if passes == "fwd+bwd" else 1.0)


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
        return nullcontext()
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


def naive_bytes(L: int, S: int, passes: str) -> int:
    """Rough peak memory of the naive path: a few ``(B, H, L, S)`` float32 arrays."""
    return (3 if passes == "fwd" else 6) * BATCH * HEADS * L * S * 4


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def run_benchmark(
    sizes=QUICK_SIZES,
    *,
    repeats: int = 5,
    threads: int | None = None,
    naive_max: int = 4096,
    passes=("fwd", "fwd+bwd"),
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time the three implementations for every size, causal flag and pass.

    Args:
        sizes: the ``L = S`` to run.
        repeats: timed runs per cell (the median is kept), after one warm-up.
        threads: threads for all three (torch, attnlab, BLAS); ``None``: all usable CPUs.
        naive_max: largest ``L`` for the naive path (it needs ``O(H·L·S)`` memory).
        passes: ``"fwd"`` and/or ``"fwd+bwd"``.
        progress: called with a short message before each cell (e.g. ``print``).

    Returns:
        One :class:`Row` per (size, causal, pass); ``seconds[impl]`` is None when skipped,
        with the reason in ``notes[impl]``; ``seconds["sgemm"]`` times a
        ``SGEMM_N``-cubed float32 matmul in the same turns (the row's ceiling).
    """
    from attnlab.core import blockwise as bw

    threads = bw.get_num_threads() if threads is None else positive_int(threads, "threads")
    repeats = positive_int(repeats, "repeats")
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(threads)
    say = progress or (lambda _msg: None)
    rng = np.random.default_rng(0)
    sgemm = _sgemm_fn()
    rows = []
    for L in sizes:
        shape = (BATCH, HEADS, L, HEAD_DIM)
        q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
        for causal in (False, True):
            for p in passes:
                row = Row(L, causal, p, attention_flops(L, L, causal=causal, passes=p))
                # The SGEMM ceiling takes its turns too: the same load as the attention.
                fns = {"sgemm": sgemm, "attnlab": _attnlab_fn(q, k, v, g, causal, p, threads)}
                if L > naive_max:
                    row.notes["naive"] = (
                        f"skipped (L > naive_max; it would need ~"
                        f"{naive_bytes(L, L, p) / 2**30:.1f} GiB of scores)"
                    )
                else:
                    fns["naive"] = _naive_fn(q, k, v, g, causal, p)
                if torch is None:
                    row.notes["torch"] = "not installed"
                else:
                    fns["torch"] = _torch_fn(torch, q, k, v, g, causal, p)
                say(f"L={L} causal={causal} {p}")
                with blas_threads(threads):
                    row.seconds.update(interleaved_medians(fns, repeats))
                    row.back_to_back.update(back_to_back_medians(fns, repeats))
                for impl in ("naive", "attnlab", "torch"):
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


@dataclass
class LayerRow:
    """A layer-level comparison: attnlab's layer against torch's, at the same threads."""

    name: str
    seconds: dict[str, float] = field(default_factory=dict)  # settled: "attnlab", "torch"
    back_to_back: dict[str, float] = field(default_factory=dict)
    note: str = ""  # why it was skipped, or what was compared

    def ratio(self, *, back_to_back: bool = False) -> float | None:
        """attnlab's time over torch's (< 1: attnlab is faster)."""
        times = self.back_to_back if back_to_back else self.seconds
        a, b = times.get("attnlab"), times.get("torch")
        return None if a is None or b is None else a / b


def layer_rows(
    *, threads: int, repeats: int, mha_tokens: int = 4096, minilm_texts: int = 256,
    progress: Callable[[str], None] | None = None,
) -> list[LayerRow]:
    """Whole layers, attnlab against torch at ``threads`` threads (0 tokens/texts: skipped).

    - ``MultiheadAttention(512, 8, batch_first=True)`` forward with ``need_weights=False``
      on ``(1, mha_tokens, 512)`` float32 inputs, against ``torch.nn.MultiheadAttention``
      with the same weights;
    - MiniLM (all-MiniLM-L6-v2) ``encode`` of ``minilm_texts`` short sentences at batch
      size 32 against ``SentenceTransformer.encode`` (skipped, with a note, when the model
      package or sentence-transformers is missing).
    """
    say = progress or (lambda _msg: None)
    torch = _torch()
    rows = []
    if mha_tokens:
        row = LayerRow(f"MultiheadAttention(512, 8) fwd, need_weights=False, L={mha_tokens}")
        if torch is None:
            row.note = "torch not installed"
        else:
            say(row.name)
            fns = _mha_fns(torch, mha_tokens, threads)
            with blas_threads(threads):
                row.seconds = interleaved_medians(fns, repeats)
                row.back_to_back = back_to_back_medians(fns, repeats)
        rows.append(row)
    if minilm_texts:
        row = LayerRow(f"MiniLM encode, {minilm_texts} sentences, batch 32")
        fns = _minilm_fns(torch, minilm_texts, threads, row)
        if fns is not None:
            say(row.name)
            with blas_threads(threads):
                row.seconds = interleaved_medians(fns, repeats)
                row.back_to_back = back_to_back_medians(fns, repeats)
        rows.append(row)
    return rows


def _mha_fns(torch, tokens: int, threads: int) -> dict[str, Callable[[], object]]:
    import attnlab

    torch.set_num_threads(threads)
    attnlab.set_num_threads(threads)
    E, H = 512, 8
    ours = attnlab.MultiheadAttention(E, H, batch_first=True, rng=np.random.default_rng(0))
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    with torch.no_grad():  # the same weights (the time does not depend on them)
        theirs.in_proj_weight.copy_(torch.from_numpy(np.ascontiguousarray(ours.in_proj_weight.data)))
        theirs.in_proj_bias.copy_(torch.from_numpy(np.ascontiguousarray(ours.in_proj_bias.data)))
        theirs.out_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(ours.out_proj.weight.data)))
        theirs.out_proj.bias.copy_(torch.from_numpy(np.ascontiguousarray(ours.out_proj.bias.data)))
    x = np.random.default_rng(1).standard_normal((1, tokens, E), dtype=np.float32)
    tx = torch.from_numpy(x)

    def run_torch():
        with torch.no_grad():
            return theirs(tx, tx, tx, need_weights=False)

    return {"attnlab": lambda: ours(x, x, x, need_weights=False), "torch": run_torch}


def benchmark_sentences(n: int) -> list[str]:
    """``n`` short, varied English sentences (8 to 20 word pieces), the same every run."""
    rng = np.random.default_rng(0)
    words = ("the river bank engineer quietly measured an old bridge before morning rain "
             "while our committee announced results of its long experiment near a quiet "
             "street and everyone celebrated the new song").split()
    return [" ".join(rng.choice(words, size=int(rng.integers(6, 17)))).capitalize() + "."
            for _ in range(n)]


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


def _minilm_fns(torch, n: int, threads: int, row: LayerRow):
    import importlib.util

    import attnlab
    from attnlab.models.bert import load_minilm, minilm_available, minilm_path

    missing = [m for m in ("sentence_transformers",) if importlib.util.find_spec(m) is None]
    if torch is None or missing or not minilm_available():
        row.note = ("skipped: needs the MiniLM model package (pretrained extra) and "
                    "sentence-transformers")
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    attnlab.set_num_threads(threads)
    ours = load_minilm()
    theirs = _quietly(SentenceTransformer, str(minilm_path()), device="cpu")
    texts = benchmark_sentences(n)
    diff = np.abs(ours.encode(texts) - theirs.encode(texts, show_progress_bar=False)).max()
    row.note = f"max |embedding difference| {diff:.1e}"

    def run_torch():
        with torch.inference_mode():
            return theirs.encode(texts, batch_size=32, show_progress_bar=False)

    return {"attnlab": lambda: ours.encode(texts, batch_size=32), "torch": run_torch}


# Pause before each timed call. After a parallel call, OpenBLAS's and OpenMP's worker
# threads busy-wait for a while (OpenBLAS: about 0.1 s); whatever runs next in that window
# loses a core to them (measured: the blockwise kernel 131 ms right after a 2-thread SGEMM,
# 103 ms after a pause). Every implementation starts from an idle machine instead.
SETTLE_SECONDS = 0.25


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int, *, settle: float = SETTLE_SECONDS
) -> dict[str, float]:
    """Median wall time of each function, timed in turns (a, b, c, a, b, c, ...).

    Taking turns spreads a busy machine's noise over all of them alike, so the ratios
    stay fair even when the absolute times wobble. One untimed warm-up call each first,
    and a ``settle`` pause before every timed call (see :data:`SETTLE_SECONDS`).
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(settle)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _attnlab_fn(q, k, v, g, causal: bool, passes: str, threads: int) -> Callable[[], object]:
    from attnlab.core import blockwise as bw

    def fwd():
        return bw.blockwise_attention_forward(q, k, v, is_causal=causal, num_threads=threads)

    def both():
        out, lse = fwd()
        return bw.blockwise_attention_backward(
            g, q, k, v, is_causal=causal, out=out, lse=lse, num_threads=threads
        )

    return fwd if passes == "fwd" else both


def _naive_fn(q, k, v, g, causal: bool, passes: str) -> Callable[[], object]:
    from attnlab.core import naive
    from attnlab.core.spec import check_attention_args

    spec = check_attention_args(q, k, v, is_causal=causal)

    def fwd():
        return naive.forward(spec)

    def both():
        naive.forward(spec)
        return naive.backward(spec, g)

    return fwd if passes == "fwd" else both


def _torch_fn(torch, q, k, v, g, causal: bool, passes: str) -> Callable[[], object]:
    tq, tk, tv, tg = (torch.from_numpy(a) for a in (q, k, v, g))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if passes == "fwd":

        def fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, is_causal=causal)

        return fwd
    tq, tk, tv = (t.clone().requires_grad_(True) for t in (tq, tk, tv))

    def both():
        for t in (tq, tk, tv):
            t.grad = None
        sdpa(tq, tk, tv, is_causal=causal).backward(tg)

    return both


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
