"""When the first streamed token appears, and what streaming costs: SmolLM2's ``stream``
against a prompt's forward pass plus one decoding step, and a whole answer streamed as text
(``stream`` through ``decode_stream``, as ``attnlab generate`` prints it) against the same
tokens from ``generate``; each pair timed in turns in one process (the median of each, and
their ratio: a first-token ratio below 1 means the first token comes before a prefill and
a step would have ended; a whole-answer ratio of 1 means streaming costs nothing).

Run ``python benchmarks/first_token.py [--repeats 7] [--threads 2] [--quantized] [--new 32]``.
Prints; never a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _setup import machine_load, pin_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantized", action="store_true")
    p.add_argument("--prompt", default="Tell me a long story about a cat who learns to read.")
    p.add_argument("--new", type=int, default=32, help="new tokens of the whole answer (no end token: all of them)")
    args = p.parse_args()
    threads = pin_threads(args.threads)

    import numpy as np

    from attnlab._cpu import cpu_info
    from attnlab.models import load_smollm2
    from attnlab.models.decoder import decode_stream

    model = load_smollm2(quantized=args.quantized)
    ids, _ = model.encode(model.chat_prompt(args.prompt))
    model.generate(ids, 2)  # warm-up: compiled kernels, caches

    def prefill_and_step():
        cache = model.new_cache()
        logits = model(ids[None], cache=cache, logits_to_keep=1)
        model(np.array([[int(logits[0, -1].argmax())]]), cache=cache, logits_to_keep=1)

    def first_streamed():
        tokens = model.stream(ids, 64)
        next(tokens)
        tokens.close()

    def generated():
        return model.tokenizer.decode(model.generate(ids, args.new)[len(ids):].tolist(), skip_special_tokens=False)

    def streamed_text():
        return "".join(decode_stream(model.tokenizer, model.stream(ids, args.new)))

    answer = generated()
    same = streamed_text() == answer
    pairs = ((("prefill + one step", prefill_and_step), ("first streamed token", first_streamed)),
             ((f"generate {args.new}, decode", generated), (f"stream {args.new} as text", streamed_text)))
    load_before = machine_load()
    results = []
    for pair in pairs:
        times: dict[str, list[float]] = {name: [] for name, _ in pair}
        for _ in range(args.repeats):
            for name, fn in pair:
                time.sleep(0.1)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        (base, _), (other, _) = pair
        results.append((times, base, other, [o / b for o, b in zip(times[other], times[base], strict=True)]))
    print(f"CPU: {cpu_info().describe()}; {threads} thread(s); load average {load_before} before, "
          f"{machine_load()} after")
    print(f"SmolLM2-135M-Instruct ({'quantized' if args.quantized else 'float32'}), a {len(ids)}-token prompt, "
          f"median of {args.repeats} timed in turns; the streamed text {'equals' if same else 'DIFFERS FROM'} "
          f"the generated one ({answer[:50]!r}...)")
    for times, base, other, ratios in results:
        for name, values in times.items():
            print(f"  {name:24s} {1e3 * statistics.median(values):8.1f} ms  "
                  f"(spread {1e3 * min(values):.1f}-{1e3 * max(values):.1f})")
        print(f"  {other} / {base}: median {statistics.median(ratios):.2f} "
              f"(spread {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
