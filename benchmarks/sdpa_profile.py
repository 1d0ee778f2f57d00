"""Where one short attention call spends its time: per-stage timings (process CPU time,
one thread, medians) of the naive NumPy path (the one short float32 calls took before the
rows kernel) and of the rows kernel, plus a cProfile of the public call. Not a test:
``python benchmarks/sdpa_profile.py [--shape bert|h8-64|h8-512|smollm2|gpt2]``.
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _setup import machine_load, pin_threads  # noqa: E402

SHAPES = {  # B, Hq, Hkv, L, E, causal
    "bert": (32, 12, 12, 128, 64, False),
    "h8-64": (1, 8, 8, 64, 64, False),
    "h8-512": (1, 8, 8, 512, 64, False),
    "smollm2": (1, 9, 3, 512, 64, True),
    "gpt2": (1, 12, 12, 1024, 64, True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="bert", choices=sorted(SHAPES))
    p.add_argument("--profile", action="store_true", help="also print a cProfile of 50 public calls")
    args = p.parse_args(argv)
    pin_threads(1)

    import numpy as np

    import attnlab
    from attnlab._threads import set_num_threads
    from attnlab.core import _fused, naive, rows
    from attnlab.core.masks import causal_mask
    from attnlab.core.softmax import softmax_
    from attnlab.core.spec import check_attention_args

    set_num_threads(1)
    B, Hq, Hkv, L, E, causal = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
    k, v = rng.standard_normal((2, B, Hkv, L, E), dtype=np.float32)
    gqa = Hq != Hkv

    def t(fn, n=None) -> float:
        fn()
        reps = n or max(5, min(200, int(0.3 / max(1e-6, _once(fn)))))
        ts = []
        for _ in range(reps):
            t0 = time.process_time()
            fn()
            ts.append(time.process_time() - t0)
        return float(np.median(ts)) * 1e3

    def _once(fn) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    spec = check_attention_args(q, k, v, is_causal=causal, enable_gqa=gqa)
    qs = q * np.float32(spec.scale)
    kt = spec.key.swapaxes(-1, -2)
    s = np.matmul(qs, kt)
    if causal:
        s[..., ~causal_mask(L, L)] = -np.inf
    p_ = softmax_(s.copy())
    print(f"shape {args.shape}: B={B} Hq={Hq} Hkv={Hkv} L=S={L} E={E} causal={causal}; load {machine_load()}")
    print("naive NumPy path (ms):")
    check = t(lambda: check_attention_args(q, k, v, is_causal=causal, enable_gqa=gqa))
    print(f"  validation + GQA repeat  {check:8.3f}")
    print(f"  q * scale                {t(lambda: q * np.float32(spec.scale)):8.3f}")
    print(f"  q k^T (all keys)         {t(lambda: np.matmul(qs, kt)):8.3f}")
    if causal:
        print(f"  causal mask              {t(lambda: naive.scores(spec)) - t(lambda: np.matmul(qs, kt)):8.3f}")
    print(f"  softmax (NumPy, blocks)  {t(lambda: softmax_(s.copy())) - t(lambda: s.copy()):8.3f}")
    print(f"  p v                      {t(lambda: np.matmul(p_, spec.value)):8.3f}")
    print(f"  naive.forward total      {t(lambda: naive.forward(spec)):8.3f}")
    lay = rows._Layout(spec)
    print("rows kernel (ms):")
    print(f"  layout (views)           {t(lambda: rows._Layout(spec)):8.3f}")
    sc = np.matmul(lay.q.reshape(lay.NH, -1, E), lay.k.swapaxes(-1, -2))  # unscaled, as the kernel's
    mode, mask, lim0 = lay.mode, rows._NO_MASK, 1
    inv = np.empty(sc.size // L, np.float32)
    row_pass = t(lambda: _fused.softmax_rows(sc.copy().reshape(-1, L, L), mode, mask, lim0, inv, lay.scale, L))
    print(f"  compiled row pass (full) {row_pass - t(lambda: sc.copy()):8.3f}")
    print(f"  rows.forward total       {t(lambda: rows.forward(spec)):8.3f}")
    total = t(lambda: attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))
    print(f"public call total          {total:8.3f}")
    if args.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
