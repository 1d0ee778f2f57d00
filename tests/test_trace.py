"""attnlab.trace: every intermediate equals what the core and the layers compute."""

import json

import numpy as np
import pytest

import attnlab

RNG = np.random.default_rng(7)


def _mha(E=16, H=4, *, bias=True, dtype=np.float32, seed=0):
    mha = attnlab.MultiheadAttention(E, H, bias=bias, batch_first=True,
                                     rng=np.random.default_rng(seed), dtype=dtype)
    if bias:  # non-zero biases, so they matter
        mha.in_proj_bias.data[...] = np.random.default_rng(seed + 1).standard_normal(3 * E)
        mha.out_proj.bias.data[...] = np.random.default_rng(seed + 2).standard_normal(E)
    return mha


def _x(T=5, E=16, dtype=np.float32):
    return RNG.standard_normal((1, T, E)).astype(dtype)


def test_step_names_shapes_and_order():
    mha, x = _mha(bias=False), _x()
    t = attnlab.trace(mha, x, tokens=list("abcde"))
    assert t.names() == ["X", "W_q", "W_k", "W_v", "Q", "K", "V", "scores", "scaled_scores",
                         "weights", "head_output", "concat", "W_o", "output"]
    shapes = {(s.name, s.head): s.shape for s in t.steps}
    assert shapes[("X", None)] == (5, 16)
    assert shapes[("W_q", 3)] == (16, 4)
    assert shapes[("Q", 0)] == (5, 4)
    assert shapes[("weights", 2)] == (5, 5)
    assert shapes[("concat", None)] == (5, 16)
    assert shapes[("output", None)] == (5, 16)
    assert len(t) == 1 + 3 * 4 + 3 * 4 + 3 * 4 + 4 + 3
    assert all(s.description for s in t.steps)
    assert t.tokens == list("abcde") and t.num_heads == 4 and t.scale == pytest.approx(0.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_trace_equals_the_layer(dtype, bias):
    mha, x = _mha(bias=bias, dtype=dtype), _x(dtype=dtype)
    out, w = mha(x, x, x, average_attn_weights=False)
    t = attnlab.trace(mha, x)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(t.get("output"), out[0], rtol=tol, atol=tol)
    weights = np.stack([t.get("weights", h) for h in range(4)])
    np.testing.assert_allclose(weights, w[0], rtol=tol, atol=tol)
    assert t.get("output").dtype == dtype
    assert ("b_q" in t.names()) == bias


def test_trace_steps_follow_the_core():
    mha, x = _mha(), _x()
    t = attnlab.trace(mha, x)
    X = t.get("X")
    for h in range(4):
        q = X @ t.get("W_q", h) + t.get("b_q", h)
        k = X @ t.get("W_k", h) + t.get("b_k", h)
        np.testing.assert_allclose(t.get("Q", h), q, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(t.get("scores", h), q @ k.T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(t.get("scaled_scores", h), t.get("scores", h) * 0.5, rtol=1e-6)
        np.testing.assert_allclose(t.get("weights", h), attnlab.softmax(t.get("scaled_scores", h)))
        np.testing.assert_allclose(t.get("weights", h), attnlab.attention_weights(q, k), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(
            t.get("head_output", h),
            attnlab.scaled_dot_product_attention(t.get("Q", h), t.get("K", h), t.get("V", h)),
            rtol=1e-6, atol=1e-6,
        )
    np.testing.assert_allclose(t.get("output"), t.get("concat") @ t.get("W_o") + t.get("b_o"),
                               rtol=1e-5, atol=1e-5)


def test_trace_matches_torch():
    torch = pytest.importorskip("torch", reason="torch (the test oracle) is not installed")
    E, H = 16, 4
    mha, x = _mha(E, H, dtype=np.float64), _x(E=E, dtype=np.float64)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in mha.state_dict().items()})
    xt = torch.from_numpy(x)
    out, w = ref(xt, xt, xt, average_attn_weights=False)
    t = attnlab.trace(mha, x)
    np.testing.assert_allclose(t.get("output"), out[0].detach().numpy(), rtol=1e-10, atol=1e-12)
    weights = np.stack([t.get("weights", h) for h in range(H)])
    np.testing.assert_allclose(weights, w[0].detach().numpy(), rtol=1e-10, atol=1e-12)


def test_causal_and_bool_mask_add_a_masked_step():
    mha, x = _mha(bias=False), _x(T=4)
    t = attnlab.trace(mha, x, is_causal=True)
    out, w = mha(x, x, x, is_causal=True, average_attn_weights=False)
    assert "masked_scores" in t.names()
    m = t.get("masked_scores", 0)
    assert np.isneginf(m[0, 1:]).all() and np.isfinite(np.tril(m)).all()
    np.testing.assert_allclose(t.get("output"), out[0], rtol=1e-6, atol=1e-6)
    keep = np.ones((4, 4), bool)
    keep[:, 2] = False
    t2 = attnlab.trace(mha, x, attn_mask=keep)
    np.testing.assert_allclose(t2.get("weights", 1)[:, 2], 0)
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))  # -inf becomes null
    step = next(s for s in d["steps"] if s["name"] == "masked_scores")
    assert step["values"][0][1] is None


def test_self_attention_single_head():
    layer = attnlab.SelfAttention(6, 3, rng=np.random.default_rng(0))
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    ctx, w = layer(x)
    t = attnlab.trace(layer, x)
    assert t.num_heads == 1 and t.names()[-1] == "output"
    assert t.get("W_q", 0).shape == (6, 3)
    np.testing.assert_allclose(t.get("output"), ctx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(t.get("weights", 0), w, rtol=1e-6, atol=1e-6)


def test_to_dict_is_json_with_stable_keys():
    t = attnlab.trace(_mha(bias=False), _x(T=3), tokens=["a", "b", "c"])
    d = json.loads(json.dumps(t.to_dict(decimals=4)))
    assert set(d) == {"tokens", "num_heads", "scale", "steps"}
    s0 = d["steps"][0]
    assert set(s0) == {"name", "shape", "head", "description", "values"}
    assert s0["name"] == "X" and s0["shape"] == [3, 16] and s0["head"] is None
    assert np.array(s0["values"]).shape == (3, 16)


def test_trace_rejects_bad_input():
    mha = _mha(bias=False)
    with pytest.raises(TypeError, match="MultiheadAttention or attnlab.SelfAttention"):
        attnlab.trace(object(), _x())
    with pytest.raises(ValueError, match="one sequence"):
        attnlab.trace(mha, RNG.standard_normal((2, 3, 16)).astype(np.float32))
    with pytest.raises(ValueError, match="should be"):
        attnlab.trace(mha, RNG.standard_normal((3, 15)).astype(np.float32))
    with pytest.raises(ValueError, match="tokens has 2 entries"):
        attnlab.trace(mha, _x(T=3), tokens=["a", "b"])
    with pytest.raises(ValueError, match="not both"):
        attnlab.trace(mha, _x(T=3), attn_mask=np.ones((3, 3), bool), is_causal=True)
    with pytest.raises(KeyError, match="no step"):
        attnlab.trace(mha, _x(T=3)).get("nope")
