"""Decode speed of SmolLM2-135M-Instruct against the machine's memory-bandwidth limit:
attnlab float32, attnlab with the GGUF's Q4_1/Q8_0 weights kept quantized (multiplying
float32 activations, and int8 ones as llama.cpp does), transformers float32 (the same file,
dequantized) and llama.cpp (on the same GGUF, where ``llama-cpp-python`` imports).

A decode step reads every weight once, so ``bandwidth / weight bytes per token`` is the
fastest the machine allows; each rate is shown as tokens/s and as its share of that limit.
The bandwidth is measured before each run: ``threads`` threads each take the max of their
slice of a buffer 8x the last-level cache (at least 256 MiB), best of 3 (see
:func:`attnlab.decode_bench.memory_bandwidth`), and each run's share is taken against the
bandwidth measured just before it. A virtual machine's bandwidth can change from one
second to the next (a 2-vCPU EPYC VM read its weights at 36 GB/s and at 63 GB/s in turns,
a few seconds each, with two threads, as its vCPUs shared a core or not): a limit measured
once, at the start, can be the other mode's. Weight bytes per token: every block's
weights, the final norm, the unembedding and one embedding row
(:func:`attnlab.decode_bench.decode_weight_bytes`; for llama.cpp the file's own block
bytes, its float16 scales included), plus the key/value cache a step reads at the mean
context, ``prompt + new / 2`` tokens (:func:`attnlab.decode_bench.decode_cache_bytes`:
attnlab's cache in ``--cache-dtype``, transformers' in float32, llama.cpp's in float16, its
default). A long prompt (``--prompt 3000``) shows what a long context costs each library.

Each library generates ``new + 1`` greedy tokens after the prompt, in turns (attnlab float32,
attnlab quantized, transformers, llama.cpp, attnlab float32, ...), each new token stamped as
it comes (attnlab's ``stream``, a transformers streamer, llama.cpp's generator): from the
first new token to the last is ``new`` decode steps, the prompt's prefill left out. Rates
are medians over the rounds; ratios come from the same run.

    python benchmarks/decode.py [--threads 2] [--repeat 3] [--prompt 64] [--new 64]
                                [--cache-dtype float16|int8]

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import time
import warnings

from _setup import machine_load, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for every library (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds, taking turns (default 3)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new", type=int, default=64, help="new tokens timed (default 64)")
    p.add_argument("--cache-dtype", choices=("float32", "float16", "int8"), default=None,
                   help="attnlab's key/value cache storage (default: the model's own, float32)")
    p.add_argument("--no-torch", action="store_true", help="leave transformers out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import numpy as np

    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.decode_bench import bandwidth_share, decode_cache_bytes, decode_weight_bytes, memory_bandwidth
    from attnlab.models.llama import load_smollm2, smollm2_path
    from attnlab.quant import quantize_activations

    attnlab.set_num_threads(threads)
    t0 = time.perf_counter()
    f32 = load_smollm2()
    t1 = time.perf_counter()
    q = load_smollm2(quantized=True)
    t2 = time.perf_counter()
    q8 = quantize_activations(load_smollm2(quantized=True), "int8")
    path = smollm2_path()
    text = ("The history of the printing press begins with movable type, and it changed how people learned, "
            "argued and remembered. ") * max(20, args.prompt // 10)
    ids = f32.encode(text)[0][: args.prompt][None]
    n = args.new
    context = ids.shape[1] + n // 2  # the mean number of cached tokens a timed step reads
    runs: dict = {}  # label: a function generating n + 1 tokens, returning (times, tokens) of each new one
    ours = decode_cache_bytes(f32, context, dtype=args.cache_dtype)
    weight_bytes: dict = {"attnlab float32": decode_weight_bytes(f32) + ours,
                          "attnlab quantized": decode_weight_bytes(q) + ours,
                          "attnlab int8 activations": decode_weight_bytes(q8) + ours}

    def stamped(tokens) -> tuple[list, list]:
        times, chosen = [], []
        for tok in tokens:
            times.append(time.perf_counter())
            chosen.append(int(np.asarray(tok).reshape(-1)[0]))
            if len(chosen) == n + 1:
                break
        return times, chosen

    for label, model in (("attnlab float32", f32), ("attnlab quantized", q), ("attnlab int8 activations", q8)):
        runs[label] = lambda model=model: stamped(model.stream(ids, n + 1, cache_dtype=args.cache_dtype))

    if not args.no_torch:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            torch = None
        if torch is not None:
            torch.set_num_threads(threads)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
            theirs.generation_config.eos_token_id = None
            theirs.generation_config.pad_token_id = None
            ids_t = torch.from_numpy(ids)
            weight_bytes["transformers float32"] = decode_weight_bytes(f32) + decode_cache_bytes(f32, context)

            class Streamer:  # transformers' streamer interface: put() the prompt, then each new token
                def __init__(self):
                    self.times, self.chosen, self.prompt = [], [], True

                def put(self, value):
                    if self.prompt:
                        self.prompt = False
                    else:
                        self.times.append(time.perf_counter())
                        self.chosen.append(int(value.reshape(-1)[0]))

                def end(self):
                    pass

            def tgen():
                streamer = Streamer()
                with torch.inference_mode(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    theirs.generate(ids_t, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False,
                                    streamer=streamer)
                return streamer.times, streamer.chosen

            runs["transformers float32"] = tgen

    try:
        from llama_cpp import Llama as LlamaCpp
    except ImportError:
        LlamaCpp = None
    if LlamaCpp is not None:
        llama = LlamaCpp(str(path), n_ctx=args.prompt + n + 8, n_threads=threads, n_batch=args.prompt, verbose=False)
        prompt_list = ids[0].tolist()
        weight_bytes["llama.cpp Q4_1"] = _gguf_decode_bytes(path) + decode_cache_bytes(f32, context, dtype="float16")

        def cgen():
            llama.reset()
            return stamped(llama.generate(prompt_list, temp=0.0, top_k=1, reset=True))

        runs["llama.cpp Q4_1"] = cgen

    rates: dict = {label: [] for label in runs}
    shares: dict = {label: [] for label in runs}
    bandwidths: list = []
    out: dict = {}
    for _ in range(args.repeat):  # in turns, so that a change in the machine's speed touches every library
        for label, run in runs.items():
            bandwidths.append(memory_bandwidth(threads=threads, repeat=3))  # this run's limit (see above)
            time.sleep(0.05)
            times, out[label] = run()
            rates[label].append(n / (times[n] - times[0]))
            shares[label].append(bandwidth_share(rates[label][-1], bandwidths[-1], weight_bytes[label]))
    labels = list(runs)
    rate = {lab: float(np.median(rates[lab])) for lab in labels}
    share = {lab: float(np.median(shares[lab])) for lab in labels}
    bandwidth = float(np.median(bandwidths))
    base = rate.get("transformers float32")

    print(f"SmolLM2-135M-Instruct decode, greedy, {ids.shape[1]}-token prompt + {n} new tokens, batch 1")
    print(f"cpu      {cpu_info().describe()}")
    print(f"threads  {threads}; numpy {np.__version__}")
    print(f"load     before {load_before}; after {machine_load()}  (a shared machine: the ratios are taken in turns)")
    print(f"memory bandwidth ({threads} thread(s), max over a {max(256 << 20, 8 * cpu_info().l3) >> 20} MiB int64 "
          f"buffer, before each run): median {bandwidth / 1e9:.1f} GB/s, {min(bandwidths) / 1e9:.1f} to "
          f"{max(bandwidths) / 1e9:.1f}")
    print(f"attnlab load: float32 {t1 - t0:.1f} s, quantized {t2 - t1:.1f} s")
    print(f"MB/token: the weights a step reads and the key/value cache at {context} tokens (attnlab "
          f"{args.cache_dtype or 'float32'}, transformers float32, llama.cpp float16)")
    print(f"median of {args.repeat} rounds, taken in turns (limit: at the median bandwidth; of limit: the median "
          f"of each run's share of the bandwidth measured before it):")
    head = f"  {'':<26}{'MB/token':>10}{'limit tok/s':>13}{'tokens/s':>10}{'of limit':>10}"
    print(head + ("   vs transformers" if base else ""))
    for lab in labels:
        wb = weight_bytes[lab]
        line = (f"  {lab:<26}{wb / 1e6:>10.1f}{bandwidth / wb:>13.1f}{rate[lab]:>10.1f}"
                f"{share[lab]:>10.0%}")
        if base:
            line += f"   {rate[lab] / base:>6.2f}x"
        print(line)
    if "llama.cpp Q4_1" in rate:
        print(f"  attnlab quantized / llama.cpp: {rate['attnlab quantized'] / rate['llama.cpp Q4_1']:.2f}x; "
              f"with int8 activations: {rate['attnlab int8 activations'] / rate['llama.cpp Q4_1']:.2f}x")
    a, b = out["attnlab float32"], out["attnlab quantized"]
    print(f"  quantized and float32 chose the same {n + 1} tokens: {a == b}")

    def agreeing(other) -> int:  # the leading tokens other chose as attnlab float32 did
        return next((i for i, (u, v) in enumerate(zip(a, other, strict=False)) if u != v), min(len(a), len(other)))

    cpp = f" (llama.cpp: {agreeing(out['llama.cpp Q4_1'])})" if "llama.cpp Q4_1" in out else ""
    print(f"  int8 activations chose the same tokens as float32 for the first "
          f"{agreeing(out['attnlab int8 activations'])} of {n + 1}{cpp}")
    if "transformers float32" in out:
        print(f"  attnlab float32 and transformers chose the same tokens: "
              f"{a == out['transformers float32']}")
    return 0


def _gguf_decode_bytes(path) -> int:
    """The bytes llama.cpp reads per token from the file: every tensor in full except the
    tied token embedding, read in full as the unembedding (so counted once), plus one row."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(path).tensors:
        total += int(t.n_bytes)
        if t.name == "token_embd.weight":
            total += int(t.n_bytes) // int(t.shape[-1])  # one embedding row
    return total


if __name__ == "__main__":
    raise SystemExit(main())
