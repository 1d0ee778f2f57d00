"""Initialisers as in ``torch.nn.init``, drawn from an explicit ``np.random.Generator``.

Inside :func:`empty_weights` the random initialisers return uninitialised arrays instead:
for models whose weights are loaded right after they are built (no time spent drawing
numbers that are overwritten).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

_STATE = threading.local()


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build layers without drawing their initial weights (``np.empty``), in this thread.

    >>> from attnlab.nn import Linear
    >>> with empty_weights():
    ...     layer = Linear(1000, 1000)   # no random numbers drawn
    >>> layer.weight.shape
    (1000, 1000)
    """
    before = getattr(_STATE, "empty", False)
    _STATE.empty = True
    try:
        yield
    finally:
        _STATE.empty = before


def _empty(shape, dtype) -> np.ndarray | None:
    return np.empty(shape, dtype) if getattr(_STATE, "empty", False) else None


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    fan_in = shape[1] * receptive if len(shape) > 1 else shape[0]
    fan_out = shape[0] * receptive
    return fan_in, fan_out


def zeros(shape, dtype) -> np.ndarray:
    return np.zeros(shape, dtype)


def uniform(rng: np.random.Generator, shape, bound: float, dtype) -> np.ndarray:
    empty = _empty(shape, dtype)
    return rng.uniform(-bound, bound, size=shape).astype(dtype) if empty is None else empty


def normal(rng: np.random.Generator, shape, dtype, std: float = 1.0) -> np.ndarray:
    """``N(0, std^2)`` (torch's ``nn.Embedding`` uses ``std=1``)."""
    empty = _empty(shape, dtype)
    if empty is not None:
        return empty
    x = rng.standard_normal(shape)
    return (x if std == 1.0 else x * std).astype(dtype)


def xavier_uniform(rng: np.random.Generator, shape, dtype, gain: float = 1.0) -> np.ndarray:
    fan_in, fan_out = _fans(tuple(shape))
    return uniform(rng, shape, gain * math.sqrt(6.0 / (fan_in + fan_out)), dtype)


def xavier_normal(rng: np.random.Generator, shape, dtype, gain: float = 1.0) -> np.ndarray:
    fan_in, fan_out = _fans(tuple(shape))
    return normal(rng, shape, dtype, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def linear_default(rng: np.random.Generator, out_features: int, in_features: int, dtype):
    """torch ``nn.Linear``'s default: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    return (
        uniform(rng, (out_features, in_features), bound, dtype),
        uniform(rng, (out_features,), bound, dtype),
    )
