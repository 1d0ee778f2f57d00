"""RMSNorm (Llama's and Gemma's), SiLU and the gated feed-forward network against
transformers' modules (weights copied across), and their backward passes against autograd."""

from __future__ import annotations

import numpy as np
import pytest

from attnlab.nn import GatedFeedForward, RMSNorm, SiLU
from attnlab.nn import functional as F

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: E402

TDTYPE = {np.float32: torch.float32, np.float64: torch.float64}
TOL = {np.float32: 2e-6, np.float64: 1e-12}


def max_rel(a, b):
    b = b.detach().numpy() if hasattr(b, "detach") else b
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1.0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_forward_and_backward_match_transformers(dtype, gemma):
    rng = np.random.default_rng(0)
    D = 24
    norm = RMSNorm(D, eps=1e-5, add_unit_offset=gemma, dtype=dtype)
    norm.weight.data[...] = rng.standard_normal(D).astype(dtype)
    # transformers' norms compute in float32 whatever the input; float64 is checked against
    # their formula written in float64.
    hf = (GemmaRMSNorm(D, eps=1e-5) if gemma else LlamaRMSNorm(D, eps=1e-5)).to(TDTYPE[dtype])
    hf.weight.data = torch.from_numpy(norm.weight.data.copy())
    if dtype == np.float64:
        def formula(t):
            w = (1.0 + hf.weight) if gemma else hf.weight
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        hf.forward = formula
    x = (rng.standard_normal((3, 5, D)) * 3).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    y = norm(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = hf(tx)
    (ty * torch.from_numpy(g)).sum().backward()
    gx = norm.backward(g)
    assert max_rel(y, ty) <= TOL[dtype]
    assert max_rel(gx, tx.grad) <= TOL[dtype]
    assert max_rel(norm.weight.grad, hf.weight.grad) <= TOL[dtype] * 10


def test_rms_norm_without_weight_and_the_normalized_value():
    x = np.array([[1.0, -2.0, 2.0]], np.float32)
    norm = RMSNorm(3, eps=0.0, elementwise_affine=False)
    y = norm(x)
    np.testing.assert_allclose(y, x / np.sqrt(3.0), rtol=1e-6)
    x_hat, rstd = F.rms_normalize(x, 0.0)
    np.testing.assert_allclose(x_hat, y, rtol=0)
    assert rstd.shape == (1, 1)
    assert norm.state_dict() == {}
    with pytest.raises(ValueError, match=r"x has shape \(1, 2\), but should be \(\.\.\., 3\)"):
        norm(np.zeros((1, 2), np.float32))


def test_rms_norm_float16_is_computed_in_float32():
    x = np.full((1, 4), 300.0, np.float16)  # x * x overflows float16
    x_hat, _ = F.rms_normalize(x, 1e-6)
    assert x_hat.dtype == np.float16
    np.testing.assert_allclose(x_hat.astype(np.float32), 1.0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_matches_torch_with_gradient(dtype):
    x = np.concatenate([np.linspace(-30, 30, 101), [-1000.0, 1000.0, 0.0]]).astype(dtype)
    g = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)
    act = SiLU()
    y = act(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.silu(tx)
    (ty * torch.from_numpy(g)).sum().backward()
    assert y.dtype == dtype and not np.isnan(y).any()
    assert max_rel(y, ty) <= TOL[dtype]
    assert max_rel(act.backward(g), tx.grad) <= TOL[dtype]


@pytest.mark.skipif(not __import__("attnlab").core.blockwise.fused_available(), reason="numba (the fast extra)")
def test_large_float32_silu_runs_compiled_and_matches_torch(monkeypatch):
    """From F._LOOP_COMPILED_MIN elements a C-contiguous float32 SiLU runs on the compiled
    loop (exp of -|x| only): torch's numbers within 1e-6, inf, NaN and signed zeros as
    torch, also in place; a strided array takes NumPy's path, also within 1e-6."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(F._LOOP_COMPILED_MIN + 7) * 8).astype(np.float32)
    x[:7] = [np.inf, -np.inf, np.nan, 0.0, -0.0, -200.0, 200.0]
    calls = []
    real = F._run_compiled
    monkeypatch.setattr(F, "_run_compiled", lambda k, a, out: calls.append(a.size) or real(k, a, out))
    want = torch.nn.functional.silu(torch.from_numpy(x)).numpy()
    got = F.silu(x)
    assert calls == [x.size] and got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.signbit(got[:7]), np.signbit(want[:7]))
    assert max_rel(got[3:], want[3:]) <= 1e-6 and got[0] == np.inf
    inplace = x.copy()
    assert F.silu(inplace, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, got)
    strided = np.stack([x, x], axis=1)[:, 0]
    assert max_rel(F.silu(strided)[3:], want[3:]) <= 1e-6 and calls == [x.size, x.size]
    wide = np.empty(x.shape, np.float64)  # another dtype's out: NumPy's path writes it
    F.silu(x, out=wide)
    assert calls == [x.size, x.size] and max_rel(wide[3:].astype(np.float32), want[3:]) <= 1e-6


@pytest.mark.skipif(not __import__("attnlab").core.blockwise.fused_available(), reason="numba (the fast extra)")
def test_large_float32_tanh_gelu_runs_compiled_and_matches_torch(monkeypatch):
    """From F._LOOP_COMPILED_MIN elements a C-contiguous float32 tanh GELU runs on the
    compiled loop (x sigmoid(2u)): torch's numbers within 1e-6 of their scale (and within
    2e-7 of the float64 formula, closer than torch below u << 0, where 1 + tanh cancels),
    inf and NaN as torch, also in place; a strided array takes NumPy's path."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(F._LOOP_COMPILED_MIN + 6) * 4).astype(np.float32)
    x[:6] = [np.inf, -np.inf, np.nan, 0.0, -30.0, 30.0]
    calls = []
    real = F._run_compiled
    monkeypatch.setattr(F, "_run_compiled", lambda k, a, out: calls.append(k) or real(k, a, out))
    want = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    got = F.gelu(x, approximate="tanh")
    assert calls == ["gelu_tanh32_"] and got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert got[0] == np.inf and got[3] == 0.0
    assert np.abs(got[3:] - want[3:]).max() <= 1e-6 * max(1.0, np.abs(want[3:]).max())
    x64 = x[3:].astype(np.float64)
    exact = 0.5 * x64 * (1.0 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3)))
    assert np.abs(got[3:] - exact).max() <= 2e-7 * max(1.0, np.abs(exact).max())
    inplace = x.copy()
    assert F.gelu(inplace, approximate="tanh", out=inplace) is inplace
    np.testing.assert_array_equal(inplace, got)
    strided = np.stack([x, x], axis=1)[:, 0]
    numpy_path = F.gelu(strided, approximate="tanh")
    assert calls == ["gelu_tanh32_", "gelu_tanh32_"]
    assert np.abs(numpy_path[3:] - want[3:]).max() <= 1e-6 * max(1.0, np.abs(want[3:]).max())


class _Cfg:
    def __init__(self, d, f, act, bias):
        self.hidden_size, self.intermediate_size, self.hidden_act, self.mlp_bias = d, f, act, bias


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("activation", "hf_act", "bias"),
                         [("silu", "silu", False), ("silu", "silu", True), ("gelu_tanh", "gelu_pytorch_tanh", False)])
def test_gated_feed_forward_matches_llama_mlp_with_gradients(dtype, activation, hf_act, bias):
    rng = np.random.default_rng(1)
    ff = GatedFeedForward(12, 20, activation=activation, bias=bias, rng=rng, dtype=dtype)
    hf = LlamaMLP(_Cfg(12, 20, hf_act, bias)).to(TDTYPE[dtype])
    hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in ff.state_dict().items()})
    x = rng.standard_normal((2, 7, 12)).astype(dtype)
    g = rng.standard_normal((2, 7, 12)).astype(dtype)
    y = ff(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = hf(tx)
    (ty * torch.from_numpy(g)).sum().backward()
    gx = ff.backward(g)
    assert max_rel(y, ty) <= TOL[dtype] * 5
    assert max_rel(gx, tx.grad) <= TOL[dtype] * 5
    tparams = dict(hf.named_parameters())
    for name, p in ff.named_parameters():
        assert max_rel(p.grad, tparams[name].grad) <= TOL[dtype] * 10, name


def test_gated_feed_forward_refuses_an_unknown_activation():
    with pytest.raises(ValueError, match="activation must be one of 'silu'.*got 'swish'"):
        GatedFeedForward(4, 8, activation="swish")


def test_hook_points_of_the_gated_network_and_rms_norm():
    rng = np.random.default_rng(2)
    ff = GatedFeedForward(6, 10, rng=rng).eval()
    x = rng.standard_normal((2, 3, 6)).astype(np.float32)
    out, cache = ff.run_with_cache(x)
    gate = x @ ff.gate_proj.weight.data.T
    up = x @ ff.up_proj.weight.data.T
    np.testing.assert_allclose(cache["hook_pre"], gate, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache["hook_pre_linear"], up, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache["hook_post"], F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    zeroed = ff.run_with_hooks(x, fwd_hooks=[("hook_post", lambda a, name: np.zeros_like(a))])
    np.testing.assert_array_equal(zeroed, 0.0)
    assert not np.allclose(out, 0.0)
    norm = RMSNorm(6).eval()
    norm.weight.data[...] = 2.0
    y, c = norm.run_with_cache(x)
    np.testing.assert_allclose(c["hook_normalized"] * 2.0, y, rtol=1e-6)
    doubled = norm.run_with_hooks(x, fwd_hooks=[("hook_normalized", lambda a, name: a * 2)])
    np.testing.assert_allclose(doubled, 2 * y, rtol=1e-6)
