"""all-MiniLM-L6-v2 on the CPU: attnlab's NumPy encoder vs sentence-transformers (torch).

Prints, side by side from one run, sentences per second for short and long texts at batch
size 32 with the same number of threads for both (NumPy's BLAS via the ``*_NUM_THREADS``
variables set before NumPy is imported and ``attnlab.set_num_threads``, torch via
``torch.set_num_threads``), the ratio
attnlab / sentence-transformers (> 1 means attnlab is faster), and the model load times.
Each thread count runs in its own process (BLAS reads its thread count once).

    python benchmarks/minilm.py [--threads 1,2] [--repeat R]

Needs the ``pretrained`` and ``test`` extras. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2",
                   help="comma-separated thread counts, each used by both libraries (default 1,2)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per case; the best is kept")
    p.add_argument("--short", type=int, default=512, help="number of short texts (default 512)")
    p.add_argument("--long", type=int, default=64, help="number of long texts (default 64)")
    return p.parse_args(argv)


def make_texts(n_short: int, n_long: int):
    import numpy as np

    rng = np.random.default_rng(0)
    subjects = ["The cat", "A young engineer", "My grandmother", "The committee", "Our team",
                "The river", "A small bank", "The orchestra", "Everyone", "The old bridge"]
    verbs = ["watched", "described", "repaired", "ignored", "celebrated", "measured",
             "painted", "questioned", "followed", "announced"]
    objects = ["the sunset over the hills", "a complicated proposal", "the broken window",
               "the results of the experiment", "an unexpected visitor", "the money in the vault",
               "the quiet street", "a new song", "the muddy bank of the river", "the deadline"]
    tails = ["", " yesterday", " with great care", " before lunch", " for the third time",
             " despite the rain", " in the morning"]

    def sentence():
        return (f"{subjects[rng.integers(10)]} {verbs[rng.integers(10)]} "
                f"{objects[rng.integers(10)]}{tails[rng.integers(7)]}.")

    short = [sentence() for _ in range(n_short)]
    # long texts: 150 to 250 word pieces, under the 256-token limit (no truncation)
    long = [" ".join(sentence() for _ in range(int(rng.integers(16, 24)))) for _ in range(n_long)]
    return short, long


def best_rate(fn, texts, repeat: int) -> float:
    fn(texts[:32])  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(texts)
        best = min(best, time.perf_counter() - t0)
    return len(texts) / best


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = [int(t) for t in str(args.threads).split(",") if t.strip()]
    if args.child:
        return measure(args, counts[0])
    import json
    import subprocess

    results = []
    for n in counts:
        cmd = [sys.executable, __file__, "--child", "--threads", str(n), "--repeat",
               str(args.repeat), "--short", str(args.short), "--long", str(args.long)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"all-MiniLM-L6-v2 on the CPU, batch 32, best of {args.repeat}; "
          f"numpy {results[0]['numpy']}, torch {results[0]['torch']}")
    w = max(len(r["label"]) for res in results for r in res["rows"])
    head = f"{'threads':>7}  {'texts':<{w}}  {'attnlab/s':>10}  {'s-t/s':>10}  {'ratio':>6}  {'max |diff|':>10}"
    print(head)
    for res in results:
        for r in res["rows"]:
            print(f"{res['threads']:>7}  {r['label']:<{w}}  {r['ours']:>10.1f}  {r['st']:>10.1f}  "
                  f"{r['ours'] / r['st']:>5.2f}x  {r['err']:>10.1e}")
        lo, ls = res["load_ours"], res["load_st"]
        print(f"{res['threads']:>7}  {'model load (s)':<{w}}  {lo:>10.3f}  {ls:>10.3f}  "
              f"{ls / lo:>5.2f}x  (s-t time / attnlab time; imports done before)")
    return 0


def measure(args, threads: int) -> int:
    n = str(threads)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = n
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "numpy" in sys.modules:
        print("warning: numpy was imported before the thread count was set", file=sys.stderr)

    import json

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import attnlab
    from attnlab.models.bert import load_minilm, minilm_path

    torch.set_num_threads(threads)
    attnlab.set_num_threads(threads)  # attnlab's own thread pool (BLAS held to 1 inside it)
    path = str(minilm_path())

    t0 = time.perf_counter()
    ours = load_minilm()
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    st = SentenceTransformer(path, device="cpu")
    load_st = time.perf_counter() - t0

    short, long = make_texts(args.short, args.long)

    def run_ours(texts):
        return ours.encode(texts, batch_size=32)

    def run_st(texts):
        with torch.inference_mode():
            return st.encode(texts, batch_size=32, show_progress_bar=False)

    rows = []
    for name, texts in (("short", short), ("long", long)):
        toks = [len(e.ids) for e in ours._encodings(texts)]
        err = float(np.abs(run_ours(texts) - run_st(texts)).max())
        r_ours = best_rate(run_ours, texts, args.repeat)
        r_st = best_rate(run_st, texts, args.repeat)
        label = (f"{name} ({len(texts)} texts, {min(toks)}-{max(toks)} tokens, "
                 f"mean {int(np.mean(toks))})")
        rows.append({"label": label, "ours": r_ours, "st": r_st, "err": err})
    print(json.dumps({"threads": threads, "numpy": np.__version__, "torch": torch.__version__,
                      "load_ours": load_ours, "load_st": load_st, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
