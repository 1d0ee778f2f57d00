"""Training speed: steps/s of attnlab's TinyTransformer and its torch twin, side by side.

Both run the same step on the same batches: forward, cross-entropy on the answer
positions, backward, gradient clipping at 1.0, AdamW. Same thread count for both (NumPy's
BLAS via environment variables set before NumPy loads; torch via set_num_threads).
Rounds alternate between the two so machine noise hits both alike; the table shows the
median round. Not a test: run ``python benchmarks/train.py [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    p.add_argument("--steps", type=int, default=30, help="steps per round (default 30)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--activation", default="relu")
    p.add_argument("--cpu-time", action="store_true",
                   help="time in process CPU time (robust to a loaded machine; one thread only)")
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if "numpy" in sys.modules:
        print("warning: numpy was imported before the thread count was set", file=sys.stderr)

    import time

    import numpy as np
    import torch

    from attnlab.benchmark import training_step_fns
    from attnlab.models.tiny import TinyTransformerConfig
    from attnlab.train.tasks import RecallTask

    torch.set_num_threads(args.threads)
    plan = training_step_fns(torch, args.steps, batch_size=args.batch_size, d_model=args.d_model,
                             activation=args.activation)
    ours, theirs = plan.fns["attnlab"], plan.fns["torch"]
    task = RecallTask()
    cfg = TinyTransformerConfig(vocab_size=task.vocab_size, context_length=task.seq_len, d_model=args.d_model,
                                d_ff=2 * args.d_model, activation=args.activation)
    ours(), theirs()  # warm-up
    clock = time.process_time if args.cpu_time else time.perf_counter
    rates = {"attnlab": [], "torch": []}
    for _ in range(args.rounds):
        for name, fn in (("attnlab", ours), ("torch", theirs)):
            t0 = clock()
            fn()
            rates[name].append(args.steps / (clock() - t0))
    med = {k: float(np.median(v)) for k, v in rates.items()}
    print(
        f"TinyTransformer training step: d_model={cfg.d_model}, heads={cfg.n_heads}, "
        f"layers={cfg.n_layers}, batch {args.batch_size} x "
        f"{task.seq_len} tokens, {args.threads} thread(s), {args.rounds} rounds of {args.steps} steps, "
        f"{'CPU' if args.cpu_time else 'wall'} time, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'':10} {'steps/s':>9} {'ms/step':>9}")
    for name in ("attnlab", "torch"):
        print(f"{name:10} {med[name]:9.1f} {1000 / med[name]:9.2f}")
    print(f"ratio attnlab/torch: {med['attnlab'] / med['torch']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
