"""What a long context costs a decoding step: SmolLM2-135M's step after a short and after a
long context, the two timed in turns, so that a machine whose speed changes touches both.

A generation's 3,000th token and its 100th are timed seconds apart, and a virtual machine's
speed can change in between (a 2-vCPU EPYC VM read memory at 36 and at 63 GB/s in turns, a
few seconds each, as its two vCPUs shared a physical core or not): the rate of one window
over the other's then measures the machine as much as the context. Here each context has a
cache of its own, filled once by a prompt of that many tokens, and every round runs
``--steps`` steps at each context in turn; after each step the cache is cropped back, so
every step at a context reads the same number of keys. Steps run on ``--threads`` threads
(no timing picks them: attnlab's step chooser is left out), with the model's weights kept
quantized (the GGUF's Q4_1 and Q8_0) unless ``--float32``, and the cache stored as
``--cache-dtype``.

Prints each context's median step (over all rounds) and the rate it allows, and each
longer context's rate over the shortest's, with the least and most of the rounds' ratios.

    python benchmarks/long_context.py [--contexts 100,3000] [--steps 20] [--rounds 5]
                                      [--threads 2] [--cache-dtype float16|int8] [--float32]

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import sys
import time

from _setup import OneLineParser, machine_load, pin_threads, refuse

CACHE_DTYPES = ("float32", "float16", "int8")


def parse_args(argv=None):
    p = OneLineParser(prog="long_context.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="100,3000",
                   help="comma-separated cached tokens before each timed step (default 100,3000)")
    p.add_argument("--steps", type=int, default=20, help="timed steps at each context a round (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each context once a round (default 5)")
    p.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    p.add_argument("--cache-dtype", default="float32", help="float32, float16 or int8 (default float32)")
    p.add_argument("--float32", action="store_true", help="the float32 model instead of the quantized one")
    return p.parse_args(argv)


def _contexts(text: str) -> list[int] | str:
    """The contexts, sorted, or what is wrong with them (one line)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        return f"--contexts must be comma-separated whole numbers, got {text!r}"
    if any(v < 1 for v in values):
        return f"--contexts must each be at least 1, got {text!r}"
    return sorted(set(values))


def _refusal(args) -> str | None:
    """What is wrong with the arguments, in one line, or None."""
    contexts = _contexts(args.contexts)
    if isinstance(contexts, str):
        return contexts
    for name in ("steps", "rounds", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name} must be at least 1, got {value}"
    if args.cache_dtype not in CACHE_DTYPES:
        return f"--cache-dtype must be {', '.join(CACHE_DTYPES[:-1])} or {CACHE_DTYPES[-1]}, got {args.cache_dtype!r}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    refusal = _refusal(args)
    if refusal:
        return refuse("long_context.py", refusal)
    contexts = _contexts(args.contexts)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import numpy as np

    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.models.llama import load_smollm2

    attnlab.set_num_threads(threads)
    model = load_smollm2(quantized=not args.float32)
    if contexts[-1] + 1 > model.max_positions:
        return refuse("long_context.py", f"--contexts go up to {model.max_positions - 1} tokens for this model, "
                                         f"got {contexts[-1]}")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(1, contexts[-1] + 1))
    caches = {}
    for c in contexts:  # each context's prompt fills a cache of its own, once
        cache = model.new_cache(dtype=args.cache_dtype)
        model(ids[:, :c], cache=cache, logits_to_keep=1)
        caches[c] = cache

    def steps(c: int) -> list[float]:
        cache, token, out = caches[c], ids[:, c:c + 1], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            model(token, cache=cache, logits_to_keep=1)
            out.append(time.perf_counter() - t0)
            for layer in cache:  # back to c tokens: every step reads the same keys
                layer.crop(c)
        return out

    for c in contexts:  # warm-up: compiled kernels, the caches' pages
        steps(c)
    times: dict = {c: [] for c in contexts}
    ratios: dict = {c: [] for c in contexts[1:]}
    for _ in range(args.rounds):
        medians = {}
        for c in contexts:
            t = steps(c)
            times[c] += t
            medians[c] = float(np.median(t))
        for c in contexts[1:]:
            ratios[c].append(medians[contexts[0]] / medians[c])

    kind = "float32" if args.float32 else "quantized (Q4_1/Q8_0 as stored)"
    print(f"SmolLM2-135M {kind} decode step after each context, {args.cache_dtype} cache, batch 1")
    print(f"cpu      {cpu_info().describe()}")
    print(f"threads  {threads}; numpy {np.__version__}")
    print(f"load     before {load_before}; after {machine_load()}")
    print(f"{args.rounds} rounds of {args.steps} steps at each context, in turns; medians over all rounds")
    print(f"  {'context':>8}{'ms/step':>10}{'tokens/s':>10}{'rate over ' + str(contexts[0]):>18}{'rounds':>16}")
    short = float(np.median(times[contexts[0]]))
    for c in contexts:
        ms = 1e3 * float(np.median(times[c]))
        line = f"  {c:>8}{ms:>10.2f}{1e3 / ms:>10.1f}"
        if c != contexts[0]:
            line += f"{short / (ms / 1e3):>18.2f}{min(ratios[c]):>9.2f}-{max(ratios[c]):.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
