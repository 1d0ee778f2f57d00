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


# ---- layers on other array libraries (Module.to) ----------------------------------------
# Each case: (build(dtype) -> layer, call(layer, to_library, dtype) -> output(s)). The inputs
# are made in NumPy and handed over through ``to_library`` (the identity for the NumPy path),
# so one case runs the same call in every library.


def perturbed(layer, seed: int = 1):
    """``layer`` with every parameter moved off its initial value (LayerNorm's ones, zero biases)."""
    rng = np.random.default_rng(seed)
    for p in layer.parameters():
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return layer


def normal(shape, dtype, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _keep(shape, seed: int = 3) -> np.ndarray:
    """A boolean mask (True = takes part) whose first key always takes part."""
    m = np.random.default_rng(seed).random(shape) < 0.6
    m[..., 0] = True
    return m


def _layer_cases():
    from attnlab.nn import GELU, Embedding, LayerNorm, Linear, MultiheadAttention, ReLU, SelfAttention, TransformerBlock

    def rng(seed=0):
        return np.random.default_rng(seed)

    def mha(**options):
        return lambda dt: MultiheadAttention(8, 2, rng=rng(), dtype=dt, **options)

    def block(**options):
        return lambda dt: TransformerBlock(8, 2, 12, rng=rng(), dtype=dt, **options)

    x = (2, 5, 8)  # (B, T, E)
    return {
        "Linear": (lambda dt: Linear(8, 5, rng=rng(), dtype=dt), lambda m, a, dt: m(a(normal(x, dt)))),
        "Linear-no-bias": (lambda dt: Linear(8, 5, False, rng=rng(), dtype=dt), lambda m, a, dt: m(a(normal(x, dt)))),
        "LayerNorm": (lambda dt: LayerNorm(8, dtype=dt), lambda m, a, dt: m(a(normal(x, dt) * 3 + 1))),
        "LayerNorm-no-affine": (
            lambda dt: LayerNorm(8, elementwise_affine=False, dtype=dt), lambda m, a, dt: m(a(normal(x, dt))),
        ),
        "GELU": (lambda dt: GELU(), lambda m, a, dt: m(a(normal((4, 300), dt) * 4))),
        "GELU-tanh": (lambda dt: GELU("tanh"), lambda m, a, dt: m(a(normal((4, 300), dt) * 4))),
        "ReLU": (lambda dt: ReLU(), lambda m, a, dt: m(a(normal(x, dt)))),
        "Embedding": (
            lambda dt: Embedding(11, 8, rng=rng(), dtype=dt),
            lambda m, a, dt: m(a(rng(4).integers(0, 11, size=(2, 5)))),
        ),
        "SelfAttention": (
            lambda dt: SelfAttention(8, 6, qkv_bias=True, rng=rng(), dtype=dt),
            lambda m, a, dt: m(a(normal(x, dt)), is_causal=True),
        ),
        "SelfAttention-cross-mask": (
            lambda dt: SelfAttention(8, 6, rng=rng(), dtype=dt),
            lambda m, a, dt: m(a(normal(x, dt)), a(normal((2, 7, 8), dt, 1)), attn_mask=a(_keep((5, 7)))),
        ),
        "MHA-self": (
            mha(batch_first=True),
            lambda m, a, dt: (lambda q: m(q, q, q))(a(normal(x, dt))),
        ),
        "MHA-cross-kdim-vdim-padding": (
            mha(kdim=6, vdim=4),  # (L, N, E) inputs
            lambda m, a, dt: m(a(normal((5, 2, 8), dt)), a(normal((7, 2, 6), dt, 1)), a(normal((7, 2, 4), dt, 2)),
                               key_padding_mask=a(_keep((2, 7)))),
        ),
        "MHA-cross-per-head-float-mask": (
            mha(batch_first=True),  # the fused in_proj_weight, applied in three parts
            lambda m, a, dt: m(a(normal(x, dt)), a(normal((2, 7, 8), dt, 1)), a(normal((2, 7, 8), dt, 2)),
                               attn_mask=a(normal((4, 5, 7), dt, 5)), average_attn_weights=False),
        ),
        "MHA-causal-padding-bias-kv-zero-attn": (
            mha(batch_first=True, add_bias_kv=True, add_zero_attn=True),
            lambda m, a, dt: (lambda q: m(q, q, q, key_padding_mask=a(_keep((2, 5))), is_causal=True))(
                a(normal(x, dt))),
        ),
        "MHA-unbatched-no-weights": (
            mha(),
            lambda m, a, dt: (lambda q: m(q, q, q, need_weights=False, is_causal=True))(a(normal((5, 8), dt))),
        ),
        "TransformerBlock-pre-norm-causal": (
            block(), lambda m, a, dt: m.forward_with_weights(a(normal(x, dt))),
        ),
        "TransformerBlock-post-norm-padding": (
            block(causal=False, norm_first=False, activation="relu"),
            lambda m, a, dt: m.forward_with_weights(a(normal(x, dt)), key_padding_mask=a(_keep((2, 5)))),
        ),
    }


LAYER_CASES = _layer_cases()


def run_case(name: str, dtype, to_library=None, *, convert=None):
    """Case ``name``'s outputs (a tuple, ``None`` entries kept): on NumPy, or after
    ``convert(layer)`` with inputs handed over by ``to_library``."""
    build, call = LAYER_CASES[name]
    layer = perturbed(build(np.dtype(dtype))).eval()
    if convert is not None:
        convert(layer)
    out = call(layer, to_library or (lambda arr: arr), dtype)
    return out if isinstance(out, tuple) else (out,)
