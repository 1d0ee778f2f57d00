"""Helpers shared by several test modules (import with ``from helpers import ...``)."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.core import blockwise


def rel_err(got: np.ndarray, want: np.ndarray, floor: float = 1e-30) -> float:
    """Largest absolute difference relative to the reference's largest entry (or ``floor``)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.size == 0:
        return 0.0
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(np.max(diff) / max(float(np.max(np.abs(want))), floor))


def grad_err(got: np.ndarray, want: np.ndarray) -> float:
    """:func:`rel_err` for gradients, relative to at least 1: the inputs are standard normal,
    so a gradient that is exactly 0 in theory (``L == S == 1``) is ``O(eps)`` in practice."""
    return rel_err(got, want, floor=1.0)


def attention_inputs(rng, batch, hq, h, L, S, E, Ev, dtype):
    """Standard normal ``q (*batch, hq, L, E)``, ``k``, ``v`` (``h`` heads) and ``grad_out``."""
    q = rng.standard_normal((*batch, hq, L, E)).astype(dtype)
    k = rng.standard_normal((*batch, h, S, E)).astype(dtype)
    v = rng.standard_normal((*batch, h, S, Ev)).astype(dtype)
    g = rng.standard_normal((*batch, hq, L, Ev)).astype(dtype)
    return q, k, v, g


# The two implementations of the blockwise kernel's element-wise pass: compiled (numba,
# the ``fast`` extra; installed for the test suite) and NumPy. Parametrize with this.
ELEMENTWISE_PASSES = [
    pytest.param(True, id="compiled", marks=pytest.mark.skipif(
        not blockwise.fused_available(), reason="numba (the fast extra) is not installed")),
    pytest.param(False, id="numpy"),
]


def kernel_tuning(fused: bool, **changes):
    """A ``blockwise.tuned`` context in which every call runs on the chosen element-wise
    pass and starts a real pool, however small the problem."""
    return blockwise.tuned(fused=fused, fused_min_scores=0, min_scores_per_thread=0, **changes)
