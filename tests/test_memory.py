"""attnlab.keep_freed_memory: freed arrays are reused instead of faulted in afresh.

Each check runs in a fresh Python process (the setting is process-wide and cannot be undone)
and counts the minor page faults of a loop that allocates and frees the same arrays.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import attnlab
from attnlab import _memory

glibc = pytest.mark.skipif(_memory._glibc() is None, reason="glibc's mallopt only")

_LOOP = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    import attnlab
    kept = attnlab.keep_freed_memory() if sys.argv[1] == "keep" else False
    x = np.ones((512, 1536), dtype=np.float32)
    def step():  # two 3 MB temporaries alive at once, then both freed
        d = np.exp(-x)
        d += 1
        return float(d[0, 0])
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"kept": kept, "after": attnlab.freed_memory_kept(), "faults": faults}))
    """
)


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@glibc
def test_freed_arrays_are_reused_not_faulted_in():
    system, kept = _faults("system"), _faults("keep")
    assert system["kept"] is False and system["after"] is False
    assert kept["kept"] is True and kept["after"] is True
    # glibc returns the two freed 3 MB blocks at once: every step faults them in again
    # (about 1,500 pages); kept, the loop reuses them.
    assert system["faults"] > 20 * 700
    assert kept["faults"] < 100


def test_cli_keeps_freed_memory_unless_told_not_to(monkeypatch, capsys):
    """Every command runs with freed memory kept; bench --system-allocator leaves malloc alone."""
    from attnlab import cli

    calls = []
    monkeypatch.setattr(_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["bench", "--sections", "nothing"]) == 2  # a bad option: the command ran its checks
    assert calls == [1]
    assert cli.main(["bench", "--system-allocator", "--sections", "nothing"]) == 2
    assert calls == [1]
    capsys.readouterr()


def test_public_names():
    assert attnlab.keep_freed_memory is _memory.keep_freed_memory
    assert "keep_freed_memory" in attnlab.__all__ and "freed_memory_kept" in attnlab.__all__
