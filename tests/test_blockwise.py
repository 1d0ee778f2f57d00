"""The blockwise (online-softmax) kernel against the naive path and torch's autograd."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
import attnlab._threads
from attnlab import (
    blockwise_attention,
    blockwise_attention_backward,
    blockwise_attention_forward,
    causal_mask,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnlab._cpu import pinned_cpu
from attnlab.core import blockwise as bw
from attnlab.core import dispatch, naive, rows
from attnlab.core import spec as attention_mod
from helpers import ELEMENTWISE_PASSES, attention_inputs, grad_err, kernel_tuning, pad_every_score_row, rel_err

TOL = {np.float32: 1e-5, np.float64: 1e-12}
inputs = attention_inputs


def naive_mask(kind, L, S, rng, dtype):
    """(mask for the naive path, kwargs for the blockwise path)."""
    if kind == "none":
        return None, {}
    if kind == "causal":
        return causal_mask(L, S), {"is_causal": True}
    if kind == "bottom-right":
        return causal_mask(L, S, align="bottom-right"), {
            "is_causal": True,
            "causal_align": "bottom-right",
        }
    if kind == "bool":
        m = rng.random((L, S)) < 0.7
        if L:
            m[0] = False  # a fully masked row
        return m, {"attn_mask": m}
    m = rng.standard_normal((L, S)).astype(dtype)
    if S:
        m[:, 0] = -np.inf
    return m, {"attn_mask": m}


def check_against_naive(q, k, v, g, kind, rng, *, gqa=False, fused=False, diag_rows=None, **blocks):
    """The blockwise kernel (on the chosen element-wise pass, always on a real pool when
    ``num_threads > 1``; causal diagonal tiles cut into pieces of ``diag_rows`` rows when
    given) against the naive path, forward and backward."""
    dtype = q.dtype.type
    mask, kw = naive_mask(kind, q.shape[-2], k.shape[-2], rng, dtype)
    spec = attention_mod.check_attention_args(q, k, v, attn_mask=mask, enable_gqa=gqa)
    want, want_g = naive.forward(spec), naive.backward(spec, g)
    pieces = {} if diag_rows is None else {"diag_rows": diag_rows}
    with kernel_tuning(fused, **pieces):
        out, lse = blockwise_attention_forward(q, k, v, enable_gqa=gqa, **kw, **blocks)
        got_g = blockwise_attention_backward(g, q, k, v, enable_gqa=gqa, out=out, lse=lse, **kw, **blocks)
    assert out.dtype == q.dtype and not np.isnan(out).any()
    assert rel_err(out, want) <= TOL[dtype]
    for name, a, b in zip("qkv", got_g, want_g, strict=True):
        assert grad_err(a, b) <= TOL[dtype], name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    L=st.integers(0, 37),
    S=st.integers(0, 37),
    E=st.integers(1, 9),
    Ev=st.integers(1, 9),
    block_q=st.integers(1, 40),
    block_k=st.integers(1, 40),
    kind=st.sampled_from(["none", "causal", "bottom-right", "bool", "float"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    threads=st.sampled_from([1, 2, 3]),
    kv_heads=st.sampled_from([1, 3]),  # 1: GQA, 3 query heads share one key/value head
    fused=st.sampled_from([False, True] if bw.fused_available() else [False]),
    diag_rows=st.integers(1, 12),
)
def test_equals_naive_for_any_blocks(
    seed, L, S, E, Ev, block_q, block_k, kind, dtype, threads, kv_heads, fused, diag_rows
):
    """Any tile sizes and causal diagonal pieces, on both element-wise passes (the compiled
    one computes float32; a float64 call runs on NumPy), with pools that really start (2 or
    3 threads)."""
    rng = np.random.default_rng(seed)
    q, k, v, g = inputs(rng, (2,), 3, kv_heads, L, S, E, Ev, dtype)
    check_against_naive(
        q, k, v, g, kind, rng, gqa=kv_heads != 3, block_q=block_q, block_k=block_k,
        num_threads=threads, fused=fused, diag_rows=diag_rows,
    )


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_small_problems_start_a_pool_under_test_tuning(fused, monkeypatch):
    """The property tests above run tiny problems: check that they really start pools
    (and not under the machine's tuning, where such sizes stay in one thread)."""
    pools = []
    real = bw.run_units

    def spy(units, run_unit, threads):
        pools.append(threads)
        return real(units, run_unit, threads)

    monkeypatch.setattr(bw, "run_units", spy)
    rng = np.random.default_rng(16)
    q, k, v, g = inputs(rng, (4,), 2, 2, 40, 30, 4, 4, np.float32)
    with kernel_tuning(fused):
        plan = bw._plan(attention_mod.check_attention_args(q, k, v), None, 4, None, 2)
        blockwise_attention_backward(g, q, k, v, block_q=4, num_threads=2)
    assert plan.fused == fused and pools == [2, 2]  # forward and backward pools
    pools.clear()
    blockwise_attention(q, k, v, block_q=4, num_threads=2)
    assert pools == [1]


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["none", "causal", "bottom-right", "bool", "float"])
@pytest.mark.parametrize("L,S", [(100, 77), (77, 100), (130, 130)])
def test_blocks_dividing_neither_L_nor_S(dtype, kind, L, S, fused):
    rng = np.random.default_rng(L * S)
    q, k, v, g = inputs(rng, (), 2, 2, L, S, 16, 12, dtype)
    check_against_naive(q, k, v, g, kind, rng, block_q=13, block_k=29, num_threads=2, fused=fused)


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("kind", ["none", "causal", "bottom-right", "bool", "float"])
def test_padded_score_rows_are_never_read(kind, fused, monkeypatch):
    """Tiles with padded rows (:func:`attnlab.core.blockwise.score_stride`; here every
    width, the pads NaN) give the naive numbers: the compiled passes stop at the tile's
    own width."""
    pad_every_score_row(monkeypatch)
    assert bw.score_stride(29) == 29 + 16
    rng = np.random.default_rng(29)
    q, k, v, g = inputs(rng, (), 2, 2, 70, 90, 16, 12, np.float32)
    check_against_naive(q, k, v, g, kind, rng, block_q=13, block_k=29, num_threads=2, fused=fused)


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("kind", ["causal", "bottom-right"])
@pytest.mark.parametrize("diag_rows", [1, 5, 16, 64])
def test_causal_diagonal_pieces(kind, diag_rows, fused):
    """Diagonal tiles cut into row pieces that each stop at their own last visible key
    (pieces dividing the tile or not, down to single rows) give the naive numbers."""
    rng = np.random.default_rng(diag_rows)
    q, k, v, g = inputs(rng, (), 2, 2, 150, 170, 16, 12, np.float32)
    check_against_naive(
        q, k, v, g, kind, rng, block_q=64, block_k=48, num_threads=2, fused=fused, diag_rows=diag_rows
    )


def test_causal_pieces_skip_the_hidden_keys():
    """A diagonal tile is cut into pieces that each stop at their rows' last visible key;
    fully visible tiles stay whole."""
    spec = attention_mod.check_attention_args(*np.zeros((3, 8, 2)), is_causal=True)
    with bw.tuned(diag_rows=3):
        plan = bw._plan(spec, None, 8, 8, 1)
        assert plan.pieces(0, 8, 0, 8) == [(0, 3, 3), (3, 6, 6), (6, 8, 8)]
        assert plan.pieces(4, 8, 0, 4) == [(4, 8, 4)]  # every row sees every key
    with bw.tuned(diag_rows=8):
        assert bw._plan(spec, None, 8, 8, 1).pieces(0, 8, 0, 8) == [(0, 8, 8)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["none", "causal", "bool"])
def test_gqa(dtype, kind):
    rng = np.random.default_rng(1)
    q, k, v, g = inputs(rng, (2,), 6, 2, 21, 19, 8, 5, dtype)
    check_against_naive(q, k, v, g, kind, rng, gqa=True, block_q=4, block_k=7)


def test_broadcast_batch_dims_and_mask_per_head():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, 2, 10, 4))
    k = rng.standard_normal((1, 2, 12, 4))  # broadcast over the batch
    v = rng.standard_normal((1, 2, 12, 3))
    g = rng.standard_normal((3, 2, 10, 3))
    mask = rng.random((3, 1, 10, 12)) < 0.5
    want = scaled_dot_product_attention(q, k, v, mask)
    assert rel_err(blockwise_attention(q, k, v, mask, block_q=3, block_k=5), want) <= 1e-12
    for a, b in zip(
        blockwise_attention_backward(g, q, k, v, mask, block_k=5),
        scaled_dot_product_attention_backward(g, q, k, v, mask),
        strict=True,
    ):
        assert a.shape == b.shape and grad_err(a, b) <= 1e-12


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_scale_and_large_scores_stay_finite(fused):
    rng = np.random.default_rng(3)
    q, k, v, g = inputs(rng, (), 1, 1, 40, 50, 8, 8, np.float32)
    q *= 30  # scores in the hundreds: exp would overflow without the running max
    for scale in (None, 0.5, 3.0):
        want = scaled_dot_product_attention(q, k, v, scale=scale)
        with kernel_tuning(fused):
            got = blockwise_attention(q, k, v, scale=scale, block_q=7, block_k=9)
        assert np.isfinite(got).all() and rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("profile", ["jump", "ramp", "drop", "big-values"])
def test_score_jumps_between_key_tiles(dtype, profile, fused):
    """The forward pass lets its shift lag behind the row max between tiles: scores that
    later jump far above it (overflow, redone exactly), creep up (rescaled) or fall far
    below it must all give the naive result."""
    rng = np.random.default_rng(12)
    L, S, E = 9, 96, 4
    q = np.abs(rng.standard_normal((L, E))).astype(dtype) + 0.5
    k = np.abs(rng.standard_normal((S, E))).astype(dtype)
    v = rng.standard_normal((S, 3)).astype(dtype)
    ramp = np.linspace(0, 1, S, dtype=dtype)[:, None]
    if profile == "jump":
        k[S // 2 :] *= 200  # scores jump by hundreds in the second half
    elif profile == "ramp":
        k *= 1 + 60 * ramp  # scores grow tile after tile
    elif profile == "drop":
        k[8:] *= -100  # later scores far below the first tile's
    else:
        k *= 1 + 40 * ramp
        v *= 1e30  # exp(score - shift) * v overflows before exp alone does
    g = rng.standard_normal((L, 3)).astype(dtype)
    want = scaled_dot_product_attention(q, k, v, scale=1.0)
    with kernel_tuning(fused):
        out, lse = blockwise_attention_forward(q, k, v, scale=1.0, block_q=4, block_k=8)
    assert np.isfinite(out).all() and rel_err(out, want) <= TOL[dtype]
    scores = q.astype(np.float64) @ k.T.astype(np.float64)
    top = scores.max(-1)
    want_lse = (top + np.log(np.exp(scores - top[:, None]).sum(-1))).astype(dtype)
    assert rel_err(lse, want_lse) <= TOL[dtype]
    if profile != "big-values":
        want_g = scaled_dot_product_attention_backward(g, q, k, v, scale=1.0)
        with kernel_tuning(fused):
            got_g = blockwise_attention_backward(
                g, q, k, v, scale=1.0, out=out, lse=lse, block_q=4, block_k=8
            )
        # Backward recomputes p = exp(score - lse): with scores in the thousands ("jump")
        # float32 rounds score - lse to eps * |score|, so compare at that scale there.
        floor = float(np.abs(scores).max()) if profile == "jump" else 1.0
        for a, b in zip(got_g, want_g, strict=True):
            assert rel_err(a, b, floor=floor) <= TOL[dtype]


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_fully_masked_rows_and_empty_sizes_give_zeros(fused):
    rng = np.random.default_rng(4)
    q, k, v, g = (a[0] for a in inputs(rng, (), 1, 1, 6, 5, 4, 3, np.float32))  # (L|S, E)
    mask = np.ones((6, 5), dtype=bool)
    mask[2] = False
    with kernel_tuning(fused):
        out = blockwise_attention(q, k, v, mask, block_k=2)
        dq, dk, dv = blockwise_attention_backward(np.ones((6, 3), np.float32), q, k, v, mask, block_k=2)
    assert (out[2] == 0).all() and np.isfinite(out).all()
    assert (dq[2] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    # L > S bottom-right: the first L - S queries see nothing.
    with kernel_tuning(fused):
        out = blockwise_attention(q, k, v, is_causal=True, causal_align="bottom-right", block_q=4)
    assert (out[:1] == 0).all() and np.isfinite(out).all()
    empty_k, empty_v = np.zeros((0, 4), np.float32), np.zeros((0, 3), np.float32)
    out, lse = blockwise_attention_forward(q, empty_k, empty_v)
    assert out.shape == (6, 3) and (out == 0).all() and (lse == -np.inf).all()
    dq, dk, dv = blockwise_attention_backward(np.ones((6, 3), np.float32), q, empty_k, empty_v)
    assert (dq == 0).all() and dk.shape == (0, 4) and dv.shape == (0, 3)
    assert blockwise_attention(q[:0], k, v).shape == (0, 3)


@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape",
    [
        ((0, 3, 5, 4), (0, 3, 6, 4), (0, 3, 6, 2)),  # empty batch
        ((2, 5, 4), (2, 6, 4), (2, 6, 0)),  # Ev = 0
        ((2, 0, 4), (2, 6, 4), (2, 6, 3)),  # L = 0
        ((1, 5, 4), (3, 6, 4), (3, 6, 2)),  # query broadcast over heads
    ],
)
def test_degenerate_shapes_match_naive(q_shape, k_shape, v_shape):
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, v_shape))
    out = blockwise_attention(q, k, v, block_q=2, block_k=4)
    assert rel_err(out, scaled_dot_product_attention(q, k, v)) <= 1e-12
    g = rng.standard_normal(out.shape)
    got = blockwise_attention_backward(g, q, k, v, block_q=2, block_k=4)
    for a, b in zip(got, scaled_dot_product_attention_backward(g, q, k, v), strict=True):
        assert grad_err(a, b) <= 1e-12


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["query", "float mask"])
def test_nan_propagates_like_naive(dtype, where, fused):
    rng = np.random.default_rng(5)
    q, k, v, g = (a[0] for a in inputs(rng, (), 1, 1, 5, 6, 4, 4, dtype))
    mask = np.zeros((5, 6), dtype=dtype)
    if where == "query":
        q[1, 0] = np.nan
    else:
        mask[1, 4] = np.nan
    want = scaled_dot_product_attention(q, k, v, mask)
    want_g = scaled_dot_product_attention_backward(g, q, k, v, mask)
    with kernel_tuning(fused):
        got = blockwise_attention(q, k, v, mask, block_k=4)
        got_g = blockwise_attention_backward(g, q, k, v, mask, block_k=4)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[1]).all()
    assert rel_err(got[[0, 2, 3, 4]], want[[0, 2, 3, 4]]) <= TOL[dtype]
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def test_float16_computes_in_float32_and_returns_float16():
    rng = np.random.default_rng(6)
    q, k, v, _ = inputs(rng, (), 2, 2, 9, 11, 8, 8, np.float16)
    got = blockwise_attention(q, k, v, is_causal=True, block_q=4, block_k=4)
    want = scaled_dot_product_attention(*(a.astype(np.float32) for a in (q, k, v)), is_causal=True)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, atol=2e-3, rtol=2e-3)


def test_threads_give_the_same_numbers():
    rng = np.random.default_rng(7)
    q, k, v, g = inputs(rng, (2,), 2, 2, 300, 260, 16, 16, np.float64)
    one = blockwise_attention_backward(g, q, k, v, is_causal=True, block_q=32, num_threads=1)
    two = blockwise_attention_backward(g, q, k, v, is_causal=True, block_q=32, num_threads=2)
    for a, b in zip(one, two, strict=True):
        assert grad_err(a, b) <= 1e-13


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["none", "causal", "bottom-right", "float"])
def test_backward_equals_torch_autograd(dtype, kind):
    torch = pytest.importorskip("torch", reason="torch is the test oracle (test extra)")
    rng = np.random.default_rng(8)
    q, k, v, g = inputs(rng, (2,), 4, 2, 33, 45, 16, 8, dtype)
    mask, kw = naive_mask(kind, 33, 45, rng, dtype)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tmask = None if mask is None else torch.tensor(mask)
    tout = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tmask, enable_gqa=True
    )
    tout.backward(torch.tensor(g))
    out = blockwise_attention(q, k, v, enable_gqa=True, block_q=8, block_k=16, **kw)
    grads = blockwise_attention_backward(g, q, k, v, enable_gqa=True, block_q=8, block_k=16, **kw)
    assert rel_err(out, tout.detach().numpy()) <= TOL[dtype]
    for a, t in zip(grads, (tq, tk, tv), strict=True):
        assert grad_err(a, t.grad.numpy()) <= TOL[dtype]


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_memory_stays_linear_at_16k_tokens(fused):
    L = S = 16384
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, L, 8)).astype(np.float32) for _ in range(3))
    score_matrix = L * S * 4  # 1 GiB: what one naive score matrix would take
    with bw.tuned(fused=fused):
        blockwise_attention(q[:, :300], k[:, :300], v[:, :300])  # imports/compiles (untraced)
    tracemalloc.start()
    try:
        with bw.tuned(fused=fused):
            out = blockwise_attention(q, k, v, is_causal=True, block_q=256, block_k=1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (1, L, 8) and np.isfinite(out).all()
    assert peak < score_matrix / 64, f"peak {peak / 2**20:.1f} MiB"  # 16 MiB
    ref_rows = scaled_dot_product_attention(q[:, -3:], k, v)  # the last rows see every key
    assert rel_err(out[:, -1:], ref_rows[:, -1:]) <= 1e-5


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_memory_with_many_heads_stays_near_the_output_size(fused):
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((64, 1024, 8)).astype(np.float32) for _ in range(3))
    out_bytes = q.nbytes  # 2 MiB; scores would be 64 * 1024 * 1024 * 4 = 256 MiB
    with bw.tuned(fused=fused, block_k=512, forward_block_k=1024):
        blockwise_attention(q[:2], k[:2], v[:2])  # imports/compiles (untraced)
        tracemalloc.start()
        try:
            blockwise_attention(q, k, v, num_threads=2)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    tile = 512 * 1024 * 4  # one forward score tile: 2 MiB per thread
    # Output + lse + per-thread tiles + a few heads' keys/values at a time.
    assert peak < out_bytes + 2 * tile + 1.5 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_sdpa_dispatches_to_blockwise_by_shape(monkeypatch, pin_cpu):
    pin_cpu("zen4")  # 8.6 MB of float64 scores overflow twice its 1 MiB L2; 3 x 20^2 fit
    calls = []
    real = bw.forward_spec

    def spy(spec, **kw):
        calls.append((spec.L, spec.S))
        return real(spec, **kw)

    monkeypatch.setattr(bw, "forward_spec", spy)
    rng = np.random.default_rng(10)
    big = rng.standard_normal((3, 600, 8))  # float64: the rows kernel takes float32 only
    small = big[:, :20]
    scaled_dot_product_attention(big, big, big, is_causal=True)
    assert calls == [(600, 600)]
    scaled_dot_product_attention(small, small, small)  # small: naive
    scaled_dot_product_attention(big, big, big, dropout_p=0.1, rng=rng)  # dropout: naive
    assert calls == [(600, 600)]
    # attention_weights still gives the weights (naive path).
    assert attnlab.attention_weights(big, big).shape == (3, 600, 600)


def test_sdpa_backward_dispatch_matches_naive():
    rng = np.random.default_rng(11)
    q, k, v, g = inputs(rng, (), 1, 1, 520, 530, 8, 8, np.float64)
    spec = attention_mod.check_attention_args(q, k, v, is_causal=True)
    # 2.2 MB of float64 scores: blockwise on a 512 KiB-L2 CPU (from 1 MiB), the naive
    # path on a 2 MiB-L2 one (from 4 MiB); the CPU this test reasons about is pinned
    with pinned_cpu("avx2-512k"):
        assert dispatch.use_blockwise(spec)
        got = scaled_dot_product_attention_backward(g, q, k, v, is_causal=True)
    with pinned_cpu("xeon-avx512"):
        assert not dispatch.use_blockwise(spec)
    want = naive.backward(spec, g)
    for a, b in zip(got, want, strict=True):
        assert grad_err(a, b) <= 1e-12


def test_multihead_attention_without_weights_uses_blockwise(monkeypatch):
    calls = []
    real = bw.forward_spec
    monkeypatch.setattr(bw, "forward_spec", lambda spec, **kw: calls.append(1) or real(spec, **kw))
    monkeypatch.setattr(rows, "planned", lambda spec, **kw: False)  # float32 would go there
    mha = attnlab.MultiheadAttention(16, 2, batch_first=True, rng=np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((1, 600, 16)).astype(np.float32)
    with pinned_cpu("avx2-512k"):  # 2 x 600^2 float32 scores (2.9 MB) overflow twice its L2
        fast, _ = mha(x, x, x, need_weights=False, is_causal=True, attn_mask=causal_mask(600))
        slow, w = mha(x, x, x, need_weights=True, is_causal=True, attn_mask=causal_mask(600))
    assert calls and w is not None
    assert rel_err(fast, slow) <= 1e-5


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"causal_align": "bottom-right"}, ValueError, "only meaningful with is_causal"),
        ({"is_causal": True, "causal_align": "left"}, ValueError, "causal_align must be one of"),
        ({"block_q": 0}, ValueError, "block_q must be a positive int"),
        ({"block_k": 2.0}, TypeError, "block_k must be an int"),
        ({"num_threads": 0}, ValueError, "num_threads must be a positive int"),
        ({"attn_mask": np.ones((3, 3), bool), "is_causal": True}, ValueError, "not both"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    x = np.ones((4, 2))
    with pytest.raises(error, match=match):
        blockwise_attention(x, x, x, **kwargs)


def test_backward_bad_saved_state():
    x = np.ones((4, 2))
    out, lse = blockwise_attention_forward(x, x, x)
    with pytest.raises(ValueError, match="both out and lse"):
        blockwise_attention_backward(x, x, x, x, out=out)
    with pytest.raises(ValueError, match=r"lse has shape \(3,\), but should be \(4,\)"):
        blockwise_attention_backward(x, x, x, x, out=out, lse=lse[:3])
    with pytest.raises(ValueError, match="grad_out has shape"):
        blockwise_attention_backward(x[:3], x, x, x)


def test_set_num_threads():
    bw.set_num_threads(1)
    try:
        assert bw.get_num_threads() == 1
    finally:
        bw.set_num_threads(None)
    with pytest.raises(ValueError, match="n must be a positive int"):
        bw.set_num_threads(0)


def test_without_threadpoolctl_gives_the_same_numbers(monkeypatch):
    rng = np.random.default_rng(13)
    q, k, v, g = inputs(rng, (), 2, 2, 700, 650, 8, 8, np.float64)
    want = blockwise_attention_backward(g, q, k, v, is_causal=True, num_threads=2)
    monkeypatch.setattr(attnlab._threads, "have_threadpoolctl", lambda: False)
    for env in ("1", "2"):  # BLAS held to one thread by the environment: pool; else: BLAS
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", env)
        plan = bw._plan(attention_mod.check_attention_args(q, k, v), None, None, None, 2)
        assert plan.threads == (2 if env == "1" else 1)
        got = blockwise_attention_backward(g, q, k, v, is_causal=True, num_threads=2)
        for a, b in zip(got, want, strict=True):
            assert grad_err(a, b) <= 1e-13
