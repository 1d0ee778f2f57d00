"""all-MiniLM-L6-v2 on the CPU: attnlab's NumPy encoder vs sentence-transformers (torch).

Prints, side by side from one run, sentences per second for short and long texts at batch
size 32 with the same number of threads for both (NumPy's BLAS via the ``*_NUM_THREADS``
variables set before NumPy is imported, torch via ``torch.set_num_threads``), the ratio
attnlab / sentence-transformers (> 1 means attnlab is faster), and the model load times.

    python benchmarks/minilm.py [--threads N] [--repeat R]

Needs the ``pretrained`` and ``test`` extras. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="threads for both libraries (default 1)")
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
    n = str(args.threads)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = n
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "numpy" in sys.modules:
        print("warning: numpy was imported before the thread count was set", file=sys.stderr)

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from attnlab.models.bert import BertEncoder, load_minilm, minilm_path

    torch.set_num_threads(args.threads)
    path = str(minilm_path())

    t0 = time.perf_counter()
    ours = load_minilm()
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    st = SentenceTransformer(path, device="cpu")
    load_st = time.perf_counter() - t0

    short, long = make_texts(args.short, args.long)
    lengths = {}
    for name, texts in (("short", short), ("long", long)):
        toks = [len(e.ids) for e in ours._encodings(texts)]
        lengths[name] = (min(toks), int(np.mean(toks)), max(toks))

    def run_ours(texts):
        return ours.encode(texts, batch_size=32)

    def run_st(texts):
        with torch.inference_mode():
            return st.encode(texts, batch_size=32, show_progress_bar=False)

    rows = []
    for name, texts in (("short", short), ("long", long)):
        err = float(np.abs(run_ours(texts) - run_st(texts)).max())
        r_ours = best_rate(run_ours, texts, args.repeat)
        r_st = best_rate(run_st, texts, args.repeat)
        lo, mean, hi = lengths[name]
        rows.append((f"{name} ({len(texts)} texts, {lo}-{hi} tokens, mean {mean})",
                     r_ours, r_st, r_ours / r_st, err))

    print(f"all-MiniLM-L6-v2 on the CPU, batch 32, {args.threads} thread(s), best of {args.repeat}")
    print(f"numpy {np.__version__}, torch {torch.__version__}")
    w = max(len(r[0]) for r in rows)
    print(f"{'texts':<{w}}  {'attnlab/s':>10}  {'s-t/s':>10}  {'ratio':>6}  {'max |diff|':>10}")
    for label, a, b, ratio, err in rows:
        print(f"{label:<{w}}  {a:>10.1f}  {b:>10.1f}  {ratio:>5.2f}x  {err:>10.1e}")
    print(f"{'model load (s)':<{w}}  {load_ours:>10.3f}  {load_st:>10.3f}  "
          f"{load_st / load_ours:>5.2f}x  (imports done before; ratio = s-t / attnlab)")
    del BertEncoder
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
