"""Shared test helpers: parity checks that also record the worst error seen per dtype."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

# dtype name -> [number of comparisons, worst error]; printed at the end of the run.
PARITY: dict[str, list] = defaultdict(lambda: [0, 0.0])

TOL = {"float64": 1e-10, "float32": 1e-5}


def parity_error(ours, theirs) -> float:
    """float64: max abs error. float32: max abs error relative to the reference's scale."""
    ours = np.asarray(ours)
    theirs = np.asarray(theirs.detach().numpy() if hasattr(theirs, "detach") else theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    if ours.size == 0:
        return 0.0
    err = float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64))))
    if ours.dtype == np.float32:
        err /= max(float(np.max(np.abs(theirs))), 1e-30)
    return err


def assert_parity(ours, theirs, *, tol: float | None = None) -> float:
    """Assert ``ours`` equals the reference within the issue's tolerance for its dtype."""
    err = parity_error(ours, theirs)
    name = np.asarray(ours).dtype.name
    stats = PARITY[name]
    stats[0] += 1
    stats[1] = max(stats[1], err)
    limit = TOL[name] if tol is None else tol
    assert err <= limit, f"{name} error {err:.3g} > {limit:.1g}"
    return err


def pytest_terminal_summary(terminalreporter):
    if PARITY:
        terminalreporter.write_sep("-", "attnlab parity with torch (forward)")
        for name, (count, worst) in sorted(PARITY.items()):
            kind = "max abs" if name == "float64" else "max rel"
            terminalreporter.write_line(f"{name}: {count} comparisons, worst {kind} error {worst:.3g}")


@pytest.fixture
def torch():
    return pytest.importorskip("torch")
