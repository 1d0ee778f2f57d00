"""Properties that hold for any input (hypothesis)."""

from __future__ import annotations

import importlib
import math

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


@st.composite
def attention_call(draw):
    """Arguments of a valid attention call (leading dims, GQA heads, empty sizes, any float
    dtype, scales of every type), then at most one change that the checks reject or treat
    differently: a mask, dropout, a NumPy bool flag, mixed dtypes, shapes that do not fit."""
    lead = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    h, groups = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    L, S, E, Ev = draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 3))
    dt = draw(st.sampled_from([np.float32, np.float64, np.float16]))
    call = dict(
        query=np.zeros((*lead, h * groups, L, E), dt), key=np.zeros((*lead, h, S, E), dt),
        value=np.zeros((*lead, h, S, Ev), dt), attn_mask=None, dropout_p=draw(st.sampled_from([0.0, 0])),
        is_causal=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.5, 2, np.float32(0.5)])),
        enable_gqa=groups > 1 or draw(st.booleans()),
    )
    change = draw(st.sampled_from([None, "mask", "dropout", "numpy bool", "dtype", "E", "S", "lead",
                                   "no gqa", "strides", "2-D", "list"]))
    q, k, v = call["query"], call["key"], call["value"]
    if change == "mask":
        call["attn_mask"] = np.ones((L, S), bool)
    elif change == "dropout":
        call["dropout_p"] = draw(st.sampled_from([0.1, np.float32(0), False]))
    elif change == "numpy bool":
        call["is_causal"] = np.bool_(call["is_causal"])
    elif change == "dtype":
        call["value"] = v.astype(np.float64 if dt != np.float64 else np.float32)
    elif change == "E":
        call["key"] = np.zeros((*k.shape[:-1], E + 1), dt)
    elif change == "S":
        call["value"] = np.zeros((*v.shape[:-2], S + 1, Ev), dt)
    elif change == "lead":  # leading dims that broadcast (2 against 1) or do not (2 against 3)
        call["query"] = np.zeros((2, *q.shape), dt)
        n = draw(st.sampled_from([1, 3]))
        call["key"], call["value"] = np.zeros((n, *k.shape), dt), np.zeros((n, *v.shape), dt)
    elif change == "no gqa":
        call["enable_gqa"] = False
    elif change == "strides":
        call["query"] = np.zeros((*q.shape[:-1], 2 * E), dt)[..., ::2]
    elif change == "2-D":
        call["query"], call["key"], call["value"] = (a.reshape(math.prod(a.shape[:-1]), a.shape[-1]) for a in (q, k, v))
    elif change == "list":
        call["query"] = q.tolist()
    return call


@settings(max_examples=300)
@given(attention_call())
def test_the_plain_spec_is_the_checked_spec_or_none(call):
    """The common call's shortcut (spec._plain_spec) builds exactly the spec the full
    checks build, and leaves every call the checks reject (or change) to them."""
    from attnlab.core import spec as spec_mod

    plain = spec_mod._plain_spec(*call.values())
    try:
        full = spec_mod._checked_spec(*call.values())
    except (TypeError, ValueError):
        assert plain is None
        return
    if plain is None:
        return
    for name in ("query", "key", "value", "attn_mask", "xp"):
        assert getattr(plain, name) is getattr(full, name), name
    for name in ("is_causal", "scale", "dropout_p", "gqa_groups", "key_shape", "value_shape", "batch_shape"):
        a, b = getattr(plain, name), getattr(full, name)
        assert a == b and type(a) is type(b), (name, a, b)


def test_the_plain_spec_takes_the_common_calls():
    from attnlab.core import spec as spec_mod

    q = np.zeros((2, 6, 5, 8), np.float32)
    kv = np.zeros((2, 3, 7, 8), np.float32)
    assert spec_mod._plain_spec(q, q, q, None, 0.0, True, None, False) is not None
    gqa = spec_mod._plain_spec(q, kv, kv, None, 0.0, False, 0.5, True)
    assert gqa is not None and gqa.gqa_groups == 2 and gqa.batch_shape == (2, 6)
    assert spec_mod._plain_spec(q, kv, kv, None, 0.0, False, 0.5, False) is None  # the checks explain
