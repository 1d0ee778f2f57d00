"""GPT-2 generation on the CPU: attnlab's NumPy decoder vs transformers (torch).

A GPT-2 small shaped model (12 layers, 12 heads, 768 wide, 50,257 tokens; random weights
written by transformers, nothing downloaded) continues a 512-token prompt by 128 tokens,
greedily. Printed side by side from one run, the runs taking turns (attnlab, transformers,
attnlab, ...; the median of each is kept), with the same thread count for both (NumPy's
BLAS via the ``*_NUM_THREADS`` variables set before NumPy is imported, attnlab's pool via
``attnlab.set_num_threads``, torch via ``torch.set_num_threads``):

- new tokens per second, prompt included (the time of the whole ``generate`` call), for
  attnlab and for ``GPT2LMHeadModel.generate(do_sample=False)``, and their ratio (> 1:
  attnlab is faster); also the prompt's and each new token's share;
- the speed-up of the key/value cache over recomputing the whole sequence for every new
  token (attnlab both ways): per new token (a cached step against a whole-sequence pass
  at the first and the last new token's length, taken in turns), and for all the new
  tokens (the measured ``generate`` call against the recomputation's total, estimated from
  those two passes: recomputing 128 tokens outright takes minutes); the first
  ``--recompute-tokens`` tokens are recomputed outright to check they are the same;
- whether both produced the same tokens, the CPU model and flags, the thread count and
  the machine's load (``os.getloadavg``) before and after.

    python benchmarks/generate.py [--threads 2] [--repeat 3] [--prompt 512] [--new 128]

Needs the ``test`` extra (torch, transformers). Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

from _setup import machine_load, pin_threads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for both libraries (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each, taking turns (default 3)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    p.add_argument("--recompute-tokens", type=int, default=4,
                   help="new tokens recomputed outright to check the cache's tokens (default 4)")
    p.add_argument("--layers", type=int, default=12, help="n_layer (default 12, GPT-2 small)")
    p.add_argument("--width", type=int, default=768, help="n_embd (default 768); 12 heads")
    return p.parse_args(argv)


def cpu_description() -> str:
    """The CPU's model name and its vector flags, from /proc/cpuinfo (Linux)."""
    import platform

    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key.strip() == "flags":
                    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                              "amx_tile")
                    flags = [f for f in value.split() if f in wanted]
                    break
    except OSError:
        pass
    return f"{model}; flags: {' '.join(flags) or 'unknown'}"


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()

    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import attnlab
    from attnlab.benchmark import interleaved_medians
    from attnlab.models import GPT2

    torch.set_num_threads(threads)
    attnlab.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=12, n_positions=max(1024, args.prompt + args.new))
    theirs = GPT2LMHeadModel(cfg).eval()
    theirs.generation_config.eos_token_id = None  # 128 tokens, no early stop
    theirs.generation_config.pad_token_id = None
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder, safe_serialization=True)
        t0 = time.perf_counter()
        ours = GPT2.from_pretrained(folder)
        load_s = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, args.prompt))
    prompt_t = torch.from_numpy(prompt)
    out = {}

    def run_ours():
        out["ours"] = ours.generate(prompt, args.new)

    def run_theirs():
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["theirs"] = theirs.generate(prompt_t, max_new_tokens=args.new, min_new_tokens=args.new,
                                            do_sample=False).numpy()

    def prefill_ours():
        ours(prompt, cache=ours.new_cache(), logits_to_keep=1)

    def prefill_theirs():
        with torch.inference_mode():
            theirs(prompt_t, logits_to_keep=1)

    cache = ours.new_cache()
    ours(prompt, cache=cache, logits_to_keep=1)
    token = prompt[:, -1:]

    def cached_step():  # one new token against the cache (the cache is trimmed back after)
        ours(token, cache=cache, logits_to_keep=1)
        for c in cache:
            c.length -= 1

    def recompute(length):  # the whole sequence of that length, for its next token
        seq = np.resize(prompt, (1, length))
        return lambda: ours(seq, logits_to_keep=1)

    times = interleaved_medians({"ours": run_ours, "theirs": run_theirs, "prefill_ours": prefill_ours,
                                 "prefill_theirs": prefill_theirs}, args.repeat)
    step_times = interleaved_medians({"cached": cached_step, "first": recompute(args.prompt),
                                      "last": recompute(args.prompt + args.new - 1)}, args.repeat)
    seq = prompt
    for _ in range(args.recompute_tokens):  # outright recomputation: the same tokens?
        seq = np.concatenate([seq, ours(seq, logits_to_keep=1)[:, -1].argmax(-1)[:, None]], axis=1)
    same = np.array_equal(out["ours"], out["theirs"])
    same_recompute = np.array_equal(seq, out["ours"][:, : seq.shape[1]])

    n = args.new
    print(f"GPT-2 ({args.layers} layers, 12 heads, n_embd {args.width}, vocabulary {cfg.vocab_size}; random "
          f"weights), greedy, {args.prompt}-token prompt + {n} new tokens, batch 1")
    print(f"cpu      {cpu_description()}")
    print(f"threads  {threads} (BLAS, attnlab's pool, torch); numpy {np.__version__}, torch {torch.__version__}")
    print(f"load     before {load_before}; after {machine_load()}  (the machine is shared: ratios come from runs "
          "taken in turns)")
    print(f"median of {args.repeat} runs each, taken in turns:")
    rows = [("new tokens/s (whole generate call)", n / times["ours"], n / times["theirs"]),
            (f"prompt ({args.prompt} tokens), ms", 1e3 * times["prefill_ours"], 1e3 * times["prefill_theirs"]),
            ("per new token after the prompt, ms", 1e3 * (times["ours"] - times["prefill_ours"]) / n,
             1e3 * (times["theirs"] - times["prefill_theirs"]) / n)]
    print(f"  {'':<38} {'attnlab':>9} {'transformers':>13} {'ratio':>7}")
    for i, (name, a, b) in enumerate(rows):
        ratio = a / b if i == 0 else b / a  # > 1: attnlab faster
        print(f"  {name:<38} {a:>9.2f} {b:>13.2f} {ratio:>6.2f}x")
    print(f"  same {n} tokens as transformers: {same}")
    per_token = (step_times["first"] + step_times["last"]) / 2  # new token i reruns prompt + i tokens
    total = n * per_token
    print(f"cache vs recomputing everything (attnlab): a new token costs {1e3 * step_times['cached']:.1f} ms "
          f"with the cache, {1e3 * step_times['first']:.0f}-{1e3 * step_times['last']:.0f} ms recomputing the "
          f"sequence ({per_token / step_times['cached']:.0f}x); all {n} tokens after the prompt: "
          f"{times['ours']:.1f} s vs about {total:.0f} s ({total / times['ours']:.1f}x; the recomputation's total "
          f"from its first and last step). The first {args.recompute_tokens} tokens recomputed outright are the "
          f"same: {same_recompute}")
    print(f"attnlab load time (safetensors, Conv1D transposed): {load_s:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
