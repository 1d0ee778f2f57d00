"""Random byte mutations of a small GGUF file: each mutated file either loads as a model whose
logits are finite, or is refused with a CheckpointError naming it; nothing else.

Run by hand for a larger count, with the outcomes tabled:

    PYTHONPATH=src:tests python tests/test_fuzz_gguf.py 20000
"""

from __future__ import annotations

import re
import struct
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from attnlab.io import CheckpointError  # noqa: E402
from attnlab.models.llama import Llama  # noqa: E402
from gguf_files import write_tiny_gguf  # noqa: E402

#: Mutations the test suite runs (about 15 ms each on a 2-core EPYC).
COUNT = 1500
# integers that sit on the edges of what a reader checks
EDGES = [0, 1, 2, 3, 0xFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 2**40, 2**63 - 1, 2**63, 2**64 - 1]


def mutate(data: bytes, header_end: int, rng: np.random.Generator) -> bytes:
    """One mutation of ``data``: a few random bytes anywhere or in the header, an edge
    integer written over a header field, or the file cut short."""
    b = bytearray(data)
    kind = rng.integers(0, 4)
    if kind == 0:  # random bytes anywhere (mostly the tensors' data)
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(0, len(b))] = rng.integers(0, 256)
    elif kind == 1:  # random bytes in the header (counts, lengths, types, metadata, tensor entries)
        for _ in range(rng.integers(1, 5)):
            b[rng.integers(0, header_end)] = rng.integers(0, 256)
    elif kind == 2:  # an edge value over 4 or 8 header bytes
        at = int(rng.integers(0, header_end - 8))
        value = int(EDGES[rng.integers(0, len(EDGES))])
        b[at:at + 8] = struct.pack("<Q", value) if rng.integers(0, 2) else struct.pack("<I", value & 0xFFFF_FFFF) + \
            bytes(b[at + 4:at + 8])
    else:  # cut short
        del b[rng.integers(0, len(b)):]
    return bytes(b)


def outcome(path: Path) -> str:
    """``"loaded, finite logits"``, or ``"refused: ..."`` with the CheckpointError's message
    (path and numbers left out); anything else raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = Llama.from_pretrained(path)
    except CheckpointError as exc:
        message = str(exc)
        assert str(path) in message, message
        text = message.replace(str(path), "").lstrip(": ")
        return "refused: " + re.sub(r"\d[\d,]*", "N", text)[:60]
    ids = np.arange(min(3, model.config.vocab_size))[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model(ids)
    assert np.isfinite(logits).all(), f"{path}: the model loaded but its logits are not finite"
    return "loaded, finite logits"


def fuzz(folder: Path, count: int, seed: int = 0) -> Counter:
    """Write the small file, then ``count`` mutations of it; the outcomes counted."""
    import gguf

    src = folder / "small.gguf"
    write_tiny_gguf(src, layers=1, hidden=32, heads=4, kv_heads=2, ff=64, qtype="Q8_0")
    data = src.read_bytes()
    header_end = min(t.data_offset for t in gguf.GGUFReader(src).tensors)
    rng = np.random.default_rng(seed)
    path = folder / "mutated.gguf"
    seen: Counter = Counter()
    for i in range(count):
        path.write_bytes(mutate(data, header_end, rng))
        try:
            seen[outcome(path)] += 1
        except BaseException as exc:
            raise AssertionError(f"mutation {i} (seed {seed}) escaped as {type(exc).__name__}: {exc}") from exc
    return seen


def test_random_mutations_load_finite_or_are_refused(tmp_path):
    seen = fuzz(tmp_path, COUNT)
    assert sum(seen.values()) == COUNT
    refused = sum(n for k, n in seen.items() if k.startswith("refused"))
    assert 0 < refused < COUNT and seen["loaded, finite logits"] > 0, seen  # both outcomes occur


if __name__ == "__main__":
    import tempfile
    import time

    n = int(sys.argv[1]) if len(sys.argv) > 1 else COUNT
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        table = fuzz(Path(d), n)
        seconds = time.perf_counter() - start
    print(f"{n} mutations in {seconds:.1f} s; outcomes:")
    for text, k in table.most_common():
        print(f"{k:7d}  {text}")
