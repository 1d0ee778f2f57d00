"""When the first streamed token appears: SmolLM2's ``stream`` against a prompt's forward pass
plus one decoding step, timed in turns in one process (the median of each, and their ratio:
below 1, the first token comes before a prefill and a step would have ended).

Run ``python benchmarks/first_token.py [--repeats 7] [--threads 2] [--quantized]``. Prints;
never a test.
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
    args = p.parse_args()
    threads = pin_threads(args.threads)

    import numpy as np

    from attnlab._cpu import cpu_info
    from attnlab.models import load_smollm2

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

    times: dict[str, list[float]] = {"prefill + one step": [], "first streamed token": []}
    for _ in range(args.repeats):
        for name, fn in (("prefill + one step", prefill_and_step), ("first streamed token", first_streamed)):
            time.sleep(0.1)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [f / p for f, p in zip(times["first streamed token"], times["prefill + one step"], strict=True)]
    print(f"CPU: {cpu_info().describe()}; {threads} thread(s); load average {machine_load()}")
    print(f"SmolLM2-135M-Instruct ({'quantized' if args.quantized else 'float32'}), a {len(ids)}-token prompt, "
          f"median of {args.repeats} timed in turns")
    for name, values in times.items():
        print(f"  {name:22s} {1e3 * med[name]:7.1f} ms  (spread {1e3 * min(values):.1f}-{1e3 * max(values):.1f})")
    print(f"  first token / (prefill + one step): median {statistics.median(ratios):.2f} "
          f"(spread {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
