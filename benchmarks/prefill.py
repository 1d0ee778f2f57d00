"""Prefill (one prompt through the whole model, the next token's logits only) and encoding,
attnlab against transformers, side by side in one process: GPT-2 small (random weights
written by transformers), SmolLM2-135M (the bundled GGUF, float32) and all-MiniLM-L6-v2
(sentence-transformers, where installed).

The runs take turns (attnlab, transformers, attnlab, ...) and the median of each is kept;
the same thread count for both. ``--profile`` writes a cProfile of one attnlab prefill per
model instead (``--out`` folder) and prints the top entries.

    python benchmarks/prefill.py [--threads 2] [--repeat 5] [--prompt 512] [--models gpt2,smollm2,minilm]

Needs the ``test`` extra. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

from _setup import machine_load, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for both libraries (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each, taking turns (default 5)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--sentences", type=int, default=256, help="MiniLM sentences (default 256)")
    p.add_argument("--models", default="gpt2,smollm2,minilm", help="comma-separated: gpt2, smollm2, minilm")
    p.add_argument("--profile", action="store_true", help="cProfile one attnlab prefill per model instead")
    p.add_argument("--out", default=".", help="folder of the --profile files (default: here)")
    p.add_argument("--system-allocator", action="store_true",
                   help="leave glibc returning freed memory to the system (default: attnlab.keep_freed_memory(), "
                        "as the attnlab command runs; for the whole process, transformers included)")
    return p.parse_args(argv)


def gpt2_pair(prompt_len):
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnlab.models import GPT2

    torch.manual_seed(0)
    theirs = GPT2LMHeadModel(GPT2Config(n_positions=max(1024, prompt_len))).eval()
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder, safe_serialization=True)
        ours = GPT2.from_pretrained(folder)
    ids = np.random.default_rng(0).integers(0, theirs.config.vocab_size, size=(1, prompt_len))
    return ours, theirs, ids


def smollm2_pair(prompt_len):
    import torch
    from transformers import AutoModelForCausalLM

    from attnlab.models.llama import load_smollm2, smollm2_path

    ours = load_smollm2()
    path = smollm2_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    text = ("The history of the printing press begins with movable type, and it changed how people learned, "
            "argued and remembered. ") * 40
    ids = ours.encode(text)[0][:prompt_len][None]
    return ours, theirs, ids


def prefill_runs(name, ours, theirs, ids):
    import torch

    ids_t = torch.from_numpy(ids)

    def run_ours():
        return ours(ids, cache=ours.new_cache(), logits_to_keep=1)

    def run_theirs():
        with torch.inference_mode():
            return theirs(ids_t, logits_to_keep=1).logits

    a, b = run_ours(), run_theirs().numpy()
    err = float(abs(a - b).max())
    return {f"{name}_ours": run_ours, f"{name}_theirs": run_theirs}, err


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()
    import numpy as np
    import torch

    import attnlab
    from attnlab.benchmark import interleaved_medians

    torch.set_num_threads(threads)
    attnlab.set_num_threads(threads)
    if not args.system_allocator:
        attnlab.keep_freed_memory()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    runs, errs = {}, {}
    for m in models:
        if m == "gpt2":
            r, errs[m] = prefill_runs(m, *gpt2_pair(args.prompt))
        elif m == "smollm2":
            r, errs[m] = prefill_runs(m, *smollm2_pair(args.prompt))
        elif m == "minilm":
            r, errs[m] = minilm_pair(args.sentences)
        else:
            raise SystemExit(f"unknown model {m!r}")
        runs.update(r)
    if args.profile:
        import cProfile
        import pstats
        from pathlib import Path

        for m in models:
            f = runs[f"{m}_ours"]
            f()
            prof = cProfile.Profile()
            prof.enable()
            f()
            prof.disable()
            out = Path(args.out) / f"prefill_{m}.prof"
            prof.dump_stats(out)
            print(f"== {m}: {out}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    times = interleaved_medians(runs, args.repeat)
    print(f"threads {threads}; numpy {np.__version__}, torch {torch.__version__}; prompt {args.prompt} tokens, "
          f"batch 1, next-token logits only")
    print(f"load before {load_before}; after {machine_load()}")
    print("memory: " + ("glibc's defaults (--system-allocator)" if args.system_allocator
                        else "freed memory kept for reuse (attnlab.keep_freed_memory), both libraries"))
    print(f"median of {args.repeat} runs each, taken in turns:")
    print(f"  {'':<10} {'attnlab ms':>11} {'transformers ms':>16} {'time ratio':>11} {'max |diff|':>11}")
    for m in models:
        a, b = times[f"{m}_ours"], times[f"{m}_theirs"]
        print(f"  {m:<10} {1e3 * a:>11.1f} {1e3 * b:>16.1f} {a / b:>10.2f}x {errs[m]:>11.2e}")
    return 0


def minilm_pair(n):
    """Encode ``n`` sentences (batch 32) with attnlab and sentence-transformers."""
    import numpy as np
    import torch
    from minilm import make_texts
    from sentence_transformers import SentenceTransformer

    from attnlab.models.bert import load_minilm, minilm_path

    ours = load_minilm()
    st = SentenceTransformer(str(minilm_path()), device="cpu")
    texts = make_texts(n, 0)[0]

    def run_ours():
        return ours.encode(texts, batch_size=32)

    def run_theirs():
        with torch.inference_mode():
            return st.encode(texts, batch_size=32, show_progress_bar=False)

    err = float(np.abs(run_ours() - run_theirs()).max())
    return {"minilm_ours": run_ours, "minilm_theirs": run_theirs}, err


if __name__ == "__main__":
    raise SystemExit(main())
