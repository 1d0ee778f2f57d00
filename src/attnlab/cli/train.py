"""attnlab train: train a TinyTransformer on multi-query associative recall.

--arch llama trains Llama-style blocks (rotary positions, RMSNorm, a SwiGLU MLP,
grouped-query heads) instead of the GPT-style ones.

Writes to --out: checkpoint.npz (weights + config, no pickle), metrics.json
(steps, seconds, final_loss, heldout_accuracy, ...) and curves.png (loss and accuracy;
needs matplotlib), replacing an earlier run's. A NaN/inf loss stops training and keeps the
last good weights; Ctrl-C saves a checkpoint (and the curves so far) before exiting; a
checkpoint that cannot be written (a full disk) ends the run with one line and leaves the
last one saved. Sizes that would not fit in memory are refused before anything starts.
"""

from __future__ import annotations

import json
import math
import sys
import time

from attnlab.cli._common import CLIError, atomic_write, prepare_out_dir

DEFAULT_OUT = "attnlab-out/train"
ARCHS = ("gpt", "llama")


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a tiny transformer on associative recall",
        description=__doc__,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", default="recall",
                   help="the task (only 'recall': multi-query associative recall)")
    p.add_argument("--steps", default=None, metavar="N", help="optimisation steps (default 1000)")
    p.add_argument("--seed", default="0", metavar="N", help="seed for weights and data (default 0)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--batch-size", default=None, metavar="N", help="sequences per step (default 64)")
    p.add_argument("--lr", default=None, metavar="X", help="peak learning rate (default 1e-3)")
    p.add_argument("--d-model", default=None, metavar="N", help="model width (default 64)")
    p.add_argument("--heads", default=None, metavar="N", help="attention heads (default 4)")
    p.add_argument("--layers", default=None, metavar="N", help="transformer blocks (default 2)")
    p.add_argument("--arch", default="gpt", choices=ARCHS,
                   help="the blocks: 'gpt' (learned positions, LayerNorm, a ReLU MLP; the default) or "
                        "'llama' (rotary positions, RMSNorm, a SwiGLU MLP, grouped-query heads, no biases)")
    p.add_argument("--kv-heads", default=None, metavar="N",
                   help="key/value heads shared by the query heads; must divide --heads (default: all "
                        "heads; with --arch llama, half of them when --heads is even)")
    p.add_argument("--num-keys", default=None, metavar="N", help="distinct keys (default 16)")
    p.add_argument("--num-values", default=None, metavar="N", help="distinct values (default 16)")
    p.add_argument("--num-pairs", default=None, metavar="N", help="key/value pairs per sequence (default 8)")
    p.add_argument("--num-queries", default=None, metavar="N", help="queries per sequence (default 8)")
    p.add_argument("--eval-every", default="50", metavar="N", help="held-out check every N steps (default 50)")
    p.add_argument("--save-every", default="500", metavar="N",
                   help="checkpoint every N steps, 0: only at the end (default 500)")
    p.set_defaults(run=run)


def _int(value, flag: str, *, minimum: int = 1) -> int:
    try:
        out = int(str(value), 10)
    except ValueError:
        raise CLIError(f"{flag} must be an integer >= {minimum}, got {value!r}") from None
    if out < minimum:
        raise CLIError(f"{flag} must be an integer >= {minimum}, got {value!r}")
    return out


def _float(value, flag: str) -> float:
    try:
        out = float(value)
    except ValueError:
        raise CLIError(f"{flag} must be a positive number, got {value!r}") from None
    if not (math.isfinite(out) and out > 0):
        raise CLIError(f"{flag} must be a positive number, got {value!r}")
    return out


class _Progress:
    """A one-line bar redrawn in place on a TTY; otherwise a plain line every ``every`` steps."""

    def __init__(self, total: int, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, total // 20)
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, acc: float, heldout: float | None) -> None:
        if not self.tty and step % self.every and step != self.total:
            return
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        extra = f" held-out {heldout:6.1%}" if heldout is not None else ""
        text = (
            f"step {step:>{len(str(self.total))}}/{self.total} loss {loss:.4f} acc {acc:6.1%}"
            f"{extra} {rate:5.1f} steps/s"
        )
        if self.tty:
            width = 24
            done = int(width * step / self.total)
            print(f"\r[{'#' * done}{'.' * (width - done)}] {text}", end="", file=self.stream, flush=True)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=self.stream, flush=True)


OUTPUTS = ("checkpoint.npz", "metrics.json", "curves.png")


def _check_fits(model_config, config, task) -> None:
    """Refuse sizes whose training would not fit in memory, before allocating anything."""
    from attnlab.train.sizes import available_memory, training_bytes

    need = training_bytes(model_config, batch_size=config.batch_size, seq_len=task.seq_len)
    have = available_memory()
    if have is not None and need > have:
        c = model_config
        raise CLIError(
            f"this model cannot be trained here: d_model {c.d_model}, {c.n_layers} layers, "
            f"d_ff {c.d_ff}, batch {config.batch_size} need about {_size(need)} (weights, "
            f"gradients, optimizer state, activations), but {_size(have)} of memory is free"
        )


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def run(args) -> int:
    if args.task != "recall":
        raise CLIError(f"--task must be 'recall', got {args.task!r}")
    steps = _int(args.steps, "--steps") if args.steps is not None else None
    seed = _int(args.seed, "--seed", minimum=0)
    eval_every = _int(args.eval_every, "--eval-every")
    save_every = _int(args.save_every, "--save-every", minimum=0)

    from attnlab.models.tiny import TinyTransformerConfig
    from attnlab.train.checkpoint import save_checkpoint
    from attnlab.train.loop import NonFiniteLossError, TrainConfig, Trainer
    from attnlab.train.tasks import RecallTask

    tc, mc = TrainConfig(), TinyTransformerConfig()
    train_kw = {"seed": seed}
    if steps is not None:
        train_kw["steps"] = steps
    if args.batch_size is not None:
        train_kw["batch_size"] = _int(args.batch_size, "--batch-size")
    if args.lr is not None:
        train_kw["lr"] = _float(args.lr, "--lr")
    if train_kw.get("steps", tc.steps) <= tc.warmup:
        train_kw["warmup"] = train_kw.get("steps", tc.steps) // 10
    model_kw = {}
    for flag, key in (("d_model", "d_model"), ("heads", "n_heads"), ("layers", "n_layers")):
        if getattr(args, flag) is not None:
            model_kw[key] = _int(getattr(args, flag), "--" + flag.replace("_", "-"))
    if "d_model" in model_kw:
        model_kw["d_ff"] = 2 * model_kw["d_model"]
    if args.kv_heads is not None:
        model_kw["n_kv_heads"] = _int(args.kv_heads, "--kv-heads")
        heads = model_kw.get("n_heads", mc.n_heads)
        if heads % model_kw["n_kv_heads"]:
            raise CLIError(f"--kv-heads must divide --heads ({heads}), got {args.kv_heads!r}")
    arch = getattr(args, "arch", "gpt")
    if arch not in ARCHS:
        raise CLIError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    make_config = TinyTransformerConfig.llama if arch == "llama" else TinyTransformerConfig
    task_kw = {}
    for key in ("num_keys", "num_values", "num_pairs", "num_queries"):
        if getattr(args, key) is not None:
            task_kw[key] = _int(getattr(args, key), "--" + key.replace("_", "-"))
    try:
        task = RecallTask(**task_kw)
        model_config = make_config(**{
            **model_kw, "vocab_size": task.vocab_size, "context_length": max(mc.context_length, task.seq_len),
        })
        config = TrainConfig(**{**tc.to_dict(), **train_kw})
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    _check_fits(model_config, config, task)
    out = prepare_out_dir(args.out)
    # An earlier run's files never stay beside this run's, even if this one is killed.
    paths = {name: out / name for name in OUTPUTS}
    try:
        for p in paths.values():
            p.unlink(missing_ok=True)
    except OSError as exc:
        raise CLIError(f"cannot replace an earlier run's files in {str(out)!r}: {_why(exc)}") from None
    try:
        trainer = Trainer.build(task, model_config, config)
    except MemoryError:
        raise CLIError("not enough memory for this model: use a smaller --d-model, --layers "
                       "or --batch-size") from None
    ckpt_path = paths["checkpoint.npz"]
    saved = {"step": None}

    def save(state, step, status) -> None:
        meta = {"step": step, "status": status, "seed": seed}
        try:
            save_checkpoint(ckpt_path, trainer.model, task, state=state, meta=meta)
        except OSError as exc:
            kept = (f"kept the checkpoint of step {saved['step']} in {ckpt_path}"
                    if saved["step"] is not None else "no checkpoint was saved")
            raise CLIError(f"cannot save the checkpoint of step {step}: {_why(exc)}; {kept}") from None
        saved["step"] = step

    evals: list[dict] = []
    progress = _Progress(config.steps)
    start = time.perf_counter()
    status, code, message = "finished", 0, None
    heldout_acc = None
    try:
        try:
            for _ in range(config.steps):
                loss, acc = trainer.train_step()
                step = trainer.step
                if step % eval_every == 0 or step == config.steps:
                    el, ea = trainer.evaluate(limit=500)
                    evals.append({"step": step, "loss": el, "accuracy": ea})
                    heldout_acc = ea
                progress.update(step, loss, acc, heldout_acc)
                if save_every and step % save_every == 0 and step != config.steps:
                    save(trainer.model.state_dict(), step, "running")
        finally:
            progress.close()
    except NonFiniteLossError as exc:
        save(trainer.good_state, trainer.good_step, "stopped: non-finite loss")
        status, code = "stopped: non-finite loss", 1
        message = (
            f"attnlab train: error: loss became {exc.loss} at step {exc.step}; stopped and kept "
            f"the last good weights (step {trainer.good_step}) in {ckpt_path}"
        )
    except KeyboardInterrupt:
        save(trainer.good_state, trainer.good_step, "interrupted")
        status, code = "interrupted", 130
        message = (f"attnlab train: interrupted at step {trainer.step}; saved the weights of step "
                   f"{trainer.good_step} to {ckpt_path}")
    except MemoryError:
        raise CLIError(f"ran out of memory at step {trainer.step}: use a smaller --d-model, "
                       "--layers or --batch-size") from None
    else:
        save(trainer.model.state_dict(), trainer.step, "finished")
    seconds = time.perf_counter() - start

    h = trainer.history
    final_loss = h["loss"][-1] if h["loss"] else None
    if status == "finished":
        heldout_loss, heldout_accuracy = trainer.evaluate()
    else:
        heldout_loss = heldout_accuracy = None
    metrics = {
        "task": "recall",
        "status": status,
        "steps": trainer.step,
        "checkpoint_step": saved["step"],
        "seconds": round(seconds, 3),
        "steps_per_second": round(trainer.step / seconds, 3) if seconds > 0 else None,
        "final_loss": final_loss,
        "final_accuracy": h["accuracy"][-1] if h["accuracy"] else None,
        "heldout_loss": heldout_loss,
        "heldout_accuracy": heldout_accuracy,
        "heldout_size": config.eval_size,
        "model": model_config.to_dict(),
        "task_config": task.to_dict(),
        "train_config": config.to_dict(),
        "evals": evals,
        "history": {k: v for k, v in h.items() if k in ("loss", "accuracy")},
    }
    text = json.dumps(metrics, indent=2)
    wrote = [ckpt_path.name]
    try:
        atomic_write(paths["metrics.json"], lambda p: p.write_text(text + "\n"))
        wrote.append("metrics.json")
        try:
            from attnlab.viz.plots import plot_training_curves

            atomic_write(paths["curves.png"], lambda p: plot_training_curves(
                h, evals, title=f"TinyTransformer{' (Llama-style)' if arch == 'llama' else ''} on multi-query "
                                "associative recall", path=p))
            wrote.append("curves.png")
        except ImportError:
            print("attnlab train: matplotlib is not installed; skipped curves.png "
                  "(pip install 'attnlab[viz]')", file=sys.stderr)
    except OSError as exc:
        raise CLIError(f"cannot write {str(out)!r}: {_why(exc)}; wrote {', '.join(wrote)} "
                       f"(the checkpoint of step {saved['step']})") from None
    if message:
        print(message, file=sys.stderr)
        return code
    print(
        f"held-out accuracy {heldout_accuracy:.2%} (loss {heldout_loss:.4f}) after {trainer.step} "
        f"steps in {seconds:.1f} s; wrote {', '.join(wrote)} to {out}"
    )
    return 0
