"""Forward parity with PyTorch: scaled_dot_product_attention, attention_weights, softmax."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import attnlab
from conftest import assert_parity

torch = pytest.importorskip("torch")

DTYPES = [np.float32, np.float64]


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def random_bool_mask(rng, shape):
    """A random boolean mask with at least one True per row (no fully masked rows)."""
    m = rng.random(shape) < 0.6
    m[..., 0] = True
    return m


def reference_sdpa(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(
            t(q), t(k), t(v), attn_mask=None if mask is None else t(mask),
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )


BATCHES = [(), (3,), (2, 3)]
LENGTHS = [(5, 5), (4, 9), (7, 3), (1, 6)]
MASKS = ["none", "bool", "float", "causal", "bool-broadcast"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("L,S", LENGTHS)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_sdpa_matches_torch(dtype, batch, L, S, mask_kind):
    rng = np.random.default_rng([len(batch), *batch, L, S, MASKS.index(mask_kind)])  # fixed per case
    E, Ev = 8, 6
    q = rng.standard_normal((*batch, L, E)).astype(dtype)
    k = rng.standard_normal((*batch, S, E)).astype(dtype)
    v = rng.standard_normal((*batch, S, Ev)).astype(dtype)
    mask, causal = None, False
    if mask_kind == "bool":
        mask = random_bool_mask(rng, (*batch, L, S))
    elif mask_kind == "float":
        mask = rng.standard_normal((*batch, L, S)).astype(dtype)
    elif mask_kind == "bool-broadcast":
        mask = random_bool_mask(rng, (1, S))
    elif mask_kind == "causal":
        causal = True
    ours = attnlab.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    ref = reference_sdpa(q, k, v, mask, causal)
    assert_parity(ours, ref)
    weights = attnlab.attention_weights(q, k, attn_mask=mask, is_causal=causal)
    ref_w = reference_weights(q, k, mask, causal, None)
    assert_parity(weights, ref_w)


def reference_weights(q, k, mask, causal, scale):
    """softmax(q k^T * scale + mask) in torch, with fully masked rows set to 0."""
    with torch.no_grad():
        qt, kt = t(q), t(k)
        scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        s = qt @ kt.transpose(-2, -1) * scale
        L, S = s.shape[-2:]
        if causal:
            s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
        elif mask is not None:
            m = t(mask)
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        w = torch.softmax(s, dim=-1)
        return torch.nan_to_num(w, nan=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [None, 0.25, 2.0])
def test_sdpa_scale(dtype, scale):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 6, 16)).astype(dtype) for _ in range(3))
    assert_parity(attnlab.scaled_dot_product_attention(q, k, v, scale=scale), reference_sdpa(q, k, v, scale=scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,H", [(8, 2), (6, 3), (4, 1), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_gqa(dtype, Hq, H, causal):
    rng = np.random.default_rng(Hq * 10 + H)
    q = rng.standard_normal((2, Hq, 5, 8)).astype(dtype)
    k = rng.standard_normal((2, H, 7, 8)).astype(dtype)
    v = rng.standard_normal((2, H, 7, 4)).astype(dtype)
    ours = attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert_parity(ours, reference_sdpa(q, k, v, is_causal=causal, enable_gqa=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_head_broadcast(dtype):
    """Leading dims broadcast as in torch's math path (a single K/V head shared)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 5, 8)).astype(dtype)
    k = rng.standard_normal((2, 1, 6, 8)).astype(dtype)
    v = rng.standard_normal((2, 1, 6, 8)).astype(dtype)
    ref = torch.softmax(t(q) @ t(k).transpose(-2, -1) / np.sqrt(8), -1) @ t(v)
    assert_parity(attnlab.scaled_dot_product_attention(q, k, v), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zeros(dtype):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 4, 8)).astype(dtype) for _ in range(3))
    mask = np.ones((2, 4, 4), bool)
    mask[0, 1] = False
    out = attnlab.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.all(out[0, 1] == 0) and np.isfinite(out).all()
    w = attnlab.attention_weights(q, k, attn_mask=mask)
    assert np.all(w[0, 1] == 0)
    np.testing.assert_allclose(w[1].sum(-1), 1, rtol=1e-6)
    # and the other rows still equal torch
    ref = reference_sdpa(q, k, v, mask).numpy()
    assert_parity(np.delete(out.reshape(8, 8), 1, axis=0), np.delete(ref.reshape(8, 8), 1, axis=0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_key_sequence_gives_zeros(dtype):
    q = np.ones((2, 3, 4), dtype)
    k = np.ones((2, 0, 4), dtype)
    v = np.ones((2, 0, 5), dtype)
    out = attnlab.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 5) and out.dtype == dtype and np.all(out == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_preserved_end_to_end(dtype):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 4)).astype(dtype)
    assert attnlab.scaled_dot_product_attention(q, q, q).dtype == dtype
    assert attnlab.attention_weights(q, q).dtype == dtype
    assert attnlab.softmax(q).dtype == dtype
    ctx, w = attnlab.simple_attention(q)
    assert ctx.dtype == w.dtype == dtype
    mha = attnlab.MultiheadAttention(4, 2, rng=rng, dtype=dtype)
    out, w = mha(q, q, q)
    assert out.dtype == w.dtype == dtype
    # a float64 float mask on float32 inputs does not upcast the result
    out = attnlab.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros((3, 3)))
    assert out.dtype == dtype


def test_nan_and_inf_propagate_as_in_torch():
    q = np.random.default_rng(5).standard_normal((3, 4))
    k = q.copy()
    k[1, 2] = np.nan
    out = attnlab.scaled_dot_product_attention(q, k, q)
    ref = reference_sdpa(q, k, q).numpy()
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(out).all()
    v = q.copy()
    v[0, 0] = np.inf
    out = attnlab.scaled_dot_product_attention(q, q, v)
    ref = reference_sdpa(q, q, v).numpy()
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_matches_torch(dtype):
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 5, 6)) * 30).astype(dtype)
    for axis in (0, 1, -1):
        assert_parity(attnlab.softmax(x, axis=axis), torch.softmax(t(x), dim=axis))


def test_dropout_is_seeded_and_scaled():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 6, 8)) for _ in range(3))
    a = attnlab.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(1))
    b = attnlab.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(1))
    c = attnlab.scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # the same computation written out: weights * keep / (1 - p)
    keep = np.random.default_rng(1).random((2, 6, 6)) >= 0.5
    w = attnlab.attention_weights(q, k)
    np.testing.assert_allclose(a, (w * keep / 0.5) @ v, rtol=1e-12)
    # dropout_p=0 draws nothing: the Generator is untouched
    g = np.random.default_rng(3)
    state = g.bit_generator.state
    attnlab.scaled_dot_product_attention(q, k, v, rng=g)
    assert g.bit_generator.state == state


def test_seed_003_loop_equals_matrix_form():
    """Seed 003: attention for each word in a loop equals the matrix form, with L != S."""
    rng = np.random.default_rng(8)
    vocab = 10
    words_q = rng.integers(0, vocab, size=4)
    words_k = rng.integers(0, vocab, size=7)
    one_hot = np.eye(vocab)
    wq, wk, wv = (rng.standard_normal((vocab, vocab)) for _ in range(3))
    Q = one_hot[words_q] @ wq
    K = one_hot[words_k] @ wk
    V = one_hot[words_k] @ wv
    rows = []
    for query in Q:  # one word at a time
        scores = np.array([query @ key for key in K]) / np.sqrt(K.shape[1])
        weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        rows.append(sum(w * value for w, value in zip(weights, V, strict=True)))
    np.testing.assert_allclose(attnlab.scaled_dot_product_attention(Q, K, V), np.array(rows), rtol=1e-12)


def test_seed_004_journey_figures():
    x = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                  [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
    context, weights = attnlab.simple_attention(x)
    np.testing.assert_allclose(weights[1], [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581], atol=5e-5)
    np.testing.assert_allclose(context[1], [0.4419, 0.6515, 0.5683], atol=5e-5)
    ref_w = torch.softmax(t(x) @ t(x).T, dim=-1)
    assert_parity(weights, ref_w)
    assert_parity(context, ref_w @ t(x))


@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
@pytest.mark.parametrize("L,S", [(3, 3), (2, 5), (5, 2), (0, 3), (4, 0)])
def test_causal_mask_matches_obvious_construction(align, L, S):
    m = attnlab.causal_mask(L, S, align=align)
    offset = 0 if align == "top-left" else S - L
    expected = np.array([[j <= i + offset for j in range(S)] for i in range(L)], dtype=bool).reshape(L, S)
    np.testing.assert_array_equal(m, expected)
    if align == "top-left" and L and S:
        np.testing.assert_array_equal(m, torch.ones(L, S, dtype=torch.bool).tril().numpy())


def test_bottom_right_mask_is_kv_cache_decoding():
    """Decoding the last 2 tokens against a cache of 6 keys equals full causal attention."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((6, 8))
    full = attnlab.scaled_dot_product_attention(x, x, x, is_causal=True)
    last = attnlab.scaled_dot_product_attention(
        x[-2:], x, x, attn_mask=attnlab.causal_mask(2, 6, align="bottom-right")
    )
    np.testing.assert_allclose(last, full[-2:], rtol=1e-12)


def test_padding_mask_and_torch_convention():
    m = attnlab.padding_mask([2, 0, 3], 3)
    np.testing.assert_array_equal(m, [[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    torch_style = ~m  # torch MHA: True = ignore
    np.testing.assert_array_equal(attnlab.convert_mha_mask(torch_style), m)
    f = np.array([[0.0, -np.inf]])
    assert attnlab.convert_mha_mask(f) is not None and np.array_equal(attnlab.convert_mha_mask(f), f)
    assert attnlab.convert_mha_mask(None) is None


def test_all_option_combinations_run():
    """A sweep over every option pair, checked against torch in float64."""
    rng = np.random.default_rng(10)
    for causal, scale, gqa in itertools.product([False, True], [None, 0.5], [False, True]):
        q = rng.standard_normal((2, 4, 3, 8))
        k = rng.standard_normal((2, 2 if gqa else 4, 5, 8))
        v = rng.standard_normal((2, 2 if gqa else 4, 5, 8))
        ours = attnlab.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        assert_parity(ours, reference_sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa))
