"""Helpers shared by the subcommands: errors, output folders, tables."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from attnlab._io import atomic_write  # noqa: F401  (re-exported for the subcommands)
from attnlab.trace import format_table  # noqa: F401  (re-exported for the subcommands)


class CLIError(Exception):
    """A user error: printed as one line on stderr, exit code 2, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit code 2), not usage + error.

    Subparsers made with ``add_subparsers().add_parser`` inherit this class.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def prepare_out_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and check it is writable, else raise ``CLIError``."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".attnlab-write-test-"):
            pass
    except OSError as exc:
        raise CLIError(f"cannot write to output folder {str(out)!r}: {exc.strerror or exc}") from None
    return out


def use_color(stream=None) -> bool:
    stream = stream or sys.stdout
    return stream.isatty() and os.environ.get("NO_COLOR") is None and os.environ.get("TERM") != "dumb"
