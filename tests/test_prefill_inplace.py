"""The eval-mode shortcuts of the prefill path give the numbers of the layers' ordinary
path: the blocked (and threaded) in-place activations and the in-place norms."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.core.blockwise import tuned
from attnlab.nn import LayerNorm, RMSNorm
from attnlab.nn import functional as F


def reference_gelu_tanh(x):
    inner = F._SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + np.tanh(inner))


def reference_silu(x):
    d = np.exp(-x)
    d += 1
    return x / d


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strided", [False, True])
def test_blocked_activations_equal_the_plain_formulas_bit_for_bit(threads, strided):
    """NumPy's blocked paths (numba off: a large contiguous float32 SiLU would otherwise
    take the compiled loop, which tests/test_llama_layers.py checks against torch)."""
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((3, 200, 2 * 3000)) * 4).astype(np.float32)  # 1.8M per half
    gate = base[..., :3000] if strided else base[..., :3000].copy()
    attnlab.set_num_threads(threads)
    try:
        with tuned(fused=False):
            np.testing.assert_array_equal(F.gelu(gate, approximate="tanh"), reference_gelu_tanh(gate))
            np.testing.assert_array_equal(F.silu(gate), reference_silu(gate))
            want = reference_silu(gate)
            F.silu(gate, out=gate)
            np.testing.assert_array_equal(gate, want)
    finally:
        attnlab.set_num_threads(None)


def test_eval_norms_in_place_equal_the_training_path():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 9, 12)).astype(np.float32)
    for norm in (LayerNorm(12), RMSNorm(12), RMSNorm(12, add_unit_offset=True)):
        norm.weight.data[...] = rng.standard_normal(12).astype(np.float32)
        if getattr(norm, "bias", None) is not None:
            norm.bias.data[...] = rng.standard_normal(12).astype(np.float32)
        norm.train()
        want = norm(x)
        norm.eval()
        np.testing.assert_array_equal(norm(x), want)
