"""attnlab sweep DATA OUT: run a method over every item of a JSONL file, writing results as it goes.

DATA is a JSONL file: one JSON object a line (or a JSON string: the text). Each item's text
(the field --field, default "text"; a list of token ids works too) goes through the model
(--model, default the bundled SmolLM2-135M-Instruct) and the method; results go to OUT, one
safetensors shard per batch, with a manifest and an items table (Parquet). Run the same
command again and it goes on where it stopped: what is recorded is skipped. Items that
cannot be read or computed are recorded with their error (and line number) and the sweep
goes on. Read the results in Python with attnlab.sweep.read_results(OUT).

Methods and their options (--option NAME=VALUE, VALUE as JSON or a bare word):
  logit_lens_top       k=5, position=-1 (a token; none: every token)
  cache                hooks=["blocks.3.hook_resid_post", ...], position=-1|"mean"
  detect_heads         kind=induction|previous_token|duplicate_token, exclude_bos=true
  activation_patching  hook=resid_pre|attn_out|mlp_out|z (items: clean, corrupted, answer, wrong)
  generate             max_new_tokens=16, temperature=0, top_k, seed, eos_token_id
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from attnlab.cli._common import CLIError, add_quantized_flags, check_quantized_flags, load_decoder


def register(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="run a method (logit lens, cache, head detection, patching, generation) over a JSONL dataset",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  attnlab sweep prompts.jsonl out/ --method logit_lens_top --option k=5 --option position=-1\n"
        "  attnlab sweep prompts.jsonl out/ --engine processes --workers 2\n"
        "  attnlab sweep prompts.jsonl out/ --quantized --engine processes  # workers map the 4-bit codes\n"
        "  attnlab sweep prompts.jsonl out/ --method cache --option 'hooks=[\"blocks.5.hook_resid_post\"]'\n"
        "  attnlab sweep prompts.jsonl out/ --engine ray --address 127.0.0.1:6379",
    )
    p.add_argument("data", metavar="DATA", help="the JSONL file")
    p.add_argument("out", metavar="OUT", help="the sweep's folder (created; give the same one to resume)")
    p.add_argument("--model", metavar="PATH", default="smollm2",
                   help="a model folder, a .gguf file or an attnlab checkpoint (default: the bundled SmolLM2)")
    add_quantized_flags(p, what="--model")
    p.add_argument("--method", default="logit_lens_top", metavar="NAME",
                   help="logit_lens_top (default), cache, detect_heads, activation_patching, generate")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an option of the method (repeat for several)")
    p.add_argument("--field", default=None, metavar="NAME", help="the items' field holding the text (default text)")
    p.add_argument("--engine", choices=("serial", "processes", "ray"), default="serial",
                   help="where batches run (the same results on each; default serial)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes or Ray actors (default: CPUs / threads)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="threads per batch, in every engine (default 1)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="most items in a batch (default 16)")
    p.add_argument("--max-batch-tokens", type=int, default=1024, metavar="N",
                   help="most padded tokens in a batch (default 1024)")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="with --engine ray: a running cluster (default: a local one for the sweep)")
    p.add_argument("--stop-on-error", action="store_true", help="stop at the first item that fails")
    p.add_argument("--retry-failed", action="store_true", help="run items recorded as failed again")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _options(pairs: list[str], field: str | None) -> dict:
    options = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise CLIError(f"--option takes NAME=VALUE, got {pair!r}")
        try:
            options[name] = json.loads(value)
        except json.JSONDecodeError:
            options[name] = value  # a bare word: the text itself
    if field is not None:
        options["field"] = field
    return options


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _Bar:
    """A one-line progress bar on stderr: items, rate and time left (redrawn in place on a
    terminal, a line every 10 s otherwise)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, p) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 10 and (p.total is None or p.done < p.total):
            return
        self.last = now
        total = "?" if p.total is None else str(p.total)
        width = 24
        filled = width if p.total in (None, 0) else int(width * min(1.0, p.done / p.total))
        failed = f", {p.failed} failed" if p.failed else ""
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {p.done}/{total} items{failed}  "
                f"{p.rate:.2f} items/s  {_clock(p.eta)} left")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


def run(args) -> int:
    from pathlib import Path

    from attnlab.sweep import SweepError, sweep

    if not Path(args.data).is_file():
        raise CLIError(f"dataset {args.data!r} is not a file (give a JSONL file: one JSON object a line)")
    for flag, value in (("--workers", args.workers), ("--threads", args.threads), ("--batch-size", args.batch_size),
                        ("--max-batch-tokens", args.max_batch_tokens)):
        if value is not None and value < 1:
            raise CLIError(f"{flag} must be a positive integer, got {value}")
    if args.address is not None and args.engine != "ray":
        raise CLIError("--address is for --engine ray")
    path = None if str(args.model).lower() == "smollm2" else Path(args.model)
    check_quantized_flags(args, path, what="--model")
    options = _options(args.option, args.field)
    bar = None if args.quiet else _Bar()
    try:
        t0 = time.perf_counter()  # a model loaded here counts in the load time the summary gives
        model = load_decoder(path, quantized=True, activations=args.activations) if args.quantized else args.model
        loaded = time.perf_counter() - t0
        report = sweep(model, args.data, args.out, method=args.method, options=options, engine=args.engine,
                       workers=args.workers, threads=args.threads, batch_size=args.batch_size,
                       max_batch_tokens=args.max_batch_tokens, on_error="raise" if args.stop_on_error else "record",
                       retry_failed=args.retry_failed, address=args.address, progress=bar)
    except (SweepError, ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        if bar is not None:
            bar.end()
        raise CLIError(str(exc)) from None
    if bar is not None:
        bar.end()
    print(f"{report.out}: {report.computed} items computed in {report.seconds:.1f} s ({report.rate:.2f} items/s; "
          f"model loaded in {loaded + report.load_seconds:.1f} s), {report.skipped} already done, "
          f"{report.failed} failed; "
          f"read with attnlab.sweep.read_results({str(report.out)!r})")
    return 0
