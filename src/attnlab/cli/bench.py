"""attnlab bench: time naive NumPy attention, attnlab's blockwise kernel and torch SDPA.

fp32, B=1, H=8, E=64, L = S, causal and not, forward and forward+backward, side by side
in one run with the same thread count. Each cell is timed twice, the implementations
taking turns: the median of --repeats calls each made after a settle pause (idle thread
pools), and the median of calls made back to back (warm thread pools). Printed: the CPU
(model, avx2/avx512f, caches) and attnlab's tile sizes, the times, GFLOP/s, attnlab's time
over torch's in both timings (below 1: attnlab is faster; the "faster" column names the
winner of the settled timing and by how much) and the share of the SGEMM rate (a 2048^3
float32 matmul that takes the same turns). Then two layer-level rows:
MultiheadAttention(need_weights=False) forward against torch.nn.MultiheadAttention, and
MiniLM's encode against sentence-transformers (skipped with a note when the model package
is missing), and the peak memory (RSS, in a fresh process) of a single-head forward pass
over --memory-tokens tokens.

The default is a quick run (L up to 2048); --full runs L up to 8192 and a 65536-token
memory run (many minutes on 2 cores).
"""

from __future__ import annotations

from attnlab._threads import have_threadpoolctl
from attnlab.cli._common import CLIError

IMPLS = ("naive", "attnlab", "torch")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise CLIError(f"--sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise CLIError(f"--sizes must be positive integers, got {text!r}")
    return sizes


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark attention: naive NumPy vs attnlab vs torch",
        description=__doc__,
    )
    p.add_argument("--full", action="store_true",
                   help="sizes 512..8192 and a 65536-token memory run")
    p.add_argument("--sizes", type=str, default=None,
                   help="comma-separated L = S values (default 512,1024,2048; --full: "
                        "512,1024,2048,4096,8192)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per cell, median kept "
                   "(default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch, attnlab and BLAS alike (default: all usable CPUs)")
    p.add_argument("--naive-max", type=int, default=4096,
                   help="largest L for the naive path, which needs O(H*L*S) memory "
                        "(default 4096)")
    p.add_argument("--passes", choices=["fwd", "fwd+bwd", "both"], default="both",
                   help="forward, forward+backward, or both (default)")
    p.add_argument("--memory-tokens", type=int, default=None,
                   help="tokens of the single-head peak-memory run; 0 skips it "
                        "(default 16384; --full: 65536)")
    p.add_argument("--layer-tokens", type=int, default=4096,
                   help="tokens of the MultiheadAttention row; 0 skips it (default 4096)")
    p.add_argument("--minilm-texts", type=int, default=256,
                   help="sentences of the MiniLM encode row; 0 skips it (default 256)")
    p.set_defaults(run=run)


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def faster(ratio: float | None) -> str:
    """Which side a time ratio (attnlab / torch) favours, in words.

    >>> faster(0.8), faster(1.25), faster(1.0)
    ('attnlab by 1.25x', 'torch by 1.25x', 'even')
    """
    if ratio is None:
        return "-"
    if abs(ratio - 1) < 0.005:
        return "even"
    return f"attnlab by {1 / ratio:.2f}x" if ratio < 1 else f"torch by {ratio:.2f}x"


def _table(head: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(h), *(len(c[j]) for c in lines)) for j, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines]
    return "\n".join(out)


def _pct(part, whole) -> str:
    if part is None or not whole:
        return _fmt(None, ".0f")  # no share without both rates (e.g. torch is not installed)
    return _fmt(100 * part / whole, ".0f") + "%"


def format_rows(rows) -> str:
    """The side-by-side table (plain text)."""
    head = ["L=S", "causal", "pass"]
    head += [f"{i} ms" for i in IMPLS] + ["attnlab GF/s", "torch GF/s"]
    head += ["attnlab/torch", "back-to-back", "faster", "SGEMM GF/s", "attnlab %SGEMM",
             "torch %SGEMM"]
    lines = []
    for r in rows:
        cells = [str(r.L), "yes" if r.causal else "no", r.passes]
        cells += [_fmt(None if r.seconds.get(i) is None else 1e3 * r.seconds[i], ".1f")
                  for i in IMPLS]
        cells += [_fmt(r.gflops(i), ".0f") for i in ("attnlab", "torch")]
        ratio = r.ratio("attnlab")
        cells += [_fmt(ratio, ".2f"), _fmt(r.ratio("attnlab", back_to_back=True), ".2f"),
                  faster(ratio)]
        ceiling = r.gflops("sgemm")
        cells += [_fmt(ceiling, ".0f"), _pct(r.gflops("attnlab"), ceiling),
                  _pct(r.gflops("torch"), ceiling)]
        lines.append(cells)
    return _table(head, lines)


def format_layer_rows(rows) -> str:
    """The layer-level table (plain text)."""
    head = ["layer", "attnlab ms", "torch ms", "attnlab/torch", "back-to-back", "faster", "note"]
    lines = []
    for r in rows:
        ms = [_fmt(None if r.seconds.get(i) is None else 1e3 * r.seconds[i], ".1f")
              for i in ("attnlab", "torch")]
        ratio = r.ratio()
        lines.append([r.name, *ms, _fmt(ratio, ".2f"), _fmt(r.ratio(back_to_back=True), ".2f"),
                      faster(ratio), r.note])
    return _table(head, lines)


def _load() -> str:
    import os

    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run(args) -> int:
    import platform
    import sys

    import numpy as np

    from attnlab import benchmark as bm
    from attnlab._cpu import cpu_info
    from attnlab.core import blockwise as bw

    sizes = _sizes(args.sizes) if args.sizes else list(bm.FULL_SIZES if args.full else bm.QUICK_SIZES)
    if args.repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")
    mem_tokens = args.memory_tokens
    if mem_tokens is None:
        mem_tokens = 65536 if args.full else 16384
    if mem_tokens < 0:
        raise CLIError(f"--memory-tokens must be >= 0, got {mem_tokens}")
    for flag, value in (("--layer-tokens", args.layer_tokens), ("--minilm-texts", args.minilm_texts)):
        if value < 0:
            raise CLIError(f"{flag} must be >= 0, got {value}")
    passes = ("fwd", "fwd+bwd") if args.passes == "both" else (args.passes,)
    threads = args.threads or bw.get_num_threads()

    torch = bm._torch()
    print(f"attnlab bench: fp32, B={bm.BATCH}, H={bm.HEADS}, E={bm.HEAD_DIM}, L=S in {sizes}, "
          f"{threads} thread(s), median of {args.repeats} runs taken in turns")
    print(f"CPU: {cpu_info().describe()}; load average {_load()}")
    tuning = bw.tuning()
    if bw.fused_available() and tuning.fused is not False:
        from importlib.metadata import version

        passes_note = (f"compiled (numba {version('numba')}) from {tuning.fused_min_scores} "
                       "scores per call, NumPy below")
    else:
        passes_note = "NumPy (numba not installed or turned off)"
    print(f"attnlab tiles: {tuning.source}; element-wise pass: {passes_note}")
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"torch {torch.__version__ if torch else 'not installed'}, "
          f"threadpoolctl {'yes' if have_threadpoolctl() else 'no (BLAS threads only)'}")
    sgemm = bm.sgemm_gflops(threads)
    print(f"SGEMM (2048^3 float32 matmul, {threads} thread(s)): best of 10 now {sgemm:.0f} "
          f"GFLOP/s; each row's ceiling is the median of SGEMM runs taken in turns with it")
    sys.stdout.flush()

    def progress(msg: str) -> None:
        print(f"  ... {msg}", file=sys.stderr, flush=True)

    rows = bm.run_benchmark(
        sizes, repeats=args.repeats, threads=threads, naive_max=args.naive_max,
        passes=passes, progress=progress,
    )
    print()
    print(format_rows(rows))
    print("attnlab/torch: attnlab's time over torch's, below 1 when attnlab is faster; first "
          "with a settle pause before every call, then back to back.")
    notes = []
    for r in rows:
        for impl, note in r.notes.items():
            text = f"{impl} L={r.L} {r.passes}: {note}" if impl == "naive" else f"{impl}: {note}"
            if text not in notes:
                notes.append(text)
    if notes:
        print("notes: " + "; ".join(notes))
    print("GFLOP/s count useful work: 4*B*H*L*S*E per forward (halved when causal), "
          "x3.5 for forward+backward.")
    by_key = {(r.L, r.causal, r.passes): r for r in rows}
    halves = []
    for (L, causal, p), r in by_key.items():
        full = by_key.get((L, False, p))
        if causal and full and full.seconds.get("attnlab") and r.seconds.get("attnlab"):
            halves.append(f"L={L} {p}: {r.seconds['attnlab'] / full.seconds['attnlab']:.2f}")
    if halves:
        print("attnlab causal / non-causal time: " + ", ".join(halves))

    if args.layer_tokens or args.minilm_texts:
        layers = bm.layer_rows(threads=threads, repeats=args.repeats, mha_tokens=args.layer_tokens,
                               minilm_texts=args.minilm_texts, progress=progress)
        print()
        print(format_layer_rows(layers))

    if mem_tokens:
        print()
        progress(f"peak memory of a {mem_tokens}-token forward pass")
        try:
            m = bm.peak_memory(mem_tokens, threads=threads)
        except RuntimeError as exc:
            raise CLIError(str(exc)) from None
        mib = 2**20
        print(f"peak memory, {mem_tokens} tokens, one head, E={bm.HEAD_DIM}, fp32 forward "
              f"(fresh process): peak RSS {m['peak_bytes'] / mib:.0f} MiB "
              f"(before the call {m['before_bytes'] / mib:.0f} MiB, q/k/v "
              f"{m['inputs_bytes'] / mib:.0f} MiB); the naive score matrix alone would be "
              f"{m['score_matrix_bytes'] / mib:.0f} MiB; took {m['seconds']:.1f} s")
    return 0
