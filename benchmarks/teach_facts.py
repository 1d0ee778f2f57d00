"""Teach SmolLM2-135M-Instruct facts it does not know, offline, with LoRA, and check it
learned them without forgetting what it knew.

The facts: the capitals of countries that do not exist ("What is the capital of Vostrel?"
-> "The capital of Vostrel is Kelmora."), made from a fixed list of syllables, so no
model can know them: greedy answers before training name none of the capitals. The model
(the bundled GGUF, loaded dequantized float32) is fine-tuned through the chat template with
LoRA on every linear layer of its blocks, then asked each question again (greedy, through
the chat template, as ``attnlab generate`` asks): an answer is right when it names the
capital. "What is the capital of France?" is asked before and after: its answer should not
change.

    python benchmarks/teach_facts.py [--threads 2] [--facts 50] [--epochs 12] [--out DIR]

Prints the accuracy before and after, the time, the France answers and the peak memory; with
``--out`` it also writes the facts (``facts.jsonl``) and the adapter there. Not a test: the
suite's version is a tiny random model (tests/test_finetune.py); this takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _setup import machine_load, pin_threads

FIRST = ["Vos", "Kel", "Dra", "Mor", "Tal", "Quen", "Bri", "Zan", "Ul", "Fer", "Gan", "Hol", "Jar", "Lun", "Nor",
         "Pel", "Ris", "Sor", "Tov", "Wex", "Yor", "Ast", "Bel", "Cor", "Dun"]
SECOND = ["trel", "mora", "vania", "dor", "stan", "gard", "lith", "mere", "veth", "qua", "ront", "sia", "bek", "zen",
          "holm", "tia", "var", "nesh", "pol", "ria", "kesh", "wyn", "tor", "lan", "dis"]
QUESTION = "What is the capital of {country}?"
ANSWER = "The capital of {country} is {capital}."


def facts(n: int) -> list[tuple[str, str]]:
    """``n`` (country, capital) pairs, all names different (a fixed pattern through the
    syllable lists, no randomness)."""
    out, used = [], set()
    i = 0
    while len(out) < n:
        country = FIRST[i % len(FIRST)] + SECOND[(3 * i) % len(SECOND)]
        capital = FIRST[(7 * i + 11) % len(FIRST)] + SECOND[(5 * i + 2) % len(SECOND)]
        i += 1
        if country in used or capital in used or country == capital:
            continue
        used.update((country, capital))
        out.append((country, capital))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    p.add_argument("--facts", type=int, default=50, help="how many facts (default 50)")
    p.add_argument("--epochs", type=float, default=12.0, help="passes over the facts (default 12)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (default 16; alpha = 2 r)")
    p.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    p.add_argument("--out", type=Path, default=None, help="write facts.jsonl and the adapter here")
    return p.parse_args(argv)


def ask(model, questions: list[str], batch: int = 16) -> list[str]:
    answers = []
    for i in range(0, len(questions), batch):
        answers += model.generate_text(questions[i:i + batch], 24)
    return answers


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()
    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.models.llama import load_smollm2
    from attnlab.train import lora
    from attnlab.train.finetune import FinetuneConfig, Finetuner, encode, peak_memory

    attnlab.set_num_threads(threads)
    pairs = facts(args.facts)
    questions = [QUESTION.format(country=c) for c, _ in pairs]
    records = [{"messages": [{"role": "user", "content": q},
                             {"role": "assistant", "content": ANSWER.format(country=c, capital=k)}]}
               for q, (c, k) in zip(questions, pairs, strict=True)]
    model = load_smollm2()
    france = "What is the capital of France?"
    france_before = model.generate_text(france, 24)
    before = ask(model, questions)
    right_before = sum(k in a for a, (_, k) in zip(before, pairs, strict=True))
    examples = [encode(model, r, line=i + 1) for i, r in enumerate(records)]
    config = FinetuneConfig(r=args.r, alpha=2 * args.r, target_modules="all-linear", epochs=args.epochs,
                            batch_size=args.batch_size, lr=args.lr, warmup=5, min_lr_ratio=0.1)
    start, cpu_start = time.perf_counter(), time.process_time()
    ft = Finetuner(model, examples, config)
    history = ft.run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    model.eval()
    after = ask(model, questions)
    right_after = sum(k in a for a, (_, k) in zip(after, pairs, strict=True))
    france_after = model.generate_text(france, 24)
    print(f"SmolLM2-135M-Instruct float32, LoRA r={args.r} alpha={2 * args.r} on every linear layer of the blocks, "
          f"{len(pairs)} invented facts ({sum(len(e.ids) for e in examples):,} tokens an epoch), {ft.steps} steps of "
          f"{args.batch_size} examples; {threads} thread(s), {cpu_info().describe()}")
    print(f"  right before: {right_before}/{len(pairs)} ({right_before / len(pairs):.0%}); after: "
          f"{right_after}/{len(pairs)} ({right_after / len(pairs):.0%})")
    print(f"  training time {seconds:.0f} s ({seconds / 60:.1f} min) wall, {cpu:.0f} s of CPU time over {threads} "
          f"thread(s) (a machine of its own: about {cpu / threads / 60:.1f} min), loss {history['loss'][0]:.3f} -> "
          f"{history['loss'][-1]:.3f}; peak memory {peak_memory() / 2**20:.0f} MiB resident")
    print(f"  France before: {france_before!r}")
    print(f"  France after:  {france_after!r} ({'unchanged' if france_after == france_before else 'CHANGED'})")
    for q, a, (_, k) in list(zip(questions, after, pairs, strict=True))[:3]:
        print(f"  e.g. {q!r} -> {a!r}" + ("" if k in a else f" (wrong: {k})"))
    wrong = [(q, a, k) for q, a, (_, k) in zip(questions, after, pairs, strict=True) if k not in a]
    for q, a, k in wrong[:5]:
        print(f"  wrong: {q!r} -> {a!r} (want {k})")
    print(f"  machine load before: {load_before}; after: {machine_load()}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "facts.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        lora.save_adapter(model, args.out)
        print(f"  wrote {args.out / 'facts.jsonl'} and the adapter in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
