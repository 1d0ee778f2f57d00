"""Properties that hold for any input (hypothesis)."""

from __future__ import annotations

import importlib

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attnlab

settings.register_profile("attnlab", deadline=None, max_examples=40)
settings.load_profile("attnlab")

dims = st.integers(1, 6)


@st.composite
def qkv(draw, *, same_length=False):
    B, L, E = draw(st.integers(1, 3)), draw(dims), draw(dims)
    S = L if same_length else draw(dims)
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in [(B, L, E), (B, S, E), (B, S, E)]) + (rng,)


@given(qkv(), st.booleans())
def test_weight_rows_sum_to_one(args, causal):
    q, k, _, rng = args
    if causal and q.shape[1] != k.shape[1]:
        causal = False
    mask = None if causal else rng.random((q.shape[1], k.shape[1])) < 0.5
    w = attnlab.attention_weights(q, k, attn_mask=mask, is_causal=causal)
    sums = w.sum(-1)
    has_key = np.ones_like(sums, bool) if mask is None else np.broadcast_to(mask.any(-1), sums.shape)
    tol = 1e-5 if q.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(sums[has_key], 1, atol=tol)
    assert np.all(sums[~has_key] == 0)
    assert np.all(w >= 0)


@given(qkv(same_length=True), st.data())
def test_unmasked_self_attention_is_permutation_equivariant(args, data):
    x, _, _, rng = args
    E = 4
    mha = attnlab.MultiheadAttention(E, 2, batch_first=True, rng=rng, dtype=x.dtype)
    x = rng.standard_normal((x.shape[0], x.shape[1], E)).astype(x.dtype)
    perm = np.array(data.draw(st.permutations(range(x.shape[1]))))
    out, w = mha(x, x, x)
    out_p, w_p = mha(x[:, perm], x[:, perm], x[:, perm])
    tol = 1e-5 if x.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out_p, out[:, perm], atol=tol)
    np.testing.assert_allclose(w_p, w[:, perm][:, :, perm], atol=tol)


@given(qkv(same_length=True), st.data())
def test_causal_outputs_ignore_the_future(args, data):
    q, k, v, rng = args
    T = q.shape[1]
    t = data.draw(st.integers(0, T - 1))
    out = attnlab.scaled_dot_product_attention(q, k, v, is_causal=True)
    k2, v2, q2 = k.copy(), v.copy(), q.copy()
    k2[:, t + 1 :] = rng.standard_normal(k2[:, t + 1 :].shape) * 100
    v2[:, t + 1 :] = rng.standard_normal(v2[:, t + 1 :].shape) * 100
    q2[:, t + 1 :] = rng.standard_normal(q2[:, t + 1 :].shape)
    out2 = attnlab.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    np.testing.assert_array_equal(out2[:, : t + 1], out[:, : t + 1])


@given(
    st.lists(st.floats(-50, 50), min_size=1, max_size=8),
    st.floats(-1e3, 1e3),
)
def test_softmax_is_shift_invariant(values, shift):
    x = np.array(values)
    np.testing.assert_allclose(attnlab.softmax(x + shift), attnlab.softmax(x), atol=1e-12)
    np.testing.assert_allclose(attnlab.softmax(x).sum(), 1.0)


def test_softmax_survives_large_values():
    x = np.array([1000.0, 1001.0, -np.inf], dtype=np.float32)
    p = attnlab.softmax(x)
    assert np.isfinite(p).all() and p[2] == 0 and abs(p.sum() - 1) < 1e-6


@given(
    st.integers(1, 5), st.integers(1, 40), st.integers(1, 300),
    st.sampled_from([np.float32, np.float64]), st.integers(0, 2**32 - 1),
)
@example(3, 22, 1, np.float32, 184048)  # strided exp 5.2 eps away on an AVX-512 EPYC
def test_in_place_softmax_in_blocks_equals_softmax(rows, cols, block, dtype, seed):
    sm = importlib.import_module("attnlab.core.softmax")  # the module, not the function

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 3, cols)) * 5).astype(dtype)
    x[0, 1] = -np.inf  # a row with nothing to attend to
    x[-1, -1, 1::2] = -np.inf  # some keys masked (column 0 stays)
    expected = attnlab.softmax(x)
    before = sm._SOFTMAX_BLOCK
    try:
        sm._SOFTMAX_BLOCK = block  # blocks of one row up to the whole array
        work = x.copy()
        assert sm.softmax_(work) is work
        wide = np.zeros((rows, 3, 2 * cols), dtype=dtype)
        strided = wide[..., ::2]  # not C-contiguous: one piece
        strided[...] = x
        assert not strided.flags.c_contiguous and sm.softmax_(strided) is strided
    finally:
        sm._SOFTMAX_BLOCK = before
    np.testing.assert_allclose(work, expected, rtol=4 * np.finfo(dtype).eps, atol=0)
    # A strided array takes NumPy's other exp loop (not the contiguous SIMD one): on AVX-512
    # the two differ by up to ~5 ulp (seed 184048 below: 5.2 eps), each within its own bound.
    np.testing.assert_allclose(strided, expected, rtol=8 * np.finfo(dtype).eps, atol=0)
    assert not work[0, 1].any() and np.isfinite(work).all()
    sums = work.sum(-1)
    sums[0, 1] += 1  # the empty row sums to 0
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
