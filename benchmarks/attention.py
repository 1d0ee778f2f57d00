"""Attention benchmark: naive NumPy vs attnlab vs torch SDPA, the full table.

Run ``python benchmarks/attention.py`` (or ``make bench``); extra arguments go to
``attnlab bench`` (e.g. ``--sizes 1024,4096 --repeats 7 --threads 2``). Prints; never a test.
"""

import sys

from attnlab.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--full", *sys.argv[1:]]))
