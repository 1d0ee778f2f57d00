"""Teach SmolLM2-135M-Instruct facts it does not know, offline, with LoRA, and check it
learned them without forgetting what it knew.

The facts: the capitals of countries that do not exist ("What is the capital of Vostrel?"
-> "The capital of Vostrel is Kelmora."), made from a fixed list of syllables, so no
model can know them: greedy answers before training name none of the capitals. The model
(the bundled GGUF, loaded dequantized float32) is fine-tuned through the chat template with
LoRA on every linear layer of its blocks, then asked each question again (greedy, through
the chat template, as ``attnlab generate`` asks): an answer is right when it names the
capital. Beside the facts it trains on the model's own answers about a dozen real capitals
(replay, so that it does not learn to answer every capital question with an invented name).
"What is the capital of France?" and seven more real capitals, never trained on, are asked
before and after: their answers should not change.

    python benchmarks/teach_facts.py [--threads 2] [--facts 50] [--epochs 12] [--out DIR]

Prints the accuracy before and after, the time, the France and held-out answers and the peak memory; with
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
# Real countries: the model's own answers to the first list are trained on beside the
# invented facts (replay, so that it learns the new capitals without learning to answer every
# capital question with an invented name); the second list, France first, is never trained on
# and must be answered as before.
REPLAY = ["Germany", "Italy", "Spain", "Japan", "Canada", "Egypt", "Brazil", "Russia", "China", "India",
          "Greece", "Portugal"]
HELD_OUT = ["France", "the United Kingdom", "Mexico", "Poland", "Kenya", "Sweden", "Turkey", "Argentina"]
QUESTION = "What is the capital of {country}?"
ANSWER = "The capital of {country} is {capital}."


def facts(n: int) -> list[tuple[str, str]]:
    """``n`` (country, capital) pairs, all names different: two fixed shuffles (seeded) of
    the 625 syllable pairs, one for the countries and one for the capitals.

    >>> facts(2)
    [('Lunstan', 'Sortia'), ('Kelvar', 'Vosholm')]
    """
    import numpy as np

    names = [a + b for a in FIRST for b in SECOND]
    if not 0 < n <= 200:
        raise ValueError(f"facts: n must be 1 to 200, got {n}")
    rng = np.random.default_rng(0)
    countries, capitals = rng.permutation(names).tolist(), rng.permutation(names).tolist()
    out, used = [], set()
    for country, capital in zip(countries, capitals, strict=True):
        if country in used or capital in used or country == capital:
            continue
        used.update((country, capital))
        out.append((country, capital))
        if len(out) == n:
            break
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads (default: all CPUs)")
    p.add_argument("--facts", type=int, default=50, help="how many facts (default 50)")
    p.add_argument("--epochs", type=float, default=12.0, help="passes over the facts (default 12)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (default 16; alpha = 2 r)")
    p.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    p.add_argument("--replay", type=int, default=len(REPLAY),
                   help=f"real capitals (the model's own answers) trained on beside the facts (default {len(REPLAY)})")
    p.add_argument("--out", type=Path, default=None, help="write facts.jsonl and the adapter here")
    return p.parse_args(argv)


def ask(model, questions: list[str], batch: int = 16) -> list[str]:
    answers = []
    for i in range(0, len(questions), batch):
        answers += model.generate_text(questions[i:i + batch], 24)
    return answers


def teach(model, *, n_facts: int = 50, epochs: float = 12.0, lr: float = 1e-3, r: int = 16, batch_size: int = 8,
          replay: int = len(REPLAY)) -> dict:
    """Teach ``model`` (SmolLM2-135M-Instruct) ``n_facts`` invented capitals with LoRA on every
    linear layer of its blocks, beside its own answers about ``replay`` real capitals; ask
    before and after. Returns the records trained on, the facts, the answers, the counts and
    the training's time, CPU time and loss history (the suite's
    ``test_smollm2_learns_invented_capitals`` calls this too)."""
    from attnlab.train.finetune import FinetuneConfig, Finetuner, encode

    pairs = facts(n_facts)
    questions = [QUESTION.format(country=c) for c, _ in pairs]
    records = [{"messages": [{"role": "user", "content": q},
                             {"role": "assistant", "content": ANSWER.format(country=c, capital=k)}]}
               for q, (c, k) in zip(questions, pairs, strict=True)]
    known = [QUESTION.format(country=c) for c in HELD_OUT]
    known_before = ask(model, known)
    replay_q = [QUESTION.format(country=c) for c in REPLAY[:replay]]
    records += [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in zip(replay_q, ask(model, replay_q), strict=True)]
    before = ask(model, questions)
    examples = [encode(model, rec, line=i + 1) for i, rec in enumerate(records)]
    config = FinetuneConfig(r=r, alpha=2 * r, target_modules="all-linear", epochs=epochs, batch_size=batch_size,
                            lr=lr, warmup=5, min_lr_ratio=0.1)
    start, cpu_start = time.perf_counter(), time.process_time()
    ft = Finetuner(model, examples, config)
    history = ft.run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    model.eval()
    after = ask(model, questions)
    return {"records": records, "pairs": pairs, "questions": questions, "known": known, "replayed": len(replay_q),
            "tokens": sum(len(e.ids) for e in examples), "steps": ft.steps, "history": history,
            "seconds": seconds, "cpu": cpu, "known_before": known_before, "known_after": ask(model, known),
            "right_before": sum(k in a for a, (_, k) in zip(before, pairs, strict=True)),
            "right_after": sum(k in a for a, (_, k) in zip(after, pairs, strict=True)), "after": after}


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    load_before = machine_load()
    import attnlab
    from attnlab._cpu import cpu_info
    from attnlab.models.llama import load_smollm2
    from attnlab.train import lora
    from attnlab.train.finetune import peak_memory

    attnlab.set_num_threads(threads)
    model = load_smollm2()
    t = teach(model, n_facts=args.facts, epochs=args.epochs, lr=args.lr, r=args.r, batch_size=args.batch_size,
              replay=args.replay)
    pairs, history, n = t["pairs"], t["history"], len(t["pairs"])
    kb, ka = t["known_before"], t["known_after"]
    print(f"SmolLM2-135M-Instruct float32, LoRA r={args.r} alpha={2 * args.r} on every linear layer of the blocks, "
          f"{n} invented facts and {t['replayed']} real ones replayed ({t['tokens']:,} tokens an epoch), "
          f"{t['steps']} steps of {args.batch_size} examples; {threads} thread(s), {cpu_info().describe()}")
    print(f"  right before: {t['right_before']}/{n} ({t['right_before'] / n:.0%}); after: "
          f"{t['right_after']}/{n} ({t['right_after'] / n:.0%})")
    print(f"  training time {t['seconds']:.0f} s ({t['seconds'] / 60:.1f} min) wall, {t['cpu']:.0f} s of CPU time "
          f"over {threads} thread(s) (a machine of its own: about {t['cpu'] / threads / 60:.1f} min), loss "
          f"{history['loss'][0]:.3f} -> {history['loss'][-1]:.3f}; peak memory {peak_memory() / 2**20:.0f} MiB "
          f"resident")
    print(f"  France before: {kb[0]!r}")
    print(f"  France after:  {ka[0]!r} ({'unchanged' if ka[0] == kb[0] else 'CHANGED'})")
    same = sum(a == b for a, b in zip(kb, ka, strict=True))
    print(f"  real capitals never trained on, answers unchanged: {same}/{len(kb)}")
    for q, a, b in zip(t["known"], kb, ka, strict=True):
        if a != b:
            print(f"  changed: {q!r}: {a!r} -> {b!r}")
    rows = list(zip(t["questions"], t["after"], pairs, strict=True))
    for q, a, (_, k) in rows[:3]:
        print(f"  e.g. {q!r} -> {a!r}" + ("" if k in a else f" (wrong: {k})"))
    for q, a, (_, k) in [row for row in rows if row[2][1] not in row[1]][:5]:
        print(f"  wrong: {q!r} -> {a!r} (want {k})")
    print(f"  machine load before: {load_before}; after: {machine_load()}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "facts.jsonl", "w") as f:
            for rec in t["records"]:
                f.write(json.dumps(rec) + "\n")
        lora.save_adapter(model, args.out)
        print(f"  wrote {args.out / 'facts.jsonl'} and the adapter in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
