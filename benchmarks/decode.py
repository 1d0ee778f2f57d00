"""Decode speed of SmolLM2-135M-Instruct against the machine's memory-bandwidth limit:
attnlab float32, attnlab with the GGUF's Q4_1/Q8_0 weights kept quantized, transformers
float32 (the same file, dequantized) and llama.cpp (on the same GGUF, where
``llama-cpp-python`` imports).

A decode step reads every weight once, so ``bandwidth / weight bytes per token`` is the
fastest the machine allows; each rate is shown as tokens/s and as its share of that limit.
The bandwidth is measured first: ``threads`` threads each take the max of their slice of a
buffer 8x the last-level cache (at least 256 MiB), best of 5 (see
:func:`attnlab.decode_bench.memory_bandwidth`). Weight bytes per token: every block's
weights, the final norm, the unembedding and one embedding row
(:func:`attnlab.decode_bench.decode_weight_bytes`; for llama.cpp the file's own block
bytes, its float16 scales included).

Each library generates ``1`` and ``new + 1`` greedy tokens after the prompt, in turns
(attnlab float32, attnlab quantized, transformers, llama.cpp, attnlab float32, ...);
the median difference is ``new`` decode steps. Ratios come from the same run.

    python benchmarks/decode.py [--threads 2] [--repeat 3] [--prompt 64] [--new 64]

Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import time
import warnings

from _setup import machine_load, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="threads for every library (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds, taking turns (default 3)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new", type=int, default=64, help="new tokens timed (default 64)")
    p.add_argument("--no-torch", action="store_true", help="leave transformers out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import numpy as np

    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.benchmark import interleaved_medians
    from attnlab.decode_bench import bandwidth_share, decode_weight_bytes, memory_bandwidth
    from attnlab.models.llama import load_smollm2, smollm2_path

    attnlab.set_num_threads(threads)
    bandwidth = memory_bandwidth(threads=threads)
    t0 = time.perf_counter()
    f32 = load_smollm2()
    t1 = time.perf_counter()
    q = load_smollm2(quantized=True)
    t2 = time.perf_counter()
    path = smollm2_path()
    text = ("The history of the printing press begins with movable type, and it changed how people learned, "
            "argued and remembered. ") * 20
    ids = f32.encode(text)[0][: args.prompt][None]
    n = args.new
    out: dict = {}
    runs: dict = {}
    weight_bytes: dict = {"attnlab float32": decode_weight_bytes(f32), "attnlab quantized": decode_weight_bytes(q)}

    def gen(model, key, k):
        def run():
            out[key] = model.generate(ids, k)
        return run

    for label, model in (("attnlab float32", f32), ("attnlab quantized", q)):
        runs[(label, 1)] = gen(model, (label, 1), 1)
        runs[(label, n + 1)] = gen(model, (label, n + 1), n + 1)

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
            weight_bytes["transformers float32"] = weight_bytes["attnlab float32"]

            def tgen(k):
                def run():
                    with torch.inference_mode(), warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out[("transformers float32", k)] = theirs.generate(
                            ids_t, max_new_tokens=k, min_new_tokens=k, do_sample=False).numpy()
                return run

            runs[("transformers float32", 1)] = tgen(1)
            runs[("transformers float32", n + 1)] = tgen(n + 1)

    try:
        from llama_cpp import Llama as LlamaCpp
    except ImportError:
        LlamaCpp = None
    if LlamaCpp is not None:
        llama = LlamaCpp(str(path), n_ctx=args.prompt + n + 8, n_threads=threads, n_batch=args.prompt, verbose=False)
        prompt_list = ids[0].tolist()
        weight_bytes["llama.cpp Q4_1"] = _gguf_decode_bytes(path)

        def cgen(k):
            def run():
                llama.reset()
                toks = []
                for tok in llama.generate(prompt_list, temp=0.0, top_k=1, reset=True):
                    toks.append(tok)
                    if len(toks) == k:
                        break
                out[("llama.cpp Q4_1", k)] = toks
            return run

        runs[("llama.cpp Q4_1", 1)] = cgen(1)
        runs[("llama.cpp Q4_1", n + 1)] = cgen(n + 1)

    times = interleaved_medians(runs, args.repeat, settle=0.05)
    labels = list(dict.fromkeys(label for label, _ in runs))
    # a busy machine can make the difference meaningless (<= 0): then no rate
    rate = {lab: n / d if (d := times[(lab, n + 1)] - times[(lab, 1)]) > 0 else float("nan") for lab in labels}
    base = rate.get("transformers float32")

    print(f"SmolLM2-135M-Instruct decode, greedy, {ids.shape[1]}-token prompt + {n} new tokens, batch 1")
    print(f"cpu      {cpu_info().describe()}")
    print(f"threads  {threads}; numpy {np.__version__}")
    print(f"load     before {load_before}; after {machine_load()}  (a shared machine: the ratios are taken in turns)")
    print(f"memory bandwidth ({threads} thread(s), max over a {max(256 << 20, 8 * cpu_info().l3) >> 20} MiB int64 "
          f"buffer): {bandwidth / 1e9:.1f} GB/s")
    print(f"attnlab load: float32 {t1 - t0:.1f} s, quantized {t2 - t1:.1f} s")
    print(f"median of {args.repeat} rounds, taken in turns:")
    head = f"  {'':<22}{'MB/token':>10}{'limit tok/s':>13}{'tokens/s':>10}{'of limit':>10}"
    print(head + ("   vs transformers" if base else ""))
    for lab in labels:
        wb = weight_bytes[lab]
        line = (f"  {lab:<22}{wb / 1e6:>10.1f}{bandwidth / wb:>13.1f}{rate[lab]:>10.1f}"
                f"{bandwidth_share(rate[lab], bandwidth, wb):>10.0%}")
        if base:
            line += f"   {rate[lab] / base:>6.2f}x"
        print(line)
    if "llama.cpp Q4_1" in rate:
        print(f"  attnlab quantized / llama.cpp: {rate['attnlab quantized'] / rate['llama.cpp Q4_1']:.2f}x")
    a, b = out[("attnlab float32", n + 1)], out[("attnlab quantized", n + 1)]
    print(f"  quantized and float32 chose the same {n + 1} tokens: {np.array_equal(a, b)}")
    if ("transformers float32", n + 1) in out:
        print(f"  attnlab float32 and transformers chose the same tokens: "
              f"{np.array_equal(a, out[('transformers float32', n + 1)])}")
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
