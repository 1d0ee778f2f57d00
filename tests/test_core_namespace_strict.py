"""The functional core on ``array_api_strict`` arrays: the path uses only the Array API standard
(2022.12, no boolean indexing, no data-dependent shapes), keeps the arrays' device and never
converts them to NumPy (arrays on ``device1`` refuse that)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import attnlab

xs = pytest.importorskip("array_api_strict")
pytest.importorskip("array_api_compat")

DEVICE = xs.Device("device1")
CPU = xs.Device("CPU_DEVICE")
TOL = {np.float32: 1e-6, np.float64: 1e-12}


@pytest.fixture(autouse=True)
def strict_standard():
    """The oldest standard the path claims, with the optional data-dependent features off."""
    with xs.ArrayAPIStrictFlags(api_version="2022.12", boolean_indexing=False, data_dependent_shapes=False):
        yield


def dev(a: np.ndarray):
    """A NumPy array as a strict array on ``device1`` (which cannot be converted back to NumPy)."""
    return xs.asarray(a, device=DEVICE)


def host(x) -> np.ndarray:
    assert isinstance(x, xs._array_object.Array), type(x)
    assert x.device == DEVICE
    return np.asarray(x.to_device(CPU))


def assert_same(ours, want: np.ndarray) -> float:
    """``ours`` (strict, on device1) equals the NumPy path's ``want`` in dtype, shape and value."""
    got = host(ours)
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == bool:
        np.testing.assert_array_equal(got, want)
        return 0.0
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    np.testing.assert_array_equal(got[~finite], want[~finite])
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    assert err <= TOL[want.dtype.type], err
    return err


def inputs(seed, dtype, Hq=4, H=2, L=5, S=7, E=8, Ev=6):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((2, H, S, E)).astype(dtype)
    v = rng.standard_normal((2, H, S, Ev)).astype(dtype)
    bool_mask = rng.random((2, Hq, L, S)) < 0.6
    bool_mask[..., 0] = True
    return q, k, v, {
        "none": None,
        "bool": bool_mask,
        "float": rng.standard_normal((2, Hq, L, S)).astype(dtype),
        "bool-broadcast": bool_mask[0, 0, 0],
    }


CASES = ["none", "bool", "float", "bool-broadcast", "causal"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("Hq,H,L,S", [(4, 2, 5, 7), (2, 2, 6, 3), (3, 3, 4, 4)])
def test_strict_arrays_equal_numpy_path(dtype, kind, Hq, H, L, S):
    q, k, v, masks = inputs(CASES.index(kind), dtype, Hq, H, L, S)
    mask, causal = (None, True) if kind == "causal" else (masks[kind], False)
    opts = dict(attn_mask=mask, is_causal=causal, enable_gqa=Hq != H)
    strict_opts = dict(opts, attn_mask=None if mask is None else dev(mask))
    assert_same(
        attnlab.scaled_dot_product_attention(dev(q), dev(k), dev(v), **strict_opts),
        attnlab.scaled_dot_product_attention(q, k, v, **opts),
    )
    assert_same(attnlab.attention_weights(dev(q), dev(k), **strict_opts), attnlab.attention_weights(q, k, **opts))
    assert_same(attnlab.attention_scores(dev(q), dev(k), **strict_opts), attnlab.attention_scores(q, k, **opts))
    g = np.random.default_rng(99).standard_normal((2, Hq, L, v.shape[-1])).astype(dtype)
    ours = attnlab.scaled_dot_product_attention_backward(dev(g), dev(q), dev(k), dev(v), **strict_opts)
    want = attnlab.scaled_dot_product_attention_backward(g, q, k, v, **opts)
    for a, b in zip(ours, want, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("kind", ["bool", "causal", "float"])
def test_strict_softcap_and_the_step_functions_equal_numpy_path(kind):
    """``softcap=`` and the explicit steps (scores and their backward, weights @ values and
    its backward) in the arrays' own library, grouped-query heads included."""
    q, k, v, masks = inputs(7, np.float64)
    q *= 4
    mask, causal = (None, True) if kind == "causal" else (masks[kind], False)
    opts = dict(attn_mask=mask, is_causal=causal, enable_gqa=True, softcap=1.5)
    strict_opts = dict(opts, attn_mask=None if mask is None else dev(mask))
    assert_same(attnlab.scaled_dot_product_attention(dev(q), dev(k), dev(v), **strict_opts),
                attnlab.scaled_dot_product_attention(q, k, v, **opts))
    g = np.random.default_rng(98).standard_normal((2, 4, 5, 6))
    ours = attnlab.scaled_dot_product_attention_backward(dev(g), dev(q), dev(k), dev(v), **strict_opts)
    for a, b in zip(ours, attnlab.scaled_dot_product_attention_backward(g, q, k, v, **opts), strict=True):
        assert_same(a, b)
    s = attnlab.attention_scores(q, k, mask, causal, None, True, softcap=1.5)
    assert_same(attnlab.attention_scores(dev(q), dev(k), strict_opts["attn_mask"], causal, None, True, softcap=1.5), s)
    g_s = np.random.default_rng(97).standard_normal(s.shape)
    ours = attnlab.attention_scores_backward(dev(g_s), dev(q), dev(k), strict_opts["attn_mask"], causal, None, True,
                                             softcap=1.5)
    for a, b in zip(ours, attnlab.attention_scores_backward(g_s, q, k, mask, causal, None, True, softcap=1.5),
                    strict=True):
        assert_same(a, b)
    w = attnlab.softmax(s)
    assert_same(attnlab.apply_attention_weights(dev(w), dev(v), enable_gqa=True),
                attnlab.apply_attention_weights(w, v, enable_gqa=True))
    ours = attnlab.apply_attention_weights_backward(dev(g), dev(w), dev(v), enable_gqa=True)
    for a, b in zip(ours, attnlab.apply_attention_weights_backward(g, w, v, enable_gqa=True), strict=True):
        assert_same(a, b)


def test_strict_dropout_equals_numpy_for_the_same_seed():
    q, k, v, _ = inputs(5, np.float64)
    args = dict(dropout_p=0.25, enable_gqa=True)
    ours = attnlab.scaled_dot_product_attention(dev(q), dev(k), dev(v), rng=np.random.default_rng(3), **args)
    assert_same(ours, attnlab.scaled_dot_product_attention(q, k, v, rng=np.random.default_rng(3), **args))
    g = np.ones((2, 4, 5, 6))
    ours = attnlab.scaled_dot_product_attention_backward(
        dev(g), dev(q), dev(k), dev(v), rng=np.random.default_rng(3), **args
    )
    want = attnlab.scaled_dot_product_attention_backward(g, q, k, v, rng=np.random.default_rng(3), **args)
    for a, b in zip(ours, want, strict=True):
        assert_same(a, b)


def test_strict_broadcast_batch_dims():
    """A key shared by every batch entry: the gradients are summed back to its shape."""
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((3, 2, 4, 8)), rng.standard_normal((1, 2, 5, 8)), rng.standard_normal((1, 2, 5, 3))
    want = attnlab.scaled_dot_product_attention(q, k, v)
    assert_same(attnlab.scaled_dot_product_attention(dev(q), dev(k), dev(v)), want)
    g = rng.standard_normal((3, 2, 4, 3))
    ours = attnlab.scaled_dot_product_attention_backward(dev(g), dev(q), dev(k), dev(v))
    for a, b in zip(ours, attnlab.scaled_dot_product_attention_backward(g, q, k, v), strict=True):
        assert_same(a, b)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_strict_softmax_and_backward(axis):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    x[0, 1, :] = -np.inf
    assert_same(attnlab.softmax(dev(x), axis=axis), attnlab.softmax(x, axis=axis))
    p, g = attnlab.softmax(x, axis=axis), rng.standard_normal(x.shape).astype(np.float32)
    assert_same(attnlab.softmax_backward(dev(g), dev(p), axis=axis), attnlab.softmax_backward(g, p, axis=axis))


def test_strict_masks():
    like = dev(np.zeros(2))
    for align in ("top-left", "bottom-right"):
        assert_same(attnlab.causal_mask(3, 5, align=align, like=like), attnlab.causal_mask(3, 5, align=align))
    assert_same(attnlab.padding_mask(dev(np.array([0, 2, 4])), 4), attnlab.padding_mask([0, 2, 4], 4))
    assert_same(attnlab.convert_mha_mask(dev(np.array([True, False]))), np.array([False, True]))
    assert_same(attnlab.mask_to_bias(dev(np.array([True, False])), np.float64), np.array([0.0, -np.inf]))


def test_strict_arrays_on_two_devices_are_refused():
    q = dev(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"must be on one device, got query on .*device1.*key on .*CPU_DEVICE"):
        attnlab.scaled_dot_product_attention(q, xs.asarray(np.zeros((2, 3))), q)


def test_without_array_api_compat_the_error_says_what_to_install(monkeypatch):
    from attnlab.core import _namespace

    monkeypatch.setitem(sys.modules, "array_api_compat", None)  # import fails
    # as in a process that never had it: no namespace found through it is remembered
    monkeypatch.setattr(_namespace, "_BY_TYPE", {np.ndarray: np})
    q = xs.asarray(np.zeros((2, 3)))
    need = r"array_api_strict.Array arrays through array-api-compat.*attnlab\[arrayapi\]"
    with pytest.raises(ImportError, match=need):
        attnlab.scaled_dot_product_attention(q, q, q)


class ThinArray:
    """An array type whose namespace has only a few functions."""

    shape, ndim, dtype = (2, 3), 2, "float32"

    def __array_namespace__(self, api_version=None):
        return types.SimpleNamespace(__name__="thin", isdtype=lambda dtype, kind: True, matmul=None, exp=None)


def test_a_namespace_lacking_functions_is_named_with_the_array_type():
    missing = (
        "arange, asarray, astype, broadcast_to, empty, expand_dims, matrix_transpose, max, min, "
        "reshape, sum, where, zeros_like"
    )
    with pytest.raises(TypeError) as info:
        attnlab.softmax(ThinArray())
    assert str(info.value) == (
        f"attnlab cannot compute on {__name__}.ThinArray arrays: their namespace 'thin' lacks {missing} "
        "(Array API standard 2022.12)"
    )
