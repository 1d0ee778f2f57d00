"""What the benchmark scripts set up before NumPy is imported (imported by them by name:
``python benchmarks/x.py`` puts this folder first on the path)."""

from __future__ import annotations

import argparse
import os
import sys


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusal is one line on stderr, ``<prog>: <message>``, exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


def refuse(prog: str, message: str) -> int:
    """A refusal found after parsing, said as :class:`OneLineParser` says its own; returns 2."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def machine_load() -> str:
    """The machine's load average, for the tables (a shared machine's timings need it)."""
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"


def pin_threads(threads: int | None) -> int:
    """Every library's thread count (``None``: all CPUs), set through the ``*_NUM_THREADS``
    variables before NumPy is imported; transformers stays offline."""
    threads = threads or len(os.sched_getaffinity(0))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "numpy" in sys.modules:
        print("warning: numpy was imported before the thread count was set", file=sys.stderr)
    return threads
