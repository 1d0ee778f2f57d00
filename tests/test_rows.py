"""The rows kernel (core/rows.py): float32 attention by cache-sized blocks of query rows with
a compiled softmax pass; causal blocks skip hidden keys, GQA without repeated keys. Against
torch in float64 (the oracle), forward and backward, under every mask, with blocks cut
every way (heads per block, rows per block, causal cuts, split backward units) and on one
or two threads."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from attnlab import scaled_dot_product_attention, scaled_dot_product_attention_backward
from attnlab._cpu import PRESETS
from attnlab.core import blockwise as bw
from attnlab.core import dispatch, naive, rows
from attnlab.core._blas import sgemm_address
from attnlab.core.spec import check_attention_args
from helpers import attention_inputs, grad_err, pad_every_score_row, rel_err

pytestmark = pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")

F32_MIN = float(np.finfo(np.float32).min)


def _torch64(torch, q, k, v, g, mask=None, *, wide=True, math=True, **kw):
    """torch's output and gradients in float64 (``wide``; else float32), cast to float32;
    on torch's math backend unless ``math=False`` (its default, fused CPU kernel)."""
    dt = torch.float64 if wide else torch.float32
    tq, tk, tv = (torch.tensor(a, dtype=dt, requires_grad=True) for a in (q, k, v))
    tm = None
    if mask is not None:
        tm = torch.tensor(mask) if mask.dtype == np.bool_ else torch.tensor(mask, dtype=dt)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The math backend: torch's fused float32 kernel recomputes a row masked everywhere
    # with -1e9 from an lse that lost log(S) (weights S times too large in its backward).
    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, **kw)
    out.backward(torch.tensor(g, dtype=dt))
    return out.detach().numpy().astype(np.float32), tuple(t.grad.numpy().astype(np.float32) for t in (tq, tk, tv))


@pytest.fixture(params=["whole", "cut", "padded"])
def blocks(request, monkeypatch):
    """``whole``: the machine's block sizes; ``cut``: blocks of a few KiB, so that calls
    are cut into several heads' blocks, row blocks and split backward units, on 2 threads;
    ``padded``: the machine's blocks with every row of scores padded (and the pads NaN)."""
    monkeypatch.setattr(rows, "_MIN_SCORES", 0)  # the small test sizes take the kernel too
    if request.param == "padded":
        pad_every_score_row(monkeypatch)
    if request.param == "cut":
        monkeypatch.setattr(rows, "_block_bytes", lambda: 24 * 1024)
        monkeypatch.setattr(rows, "_MIN_ROWS", 8)
        monkeypatch.setattr(rows, "_FORWARD_MIN_ROWS", 8)
        monkeypatch.setattr(rows, "_BACKWARD_MIN_ROWS", 8)
        monkeypatch.setattr(rows, "_CAUSAL_ROWS_RANGE", (8, 16))
        monkeypatch.setattr(rows, "_heads_bytes", lambda: 24 * 1024)
        monkeypatch.setattr(rows, "pool_threads", lambda n: 2)
        monkeypatch.setattr(rows, "_min_scores_per_thread", lambda: 0)
    return request.param


def _check(torch, q, k, v, g, mask=None, *, tol=3e-6, wide=True, **kw):
    spec = check_attention_args(q, k, v, mask, **kw)
    assert rows.planned(spec) and rows.planned(spec, backward=True)
    want, want_g = _torch64(torch, q, k, v, g, mask, wide=wide, **kw)
    out = scaled_dot_product_attention(q, k, v, mask, **kw)
    grads = scaled_dot_product_attention_backward(g, q, k, v, mask, **kw)
    assert out.dtype == np.float32 and out.shape == want.shape
    assert rel_err(out, want) <= tol
    for a, b in zip(grads, want_g, strict=True):
        assert a.shape == b.shape and a.dtype == np.float32
        assert grad_err(a, b) <= 2 * tol
    return out, grads


CASES = [  # batch, Hq, H, L, S, E, Ev, causal, GQA
    ((2,), 4, 4, 40, 40, 16, 16, False, False),
    ((2,), 4, 4, 40, 40, 16, 8, True, False),
    ((1,), 6, 2, 33, 33, 16, 16, True, True),
    ((2,), 6, 3, 20, 45, 8, 12, False, True),
    ((2,), 4, 2, 45, 20, 8, 8, True, True),  # L > S: late rows see every key
    ((), 3, 3, 20, 70, 8, 8, True, False),  # L < S, top-left: row i sees keys <= i
    ((2, 3), 2, 2, 17, 19, 8, 8, False, False),
]


def _case_id(c) -> str:
    return f"{c[0]}x{c[1]}/{c[2]}-L{c[3]}-S{c[4]}-{'causal' if c[7] else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_torch(case, blocks, torch):
    batch, hq, h, L, S, E, Ev, causal, gqa = case
    rng = np.random.default_rng(40)
    q, k, v, g = attention_inputs(rng, batch, hq, h, L, S, E, Ev, np.float32)
    _check(torch, q, k, v, g, is_causal=causal, enable_gqa=gqa)


def test_masks_match_torch(blocks, torch):
    """Bool masks (with fully masked rows: zeros), key-padding masks broadcast over heads
    and rows, float masks (-1e9 and finfo.min everywhere in a row: torch's uniform
    average), per-head masks with GQA."""
    rng = np.random.default_rng(41)
    L, S = 36, 44
    q, k, v, g = attention_inputs(rng, (2,), 6, 2, L, S, 16, 16, np.float32)
    boolean = rng.random((2, 6, L, S)) > 0.4
    boolean[:, :, 3] = False
    out, grads = _check(torch, q, k, v, g, boolean, enable_gqa=True)
    assert (out[:, :, 3] == 0).all() and (grads[0][:, :, 3] == 0).all()
    padding = np.ones((2, 1, 1, S), bool)
    padding[1, ..., 30:] = False
    _check(torch, q, k, v, g, padding, enable_gqa=True)
    bias = rng.standard_normal((L, S)).astype(np.float32)
    bias[5] = -1e9
    bias[7] = F32_MIN
    bias[:, 40:] = -np.inf
    # float32 torch: in float64, -1e9 + score keeps the scores apart (no uniform rows)
    out, _ = _check(torch, q, k, v, g, bias, enable_gqa=True, wide=False, tol=1e-5)
    np.testing.assert_allclose(out[:, :, 5], np.repeat(v[:, :, :40].mean(2), 3, axis=1), rtol=1e-5, atol=1e-6)


def test_nan_and_inf_propagate_as_in_torch(blocks, torch):
    """NaN in a query row makes that row NaN; an infinite key score makes the rows that see
    it NaN; a NaN score a causal mask hides changes nothing (as in torch)."""
    rng = np.random.default_rng(42)
    q, k, v, g = attention_inputs(rng, (1,), 2, 2, 24, 24, 8, 8, np.float32)
    q[0, 0, 4, 1] = np.nan
    k[0, 1, 10, 2] = np.inf
    k[0, 0, 20, 0] = np.nan  # hidden from rows < 20 by the causal mask
    for causal in (False, True):
        want, _ = _torch64(torch, q, k, v, g, math=False, is_causal=causal)
        out = scaled_dot_product_attention(q, k, v, is_causal=causal)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
        assert np.isnan(out[0, 0, 4]).all() and np.isnan(out[0, 0, 20 if causal else 0]).all()
        ok = ~np.isnan(want)
        assert np.abs(out[ok] - want[ok]).max() <= 1e-5


def test_agrees_with_the_naive_and_blockwise_kernels(blocks):
    rng = np.random.default_rng(43)
    q, k, v, g = attention_inputs(rng, (3,), 4, 4, 50, 60, 16, 16, np.float32)
    mask = rng.random((3, 1, 50, 60)) > 0.3
    for kw in ({"is_causal": True}, {"attn_mask": mask}):
        spec = check_attention_args(q, k, v, **kw)
        ref = naive.forward(spec)
        ref_g = naive.backward(spec, g)
        assert rel_err(rows.forward(spec), ref) <= 2e-6
        assert rel_err(bw.forward_spec(spec), ref) <= 2e-6
        for a, b in zip(rows.backward(spec, g), ref_g, strict=True):
            assert grad_err(a, b) <= 4e-6


def test_gqa_does_not_repeat_keys_in_the_kernel(blocks, torch):
    """The group's query heads share one key/value head: the same numbers as torch's
    repeat_interleave, and the key/value gradients summed over the group."""
    rng = np.random.default_rng(44)
    q, k, v, g = attention_inputs(rng, (1,), 9, 3, 64, 64, 16, 16, np.float32)
    _, (_, dk, dv) = _check(torch, q, k, v, g, is_causal=True, enable_gqa=True)
    assert dk.shape == k.shape and dv.shape == v.shape


SMALL_HEAD_CASES = [  # E >= 32 and E * S <= 4096: multiplied by transposed copies of k and v
    ((2,), 4, 4, 40, 40, 32, 32, True, False),
    ((1,), 6, 2, 33, 33, 32, 32, False, True),
    ((2,), 4, 2, 45, 20, 32, 16, True, True),
    ((), 3, 3, 20, 60, 64, 64, True, False),
]


@pytest.mark.parametrize("case", SMALL_HEAD_CASES, ids=_case_id)
def test_small_heads_multiply_by_their_own_transposed_copies(case, blocks, torch):
    """Small heads multiply by transposed copies of the keys and values, made once per call
    and block of heads and reused by its row blocks: torch's numbers, and a second call
    with other keys and values of the same shapes never reuses the first call's copies."""
    batch, hq, h, L, S, E, Ev, causal, gqa = case
    rng = np.random.default_rng(46)
    q, k, v, g = attention_inputs(rng, batch, hq, h, L, S, E, Ev, np.float32)
    assert rows._Layout(check_attention_args(q, k, v, is_causal=causal, enable_gqa=gqa)).copy_transposed
    _check(torch, q, k, v, g, is_causal=causal, enable_gqa=gqa)
    _, k2, v2, _ = attention_inputs(np.random.default_rng(47), batch, hq, h, L, S, E, Ev, np.float32)
    _check(torch, q, k2, v2, g, is_causal=causal, enable_gqa=gqa)


def _projection_layout(a: np.ndarray) -> np.ndarray:
    """``a (N, H, L, E)`` as the transposed view of an ``(N, L, H, E)`` projection (what
    MultiheadAttention hands the kernel): its batch and head axes cannot be merged."""
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("case", [((3,), 4, 4, 40, 40, 16, 16, True, False), ((3,), 6, 2, 24, 30, 8, 8, False, True),
                                  ((5,), 2, 2, 33, 33, 8, 8, False, False)], ids=_case_id)
def test_heads_transposed_out_of_a_projection_are_not_copied(case, blocks, torch, monkeypatch):
    """q, k, v and the gradient as views of (N, L, H, E) buffers: the blocks take whole batch
    entries (or heads within one) of the two-level layout, with the numbers of torch."""
    batch, hq, h, L, S, E, Ev, causal, gqa = case
    rng = np.random.default_rng(45)
    q, k, v, g = (_projection_layout(a) for a in attention_inputs(rng, batch, hq, h, L, S, E, Ev, np.float32))
    layouts = []
    real = rows._Layout

    def spy(*args, **kwargs):
        lay = real(*args, **kwargs)
        layouts.append(lay)
        return lay

    monkeypatch.setattr(rows, "_Layout", spy)
    copies = []
    real_copy = np.ascontiguousarray

    def counted_copy(a, *args, **kwargs):
        copies.append(a.shape)
        return real_copy(a, *args, **kwargs)

    monkeypatch.setattr(rows.np, "ascontiguousarray", counted_copy)
    try:
        _check(torch, q, k, v, g, is_causal=causal, enable_gqa=gqa)
    finally:
        monkeypatch.undo()
    assert len(layouts) == 2 and all(lay.two_level and lay.q.ndim == 5 and lay.k.ndim == 4 for lay in layouts)
    assert all(len(lay.head_chunks) >= 1 for lay in layouts)
    whole = {tuple(a.shape) for a in (q, k, v, g)}
    assert not whole & set(copies)  # neither the inputs nor the gradient were gathered into a copy
    if not gqa:  # (with GQA a block stacks its group's query rows: a copy of the block)
        assert copies == []


def test_threads_follow_the_work_of_a_call(monkeypatch):
    """The pool from min_scores_per_thread scores of E = 64 heads; E = 16 heads need four
    times as many scores, and heads larger than 64 count as 64."""
    monkeypatch.setattr(rows, "pool_threads", lambda n: 2)
    need = rows._min_scores_per_thread()

    def threads(n: int, E: int) -> int:  # n scores: n / 4096 heads of 64 x 64
        q = np.zeros((n // 4096, 64, E), np.float32)
        return rows._Layout(check_attention_args(q, q, q)).threads

    assert threads(need, 64) == 2 and threads(need - 4096, 64) == 1
    assert threads(need, 16) == 1 and threads(4 * need, 16) == 2
    assert threads(need, 128) == 2 and threads(need - 4096, 128) == 1



@pytest.mark.parametrize("hq, h, L", [(12, 12, 512), (9, 3, 512), (12, 12, 1024)])
def test_causal_forward_blocks_take_several_heads(hq, h, L, monkeypatch):
    """A causal forward block's rows are cut short, and then it takes as many heads as fit
    the heads' share of the L2 cache at the keys a block sees on average (S / 2); the
    backward pass keeps one head a block."""
    monkeypatch.setattr(rows, "_heads_bytes", lambda: 1 << 20)
    monkeypatch.setattr(rows, "pool_threads", lambda n: 1)
    q = np.zeros((1, hq, L, 64), np.float32)
    kv = np.zeros((1, h, L, 64), np.float32)
    spec = check_attention_args(q, kv, kv, is_causal=True, enable_gqa=hq != h)
    fwd, bwd = rows._Layout(spec), rows._Layout(spec, backward=True)
    per_block = 4 * (hq // h) * L * fwd.rows  # bytes of one key/value head's block, all keys
    want = min(h, 2 * (1 << 20) // per_block)
    assert fwd.rows < L and {f1 - f0 for f0, f1 in fwd.head_chunks} == {want} and want > 1
    assert {f1 - f0 for f0, f1 in bwd.head_chunks} == {1}


ONE_BLOCK_CASES = [  # batch, Hq, H, L, S, E, Ev, causal
    ((1,), 8, 8, 64, 64, 64, 64, False),  # copies k transposed (E * S <= 4096)
    ((1,), 8, 8, 64, 64, 64, 64, True),
    ((2,), 6, 2, 40, 50, 32, 16, False),  # GQA
    ((1,), 9, 3, 30, 70, 64, 64, True),  # causal, S > L: keys past L never seen
    ((3,), 4, 4, 64, 64, 16, 16, False),  # E = 16: no copy
    ((), 8, 8, 64, 128, 64, 64, False),  # 3-D
]


def _one_block_path(direct: bool, monkeypatch) -> None:
    """The compiled one-block call (NumPy's sgemm from compiled code), or the NumPy one."""
    if not direct:
        monkeypatch.setattr(rows, "sgemm_address", lambda: 0)
    elif not sgemm_address():
        pytest.skip("NumPy's BLAS has no CBLAS sgemm with 64-bit integers")


@pytest.mark.parametrize("direct", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("case", ONE_BLOCK_CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}-L{c[3]}-S{c[4]}-E{c[5]}")
def test_a_short_call_runs_as_one_block_with_the_general_numbers(case, direct, torch, monkeypatch):
    """Short calls skip the general layout (rows._forward_one_block) and give bit for bit
    the general kernel's numbers (and torch's, to float32 rounding), whether the blocks
    are compiled calls or NumPy's."""
    _one_block_path(direct, monkeypatch)
    batch, hq, h, L, S, E, Ev, causal = case
    rng = np.random.default_rng(47)
    q, k, v, g = attention_inputs(rng, batch, hq, h, L, S, E, Ev, np.float32)
    spec = check_attention_args(q, k, v, is_causal=causal, enable_gqa=hq != h)
    one = rows._forward_one_block(spec)
    assert one is not None
    np.testing.assert_array_equal(one, rows._forward(spec))
    want, _ = _torch64(torch, q, k, v, g, is_causal=causal, enable_gqa=hq != h)
    assert rel_err(one, want) <= 3e-6
    monkeypatch.setattr(rows, "_forward", lambda spec: pytest.fail("the general path ran"))
    np.testing.assert_array_equal(rows.forward(spec), one)


def test_the_compiled_block_takes_numpys_blas(monkeypatch):
    """NumPy's wheels carry OpenBLAS with 64-bit integers: its sgemm is found, and a short
    call is one compiled call; inf and NaN fall where the NumPy path puts them, without a
    floating-point warning (no NumPy call checks the flags)."""
    import warnings

    blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
    wheel = blas.get("name") == "scipy-openblas" and "USE64BITINT" in (blas.get("openblas configuration") or "")
    assert bool(sgemm_address()) == wheel
    if not wheel:
        pytest.skip("NumPy's BLAS is not scipy-openblas64")
    from attnlab.core import _fused

    calls = []
    real = _fused.forward_rows
    monkeypatch.setattr(_fused, "forward_rows", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(49)
    q, k, v, _ = attention_inputs(rng, (1,), 8, 8, 64, 64, 64, 64, np.float32)
    k[0, 0, 3] = 3e38  # overflowing scores: rows that see key 3 give inf - inf
    v[0, 1, 5, 2] = np.inf  # inf times probabilities that are 0
    q[0, 2, 7, 0] = np.nan
    for causal in (False, True):
        spec = check_attention_args(q, k, v, is_causal=causal)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = rows.forward(spec)
        monkeypatch.setattr(rows, "sgemm_address", lambda: 0)
        want = rows.forward(spec)
        monkeypatch.undo()
        monkeypatch.setattr(_fused, "forward_rows", lambda *a: calls.append(1) or real(*a))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        ok = np.isfinite(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-6, atol=1e-7)
        assert np.isnan(got[0, 2, 7]).all() and np.isnan(got[0, 0]).any() and np.isinf(got[0, 1, :, 2]).any()
    assert len(calls) == 2


@pytest.mark.parametrize("batch, hq, h, L, E, causal", [
    (1, 4, 4, 160, 32, False), (1, 6, 2, 160, 32, True), (1, 3, 1, 160, 32, False),
    (16, 4, 4, 128, 32, False),  # heads small enough for the keys' transposed copy
])
def test_the_blocks_as_compiled_calls(batch, hq, h, L, E, causal, monkeypatch):
    """With no mask or a causal one, the forward and backward blocks run as compiled calls
    that call NumPy's sgemm themselves (here with keys and values whose rows are 3 E
    apart, grouped queries, several causal blocks): the NumPy blocks' numbers, to float32
    rounding."""
    if not sgemm_address():
        pytest.skip("NumPy's BLAS has no CBLAS sgemm with 64-bit integers")
    from attnlab.core import _fused

    rng = np.random.default_rng(50)
    q = rng.standard_normal((batch, hq, L, E)).astype(np.float32)
    kv = rng.standard_normal((batch, h, L, 3 * E)).astype(np.float32)
    k, v = kv[..., :E], kv[..., E : 2 * E]
    g = rng.standard_normal((batch, hq, L, E)).astype(np.float32)
    spec = check_attention_args(q, k, v, is_causal=causal, enable_gqa=hq != h)
    assert rows._forward_one_block(spec) is None
    calls = []
    for name in ("forward_rows", "backward_rows"):
        real = getattr(_fused, name)
        def counted(*a, real=real, name=name):
            calls.append((name, a[2].strides))
            return real(*a)

        monkeypatch.setattr(_fused, name, counted)
    got = (rows.forward(spec), *rows.backward(spec, g))
    assert {name for name, _ in calls} == {"forward_rows", "backward_rows"}
    assert all(st[1] == 3 * E * 4 for _, st in calls)  # the keys' rows as the caller has them
    monkeypatch.setattr(rows, "sgemm_address", lambda: 0)
    want = (rows.forward(spec), *rows.backward(spec, g))
    for got_x, want_x in zip(got, want, strict=True):
        assert rel_err(got_x, want_x) <= 2e-6

@pytest.mark.parametrize("batch, hq, h, L, E, causal, by_entry", [
    (64, 4, 4, 32, 16, True, True),  # a TinyTransformer training step's attention: blocks of whole entries
    (8, 6, 2, 96, 32, True, True),  # grouped queries
    (4, 8, 8, 160, 64, False, False),  # blocks within one entry
])
def test_heads_of_a_projection_run_as_compiled_blocks(batch, hq, h, L, E, causal, by_entry, monkeypatch):
    """Heads transposed out of one ``(N, L, (Hq + 2 H) E)`` projection have no flat head
    axis (the two-level layout): their blocks run as the same compiled calls, a block of
    whole batch entries one call per entry. The numbers are those of the same heads made
    contiguous and the NumPy blocks', to float32 rounding."""
    if not sgemm_address():
        pytest.skip("NumPy's BLAS has no CBLAS sgemm with 64-bit integers")
    from attnlab.core import _fused

    rng = np.random.default_rng(52)
    qkv = rng.standard_normal((batch, L, (hq + 2 * h) * E)).astype(np.float32)
    q = qkv[..., : hq * E].reshape(batch, L, hq, E).transpose(0, 2, 1, 3)
    k = qkv[..., hq * E : (hq + h) * E].reshape(batch, L, h, E).transpose(0, 2, 1, 3)
    v = qkv[..., (hq + h) * E :].reshape(batch, L, h, E).transpose(0, 2, 1, 3)
    g = rng.standard_normal((batch, hq, L, E)).astype(np.float32)
    spec = check_attention_args(q, k, v, is_causal=causal, enable_gqa=hq != h)
    assert rows._Layout(spec).two_level
    calls = []
    for name in ("forward_rows", "backward_rows", "forward_rows_by_entry", "backward_rows_by_entry"):
        real = getattr(_fused, name)
        monkeypatch.setattr(_fused, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    got = (rows.forward(spec), *rows.backward(spec, g))
    kinds = {"forward_rows_by_entry", "backward_rows_by_entry"} if by_entry else {"forward_rows", "backward_rows"}
    assert set(calls) == kinds
    flat = check_attention_args(*(np.ascontiguousarray(a) for a in (q, k, v)), is_causal=causal,
                                enable_gqa=hq != h)
    for got_x, want_x in zip(got, (rows.forward(flat), *rows.backward(flat, g)), strict=True):
        assert rel_err(got_x, want_x) <= 2e-6  # BLAS may round other leading dimensions otherwise
    monkeypatch.setattr(rows, "sgemm_address", lambda: 0)
    for got_x, want_x in zip(got, (rows.forward(spec), *rows.backward(spec, g)), strict=True):
        assert rel_err(got_x, want_x) <= 2e-6


def test_rows_blas_cannot_take_stay_on_numpy(torch, monkeypatch):
    """Keys with reversed rows, values with one row repeated (broadcast) and a gradient
    with reversed rows: no compiled block (BLAS needs rows of positive stride), and the
    numbers are torch's."""
    from attnlab.core import _fused

    for name in ("forward_rows", "backward_rows", "forward_rows_by_entry", "backward_rows_by_entry"):
        monkeypatch.setattr(_fused, name, lambda *a: pytest.fail("a compiled block ran"))
    rng = np.random.default_rng(51)
    q, k, v, g = attention_inputs(rng, (1,), 4, 4, 160, 160, 32, 32, np.float32)
    k = k[:, :, ::-1]
    v = np.broadcast_to(v[:, :, :1], v.shape)
    g = g[:, :, ::-1]
    for causal in (False, True):
        spec = check_attention_args(q, k, v, is_causal=causal)
        assert rows.planned(spec) and rows.planned(spec, backward=True)
        out, grads = rows.forward(spec), rows.backward(spec, g)
        want, want_grads = _torch64(torch, *(np.ascontiguousarray(a) for a in (q, k, v, g)), is_causal=causal)
        assert rel_err(out, want) <= 3e-6
        for got_x, want_x in zip(grads, want_grads, strict=True):  # equal values: q's and k's near 0
            assert np.abs(got_x - want_x).max() <= 3e-5 * max(1.0, float(np.abs(want_x).max()))


def test_other_calls_take_the_general_layout():
    """Masks, strided or broadcast inputs, more than one causal block of rows, scores beyond
    the L2 cache and calls worth two threads take the general layout."""
    q = np.zeros((1, 8, 64, 64), np.float32)
    assert rows._forward_one_block(check_attention_args(q, q, q)) is not None
    mask = np.ones((64, 64), bool)
    wide = np.zeros((1, 8, 64, 128), np.float32)[..., ::2]
    long = np.zeros((1, 8, 128, 64), np.float32)
    many = np.zeros((64, 8, 64, 64), np.float32)
    for spec in (
        check_attention_args(q, q, q, mask),
        check_attention_args(wide, q, q),
        check_attention_args(q, q[:, :1], q[:, :1]),  # one key/value head for all
        check_attention_args(q, np.zeros((2, 8, 64, 64), np.float32), np.zeros((2, 8, 64, 64), np.float32)),
        check_attention_args(long, long, long, is_causal=True),
        check_attention_args(many, many, many),
        check_attention_args(q[0, 0], q[0, 0], q[0, 0]),  # 2-D: (L, E)
    ):
        assert rows._forward_one_block(spec) is None
    assert rows._forward_one_block(check_attention_args(long, long, long)) is not None
    flat = np.random.default_rng(48).standard_normal((256, 64)).astype(np.float32)  # 2-D, 65536 scores
    spec = check_attention_args(flat, flat, flat)
    assert rows.planned(spec)
    assert rel_err(rows.forward(spec), naive.forward(spec)) <= 3e-6


@pytest.mark.parametrize("cpu", list(PRESETS))
def test_dispatch(cpu, pin_cpu):
    pin_cpu(cpu)
    rng = np.random.default_rng(45)
    q = rng.standard_normal((8, 64, 16)).astype(np.float32)  # 8 x 64 x 64 = 2^15 scores
    assert rows.planned(check_attention_args(q, q, q))
    assert not rows.planned(check_attention_args(q[:7], q[:7], q[:7]))  # below: naive
    q64 = q.astype(np.float64)
    assert not rows.planned(check_attention_args(q64, q64, q64))  # float32 only
    assert not rows.planned(check_attention_args(q, q, q, dropout_p=0.1))
    with bw.tuned(fused=False):  # ATTNLAB_NO_NUMBA=1, or no numba: the NumPy paths
        assert not rows.planned(check_attention_args(q, q, q))
    long = np.zeros((1, rows.max_keys() + 1, 16), np.float32)
    few = q[:1, :32]  # 32 x 2049 scores: enough
    assert not rows.planned(check_attention_args(few, long, long))
    assert rows.planned(check_attention_args(few, long, long), backward=True) == (
        long.shape[1] <= rows.max_keys(backward=True)
    )
    assert rows.max_keys(backward=True) >= rows.max_keys()


def test_half_precision_computed_in_float32(torch, monkeypatch):
    monkeypatch.setattr(rows, "_MIN_SCORES", 0)
    rng = np.random.default_rng(46)
    q, k, v, g = attention_inputs(rng, (2,), 4, 4, 48, 48, 16, 16, np.float16)
    assert rows.planned(dispatch.widened(check_attention_args(q, k, v)))
    want, _ = _torch64(torch, q, k, v, g, is_causal=True)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == np.float16
    assert rel_err(out.astype(np.float32), want) <= 2e-3
