"""Speed on a machine that other processes keep busy: attnlab at its default threads against
the same work pinned to one core (``taskset -c``), under a load this script creates.

It starts ``--load`` busy-loop processes (plain Python ``while True: pass``), then runs each
workload in a fresh process, in turns: default threads, pinned to one core, and, with
``--other-src``, the same two from another checkout (e.g. ``git worktree``/``git archive`` of
an older commit) for a before/after. The busy loops are stopped at the end, whatever happens.

Workloads:

- ``decode``: SmolLM2-135M with its Q4_1 weights kept quantized, greedy, one sequence:
  tokens/s over the first ``--tokens`` new tokens, and over each window of 100 (the cache
  stored as ``--cache-dtype``, e.g. float16);
- ``train``: a TinyTransformer training step (d_model 96, batch 32 x 40, AdamW): ms a step,
  median of 30.

    python benchmarks/busy.py [--load 3] [--tokens 200] [--work decode,train] [--other-src PATH]
                              [--cache-dtype float16]

Every rate comes with the load average seen while it ran. Not a test: nothing here asserts a
timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

_DECODE = r"""
import json, os, sys, time
import numpy as np
import attnlab
from attnlab.models.llama import load_smollm2
new = int(sys.argv[1])
m = load_smollm2(quantized=True)
ids = m.encode("The history of the printing press begins with movable type")[0][None]
m.generate(ids, 3)
stamps = []
try:
    from attnlab._threads import DECODE_STEPS
    step = DECODE_STEPS.step
except ImportError:  # an older checkout: its generate() has no step chooser
    import contextlib
    step = contextlib.nullcontext
cache = m.new_cache() if sys.argv[2] == "default" else m.new_cache(dtype=sys.argv[2])
tok = m(ids, cache=cache)[:, -1].argmax(-1)[:, None]
stamps.append(time.perf_counter())
for _ in range(new):
    with step():
        logits = m(tok, cache=cache)
    tok = logits[:, -1].argmax(-1)[:, None]
    stamps.append(time.perf_counter())
st = np.array(stamps)
per = np.diff(st)
windows = [float(100 / (st[b] - st[b - 100])) for b in range(100, new + 1, 100)]
at = lambda i: float(1 / np.median(per[max(0, i - 10):i + 10]))
print(json.dumps({"rate": new / float(st[-1] - st[0]), "windows": windows, "token_100": at(100) if new >= 110 else None,
                  "token_3000": at(3000) if new >= 3010 else None, "load": os.getloadavg()[0]}))
"""

_TRAIN = r"""
import json, os, time
import numpy as np
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.nn import CrossEntropyLoss
from attnlab.train.optim import AdamW, clip_grad_norm_
from attnlab.train.tasks import RecallTask
task = RecallTask(num_pairs=10, num_queries=10, num_keys=20, num_values=16)
cfg = TinyTransformerConfig(vocab_size=task.vocab_size, context_length=task.seq_len, d_model=96, d_ff=192,
                            activation="relu")
model = TinyTransformer(cfg, rng=np.random.default_rng(0))
opt, loss_fn = AdamW(model.parameters(), lr=1e-3), CrossEntropyLoss()
rng = np.random.default_rng(1)
batches = [task.sample(32, rng=rng) for _ in range(35)]
times = []
for ids, targets in batches:
    t0 = time.perf_counter()
    loss_fn(model(ids), targets)
    model.zero_grad()
    model.backward(loss_fn.backward())
    clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t0)
print(json.dumps({"ms": 1e3 * float(np.median(times[5:])), "load": os.getloadavg()[0]}))
"""


def _run(code: str, src: Path, pin: int | None, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", code, *args]
    if pin is not None:
        cmd = ["taskset", "-c", str(pin), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", type=int, default=3, help="busy-loop processes to start (default 3)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens of the decode workload (default 200)")
    p.add_argument("--work", default="decode,train", help="workloads: decode,train (default both)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each configuration once a round (default 2)")
    p.add_argument("--other-src", type=Path, default=None, help="another checkout's src/ for a before/after")
    p.add_argument("--cache-dtype", default="default",
                   help="the decode workload's cache storage, e.g. float16 (default: the model's own, float32)")
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        time.sleep(1.0)
        srcs = {"this checkout": SRC}
        if args.other_src is not None:
            srcs["other checkout"] = args.other_src.resolve()
        from attnlab._cpu import cpu_info

        print(f"CPU: {cpu_info().describe()}; usable CPUs {cpus}; {args.load} busy loop(s) started; "
              f"load average {os.getloadavg()[0]:.2f}")
        for work in [w.strip() for w in args.work.split(",") if w.strip()]:
            code, wargs = (_DECODE, [str(args.tokens), args.cache_dtype]) if work == "decode" else (_TRAIN, [])
            for r in range(args.rounds):
                for name, src in srcs.items():
                    for pin in (None, cpus[-1]):
                        res = _run(code, src, pin, wargs)
                        how = "default threads" if pin is None else f"taskset -c {pin}"
                        if "error" in res:
                            print(f"{work:7} round {r + 1}  {name:15} {how:16} error: {res['error']}")
                        elif work == "decode":
                            extra = "" if res["token_3000"] is None else \
                                f"; token 100 {res['token_100']:.1f}/s, token 3000 {res['token_3000']:.1f}/s"
                            windows = ", ".join(f"{w:.1f}" for w in res["windows"])
                            print(f"{work:7} round {r + 1}  {name:15} {how:16} {res['rate']:6.1f} tokens/s (windows of "
                                  f"100: {windows}{extra}); load {res['load']:.1f}")
                        else:
                            print(f"{work:7} round {r + 1}  {name:15} {how:16} {res['ms']:6.1f} ms a step; "
                                  f"load {res['load']:.1f}")
                        sys.stdout.flush()
    finally:
        for proc in loops:
            proc.kill()
        for proc in loops:
            proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
