"""The speed table: attnlab's time over torch's (transformers' for whole models) on the rows
that matter across machines, side by side in one process, the two sides taking turns.

Rows: SDPA at BERT-like (B=32, H=12, L=128, E=32), B=8 H=12 L=256 E=64, GPT-2-like (B=1,
H=12, L=1024, E=64, causal) and SmolLM2-like (9 query heads over 3, L=512, causal) shapes,
forward; ``MultiheadAttention(768, 12)`` on B=2 x 512 tokens, forward and forward+backward;
a 6-layer GPT-2 (d_model 768, random weights) prefilling 512 tokens; a TinyTransformer
training step (d_model 96, batch 32 x 40 tokens: forward, loss, backward, clipping, AdamW);
SmolLM2-135M prefilling 512 tokens (the bundled GGUF, float32). The decode rows are
``benchmarks/decode.py``'s.

It uses attnlab's public functions only, so ``PYTHONPATH=<another checkout>/src python
benchmarks/speed_table.py`` times an older attnlab against the same torch for a
before/after (each run's ratios come from its own turns).

    python benchmarks/speed_table.py [--threads 2] [--repeat 7] [--rows sdpa,mha,gpt2,train,smollm2]

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

from _setup import machine_load, pin_threads

ROWS = ("sdpa", "mha", "gpt2", "train", "smollm2")


def _turns(fns: dict, repeat: int, settle: float) -> dict[str, list[float]]:
    """Each function ``repeat`` times in turns after a warm-up, a ``settle`` pause before each."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            time.sleep(settle)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: all usable CPUs)")
    p.add_argument("--repeat", type=int, default=7, help="timed turns a row (default 7)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ROWS)}")
    p.add_argument("--settle", type=float, default=0.05, help="pause before each timed call, s (default 0.05)")
    args = p.parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]

    import numpy as np
    import torch

    import attnlab
    from attnlab import _cpu

    attnlab.set_num_threads(threads)
    torch.set_num_threads(threads)
    if hasattr(attnlab, "keep_freed_memory"):
        attnlab.keep_freed_memory()
    rng = np.random.default_rng(0)
    out = []

    def row(name, fns, unit_scale=1e3, unit="ms"):
        times = _turns(fns, args.repeat, args.settle)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = [a / b for a, b in zip(times["attnlab"], times["other"], strict=True)]
        out.append((name, unit_scale * med["attnlab"], unit_scale * med["other"], med["attnlab"] / med["other"],
                    min(ratios), max(ratios), unit))
        print(f"  ... {name}: {med['attnlab'] / med['other']:.2f}", file=sys.stderr, flush=True)

    if "sdpa" in rows:
        F = torch.nn.functional
        for name, (B, Hq, H, L, E, causal) in {
            "SDPA BERT-like B=32 H=12 L=128 E=32": (32, 12, 12, 128, 32, False),
            "SDPA B=8 H=12 L=256 E=64": (8, 12, 12, 256, 64, False),
            "SDPA GPT-2-like B=1 H=12 L=1024 E=64 causal": (1, 12, 12, 1024, 64, True),
            "SDPA SmolLM2-like 9/3 heads L=512 causal": (1, 9, 3, 512, 64, True),
        }.items():
            q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
            k, v = (rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(2))
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
            gqa = H != Hq

            def ours(q=q, k=k, v=v, causal=causal, gqa=gqa):
                return attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

            def theirs(tq=tq, tk=tk, tv=tv, causal=causal, gqa=gqa):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa)

            row(name, {"attnlab": ours, "other": theirs})
    if "mha" in rows:
        mha = attnlab.MultiheadAttention(768, 12, batch_first=True, rng=np.random.default_rng(0))
        tmha = torch.nn.MultiheadAttention(768, 12, batch_first=True)
        with torch.no_grad():
            for name, param in tmha.named_parameters():
                param.copy_(torch.from_numpy(np.asarray(dict(mha.named_parameters())[name].data)))
        x = rng.standard_normal((2, 512, 768)).astype(np.float32)
        tx = torch.from_numpy(x)
        g = np.ones((2, 512, 768), np.float32)

        def fwd():
            return mha(x, x, x, need_weights=False)

        def tfwd():
            with torch.no_grad():
                return tmha(tx, tx, tx, need_weights=False)

        def both():
            y, _ = mha(x, x, x, need_weights=False)
            mha.zero_grad()
            mha.backward(g)

        txg = tx.clone().requires_grad_(True)

        def tboth():
            tmha.zero_grad()
            y, _ = tmha(txg, txg, txg, need_weights=False)
            y.backward(torch.from_numpy(g))

        row("MultiheadAttention(768, 12) B=2 L=512, forward", {"attnlab": fwd, "other": tfwd})
        row("the same, forward+backward", {"attnlab": both, "other": tboth})
    if "gpt2" in rows or "smollm2" in rows:
        import tempfile

        from transformers import GPT2Config, GPT2LMHeadModel
    if "gpt2" in rows:
        from attnlab.models import GPT2

        torch.manual_seed(0)
        theirs = GPT2LMHeadModel(GPT2Config(n_layer=6, n_positions=1024)).eval()
        with tempfile.TemporaryDirectory() as folder:
            theirs.save_pretrained(folder, safe_serialization=True)
            ours = GPT2.from_pretrained(folder)
        ids = rng.integers(0, 50257, size=(1, 512))
        tids = torch.from_numpy(ids)

        def g_ours():
            return ours(ids, logits_to_keep=1)

        def g_theirs():
            with torch.no_grad():
                return theirs(tids, logits_to_keep=1).logits

        row("GPT-2 6x768 prefill, 512 tokens", {"attnlab": g_ours, "other": g_theirs})
    if "train" in rows:
        from attnlab.benchmark import training_step_fns

        steps = 10
        try:
            plan = training_step_fns(torch, steps, batch_size=32, d_model=96, num_pairs=10)
            tokens = 40
        except TypeError:  # an older checkout: its recall task only, 32 tokens
            plan = training_step_fns(torch, steps, batch_size=32, d_model=96)
            tokens = 32
        row(f"training step, TinyTransformer d=96, batch 32x{tokens}",
            {"attnlab": plan.fns["attnlab"], "other": plan.fns["torch"]}, unit_scale=1e3 / steps, unit="ms/step")
    if "smollm2" in rows:
        from attnlab.models.llama import load_smollm2

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = load_smollm2()
            from attnlab import interop

            theirs = interop.to_torch(ours).eval()
        ids = rng.integers(0, ours.config.vocab_size, size=(1, 512))
        tids = torch.from_numpy(ids)

        def s_ours():
            return ours(ids, logits_to_keep=1)

        def s_theirs():
            with torch.no_grad():
                return theirs(tids, logits_to_keep=1).logits

        row("SmolLM2 prefill, 512 tokens", {"attnlab": s_ours, "other": s_theirs})

    print(f"attnlab's time over torch's (transformers' for the models), {threads} thread(s) each, median of "
          f"{args.repeat} turns (spread: the least and most of the turns' ratios)")
    print(f"CPU: {_cpu.cpu_info().describe()}; attnlab from {os.path.dirname(attnlab.__file__)}")
    print(f"load average before {load_before}, after {os.getloadavg()[0]:.2f}")
    width = max(len(r[0]) for r in out)
    print(f"{'work':{width}}  {'attnlab':>10}  {'other':>10}  {'ratio':>6}  {'spread':>11}")
    for name, a, o, ratio, lo, hi, unit in out:
        print(f"{name:{width}}  {a:7.2f} {unit[:2]:2}  {o:7.2f} {unit[:2]:2}  {ratio:6.2f}  {lo:5.2f}-{hi:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
