"""Attention benchmark: ``attnlab bench --full`` (SDPA at model shapes and L up to 8192, layers,
decoding; attnlab against torch and transformers, the naive NumPy path too).

Run ``python benchmarks/attention.py`` (or ``make bench``); extra arguments go to
``attnlab bench`` (e.g. ``--sections sdpa --sizes 1024,4096 --repeats 7 --threads 2``). Prints; never a test.
"""

import sys

from attnlab.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--full", *sys.argv[1:]]))
