"""attnlab finetune DATA.jsonl --out FOLDER: fine-tune a language model on your examples.

DATA.jsonl holds one example a line: {"prompt": "...", "completion": "..."} (plain text:
the model learns the completion, then its end token) or {"messages": [{"role": "user",
"content": "..."}, {"role": "assistant", "content": "..."}]} (the model's chat template
renders them; the model learns the assistant's messages). The whole file is checked before
training starts: a bad line is named by its number.

--lora (the default) trains low-rank adapters beside the frozen model (PEFT's LoRA) and
writes FOLDER/adapter_config.json and adapter_model.safetensors, which `attnlab generate
--adapter FOLDER` and PEFT's PeftModel.from_pretrained load. --full trains every parameter
and writes the whole model as a Hugging Face folder (config.json, model.safetensors,
tokenizer), which `attnlab generate --checkpoint FOLDER` loads.

The model (--model) is the bundled SmolLM2-135M-Instruct by default (loaded dequantized,
float32), or a decoder folder or .gguf file. Progress goes to stderr; FOLDER also gets
metrics.json and loss.png (needs matplotlib). Checkpoints go to FOLDER/checkpoints every
--save-every steps and when interrupted (Ctrl-C): `--resume` continues the run exactly where
it stopped; a finished run removes them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from attnlab.cli._common import CLIError, atomic_write, prepare_out_dir

DEFAULT_LR = {"lora": 2e-4, "full": 2e-5}


def register(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="fine-tune SmolLM2 (or any decoder) on a JSONL file: LoRA adapters or every weight",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  attnlab finetune facts.jsonl --out facts-lora --epochs 8 --lr 1e-3\n"
        '  attnlab generate --adapter facts-lora "What is the capital of Zorvania?"\n'
        "  attnlab finetune data.jsonl --out run --target q_proj,k_proj,v_proj,o_proj --r 16 --alpha 32\n"
        "  attnlab finetune data.jsonl --out run --resume        (after Ctrl-C: the same command + --resume)",
    )
    p.add_argument("data", metavar="DATA.jsonl", help="the training examples, one JSON object a line")
    p.add_argument("--out", required=True, metavar="FOLDER", help="where the adapter (or model) and the plot go")
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a decoder folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--lora", dest="method", action="store_const", const="lora",
                     help="train LoRA adapters beside the frozen model (the default)")
    how.add_argument("--full", dest="method", action="store_const", const="full", help="train every parameter")
    p.add_argument("--r", type=int, default=8, metavar="N", help="LoRA rank (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, metavar="X", help="LoRA alpha: scaling alpha/r (default 16)")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P", help="LoRA dropout (default 0)")
    p.add_argument("--target", default="q_proj,v_proj", metavar="NAMES",
                   help="the layers LoRA adapts, transformers' module names separated by commas, or "
                   "all-linear (default q_proj,v_proj)")
    p.add_argument("--epochs", type=float, default=3.0, metavar="X", help="passes over the data (default 3)")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="optimizer steps (instead of --epochs)")
    p.add_argument("--batch-size", type=int, default=4, metavar="N", help="examples per forward pass (default 4)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="forward passes per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=None, metavar="X",
                   help="peak learning rate (default 2e-4 with --lora, 2e-5 with --full)")
    p.add_argument("--warmup", type=int, default=0, metavar="N", help="warm-up steps (default 0)")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="X", help="AdamW's (default 0)")
    p.add_argument("--clip", type=float, default=1.0, metavar="X", help="gradient norm clipping, 0: off (default 1)")
    p.add_argument("--eval", metavar="FILE.jsonl", default=None, help="examples for the evaluation loss")
    p.add_argument("--eval-every", type=int, default=None, metavar="N", help="evaluation loss every N steps")
    p.add_argument("--save-every", type=int, default=None, metavar="N", help="a checkpoint every N steps")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="refuse examples longer than N tokens (default: the model's context)")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="recompute each block in the backward pass: less memory, about a third more time")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="data order and adapters' start (default 0)")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint FOLDER holds")
    p.set_defaults(run=run, method="lora")


def _config(args):
    from attnlab.train.finetune import FinetuneConfig

    for flag in ("r", "batch_size", "grad_accum", "steps", "eval_every", "save_every", "max_length"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    for flag in ("warmup", "seed"):
        if getattr(args, flag) < 0:
            raise CLIError(f"--{flag} must be a non-negative integer, got {getattr(args, flag)}")
    for flag in ("epochs", "alpha", "lr"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CLIError(f"--{flag} must be a positive number, got {value}")
    if not 0 <= args.dropout < 1:
        raise CLIError(f"--dropout must be in [0, 1), got {args.dropout}")
    if not (math.isfinite(args.clip) and args.clip >= 0) or not (math.isfinite(args.weight_decay)
                                                                and args.weight_decay >= 0):
        raise CLIError("--clip and --weight-decay must be non-negative numbers")
    targets = args.target.strip()
    targets = targets if targets == "all-linear" else tuple(t.strip() for t in targets.split(",") if t.strip())
    if not targets:
        raise CLIError("--target is empty: name the layers to adapt, e.g. q_proj,v_proj")
    return FinetuneConfig(
        method=args.method, r=args.r, alpha=args.alpha, dropout=args.dropout, target_modules=targets,
        epochs=args.epochs, steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
        lr=args.lr if args.lr is not None else DEFAULT_LR[args.method], warmup=args.warmup,
        weight_decay=args.weight_decay, clip=args.clip or None, eval_every=args.eval_every,
        save_every=args.save_every, seed=args.seed, checkpoint_blocks=args.checkpoint_blocks)


class _Progress:
    """Steps, loss, tokens/s and time left: one line redrawn in place on a terminal,
    otherwise a line every twentieth of the run (and at evaluations)."""

    def __init__(self, total: int, start_step: int, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, total // 20)
        self.start, self.first = time.perf_counter(), start_step
        self.tokens = 0

    def __call__(self, info) -> None:
        self.tokens += info.tokens
        elapsed = time.perf_counter() - self.start
        done = info.step - self.first
        left = elapsed / max(done, 1) * (self.total - info.step)
        rate = self.tokens / max(elapsed, 1e-9)
        text = (f"step {info.step:>{len(str(self.total))}}/{self.total} loss {info.loss:.4f}"
                + (f" eval {info.eval_loss:.4f}" if info.eval_loss is not None else "")
                + f" {rate:,.0f} tokens/s {_duration(elapsed)} elapsed, {_duration(left)} left")
        if self.tty:
            width = 24
            bar = int(width * info.step / self.total)
            print(f"\r[{'#' * bar}{'.' * (width - bar)}] {text}\033[K", end="", file=self.stream, flush=True)
        elif info.step % self.every == 0 or info.step == self.total or info.eval_loss is not None:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else \
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _load_model(path: str | None):
    if path is None:
        from attnlab.models.llama import load_smollm2

        return load_smollm2()
    from attnlab.models.registry import detect, from_pretrained

    family = detect(path)
    if not family.decoder or family.name == "tiny":
        raise CLIError(f"{path} holds a {family.name} model: fine-tuning takes a decoder folder or .gguf file "
                       "(GPT-2, Llama, Mistral, Qwen2/3, Gemma 2/3)")
    return from_pretrained(path)


def run(args) -> int:
    from attnlab.io.files import CheckpointError
    from attnlab.train import finetune as ft

    config = _config(args)
    data = Path(args.data)
    out = prepare_out_dir(args.out)  # an unwritable folder is found before anything loads
    latest = ft.latest_checkpoint(out)
    if latest is not None and not args.resume:
        raise CLIError(f"{out} holds an unfinished run (checkpoint {latest.name}): add --resume to continue it, "
                       "or choose another --out")
    if args.resume and latest is None:
        raise CLIError(f"--resume: {out} holds no checkpoint to continue from")
    try:
        model = _load_model(args.model)
        if config.method == "full" and not hasattr(type(model), "name_map"):
            raise CLIError(f"--full writes a transformers folder, which {type(model).__name__} has no map for")
        train = ft.load_examples(model, data, max_length=args.max_length)
        evals = ft.load_examples(model, args.eval, max_length=args.max_length) if args.eval else None
        trainer = ft.Finetuner(model, train, config, eval=evals, out=out)
        if args.resume:
            trainer.resume()
    except FileNotFoundError as exc:
        raise CLIError(f"file not found: {exc.filename}" if exc.filename else str(exc)) from None
    except (CheckpointError, ft.DataError) as exc:
        raise CLIError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc).replace("target_modules", "--target")) from None
    except ImportError as exc:
        raise CLIError(f"cannot load the model: {exc}") from None
    except OSError as exc:
        raise CLIError(f"cannot read {exc.filename or args.model}: {exc.strerror or exc}") from None
    n_train = sum(len(e.ids) for e in train)
    what = "LoRA adapters" if config.method == "lora" else "every parameter"
    trained = sum(p.data.size for _, p in trainer.params)
    print(f"attnlab finetune: {getattr(model, 'name', type(model).__name__)}, {what} ({trained:,} parameters), "
          f"{len(train)} examples ({n_train:,} tokens), {trainer.steps} steps"
          + (f", from step {trainer.step}" if trainer.step else ""), file=sys.stderr, flush=True)
    progress = _Progress(trainer.steps, trainer.step)
    start = time.perf_counter()
    try:
        history = trainer.run(progress)
    except KeyboardInterrupt:
        progress.close()
        print(f"attnlab finetune: interrupted at step {trainer.step}; checkpoint saved: run the same command with "
              "--resume to continue", file=sys.stderr)
        return 130
    except ft.NonFiniteLossError as exc:
        progress.close()
        raise CLIError(f"{exc}; the last checkpoint holds the weights before it (lower --lr)") from None
    except OSError as exc:
        progress.close()
        raise CLIError(f"cannot write a checkpoint in {out}: {exc.strerror or exc}") from None
    progress.close()
    seconds = time.perf_counter() - start
    return _finish(args, model, trainer, history, out, seconds)


def _finish(args, model, trainer, history, out: Path, seconds: float) -> int:
    import shutil

    from attnlab.train import finetune as ft
    from attnlab.train import lora

    try:
        if trainer.config.method == "lora":
            lora.save_adapter(model, out)
            wrote = [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
        else:
            ft.save_pretrained(model, out)
            wrote = ["config.json", "model.safetensors"] + (["tokenizer.json"] if model.tokenizer else [])
        peak = ft.peak_memory()
        metrics = {"steps": trainer.step, "seconds": round(seconds, 2), "method": trainer.config.method,
                   "final_loss": history["loss"][-1] if history["loss"] else None,
                   "eval_loss": history["eval_loss"][-1] if history["eval_loss"] else None,
                   "tokens_per_second": round(sum(history["tokens"]) / max(sum(history["seconds"]), 1e-9), 1),
                   "peak_memory_mib": None if peak is None else round(peak / 2**20, 1),
                   "config": trainer.config.to_dict(), "history": history}
        atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(metrics, indent=1)))
        wrote.append("metrics.json")
        try:
            from attnlab.viz.plots import plot_finetune_loss

            atomic_write(out / "loss.png", lambda p: plot_finetune_loss(
                history, title=f"Fine-tuning {getattr(model, 'name', '')}", path=p))
            wrote.append("loss.png")
        except ImportError:
            print("attnlab finetune: matplotlib is not installed; skipped loss.png (pip install 'attnlab[viz]')",
                  file=sys.stderr)
        shutil.rmtree(out / ft.CHECKPOINTS, ignore_errors=True)  # the run finished: nothing to resume
    except OSError as exc:
        raise CLIError(f"cannot write to {out}: {exc.strerror or exc}") from None
    loss = history["loss"][-1] if history["loss"] else float("nan")
    print(f"trained    {trainer.step} steps in {seconds:.1f} s, final loss {loss:.4f}"
          + (f", evaluation loss {history['eval_loss'][-1]:.4f}" if history["eval_loss"] else ""))
    if metrics["peak_memory_mib"] is not None:
        print(f"memory     peak {metrics['peak_memory_mib']:,.0f} MiB resident")
    print(f"wrote      {', '.join(wrote)} in {out}")
    use = f"--adapter {out}" if trainer.config.method == "lora" else f"--checkpoint {out}"
    model_flag = f" --checkpoint {args.model}" if args.model and trainer.config.method == "lora" else ""
    print(f"try        attnlab generate{model_flag} {use} \"...\"")
    return 0
