"""attnlab.trace: every intermediate is what the core and the layer compute; its weights are
the layer's own (difference 0) for self- and cross-attention."""

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
    assert set(d) == {"tokens", "key_tokens", "num_heads", "scale", "layer", "head", "steps"}
    assert d["key_tokens"] == ["a", "b", "c"] and d["layer"] is None and d["head"] is None
    s0 = d["steps"][0]
    assert set(s0) == {"name", "shape", "head", "description", "values"}
    assert s0["name"] == "X" and s0["shape"] == [3, 16] and s0["head"] is None
    assert np.array(s0["values"]).shape == (3, 16)


def test_trace_rejects_bad_input():
    mha = _mha(bias=False)
    with pytest.raises(TypeError, match="Attention \\(MultiheadAttention included\\) or attnlab.SelfAttention"):
        attnlab.trace(object(), _x())
    with pytest.raises(ValueError, match="one sequence"):
        attnlab.trace(mha, RNG.standard_normal((2, 3, 16)).astype(np.float32))
    with pytest.raises(ValueError, match="should be"):
        attnlab.trace(mha, RNG.standard_normal((3, 15)).astype(np.float32))
    with pytest.raises(ValueError, match="tokens has 2 entries"):
        attnlab.trace(mha, _x(T=3), tokens=["a", "b"])
    with pytest.raises(ValueError, match="key_tokens has 3 entries, but key_value has 4 rows"):
        attnlab.trace(mha, _x(T=3), _x(T=4), key_tokens=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"head must be None or in 0..3"):
        attnlab.trace(mha, _x(T=3), head=4)
    with pytest.raises(ValueError, match="add_bias_kv"):
        attnlab.trace(attnlab.MultiheadAttention(8, 2, add_bias_kv=True, rng=np.random.default_rng(0)),
                      np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="kdim == vdim"):
        attnlab.trace(attnlab.MultiheadAttention(8, 2, kdim=4, vdim=5, rng=np.random.default_rng(0)),
                      np.zeros((3, 8), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(KeyError, match="no step"):
        attnlab.trace(mha, _x(T=3)).get("nope")


# ---- the trace's weights are the layer's weights: difference 0 ----------------------------

HEAD_DIMS = [(18, 3), (128, 4), (24, 2)]  # head dims 6, 32, 12: not powers of 4


@pytest.mark.parametrize("E, H", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_self_attention_trace_is_the_layer_exactly(E, H, mask):
    mha, x = _mha(E, H), _x(T=7, E=E)
    kw = {}
    if mask == "causal":
        kw = {"is_causal": True}
    elif mask == "bool":
        kw = {"attn_mask": np.random.default_rng(3).random((7, 7)) < 0.6}
    elif mask == "float":
        kw = {"attn_mask": np.random.default_rng(3).standard_normal((7, 7)).astype(np.float32)}
    mha.eval()
    out, w = mha(x, x, x, average_attn_weights=False, **kw)
    t = attnlab.trace(mha, x, **kw)
    weights = np.stack([t.get("weights", h) for h in range(H)])
    assert np.abs(weights - w[0]).max() == 0
    assert np.abs(t.get("output") - out[0]).max() == 0
    assert ("masked_scores" in t.names()) == (mask != "none")


@pytest.mark.parametrize("E, H", HEAD_DIMS)
@pytest.mark.parametrize("kdim", [None, 5])
def test_cross_attention_trace_is_the_layer_exactly(E, H, kdim):
    L, S = 4, 9
    mha = attnlab.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, rng=np.random.default_rng(1)).eval()
    q = RNG.standard_normal((L, E)).astype(np.float32)  # unbatched (L, E)
    kv = RNG.standard_normal((S, kdim or E)).astype(np.float32)
    out, w = mha(q, kv, kv, average_attn_weights=False)
    t = attnlab.trace(mha, q, kv, tokens=list("abcd"))
    assert t.tokens == list("abcd") and t.key_tokens == [str(i) for i in range(S)]
    assert t.get("X_kv").shape == (S, kdim or E) and t.get("K", 0).shape == (S, E // H)
    assert t.get("weights", H - 1).shape == (L, S) and t.get("W_k", 0).shape == (kdim or E, E // H)
    weights = np.stack([t.get("weights", h) for h in range(H)])
    assert np.abs(weights - w).max() == 0
    assert np.abs(t.get("output") - out).max() == 0


def test_trace_of_a_sequence_first_layer():
    mha = attnlab.MultiheadAttention(12, 3, rng=np.random.default_rng(2)).eval()  # (L, N, E)
    x = RNG.standard_normal((5, 1, 12)).astype(np.float32)
    out, w = mha(x, x, x, average_attn_weights=False)
    t = attnlab.trace(mha, x)
    assert t.get("X").shape == (5, 12)
    assert np.abs(np.stack([t.get("weights", h) for h in range(3)]) - w[0]).max() == 0
    assert np.abs(t.get("output") - out[:, 0]).max() == 0


@pytest.mark.parametrize("cross", [False, True])
def test_single_head_trace_is_the_layer_exactly(cross):
    layer = attnlab.SelfAttention(6, 3, qkv_bias=True, rng=np.random.default_rng(0))
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    kv = RNG.standard_normal((7, 6)).astype(np.float32) if cross else None
    ctx, w = layer(x, kv, is_causal=not cross)
    t = attnlab.trace(layer, x, kv, is_causal=not cross)
    assert np.abs(t.get("weights", 0) - w).max() == 0
    assert np.abs(t.get("output") - ctx).max() == 0
    assert t.get("V", 0).shape == ((7, 3) if cross else (4, 3))


def test_head_keeps_one_heads_steps():
    t = attnlab.trace(_mha(), _x(T=3), head=2)
    assert {s.head for s in t.steps} == {None, 2}
    assert t.head == 2 and np.array_equal(t.get("weights", 2), attnlab.trace(_mha(), t.get("X")).get("weights", 2))


def test_str_shows_the_steps_as_tables():
    mha = _mha(E=8, H=2)
    x = _x(T=3, E=8)
    t = attnlab.trace(mha, x, tokens=["the", "cat", "sat"], is_causal=True)
    text = str(t)
    lines = text.splitlines()
    assert lines[1] == "step by step (head 0 (of 0-1))"
    assert " 1. X  (3, 8): input token vectors, one row per token" in lines
    assert any(line.startswith(" 2. W_q  (8, 4)  head 0: ") for line in lines)
    i = lines.index(next(line for line in lines if ". weights  (3, 3)  head 0:" in line))
    assert lines[i + 1].split() == ["the", "cat", "sat"]
    row = lines[i + 2].split()
    assert row[0] == "the" and [float(v) for v in row[1:]] == [1.0, 0.0, 0.0]
    assert "head 1" not in text
    assert "step by step (head 1 (of 0-1))" in t.format(head=1)
    wide = attnlab.trace(_mha(E=16, H=4), _x(T=10))
    assert "  ... 2 more rows, 2 more columns (to_dict() has every value)" in str(wide)
