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
longer context's rate over the shortest's, with the least and most of the rounds' ratios;
then the bytes a step reads at each context (the weights and the cache,
:func:`attnlab.decode_bench.decode_weight_bytes` and ``decode_cache_bytes``) and the rate
a step bound by the memory alone would keep, their ratio: a step faster than that at the
short context can keep no more.
Where ``llama-cpp-python`` imports (and the model is the quantized one), llama.cpp runs
the same GGUF file in the same turns, a context (``n_ctx``) of its own for each context
length, its cache in the nearest type it has (float32 F32, float16 F16, int8 Q8_0 with
its flash attention, which a quantized value cache needs); ``--no-llama-cpp`` leaves it
out.

    python benchmarks/long_context.py [--contexts 100,3000] [--steps 20] [--rounds 5]
                                      [--threads 2] [--cache-dtype float16|int8] [--float32]
                                      [--no-llama-cpp]

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import sys
import time

from _setup import OneLineParser, machine_load, pin_threads, refuse

CACHE_DTYPES = ("float32", "float16", "int8")
# llama.cpp's cache type for each --cache-dtype: (its name, the ggml type's name, flash attention)
LLAMA_CACHE = {"float32": ("F32", "GGML_TYPE_F32", False), "float16": ("F16", "GGML_TYPE_F16", False),
               "int8": ("Q8_0", "GGML_TYPE_Q8_0", True)}


def parse_args(argv=None):
    p = OneLineParser(prog="long_context.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="100,3000",
                   help="comma-separated cached tokens before each timed step (default 100,3000)")
    p.add_argument("--steps", type=int, default=20, help="timed steps at each context a round (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each context once a round (default 5)")
    p.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    p.add_argument("--cache-dtype", default="float32", help="float32, float16 or int8 (default float32)")
    p.add_argument("--float32", action="store_true", help="the float32 model instead of the quantized one")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
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
    from attnlab.decode_bench import decode_cache_bytes, decode_weight_bytes
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

    runs = {"attnlab": steps}
    llama_version = None
    if not args.float32 and not args.no_llama_cpp:
        llama_steps, llama_version = _llama_cpp(contexts, ids, threads, args)
        if llama_steps is not None:
            runs["llama.cpp"] = llama_steps

    for run in runs.values():  # warm-up: compiled kernels, the caches' pages
        for c in contexts:
            run(c)
    times: dict = {(name, c): [] for name in runs for c in contexts}
    ratios: dict = {(name, c): [] for name in runs for c in contexts[1:]}
    for _ in range(args.rounds):
        for name, run in runs.items():
            medians = {}
            for c in contexts:
                t = run(c)
                times[name, c] += t
                medians[c] = float(np.median(t))
            for c in contexts[1:]:
                ratios[name, c].append(medians[contexts[0]] / medians[c])

    kind = "float32" if args.float32 else "quantized (Q4_1/Q8_0 as stored)"
    print(f"SmolLM2-135M {kind} decode step after each context, {args.cache_dtype} cache, batch 1")
    print(f"cpu      {cpu_info().describe()}")
    print(f"threads  {threads}; numpy {np.__version__}"
          + ("" if llama_version is None else f"; llama-cpp-python {llama_version}"))
    print(f"load     before {load_before}; after {machine_load()}")
    if "llama.cpp" in runs:
        print(f"llama.cpp: the same GGUF file, {LLAMA_CACHE[args.cache_dtype][0]} cache")
    else:
        why = ("the float32 model" if args.float32 else "--no-llama-cpp" if args.no_llama_cpp
               else "llama-cpp-python does not import")
        print(f"llama.cpp: left out ({why})")
    print(f"{args.rounds} rounds of {args.steps} steps at each context, in turns; medians over all rounds")
    print(f"  {'':10}{'context':>8}{'ms/step':>10}{'tokens/s':>10}{'rate over ' + str(contexts[0]):>18}{'rounds':>16}")
    for name in runs:
        short = float(np.median(times[name, contexts[0]]))
        for c in contexts:
            ms = 1e3 * float(np.median(times[name, c]))
            line = f"  {name:10}{c:>8}{ms:>10.2f}{1e3 / ms:>10.1f}"
            if c != contexts[0]:
                line += f"{short / (ms / 1e3):>18.2f}{min(ratios[name, c]):>9.2f}-{max(ratios[name, c]):.2f}"
            print(line)
    weights = decode_weight_bytes(model)
    reads = {c: weights + decode_cache_bytes(model, c, dtype=args.cache_dtype) for c in contexts}
    print("bytes a step reads (weights and cache): "
          + ", ".join(f"{reads[c] / 1e6:.1f} MB after {c}" for c in contexts))
    for c in contexts[1:]:
        print(f"a step bound by the memory alone keeps {reads[contexts[0]] / reads[c]:.2f} of its rate "
              f"after {c} tokens")
    return 0


def _llama_cpp(contexts, ids, threads, args):
    """``(steps, version)``: a function timing llama.cpp's decoding steps after a context,
    as attnlab's are timed, on a context (``Llama``) of its own for each context length,
    filled once by the same prompt; ``(None, None)`` where ``llama_cpp`` does not import.
    ``Llama.eval`` first drops the cache past ``n_tokens``, so setting it back to ``c``
    before each step crops the cache as attnlab's is."""
    try:
        import llama_cpp
    except ImportError:
        return None, None
    from attnlab.models.llama import smollm2_path

    _, ggml_type, flash = LLAMA_CACHE[args.cache_dtype]
    kind = getattr(llama_cpp, ggml_type)
    llamas = {}
    for c in contexts:
        llamas[c] = llama_cpp.Llama(str(smollm2_path()), n_ctx=c + 8, n_threads=threads, n_threads_batch=threads,
                                    n_batch=min(512, c), type_k=kind, type_v=kind, flash_attn=flash, verbose=False)
        llamas[c].eval(ids[0, :c].tolist())

    def steps(c: int) -> list[float]:
        llama, token, out = llamas[c], [int(ids[0, c])], []
        for _ in range(args.steps):
            llama.n_tokens = c
            t0 = time.perf_counter()
            llama.eval(token)
            out.append(time.perf_counter() - t0)
        return out

    return steps, llama_cpp.__version__


if __name__ == "__main__":
    sys.exit(main())
