"""The ``attnlab`` command. The only part of attnlab that prints.

Each subcommand lives in its own module under ``attnlab.cli`` and exposes
``register(subparsers)``; the module imports nothing heavy at import time, so ``--help`` is
instant. Errors a user can cause become one line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

from attnlab.cli._common import CLIError, Parser

# Subcommand modules, in the order ``attnlab --help`` lists them.
COMMANDS = ["demo", "explain", "similarity", "train", "generate", "bench"]


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except CLIError as exc:
        print(f"attnlab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130
