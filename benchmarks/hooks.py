"""What the hook points cost: forward passes with no hook attached, against another checkout
of attnlab (``--baseline DIR``, e.g. a ``git worktree`` of the commit before the hooks), and
BERT with its attention maps against without.

    python benchmarks/hooks.py --baseline /tmp/attnlab-before

Each case runs in a fresh process per side, the sides interleaved round by round, best of
``--repeat`` calls per process; the table gives the best time per side and their ratio. A
benchmark, not a test: it never fails on a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = {
    "gpt2-small prefill, 512 tokens": "gpt2",
    "MiniLM encode, 256 sentences": "minilm",
    "BERT 6x384, batch 8 x 256: forward": "bert_plain",
    "BERT 6x384, batch 8 x 256: forward with maps": "bert_maps",
    "TinyTransformer d=64 training step": "train",
}

WORKER = r"""
import json, sys, time
import numpy as np
case, repeat, threads, clock = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import attnlab
from threadpoolctl import threadpool_limits
from attnlab.models import GPT2, GPT2Config, BertConfig, BertEncoder
attnlab.set_num_threads(threads)
threadpool_limits(threads)
now = time.process_time if clock == "cpu" else time.perf_counter

def best(fn):
    fn()
    times = []
    for _ in range(repeat):
        t = now(); fn(); times.append(now() - t)
    return min(times)

rng = np.random.default_rng(0)
if case == "gpt2":
    m = GPT2(GPT2Config(), rng=rng)
    ids = rng.integers(0, 50257, (1, 512))
    t = best(lambda: m(ids))
elif case == "minilm":
    from attnlab.models import load_minilm
    m = load_minilm()
    words = "the bank of the river was steep and the water ran fast past the old mill".split()
    texts = [" ".join(words[i % 7 : i % 7 + 5 + i % 9]) for i in range(256)]
    t = best(lambda: m.encode(texts, batch_size=32))
elif case.startswith("bert"):
    c = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                   intermediate_size=1536, max_position_embeddings=512)
    m = BertEncoder(c, rng=rng)
    ids = rng.integers(0, 30522, (8, 256))
    if case == "bert_plain":
        t = best(lambda: m._run(ids))
    else:
        t = best(lambda: m.forward(ids))
elif case == "train":
    from attnlab.models import TinyTransformer, TinyTransformerConfig
    from attnlab.nn import CrossEntropyLoss
    cfg = TinyTransformerConfig(vocab_size=64, context_length=64, d_model=64, n_heads=4, n_layers=2, d_ff=256)
    m = TinyTransformer(cfg, rng=rng).train()
    ids = rng.integers(0, 64, (32, 64))
    loss = CrossEntropyLoss()
    def step():
        logits = m(ids)
        loss(logits.reshape(-1, 64), ids.reshape(-1))
        m.zero_grad()
        m.backward(loss.backward().reshape(logits.shape))
    t = best(step)
print(json.dumps({"t": t}))
"""


def run(src: Path, case: str, repeat: int, threads: int, clock: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-c", WORKER, case, str(repeat), str(threads), clock], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{case} failed under {src}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["t"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another attnlab checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES.values()))
    parser.add_argument("--threads", type=int, default=1, help="BLAS and attnlab threads (default 1)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: the process's CPU time (steadier on a busy machine, one thread); wall")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1] / "src"
    from attnlab._cpu import cpu_info

    info = cpu_info()
    print(f"CPU: {info.model}; avx2={'avx2' in info.flags}, avx512f={'avx512f' in info.flags}; "
          f"L2 {info.l2 // 1024} KiB; {os.cpu_count()} cores; {args.threads} thread(s), {args.clock} time; "
          f"load {os.getloadavg()[0]:.1f}")
    wanted = args.cases.split(",")
    sides = {"now": here}
    if args.baseline:
        sides = {"baseline": args.baseline / "src", "now": here}
    print(f"{'case':48s} " + " ".join(f"{s:>10s}" for s in sides) + ("   now/baseline" if args.baseline else ""))
    for label, case in CASES.items():
        if case not in wanted:
            continue
        best = {s: float("inf") for s in sides}
        for _ in range(args.rounds):
            for side, src in sides.items():
                best[side] = min(best[side], run(src, case, args.repeat, args.threads, args.clock))
        row = f"{label:48s} " + " ".join(f"{best[s] * 1e3:8.1f}ms" for s in sides)
        if args.baseline:
            row += f"   {best['now'] / best['baseline']:.3f}"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
