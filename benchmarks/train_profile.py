"""Where a training step's time goes: forward, loss, backward, gradient clipping and AdamW,
attnlab's TinyTransformer next to its torch twin (the same weights and batches, the same
thread count), then the step's heaviest functions in attnlab (cProfile).

Each phase is timed on its own (``time.perf_counter`` around it) for every step; the table
shows each phase's median over the steps of all rounds, the two sides taking turns round
by round. Not a test: run ``python benchmarks/train_profile.py [--threads N] [--d-model 96]
[--batch-size 32] [--num-pairs 10]`` (the defaults: the 40-token recall task, d_model 96,
batch 32).
"""

from __future__ import annotations

import argparse
import os

from _setup import machine_load, pin_threads

PHASES = ("forward", "loss", "backward", "clip", "AdamW")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: all usable CPUs)")
    p.add_argument("--steps", type=int, default=20, help="steps per round (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, taking turns (default 5)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--num-pairs", type=int, default=10, help="recall pairs (and queries) a sequence (default 10)")
    p.add_argument("--no-profile", action="store_true", help="leave out the cProfile of a round of attnlab steps")
    args = p.parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import cProfile
    import io
    import pstats
    import time

    import numpy as np
    import torch

    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
    from attnlab.models.tiny_torch import copy_to_torch, torch_tiny_transformer
    from attnlab.nn import CrossEntropyLoss
    from attnlab.train.optim import AdamW, clip_grad_norm_
    from attnlab.train.tasks import RecallTask

    attnlab.set_num_threads(threads)
    torch.set_num_threads(threads)
    task = RecallTask(num_pairs=args.num_pairs, num_queries=args.num_pairs,
                      num_keys=max(16, 2 * args.num_pairs), num_values=16)
    cfg = TinyTransformerConfig(vocab_size=task.vocab_size, context_length=task.seq_len, d_model=args.d_model,
                                d_ff=2 * args.d_model, activation="relu")
    model = TinyTransformer(cfg, rng=np.random.default_rng(0))
    twin = torch_tiny_transformer(cfg)
    copy_to_torch(model, twin)
    rng = np.random.default_rng(1)
    batches = [task.sample(args.batch_size, rng=rng) for _ in range(args.steps)]
    t_batches = [(torch.from_numpy(i), torch.from_numpy(t).reshape(-1)) for i, t in batches]
    opt, loss_fn = AdamW(model.parameters(), lr=1e-3), CrossEntropyLoss()
    t_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    clock = time.perf_counter

    def ours(times):
        for ids, targets in batches:
            t0 = clock()
            logits = model(ids)
            t1 = clock()
            loss_fn(logits, targets)
            g = loss_fn.backward()
            t2 = clock()
            model.zero_grad()
            model.backward(g)
            t3 = clock()
            clip_grad_norm_(model.parameters(), 1.0)
            t4 = clock()
            opt.step()
            t5 = clock()
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
                times[name].append(b - a)

    def theirs(times):
        for ids, targets in t_batches:
            t0 = clock()
            logits = twin(ids)
            t1 = clock()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
            t2 = clock()
            t_opt.zero_grad()
            loss.backward()
            t3 = clock()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            t4 = clock()
            t_opt.step()
            t5 = clock()
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
                times[name].append(b - a)

    sides = {"attnlab": (ours, {n: [] for n in PHASES}), "torch": (theirs, {n: [] for n in PHASES})}
    for fn, _ in sides.values():  # warm-up
        fn({n: [] for n in PHASES})
    for _ in range(args.rounds):
        for fn, times in sides.values():
            fn(times)
    med = {side: {n: 1e3 * float(np.median(t[n])) for n in PHASES} for side, (_, t) in sides.items()}
    n_params = sum(q.data.size for q in model.parameters())
    print(f"TinyTransformer training step: d_model {cfg.d_model}, {cfg.n_heads} heads, {cfg.n_layers} layers, "
          f"{n_params} parameters, batch {args.batch_size} x {task.seq_len} tokens, {threads} thread(s), "
          f"{args.rounds} rounds of {args.steps} steps taking turns")
    print(f"CPU: {cpu_info().describe()}; load average before {load_before}, after "
          f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}")
    print(f"{'phase':10} {'attnlab ms':>11} {'torch ms':>9} {'attnlab/torch':>14}")
    for n in (*PHASES, "step"):
        a = sum(med["attnlab"].values()) if n == "step" else med["attnlab"][n]
        t = sum(med["torch"].values()) if n == "step" else med["torch"][n]
        print(f"{n:10} {a:11.3f} {t:9.3f} {a / t:14.2f}")
    print("(medians per phase; 'step' is their sum)")
    if not args.no_profile:
        prof = cProfile.Profile()
        prof.runcall(ours, {n: [] for n in PHASES})
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        print(f"\nattnlab, {len(batches)} steps under cProfile (its own time per function, the heaviest 15):")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
