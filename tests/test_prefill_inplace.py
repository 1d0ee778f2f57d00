"""The eval-mode shortcuts of the prefill path give the numbers of the layers' ordinary
path: the blocked (and threaded) in-place activations and the in-place norms."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.core.blockwise import tuned
from attnlab.nn import LayerNorm, RMSNorm
from attnlab.nn import functional as F
from attnlab.nn.hooks import hooks


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


needs_numba = pytest.mark.skipif(not F._compiled_planned(1 << 20, 0), reason="needs numba (the fast extra)")


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [False, True])
def test_large_rms_norm_runs_in_one_compiled_pass(monkeypatch, dtype, offset):
    """Above the compiled pass's threshold: one call of the kernel in eval mode (the weight
    folded in), the training path's numbers bit for bit, and the float64 formula to
    float32 rounding."""
    from attnlab.core import _fused

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 300, 96)) * 3).astype(dtype)
    assert x.size >= F._LN_FUSED_MIN
    norm = RMSNorm(96, add_unit_offset=offset, dtype=dtype)
    norm.weight.data[...] = rng.standard_normal(96).astype(dtype)
    calls = []
    kernel = _fused.rms_normalize
    monkeypatch.setattr(_fused, "rms_normalize", lambda *a: (calls.append(a[2].size), kernel(*a))[1])
    want = norm.train()(x)
    got = norm.eval()(x)
    assert calls == [0, 96]  # training: x_hat alone; eval: the weight in the same pass
    np.testing.assert_array_equal(got, want)
    x64 = x.astype(np.float64)
    w64 = norm.weight.data.astype(np.float64) + (1.0 if offset else 0.0)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + norm.eps) * w64
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
def test_eval_gated_network_in_place_equals_the_training_path(activation):
    """Eval mode overwrites the gate's projection with the activation and the product;
    the numbers are the training path's, bit for bit (SiLU large enough for its compiled
    loop)."""
    from attnlab.nn.blocks import GatedFeedForward

    rng = np.random.default_rng(8)
    ff = GatedFeedForward(64, 2048, activation=activation, rng=rng)
    x = rng.standard_normal((2, 70, 64)).astype(np.float32)  # 286720 hidden values
    want = ff.train()(x)
    np.testing.assert_array_equal(ff.eval()(x), want)


def test_a_hooked_gate_is_not_overwritten():
    """A hook on the gate's projection keeps the array it saw: the in-place shortcut
    stands aside."""
    from attnlab.nn.blocks import GatedFeedForward

    rng = np.random.default_rng(9)
    ff = GatedFeedForward(16, 32, rng=rng).eval()
    x = rng.standard_normal((5, 16)).astype(np.float32)
    seen = []
    with hooks(ff, [("hook_pre", lambda a, name: seen.append(a))]):
        out = ff(x)
    np.testing.assert_array_equal(seen[0], F.linear(x, ff.gate_proj.weight.data))
    np.testing.assert_array_equal(ff(x), out)
