"""erf, exact GELU and LayerNorm of attnlab.nn.functional against math.erf and torch."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.nn.functional import erf, gelu, layer_norm

torch = pytest.importorskip("torch", reason="torch is the test oracle (test extra)")


def test_erf_matches_math_erf_on_the_whole_line():
    z = np.concatenate([np.linspace(-8, 8, 200_001), [-1e30, -50.0, 0.0, 1e-300, 50.0, 1e30]])
    ref = np.array([math.erf(v) for v in z])
    assert np.abs(erf(z) - ref).max() < 4e-15  # float64: the Chebyshev path, a few ulp
    z32 = z.astype(np.float32)
    ref32 = np.array([math.erf(v) for v in z32.astype(np.float64)])
    err = np.abs(erf(z32).astype(np.float64) - ref32)  # float32: the rational fit
    assert erf(z32).dtype == np.float32
    assert err.max() < 6e-8  # 1.6e-8 of the fit plus float32's rounding


@settings(max_examples=200, deadline=None)
@given(st.floats(-20, 20, allow_nan=False))
def test_erf_is_odd_and_matches_math_erf(v):
    x = np.array([v, -v])
    e = erf(x)
    assert e[0] == -e[1]
    assert abs(e[0] - math.erf(v)) <= 4e-15


def test_gelu_is_accurate_in_float64_and_float32():
    rng = np.random.default_rng(0)
    x64 = np.concatenate([rng.standard_normal(20_000) * 3, np.linspace(-12, 12, 24_001)])
    exact = 0.5 * x64 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x64]))
    assert np.abs(gelu(x64) - exact).max() < 1e-7  # erf's error, times |x| / 2
    x32 = x64.astype(np.float32)
    ours = gelu(x32)
    assert ours.dtype == np.float32
    exact32 = 0.5 * x32.astype(np.float64) * (
        1 + np.array([math.erf(float(v) / math.sqrt(2)) for v in x32])
    )
    err = np.abs(ours - exact32)
    ulp = np.spacing(np.abs(exact32).astype(np.float32)).astype(np.float64)
    assert np.all(err[x32 >= -2] <= ulp[x32 >= -2])  # correctly rounded to within one ulp
    assert err.max() < 2.5e-7
    ref = torch.nn.functional.gelu(torch.from_numpy(x32)).numpy()
    assert err.max() <= np.abs(ref - exact32).max()  # no further from exact than torch
    assert np.abs(ours - ref).max() < 2e-6


def test_gelu_in_place_and_shapes():
    x = np.linspace(-3, 3, 2 * 3 * 50_000, dtype=np.float32).reshape(2, 3, -1)
    expected = gelu(x)
    out = gelu(x, out=x)
    assert out is x and np.array_equal(x, expected)


def test_layer_norm_matches_torch():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 5, 384)) * 4 + 2).astype(np.float32)
    w, b = rng.standard_normal((2, 384)).astype(np.float32)
    ours, _, _ = layer_norm(x, w, b, 1e-12)
    ref = torch.nn.functional.layer_norm(
        torch.from_numpy(x), (384,), torch.from_numpy(w), torch.from_numpy(b), 1e-12
    ).numpy()
    assert np.abs(ours - ref).max() < 1e-5


def test_float32_gelu_is_zero_far_below_zero_as_torch():
    # x * (1 + erf(-4)) / 2 once grew with |x|: gelu(-1e30) gave -6.9e21
    x = np.array([-np.inf, -1e30, -1e3, -10.0, -5.7, -5.6, np.nan, np.inf], dtype=np.float32)
    ours = gelu(x)
    ref = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    assert np.array_equal(ours[:5], np.zeros(5, np.float32))
    assert abs(ours[5] - ref[5]) < 1e-7 and np.isnan(ours[6]) and ours[7] == np.inf
    assert ref[1] == 0 and ref[3] == 0  # torch: 0 there too


def _gelu_inputs():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(3 * 2**20) * 4).astype(np.float32)
    x[:9] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 5.65, -5.66]
    return x


@pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba (the fast extra) is not installed")
def test_compiled_gelu_gives_the_numpy_numbers_bit_for_bit():
    from attnlab.core import blockwise
    from attnlab.nn import _compiled

    x = _gelu_inputs()
    with blockwise.tuned(fused=False):
        expected = gelu(x)
    calls = []
    original = _compiled.gelu_erf32_
    try:
        _compiled.gelu_erf32_ = lambda a: calls.append(a.size) or original(a)
        out = gelu(x)  # a new array
        inplace = x.copy()
        assert gelu(inplace, out=inplace) is inplace
    finally:
        _compiled.gelu_erf32_ = original
    assert calls == [x.size, x.size]  # both calls ran on the compiled loop
    np.testing.assert_array_equal(out, expected)  # NaN at the same places, the rest equal
    np.testing.assert_array_equal(inplace, expected)
    assert np.signbit(out[4]) and np.signbit(expected[4])  # gelu(-0.0) = -0.0 on both paths


def test_small_gelus_go_compiled_once_the_numpy_work_adds_up(monkeypatch):
    from attnlab.core import blockwise
    from attnlab.nn import functional as F

    x = np.ones(F._GELU_COMPILED_SMALL, dtype=np.float32)
    seen = []
    monkeypatch.setattr(blockwise, "fused_planned", lambda dtype, n, min_n=None, use=None: seen.append(min_n) or False)
    monkeypatch.setattr(F, "_gelu_numpy_elements", 0)
    monkeypatch.setattr(F, "_numba_started", lambda: False)
    gelu(x)
    assert seen == [F._GELU_COMPILED_MIN] and F._gelu_numpy_elements == x.size
    monkeypatch.setattr(F, "_gelu_numpy_elements", F._GELU_COMPILED_AFTER)
    gelu(x)
    assert seen[-1] == F._GELU_COMPILED_SMALL
    # Once another compiled kernel has started numba, small GELUs go compiled at once.
    monkeypatch.setattr(F, "_gelu_numpy_elements", 0)
    monkeypatch.setattr(F, "_numba_started", lambda: True)
    gelu(x)
    assert seen[-1] == F._GELU_COMPILED_SMALL


def test_numba_counts_as_started_once_a_compiled_module_is_loaded(monkeypatch):
    import sys

    from attnlab.nn import functional as F

    for name in F._COMPILED_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not F._numba_started()
    monkeypatch.setitem(sys.modules, "attnlab.core._fused", sys)
    assert F._numba_started()


@pytest.mark.parametrize("rows", [2, 300])  # BLAS's own threads, and one BLAS thread (a large matrix)
def test_blas_reductions_report_no_floating_point_flag_but_keep_nan(rows):
    """row_sum and col_sum (BLAS matrix-vector products) do not report the invalid-operation
    flag that BLAS kernels can leave (spuriously, too), even where floating-point errors
    raise; a NaN the data produces (inf - inf) still comes out, and the other sums are
    exact."""
    from attnlab.core._reduce import col_sum, row_sum

    x = np.full((rows, 64), 0.5, dtype=np.float32)
    x[0, :3] = np.inf, -np.inf, -np.inf  # row 0: inf - inf
    x[1, 2] = np.inf  # column 2: inf - inf
    with np.errstate(invalid="raise"):
        r = row_sum(x)
        c = col_sum(x)
    assert r.shape == (rows, 1) and np.isnan(r[0, 0]) and r[1, 0] == np.inf and np.all(r[2:] == 32.0)
    assert c.shape == (64,) and c[0] == np.inf and c[1] == -np.inf and np.isnan(c[2])
    assert np.all(c[3:] == 0.5 * rows)
