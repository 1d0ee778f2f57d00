"""The eval-mode shortcuts of the prefill path give the numbers of the layers' ordinary
path: the gated feed-forward network's fused gate/up product (and what happens when its
weights are edited, replaced or trained), the blocked in-place activations, and the
in-place norms."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.models.llama import Llama, LlamaConfig
from attnlab.nn import GatedFeedForward, LayerNorm, RMSNorm
from attnlab.nn import functional as F
from attnlab.train.optim import SGD


def reference_gelu_tanh(x):
    inner = F._SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1.0 + np.tanh(inner))


def reference_silu(x):
    d = np.exp(-x)
    d += 1
    return x / d


def unfused_output(ff, x):
    """The output of ``ff``'s separate projections (training mode, no dropout)."""
    ff.train()
    try:
        return ff(x)
    finally:
        ff.eval()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_gate_up_gives_the_separate_projections_numbers(activation, bias):
    rng = np.random.default_rng(1)
    ff = GatedFeedForward(16, 40, activation=activation, bias=bias, rng=rng).eval()
    x = rng.standard_normal((2, 7, 16)).astype(np.float32)
    assert ff._gate_up() is not None  # fused at construction
    np.testing.assert_allclose(ff(x), unfused_output(ff, x), rtol=2e-6, atol=1e-6)
    assert sorted(ff.state_dict()) == sorted(
        ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        + (["gate_proj.bias", "up_proj.bias", "down_proj.bias"] if bias else []))


def test_fused_gate_up_sees_in_place_edits_and_falls_back_on_replaced_weights():
    rng = np.random.default_rng(2)
    ff = GatedFeedForward(8, 12, rng=rng).eval()
    x = rng.standard_normal((5, 8)).astype(np.float32)
    before = ff(x)
    ff.up_proj.weight.data[3] = 0.0  # an ablation, in place
    edited = ff(x)
    assert not np.allclose(edited, before)
    np.testing.assert_allclose(edited, unfused_output(ff, x), rtol=2e-6, atol=1e-6)
    ff.gate_proj.weight.data = rng.standard_normal((12, 8)).astype(np.float32)  # a new array
    assert ff._gate_up() is None
    np.testing.assert_allclose(ff(x), unfused_output(ff, x), rtol=2e-6, atol=1e-6)
    assert ff.fuse_gate_up() and ff._gate_up() is not None
    np.testing.assert_allclose(ff(x), unfused_output(ff, x), rtol=2e-6, atol=1e-6)


def test_gradients_reach_the_separate_parameters_and_steps_reach_the_fused_product():
    rng = np.random.default_rng(3)
    ff = GatedFeedForward(6, 10, rng=rng)
    twin = GatedFeedForward(6, 10, rng=np.random.default_rng(0))
    twin.load_state_dict(ff.state_dict())
    twin.gate_proj.weight.data = twin.gate_proj.weight.data.copy()  # not fused
    assert twin._gate_up() is None and ff._gate_up() is not None
    x = rng.standard_normal((4, 6)).astype(np.float32)
    g = rng.standard_normal((4, 6)).astype(np.float32)
    for m in (ff, twin):
        m.train()
        m(x)
        m.backward(g)
    for name in ("gate_proj", "up_proj", "down_proj"):
        np.testing.assert_array_equal(getattr(ff, name).weight.grad, getattr(twin, name).weight.grad)
    SGD(list(ff.parameters()), lr=0.1).step()
    ff.eval()
    assert ff._gate_up() is not None  # the step updated the views in place
    np.testing.assert_allclose(ff(x), unfused_output(ff, x), rtol=2e-6, atol=1e-6)


def test_llama_loaded_from_weights_is_fused_and_matches_the_unfused_forward():
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = Llama(cfg, rng=np.random.default_rng(4))
    weights = {}
    from attnlab.models.llama import llama_name_map

    state = model.state_dict()
    for ours, theirs in llama_name_map(cfg).items():
        if len(theirs) == 1:
            weights[theirs[0]] = state[ours]
        else:
            for name, part in zip(theirs, np.split(state[ours], [16, 24]), strict=True):
                weights[name] = part
    loaded = Llama(cfg, weights)
    assert all(b.mlp._gate_up() is not None for b in loaded.layers)
    ids = np.array([[1, 5, 9, 2, 33, 7]])
    fused = loaded(ids)
    for b in loaded.layers:
        b.mlp.gate_proj.weight.data = b.mlp.gate_proj.weight.data.copy()
    np.testing.assert_allclose(fused, loaded(ids), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused, model(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strided", [False, True])
def test_blocked_activations_equal_the_plain_formulas_bit_for_bit(threads, strided):
    rng = np.random.default_rng(5)
    base = (rng.standard_normal((3, 200, 2 * 3000)) * 4).astype(np.float32)  # 1.8M per half
    gate, up = (base[..., :3000], base[..., 3000:]) if strided else (base[..., :3000].copy(), base[..., 3000:].copy())
    attnlab.set_num_threads(threads)
    try:
        np.testing.assert_array_equal(F.gelu(gate, approximate="tanh"), reference_gelu_tanh(gate))
        np.testing.assert_array_equal(F.silu(gate), reference_silu(gate))
        want = reference_silu(gate) * up
        g = gate.copy()
        np.testing.assert_array_equal(F.silu_mul(g, up, out=g), want)
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
