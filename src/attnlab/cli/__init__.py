"""The ``attnlab`` command. The only part of attnlab that prints.

Each subcommand lives in its own module under ``attnlab.cli`` and exposes
``register(subparsers)``; the module imports nothing heavy at import time, so ``--help`` is
instant. Errors a user can cause become one line on stderr and exit code 2, output faults
too (a full disk, standard output sent to ``/dev/full``, a device or a directory where a file
should be written); a reader that closes the pipe early (``attnlab demo | head -1``) ends the
command quietly (exit code 1).
"""

from __future__ import annotations

import importlib
import os
import sys

from attnlab.cli._common import CLIError, Parser

# Subcommand modules, in the order ``attnlab --help`` lists them.
COMMANDS = ["demo", "explain", "attribute", "similarity", "train", "finetune", "generate", "check", "sweep",
            "bench"]


def build_parser() -> Parser:
    from attnlab import __version__

    parser = Parser(
        prog="attnlab",
        description="Transformer self-attention from scratch in NumPy: look inside, "
        "check against PyTorch, train, benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"attnlab.cli.{name}").register(sub)
    return parser


# The arguments that are text (not paths): bytes that were not UTF-8, which Python keeps as
# lone surrogates, become U+FFFD before any model, tokenizer, picture or file sees them.
_TEXT_ARGUMENTS = ("text", "prompt", "sentence_a", "sentence_b", "word")


def _clean_text_arguments(args) -> None:
    for name in _TEXT_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
            from attnlab.viz.html_report import clean_text

            setattr(args, name, clean_text(value))


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings reach the user as one line each, never with a library's source line."""
    text = str(message).strip().splitlines()
    print(f"attnlab: warning: {text[0] if text else category.__name__}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import warnings

    command = None
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit:  # --help, --version or a usage error: flush what was printed now
            sys.stdout.flush()
            raise
        command = args.command
        _clean_text_arguments(args)
        if command is None:
            parser.print_help()
            code = 0
        else:
            if not getattr(args, "system_allocator", False):
                from attnlab._memory import keep_freed_memory

                keep_freed_memory()  # the command owns the process: reuse freed pages
            code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`attnlab demo | head -1`): no traceback, and nothing more to
        # write. Point stdout at devnull so that the flush at exit cannot fail again.
        _stdout_to_devnull()
        return 1
    except CLIError as exc:
        print(f"attnlab {command}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"attnlab {command}: error: not enough memory for this model and input; use smaller "
              "sizes or a shorter input", file=sys.stderr)
        return 2
    except OSError as exc:
        # An output fault the command did not turn into a CLIError (its reads are): standard
        # output on a full disk or /dev/full. One line; standard output then goes to devnull
        # if it still fails, so that the flush at exit cannot fail again.
        _stdout_flushes()
        what = f"cannot write {exc.filename}" if exc.filename else "cannot write the output"
        print(f"{'attnlab ' + command if command else 'attnlab'}: error: {what}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{'attnlab ' + command if command else 'attnlab'}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


def _stdout_flushes() -> bool:
    """Whether standard output takes what is buffered (if not, it is pointed at devnull)."""
    try:
        sys.stdout.flush()
    except OSError:
        _stdout_to_devnull()
        return False
    return True


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. captured in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
