"""Helpers shared by the subcommands: errors, output folders, tables."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attnlab._io import atomic_write  # noqa: F401  (re-exported for the subcommands)


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


def format_table(
    matrix: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    *,
    decimals: int = 2,
    color: bool = False,
) -> str:
    """An aligned text table of ``matrix`` labelled by tokens; shades cells on a TTY."""
    matrix = np.asarray(matrix)
    cells = [[f"{v:.{decimals}f}" for v in row] for row in matrix]
    rw = max([len(s) for s in row_labels] + [0])
    cw = max([len(s) for s in col_labels] + [len(c) for row in cells for c in row] + [1])
    lines = [" " * rw + "  " + " ".join(c.rjust(cw) for c in col_labels)]
    vmax = float(np.nanmax(matrix)) if matrix.size else 1.0
    for label, row, values in zip(row_labels, cells, matrix, strict=True):
        parts = []
        for text, v in zip(row, values, strict=True):
            text = text.rjust(cw)
            if color and vmax > 0:
                level = int(232 + min(23, max(0, round(23 * float(v) / vmax))))
                fg = 16 if level > 244 else 255
                text = f"\x1b[38;5;{fg};48;5;{level}m{text}\x1b[0m"
            parts.append(text)
        lines.append(label.rjust(rw) + "  " + " ".join(parts))
    return "\n".join(lines)
