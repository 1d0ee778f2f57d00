"""attnlab bench: attnlab against torch where models really run, in about a minute.

Three sections, each side by side in one run at the same thread count, the two sides
taking turns (the median of --repeats calls each, made after a settle pause; --full also
times calls made back to back):

  sdpa    attnlab's scaled_dot_product_attention against torch's, forward and
          forward+backward, at the shapes real models use: MiniLM-like and BERT-base-like
          batches (B=32, H=12, L=128, E=32 and 64), SmolLM2's prefill (9 query heads over 3
          key/value heads, L=512, causal), GPT-2 small's context (H=12, L=1024, causal), and
          B=1, H=8, E=64 at each of --sizes, causal and not. GFLOP/s and the share of a
          float32 matmul's rate (SGEMM) on this CPU.
  layers  MultiheadAttention forward and forward+backward against torch's; GPT-2 small's
          and SmolLM2's prefill against transformers (the same weights); MiniLM's encode
          against sentence-transformers; a TinyTransformer training step against its torch
          twin (steps/s); GPT-2 small's decoding with the key/value cache against
          transformers' generate (new tokens/s).
  decode  SmolLM2's decoding (attnlab float32 and quantized, transformers, llama.cpp where
          llama_cpp imports) against the memory-bandwidth limit.

The default is a quick run (about a minute on 2 cores, model loads included). --full adds
L up to 8192, longer prompts, SmolLM2 read from its GGUF file by transformers itself, the
naive NumPy path, the back-to-back timing, a matmul ceiling timed in turns with every row
and a 65536-token peak-memory run (many minutes). Ratios are attnlab's time over the other
side's: below 1, attnlab is faster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from attnlab._threads import available_cpus, have_threadpoolctl
from attnlab.cli._common import CLIError

SECTIONS = ("sdpa", "layers", "decode")


def _int_list(text: str, flag: str) -> list[int]:
    parts = [s.strip() for s in text.split(",")]
    if not any(parts):
        raise CLIError(f"{flag} needs at least one value, got {text!r}")
    try:
        values = [int(s) for s in parts if s]
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise CLIError(f"{flag} must be positive integers, got {text!r}")
    return values


def _sizes(text: str) -> list[int]:
    return _int_list(text, "--sizes")


def _names(text: str, flag: str, allowed) -> list[str]:
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    if not names:
        raise CLIError(f"{flag} needs at least one of {','.join(allowed)}, got {text!r}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise CLIError(f"{flag}: unknown {unknown[0]!r}; choose from {','.join(allowed)}")
    return [n for n in allowed if n in names]  # in the table's order, once each


def register(sub) -> None:
    from attnlab.benchmark import SHAPE_GROUPS

    p = sub.add_parser(
        "bench",
        help="benchmark attention, layers and decoding: attnlab vs torch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--full", action="store_true",
                   help="the long run: L up to 8192, longer prompts, back-to-back timing, the naive "
                        "path, a 65536-token memory run (many minutes)")
    p.add_argument("--sections", type=str, default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default {','.join(SECTIONS)})")
    p.add_argument("--shapes", type=str, default=",".join(SHAPE_GROUPS),
                   help=f"SDPA shapes to run, of {','.join(SHAPE_GROUPS)} (default all)")
    p.add_argument("--sizes", type=str, default=None,
                   help="comma-separated L = S of the B=1, H=8, E=64 sweep (default 64,256,1024; "
                        "--full: 64,128,256,512,1024,2048,4096,8192)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per cell, median kept (default 3, the SDPA cells of short calls 5 and the "
                        "MultiheadAttention rows 7, and 4 more for an SDPA cell or layer row within 10%% of even; "
                        "--full: 5, 5, 7 and 4 more; given, every cell and row takes exactly this many)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch, attnlab and BLAS alike (default: all usable CPUs)")
    p.add_argument("--passes", choices=["fwd", "fwd+bwd", "both"], default="both",
                   help="SDPA forward, forward+backward, or both (default)")
    p.add_argument("--naive-max", type=int, default=None,
                   help="largest L for the naive NumPy path, which needs O(H*L*S) memory; 0 leaves "
                        "it out (default 0; --full: 4096)")
    p.add_argument("--back-to-back", action="store_true",
                   help="also time calls made back to back (warm thread pools; on with --full)")
    p.add_argument("--memory-tokens", type=int, default=None,
                   help="tokens of the single-head peak-memory run (fresh process); 0 skips it "
                        "(default 0; --full: 65536)")
    p.add_argument("--layer-tokens", type=int, default=None,
                   help="tokens of the MultiheadAttention rows; 0 skips them (default 512; --full: 4096)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="prompt tokens of the GPT-2 and SmolLM2 prefill rows; 0 skips them "
                        "(default 64; --full: 1024 for GPT-2, 512 for SmolLM2)")
    p.add_argument("--minilm-texts", type=int, default=None,
                   help="sentences of the MiniLM encode row; 0 skips it (default 32; --full: 256)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="training steps per timed call of the training row; 0 skips it "
                        "(default 3; --full: 20)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens of the decode rows; 0 skips them (default 8; --full: 64)")
    p.add_argument("--explain-dispatch", metavar="SHAPE", default=None,
                   help="print which kernel, blocks and threads attnlab's attention runs for SHAPE on this "
                        "machine (forward and backward) and why, then exit: minilm, bert, smollm2, gpt2, or "
                        "B,H,L,E[,S] with H as Hq/Hkv for grouped-query heads, 'causal' and 'float64' after the "
                        "numbers (e.g. 1,9/3,512,64,causal); ATTNLAB_CPU=xeon-avx512 shows another machine's")
    p.add_argument("--system-allocator", action="store_true",
                   help="leave malloc as the system set it (returning freed memory at once) "
                        "instead of attnlab.keep_freed_memory(), which every other command "
                        "uses; either way both sides share it")
    p.set_defaults(run=run)


# ---- formatting --------------------------------------------------------------------------------
def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def faster(ratio: float | None, other: str = "torch") -> str:
    """Which side a time ratio (attnlab / other) favours, in words.

    >>> faster(0.8), faster(1.25), faster(1.0)
    ('attnlab by 1.25x', 'torch by 1.25x', 'even')
    >>> faster(2.0, "transformers")
    'transformers by 2.00x'
    """
    if ratio is None:
        return "-"
    if abs(ratio - 1) < 0.005:
        return "even"
    return f"attnlab by {1 / ratio:.2f}x" if ratio < 1 else f"{other} by {ratio:.2f}x"


def _table(head: list[str], lines: list[list[str]], *, notes: bool = False) -> str:
    """Columns right-aligned, except the first (names) and, with ``notes``, the last."""
    widths = [max(len(h), *(len(c[j]) for c in lines)) for j, h in enumerate(head)]
    left = {0, len(head) - 1} if notes else {0}

    def line(cells):
        return "  ".join(c.ljust(w) if j in left else c.rjust(w)
                         for j, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(head), *(line(c) for c in lines)])


def _pct(part, whole) -> str:
    if part is None or not whole:
        return _fmt(None, ".0f")  # no share without both rates (e.g. torch is not installed)
    return _fmt(100 * part / whole, ".0f") + "%"


def _ms(seconds) -> str:
    return _fmt(None if seconds is None else 1e3 * seconds, ".1f")


def format_rows(rows, *, sgemm: float | None = None) -> str:
    """The SDPA table (plain text). ``sgemm``: the ceiling (GFLOP/s) of rows that timed no
    matmul in their turns."""
    naive = any(r.seconds.get("naive") is not None for r in rows)
    b2b = any(r.back_to_back for r in rows)
    turns = any(r.seconds.get("sgemm") is not None for r in rows)
    head = ["shape", "B,H,L,E", "causal", "pass", "kernel"]
    head += (["naive ms"] if naive else []) + ["attnlab ms", "torch ms", "attnlab GF/s", "torch GF/s",
                                               "attnlab/torch"]
    head += (["back-to-back"] if b2b else []) + ["faster"]
    head += (["SGEMM GF/s"] if turns else []) + ["attnlab %SGEMM", "torch %SGEMM"]
    lines = []
    for r in rows:
        s = r.shape
        heads = f"{s.Hq}/{s.H}" if s.gqa else str(s.Hq)
        cells = [s.name, f"{s.B},{heads},{s.L},{s.E}", "yes" if s.causal else "no", r.passes, r.kernel or "-"]
        cells += ([_ms(r.seconds.get("naive"))] if naive else [])
        cells += [_ms(r.seconds.get("attnlab")), _ms(r.seconds.get("torch"))]
        cells += [_fmt(r.gflops(i), ".0f") for i in ("attnlab", "torch")]
        ratio = r.ratio("attnlab")
        cells.append(_fmt(ratio, ".2f"))
        if b2b:
            cells.append(_fmt(r.ratio("attnlab", back_to_back=True), ".2f"))
        cells.append(faster(ratio))
        ceiling = r.gflops("sgemm") if turns else sgemm
        if turns:
            cells.append(_fmt(ceiling, ".0f"))
        cells += [_pct(r.gflops("attnlab"), ceiling), _pct(r.gflops("torch"), ceiling)]
        lines.append(cells)
    return _table(head, lines)


def _amount(row, impl: str) -> str:
    if row.seconds.get(impl) is None:
        return "-"
    if row.per_call:
        return f"{row.rate(impl):.1f} {row.unit}"
    return f"{1e3 * row.seconds[impl]:.1f} ms"


def format_layer_rows(rows) -> str:
    """The layer table (plain text)."""
    b2b = any(r.back_to_back for r in rows)
    head = ["layer", "attnlab", "other", "other is", "attnlab/other"]
    head += (["back-to-back"] if b2b else []) + ["faster", "note"]
    lines = []
    for r in rows:
        ratio = r.ratio()
        cells = [r.name, _amount(r, "attnlab"), _amount(r, "torch"), r.torch_name, _fmt(ratio, ".2f")]
        if b2b:
            cells.append(_fmt(r.ratio(back_to_back=True), ".2f"))
        cells += [faster(ratio, r.torch_name), r.note]
        lines.append(cells)
    return _table(head, lines, notes=True)


def format_decode_rows(rows) -> str:
    """The decode table (plain text)."""
    head = ["decoder", "tok/s", "weights MiB", "limit tok/s", "share of limit", "note"]
    lines = [[r.name, _fmt(r.tokens_per_s, ".1f"),
              _fmt(None if r.weight_bytes is None else r.weight_bytes / 2**20, ".0f"),
              _fmt(r.limit, ".1f"), _pct(r.share, 1.0), r.note] for r in rows]
    return _table(head, lines, notes=True)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def process_seconds() -> float | None:
    """How long this process has run (Linux: from /proc), imports included; None if unknown."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            up = float(fh.read().split()[0])
        return up - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ---- the command -------------------------------------------------------------------------------
class _Settings:
    """The options with the quick or --full defaults filled in, checked."""

    def __init__(self, args) -> None:
        from attnlab import benchmark as bm

        full = args.full
        self.full = full
        self.sections = _names(args.sections, "--sections", SECTIONS)
        self.shapes = _names(args.shapes, "--shapes", bm.SHAPE_GROUPS)
        self.sizes = _sizes(args.sizes) if args.sizes is not None else list(bm.FULL_SIZES if full else bm.QUICK_SIZES)

        def pick(value, quick, long):
            return (long if full else quick) if value is None else value

        self.repeats = pick(args.repeats, 3, 5)
        if self.repeats < 1:
            raise CLIError(f"--repeats must be >= 1, got {self.repeats}")
        # The MultiheadAttention rows' short calls take more turns, unless --repeats says.
        self.mha_repeats = max(self.repeats, bm.MHA_REPEATS) if args.repeats is None else self.repeats
        # So do the SDPA cells of short calls.
        self.short_repeats = max(self.repeats, bm.SHORT_REPEATS) if args.repeats is None else self.repeats
        self.short_scores = bm.SHORT_CALL_SCORES
        # And an SDPA cell or layer row that lands near even takes more, unless --repeats says.
        self.close_repeats = bm.CLOSE_REPEATS if args.repeats is None else 0
        self.close_band = bm.CLOSE_BAND
        cpus = available_cpus()
        if args.threads is not None and args.threads < 1:
            raise CLIError(f"--threads must be >= 1, got {args.threads}")
        if args.threads is not None and args.threads > cpus:
            raise CLIError(f"--threads {args.threads} is more than the {cpus} usable CPU(s); timings with more "
                           "threads than cores measure the operating system's scheduler")
        self.threads = args.threads or cpus
        self.passes = ("fwd", "fwd+bwd") if args.passes == "both" else (args.passes,)
        self.naive_max = pick(args.naive_max, 0, 4096)
        self.memory_tokens = pick(args.memory_tokens, 0, 65536)
        self.layer_tokens = pick(args.layer_tokens, 512, 4096)
        self.gpt2_tokens = pick(args.prefill_tokens, 64, 1024)
        self.smollm2_tokens = pick(args.prefill_tokens, 64, 512)
        self.minilm_texts = pick(args.minilm_texts, 32, 256)
        self.train_steps = pick(args.train_steps, 3, 20)
        self.new_tokens = pick(args.new_tokens, 8, 64)
        for flag, value in (("--naive-max", self.naive_max), ("--memory-tokens", self.memory_tokens),
                            ("--layer-tokens", self.layer_tokens), ("--prefill-tokens", self.gpt2_tokens),
                            ("--minilm-texts", self.minilm_texts), ("--train-steps", self.train_steps),
                            ("--new-tokens", self.new_tokens)):
            if value < 0:
                raise CLIError(f"{flag} must be >= 0, got {value}")
        if self.gpt2_tokens > 1024 and args.prefill_tokens is not None:
            raise CLIError(f"--prefill-tokens must be at most 1024 (GPT-2's context), got {self.gpt2_tokens}")
        if self.new_tokens > 1024 - bm.DECODE_PROMPT_TOKENS:
            raise CLIError(f"--new-tokens must be at most {1024 - bm.DECODE_PROMPT_TOKENS} (GPT-2's context "
                           f"after a {bm.DECODE_PROMPT_TOKENS}-token prompt), got {self.new_tokens}")
        self.back_to_back = args.back_to_back or full
        self.settle = bm.SETTLE_SECONDS if full else bm.QUICK_SETTLE_SECONDS
        self.settle_after_torch = None if full else bm.QUICK_SETTLE_AFTER_TORCH
        self._check_memory(bm)

    def _check_memory(self, bm) -> None:
        """Refuse sizes whose arrays cannot fit in the memory available now."""
        free = bm.available_memory()
        if free is None:
            return
        gib = 2**30
        if "sdpa" in self.sections:
            for shape in bm.sdpa_shapes(self.sizes, groups=self.shapes):
                for p in self.passes:
                    need = shape.nbytes(p, naive=shape.L <= self.naive_max)
                    if need > free:
                        flag = "--sizes" if shape.name == "H=8 sweep" else "--shapes"
                        what = f"L={shape.L}" if flag == "--sizes" else shape.name
                        raise CLIError(f"{flag}: {what} needs about {need / gib:.1f} GiB for {p}, but only "
                                       f"{free / gib:.1f} GiB of memory is available")
            if self.memory_tokens:
                need = 6 * self.memory_tokens * bm.HEAD_DIM * 4 + 2**28  # q, k, v, out, tiles, Python
                if need > free:
                    raise CLIError(f"--memory-tokens {self.memory_tokens} needs about {need / gib:.1f} GiB, but "
                                   f"only {free / gib:.1f} GiB of memory is available")
        if "layers" in self.sections and self.layer_tokens:
            need = 40 * self.layer_tokens * 512 * 4  # activations and gradients of both sides
            if need > free:
                raise CLIError(f"--layer-tokens {self.layer_tokens} needs about {need / gib:.1f} GiB, but only "
                               f"{free / gib:.1f} GiB of memory is available")


def _header(s: _Settings, torch) -> None:
    import platform

    import numpy as np

    from attnlab._cpu import cpu_info

    mode = "full run" if s.full else "quick run (--full for the long one)"
    print(f"attnlab bench: {mode}; float32; {s.threads} thread(s) for attnlab, torch and BLAS alike; "
          f"sections {','.join(s.sections)}")
    timing = f"median of {s.repeats} runs taken in turns, a {s.settle:.2f} s settle pause before each"
    if s.settle_after_torch is not None:
        timing += f" ({s.settle_after_torch:.2f} s after a torch call, whose threads stop spinning sooner)"
    if s.mha_repeats != s.repeats and "layers" in s.sections and s.layer_tokens:
        timing += f"; the MultiheadAttention rows' short calls: median of {s.mha_repeats}"
    if s.short_repeats != s.repeats and "sdpa" in s.sections:
        timing += f"; SDPA cells of at most 2^{s.short_scores.bit_length() - 1} scores: median of {s.short_repeats}"
    if s.close_repeats and ("sdpa" in s.sections or "layers" in s.sections):
        timing += (f"; an SDPA cell or layer row within {s.close_band:.0%} of even after its runs: "
                   f"{s.close_repeats} more (all counted)")
    if s.back_to_back:
        timing += "; also back to back"
    print(f"timing: {timing}")
    print(f"CPU: {cpu_info().describe()}; load average {_load()}")
    from attnlab._memory import freed_memory_kept

    print("memory: " + ("freed memory kept for reuse (attnlab.keep_freed_memory), in the one process both "
                        "sides share" if freed_memory_kept() else
                        "the system allocator's settings (freed memory returned at once), for both sides"))
    try:
        from attnlab.core import blockwise as bw

        tuning = bw.tuning()
        if bw.fused_available() and tuning.fused is not False:
            from importlib.metadata import version

            passes_note = (f"compiled (numba {version('numba')}) from {tuning.fused_min_scores} "
                           "scores per call, NumPy below")
        else:
            passes_note = "NumPy (numba not installed or turned off)"
        print(f"attnlab tiles: {tuning.source}; element-wise pass: {passes_note}")
    except (ImportError, AttributeError):
        pass
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"torch {torch.__version__ if torch else 'not installed'}, "
          f"threadpoolctl {'yes' if have_threadpoolctl() else 'no (BLAS threads only)'}")
    if torch is None:
        print("torch is not installed: attnlab's rows run alone (times, GFLOP/s, share of SGEMM, decoding against "
              "the memory-bandwidth limit); the torch, transformers and sentence-transformers sides and GPT-2's rows "
              "(its weights are drawn by transformers) are skipped. pip install 'attnlab[test]' for the comparisons.")
    sys.stdout.flush()


def _sdpa_section(s: _Settings, bm, progress) -> None:
    n = 2048 if s.full else 1024
    sgemm = bm.sgemm_gflops(s.threads, n=n, repeats=10 if s.full else 3)
    how = ("each row's ceiling is the median of 2048^3 matmuls taken in turns with it" if s.full
           else "the ceiling of every row")
    print()
    print(f"== SDPA: attnlab.scaled_dot_product_attention vs torch's, {s.threads} thread(s) ==")
    print(f"SGEMM ({n}^3 float32 matmul): best of {10 if s.full else 3} {sgemm:.0f} GFLOP/s; {how}")
    sys.stdout.flush()
    shapes = bm.sdpa_shapes(s.sizes, groups=s.shapes)
    rows = bm.run_sdpa(shapes, repeats=s.repeats, threads=s.threads, passes=s.passes, naive_max=s.naive_max,
                       settle=s.settle, settle_after_torch=s.settle_after_torch, back_to_back=s.back_to_back,
                       sgemm_turns=s.full, short_repeats=s.short_repeats, close_repeats=s.close_repeats,
                       progress=progress)
    print(format_rows(rows, sgemm=sgemm))
    print("attnlab/torch: attnlab's time over torch's, below 1 when attnlab is faster"
          + (" (settled, then back to back)" if s.back_to_back else "")
          + "; kernel: the one attnlab's dispatcher picked. GFLOP/s count useful work: 4*B*H*L*S*E per "
            "forward (halved when causal), x3.5 for forward+backward; fwd+bwd is attnlab's forward then "
            "its backward (which recomputes the weights).")
    notes = []
    for r in rows:
        for impl, note in r.notes.items():
            text = f"{impl} {r.shape.name} L={r.shape.L} {r.passes}: {note}" if impl == "naive" else f"{impl}: {note}"
            if text not in notes:
                notes.append(text)
    if notes:
        print("notes: " + "; ".join(notes))
    _print_extra_turns(s, [f"{r.shape.name} L={r.shape.L}{' causal' if r.shape.causal else ''} {r.passes}"
                           for r in rows if r.extra_turns])
    by_key = {(r.shape.name, r.shape.L, r.shape.causal, r.passes): r for r in rows}
    halves = []
    for (name, L, causal, p), r in by_key.items():
        full = by_key.get((name, L, False, p))
        if causal and full and full.seconds.get("attnlab") and r.seconds.get("attnlab"):
            halves.append(f"L={L} {p}: {r.seconds['attnlab'] / full.seconds['attnlab']:.2f}")
    if halves:
        print("attnlab causal / non-causal time (sweep): " + ", ".join(halves))
    if s.memory_tokens:
        progress(f"peak memory of a {s.memory_tokens}-token forward pass")
        try:
            m = bm.peak_memory(s.memory_tokens, threads=s.threads)
        except RuntimeError as exc:
            raise CLIError(str(exc)) from None
        mib = 2**20
        print(f"peak memory, {s.memory_tokens} tokens, one head, E={bm.HEAD_DIM}, fp32 forward "
              f"(fresh process): peak RSS {m['peak_bytes'] / mib:.0f} MiB "
              f"(before the call {m['before_bytes'] / mib:.0f} MiB, q/k/v "
              f"{m['inputs_bytes'] / mib:.0f} MiB); the naive score matrix alone would be "
              f"{m['score_matrix_bytes'] / mib:.0f} MiB; took {m['seconds']:.1f} s")
    sys.stdout.flush()


def _layers_section(s: _Settings, bm, models, progress) -> None:
    rows = bm.layer_rows(threads=s.threads, repeats=s.repeats, mha_tokens=s.layer_tokens, mha_repeats=s.mha_repeats,
                         gpt2_tokens=s.gpt2_tokens, smollm2_tokens=s.smollm2_tokens, minilm_texts=s.minilm_texts,
                         train_steps=s.train_steps, decode_tokens=s.new_tokens, settle=s.settle,
                         settle_after_torch=s.settle_after_torch, back_to_back=s.back_to_back, models=models,
                         close_repeats=s.close_repeats, progress=progress)
    print()
    print(f"== layers and models: attnlab vs torch / transformers, {s.threads} thread(s) ==")
    if rows:
        print(format_layer_rows(rows))
        note = ("attnlab/other: attnlab's time over the other side's (for rates: the other's rate over "
                "attnlab's), below 1 when attnlab is faster.")
        if any(r.name.startswith("GPT-2") and r.seconds.get("torch") is not None for r in rows):
            note += " GPT-2 small: random weights drawn by transformers, the same in attnlab (interop.from_torch)."
        if any(r.name.startswith("SmolLM2") and r.seconds.get("torch") is not None for r in rows):
            note += f" SmolLM2 in transformers: {models.smollm2_source()}."
        print(note)
        _print_extra_turns(s, [r.name for r in rows if r.extra_turns])
    else:
        print("(every row skipped by its option)")
    sys.stdout.flush()


def _print_extra_turns(s: _Settings, names: list[str]) -> None:
    """The footer naming the cells or rows that landed near even and took more turns."""
    if names:
        print(f"near even after their runs, so {s.close_repeats} more a side (medians over all): " + "; ".join(names))


def _decode_section(s: _Settings, bm, models, progress) -> None:
    print()
    print(f"== decode: SmolLM2-135M against the memory-bandwidth limit, {s.threads} thread(s) ==")
    if not s.new_tokens:
        print("(skipped: --new-tokens 0)")
        return
    result = bm.decode_rows(threads=s.threads, repeats=s.repeats, new_tokens=s.new_tokens, settle=s.settle,
                            settle_after_torch=s.settle_after_torch, models=models, progress=progress)
    if result is None:
        print(f"decode section: needs {bm.DECODE_MODULE}")
        return
    bandwidth, rows = result
    if bandwidth is not None:
        print(f"read bandwidth ({s.threads} thread(s)): {bandwidth / 1e9:.1f} GB/s; the limit is the tokens/s "
              "that reading every weight once per new token allows")
    print(format_decode_rows(rows))
    source = f"transformers' SmolLM2: {models.smollm2_source()}. " if any(
        r.name.startswith("transformers") and r.tokens_per_s is not None for r in rows) else ""
    print(f"{source}Every rate is after a {bm.DECODE_PROMPT_TOKENS}-token prompt, its time taken out.")
    sys.stdout.flush()


def run(args) -> int:
    started = time.perf_counter()
    from attnlab import benchmark as bm

    if args.explain_dispatch is not None:
        try:
            print("\n".join(bm.explain_dispatch(args.explain_dispatch)))
        except ValueError as exc:
            raise CLIError(f"--explain-dispatch: {exc}") from None
        return 0

    s = _Settings(args)  # every check before anything runs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch = bm._torch()
    load_before = _load()
    _header(s, torch)

    def progress(msg: str) -> None:
        print(f"  ... [{time.perf_counter() - started:5.1f} s, cpu {time.process_time():5.1f} s] {msg}",
              file=sys.stderr, flush=True)

    models = bm.Models(gguf_in_transformers=s.full)
    if "sdpa" in s.sections:
        _sdpa_section(s, bm, progress)
    if "layers" in s.sections:
        _layers_section(s, bm, models, progress)
    if "decode" in s.sections:
        _decode_section(s, bm, models, progress)
    print()
    if models.load_seconds:
        print("model loads: " + ", ".join(f"{k} {v:.1f} s" for k, v in models.load_seconds.items()))
    total = process_seconds()
    took = f"{total:.1f} s from process start (imports and model loads included)" if total is not None else \
        f"{time.perf_counter() - started:.1f} s"
    print(f"bench took {took}, {time.process_time():.1f} s of CPU time; load average before {load_before}, "
          f"after {_load()}")
    return 0
