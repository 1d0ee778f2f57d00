"""Initialisers as in ``torch.nn.init``, drawn from an explicit ``np.random.Generator``."""

from __future__ import annotations

import math

import numpy as np


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    fan_in = shape[1] * receptive if len(shape) > 1 else shape[0]
    fan_out = shape[0] * receptive
    return fan_in, fan_out


def uniform(rng: np.random.Generator, shape, bound: float, dtype) -> np.ndarray:
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def xavier_uniform(rng: np.random.Generator, shape, dtype, gain: float = 1.0) -> np.ndarray:
    fan_in, fan_out = _fans(tuple(shape))
    return uniform(rng, shape, gain * math.sqrt(6.0 / (fan_in + fan_out)), dtype)


def xavier_normal(rng: np.random.Generator, shape, dtype, gain: float = 1.0) -> np.ndarray:
    fan_in, fan_out = _fans(tuple(shape))
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return (rng.standard_normal(shape) * std).astype(dtype)


def linear_default(rng: np.random.Generator, out_features: int, in_features: int, dtype):
    """torch ``nn.Linear``'s default: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    return (
        uniform(rng, (out_features, in_features), bound, dtype),
        uniform(rng, (out_features,), bound, dtype),
    )
