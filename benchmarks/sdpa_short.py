"""Short-sequence attention against torch, side by side: attnlab's public SDPA (forward,
forward+backward; causal and not; GQA) at the shapes real models use, and the
MultiheadAttention layer. Rounds alternate between the two; the table shows medians and
the ratio attnlab time / torch time. Not a test: ``python benchmarks/sdpa_short.py
[--threads N] [--only bert,gpt2,...]``.
"""

# ruff: noqa: B023  (the timed closures run inside the loop that binds their variables)
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _setup import machine_load, pin_threads  # noqa: E402

# (name, B, Hq, Hkv, L, E, causal)
SHAPES = [
    ("bert-e32", 32, 12, 12, 128, 32, False),
    ("bert-e64", 32, 12, 12, 128, 64, False),
    ("bert-e64-causal", 32, 12, 12, 128, 64, True),
    ("smollm2-gqa", 1, 9, 3, 512, 64, True),
    ("gpt2", 1, 12, 12, 1024, 64, True),
    *[(f"h8-L{L}", 1, 8, 8, L, 64, False) for L in (64, 128, 256, 512, 1024)],
    *[(f"h8-L{L}-causal", 1, 8, 8, L, 64, True) for L in (64, 128, 256, 512, 1024)],
    ("h8-L2048", 1, 8, 8, 2048, 64, False),
    ("h8-L2048-causal", 1, 8, 8, 2048, 64, True),
    ("h8-L4096", 1, 8, 8, 4096, 64, False),
]


CLOCK = time.perf_counter


def bench(fns: dict, budget: float, min_reps: int = 5, max_reps: int = 200) -> dict:
    for fn in fns.values():
        fn()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    one = time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, budget / max(one, 1e-6))))
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t = CLOCK()
            fn()
            times[k].append(CLOCK() - t)
    import statistics

    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--budget", type=float, default=1.0, help="seconds per shape and pass")
    p.add_argument("--passes", default="fwd,fwdbwd")
    p.add_argument("--mha", action="store_true", help="also MultiheadAttention(512, 8)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time in process CPU time (robust to a loaded machine; one thread only)")
    args = p.parse_args(argv)
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    threads = pin_threads(args.threads)

    import numpy as np
    import torch

    import attnlab
    from attnlab._threads import set_num_threads

    torch.set_num_threads(threads)
    set_num_threads(threads)
    sdpa_t = torch.nn.functional.scaled_dot_product_attention
    rng = np.random.default_rng(0)
    print(f"threads {threads}, load {machine_load()}, clock {'CPU' if args.cpu_time else 'wall'}")
    print(f"{'shape':18} {'pass':7} {'attnlab ms':>10} {'torch ms':>9} {'ratio':>6}")
    only = [s for s in args.only.split(",") if s]
    for name, B, Hq, Hkv, L, E, causal in SHAPES:
        if only and not any(name.startswith(o) for o in only):
            continue
        q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
        k = rng.standard_normal((B, Hkv, L, E), dtype=np.float32)
        v = rng.standard_normal((B, Hkv, L, E), dtype=np.float32)
        g = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
        gqa = Hq != Hkv
        tq, tk, tv, tg = (torch.from_numpy(a) for a in (q, k, v, g))
        tqr, tkr, tvr = (t.clone().requires_grad_(True) for t in (tq, tk, tv))
        for passes in args.passes.split(","):
            if passes == "fwd":
                def ours():
                    return attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

                def theirs():
                    with torch.no_grad():
                        return sdpa_t(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
            else:
                def ours():
                    attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                    return attnlab.scaled_dot_product_attention_backward(
                        g, q, k, v, is_causal=causal, enable_gqa=gqa)

                def theirs():
                    for t in (tqr, tkr, tvr):
                        t.grad = None
                    sdpa_t(tqr, tkr, tvr, is_causal=causal, enable_gqa=gqa).backward(tg)
            med = bench({"a": ours, "t": theirs}, args.budget)
            print(f"{name:18} {passes:7} {med['a'] * 1e3:10.3f} {med['t'] * 1e3:9.3f} "
                  f"{med['a'] / med['t']:6.2f}", flush=True)
    if args.mha:
        from attnlab.nn import MultiheadAttention

        for B, L in ((1, 512), (1, 1024), (1, 4096), (32, 128)):
            if only and not any(f"mha-B{B}-L{L}".startswith(o) for o in only):
                continue
            ours_m = MultiheadAttention(512, 8, batch_first=True, rng=np.random.default_rng(0))
            theirs_m = torch.nn.MultiheadAttention(512, 8, batch_first=True)
            with torch.no_grad():
                theirs_m.in_proj_weight.copy_(torch.from_numpy(ours_m.in_proj_weight.data))
                theirs_m.in_proj_bias.copy_(torch.from_numpy(ours_m.in_proj_bias.data))
                theirs_m.out_proj.weight.copy_(torch.from_numpy(ours_m.out_proj.weight.data))
                theirs_m.out_proj.bias.copy_(torch.from_numpy(ours_m.out_proj.bias.data))
            x = rng.standard_normal((B, L, 512), dtype=np.float32)
            gx = rng.standard_normal((B, L, 512), dtype=np.float32)
            tx, tgx = torch.from_numpy(x), torch.from_numpy(gx)
            txr = tx.clone().requires_grad_(True)
            for passes in args.passes.split(","):
                if passes == "fwd":
                    def ours():
                        return ours_m(x, x, x, need_weights=False)

                    def theirs():
                        with torch.no_grad():
                            return theirs_m(tx, tx, tx, need_weights=False)
                else:
                    def ours():
                        ours_m(x, x, x, need_weights=False)
                        return ours_m.backward(gx)

                    def theirs():
                        theirs_m.zero_grad()
                        txr.grad = None
                        theirs_m(txr, txr, txr, need_weights=False)[0].backward(tgx)
                med = bench({"a": ours, "t": theirs}, args.budget)
                print(f"{f'mha-B{B}-L{L}':18} {passes:7} {med['a'] * 1e3:10.3f} {med['t'] * 1e3:9.3f} "
                      f"{med['a'] / med['t']:6.2f}", flush=True)
    print(f"load after: {machine_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
