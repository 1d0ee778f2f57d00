"""The fast path at the sizes that take it: exact under every mask, dtype and scale (against
torch), half precision, thread safety, no nested pools, and tile sizes from the machine."""

from __future__ import annotations

import contextlib
import os
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attnlab._threads as threads_mod
from attnlab import (
    blockwise_attention,
    blockwise_attention_backward,
    blockwise_attention_forward,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnlab._cpu import CPUInfo, _caches, _cpuinfo, pinned_cpu
from attnlab.core import blockwise as bw
from attnlab.core import dispatch, rows
from attnlab.core.spec import check_attention_args
from attnlab.nn import functional as F
from helpers import ELEMENTWISE_PASSES, attention_inputs, grad_err, kernel_tuning, rel_err

F32_MIN = float(np.finfo(np.float32).min)
L = 1024  # with 2 heads: 2M scores (8 MiB), which the dispatcher sends to the blockwise kernel


def _mask_case(name: str, rng) -> np.ndarray:
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    if name == "causal ALiBi, slope 0.5":  # the first tiles of late rows lie below -88
        return np.where(j <= i, -0.5 * (i - j), -np.inf).astype(np.float32)
    if name == "-1e9 padding, rows masked everywhere":
        m = np.zeros((L, L), np.float32)
        m[:, L - 100 :] = -1e9
        m[::7] = -1e9  # finite everywhere: torch averages these rows uniformly
        return m
    if name == "finfo.min padding, rows masked everywhere":
        m = np.zeros((L, L), np.float32)
        m[:, L // 2 :] = F32_MIN
        m[::5] = F32_MIN
        return m
    if name == "-1e4 everywhere but ~3 keys a row":
        return np.where(rng.random((L, L)) < 3 / L, 0, -1e4).astype(np.float32)
    if name == "random bias N(0, 100^2)":
        return (rng.standard_normal((L, L)) * 100).astype(np.float32)
    raise ValueError(name)


MASK_CASES = [
    "causal ALiBi, slope 0.5",
    "-1e9 padding, rows masked everywhere",
    "finfo.min padding, rows masked everywhere",
    "-1e4 everywhere but ~3 keys a row",
    "random bias N(0, 100^2)",
]


def _torch_sdpa(torch, q, k, v, g, *, math=False, **kw):
    """torch's output and gradients; ``math``: on its math backend (softmax and autograd)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    mask = kw.pop("attn_mask", None)
    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        tout = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=None if mask is None else torch.tensor(mask), **kw
        )
    tout.backward(torch.tensor(g))
    return tout.detach().numpy(), tuple(t.grad.numpy() for t in (tq, tk, tv))


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("case", MASK_CASES)
def test_float_masks_match_torch_forward_and_backward(case, fused, torch, monkeypatch, pin_cpu):
    """Finite masks however negative: no NaN, torch's numbers (a row masked everywhere with a
    finite value is torch's uniform average), forward and backward, through the public
    functions at a size the dispatcher sends to the blockwise kernel.

    The gradients are compared with torch's math backend: torch's fused CPU kernel at
    this size recomputes a row masked everywhere with -1e9 as exp(x - lse) where lse has
    lost log(S) to rounding, so its weights there come out S times too large (1 instead
    of 1/S; its output is right). attnlab keeps the shift and log(l) apart.
    """
    rng = np.random.default_rng(20)
    q, k, v, g = attention_inputs(rng, (1,), 2, 2, L, L, 64, 64, np.float32)
    mask = _mask_case(case, rng)
    pin_cpu("xeon-avx512")  # 8 MiB of scores overflow even a 2 MiB L2
    assert dispatch.use_blockwise(check_attention_args(q, k, v, mask))
    monkeypatch.setattr(rows, "planned", lambda spec, **kw: False)  # the rows kernel: tests/test_rows.py
    want, _ = _torch_sdpa(torch, q, k, v, g, attn_mask=mask)
    _, want_g = _torch_sdpa(torch, q, k, v, g, attn_mask=mask, math=True)
    with bw.tuned(fused=fused, fused_min_scores=0):
        out = scaled_dot_product_attention(q, k, v, mask)
        grads = scaled_dot_product_attention_backward(g, q, k, v, mask)
    assert not np.isnan(out).any() and not any(np.isnan(a).any() for a in grads)
    assert rel_err(out, want) <= 1e-5
    for a, b in zip(grads, want_g, strict=True):
        assert grad_err(a, b) <= 2e-5


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_rows_masked_everywhere(fused):
    """-inf / False everywhere: 0 (attnlab's documented choice); the same finite value
    everywhere: the uniform average of the values (what float32 rounding gives for
    finfo.min, as in torch)."""
    rng = np.random.default_rng(21)
    q, k, v, g = attention_inputs(rng, (), 1, 1, 600, 700, 16, 8, np.float32)
    boolean = np.ones((600, 700), bool)
    boolean[5] = False
    neg_inf = np.where(boolean, 0, -np.inf).astype(np.float32)
    finite = np.where(boolean, 0, F32_MIN).astype(np.float32)
    with kernel_tuning(fused):
        for mask in (boolean, neg_inf):
            out = blockwise_attention(q, k, v, mask)
            dq, dk, dv = blockwise_attention_backward(g, q, k, v, mask)
            assert (out[0, 5] == 0).all() and (dq[0, 5] == 0).all()
            assert np.isfinite(dk).all() and np.isfinite(dv).all()
        out, lse = blockwise_attention_forward(q, k, v, finite)
        grads = blockwise_attention_backward(g, q, k, v, finite)
        # The same from a saved lse (-3.4e38 swallowed log(700): recomputed, not trusted).
        saved = blockwise_attention_backward(g, q, k, v, finite, out=out, lse=lse)
    np.testing.assert_allclose(out[0, 5], v[0].mean(0), rtol=1e-5, atol=1e-6)
    # The naive path's softmax (weights 1/700 in that row) is the reference.
    want_g = scaled_dot_product_attention_backward(g, q, k, v, finite)
    for a, b, c in zip(grads, saved, want_g, strict=True):
        assert grad_err(a, c) <= 1e-5 and grad_err(b, c) <= 1e-5


def _row_errors(got, want):
    return np.abs(got.astype(np.float64) - want).max(-1).ravel()


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
@pytest.mark.parametrize("scale", [1e-6, 40.0, 1000.0])
def test_extreme_scales_as_accurate_as_torch(scale, fused, torch):
    """Scores up to 7e4: float32 rounds them to a grid of 0.008, so neither torch nor
    attnlab is exact, and which rows suffer depends on the order of rounding ((q * s) @ k
    here, (q @ k) * s in torch). Against float64: attnlab's typical (median) row error at
    most twice torch's, its worst row at most ten times torch's worst (plus 1e-6)."""
    rng = np.random.default_rng(22)
    q, k, v, g = attention_inputs(rng, (1,), 2, 2, L, L, 64, 64, np.float32)
    want32, grads32 = _torch_sdpa(torch, q, k, v, g, scale=scale)
    exact, grads64 = _torch_sdpa(torch, *(a.astype(np.float64) for a in (q, k, v, g)), scale=scale)
    with bw.tuned(fused=fused, fused_min_scores=0):
        out = scaled_dot_product_attention(q, k, v, scale=scale)
        grads = scaled_dot_product_attention_backward(g, q, k, v, scale=scale)
    assert np.isfinite(out).all() and all(np.isfinite(a).all() for a in grads)
    for ours, theirs, ref in [(out, want32, exact), *zip(grads, grads32, grads64, strict=True)]:
        mine, torch_errors = _row_errors(ours, ref), _row_errors(theirs, ref)
        assert np.median(mine) <= 2 * np.median(torch_errors) + 1e-6
        assert mine.max() <= 10 * torch_errors.max() + 1e-6


# --------------------------------------------------------------------------- half precision


def test_float16_small_takes_naive_path_in_float32():
    rng = np.random.default_rng(23)
    q, k, v, g = attention_inputs(rng, (), 2, 2, 9, 11, 8, 8, np.float16)
    q *= 40  # scores above float16's 65504: computed in float16 they would be inf and NaN
    k *= 40
    spec = check_attention_args(q, k, v)
    with pinned_cpu("avx2-512k"):  # 2 x 99 scores: the naive path even on the smallest L2
        assert not dispatch.use_blockwise(dispatch.widened(spec))
    out = scaled_dot_product_attention(q, k, v)
    grads = scaled_dot_product_attention_backward(g, q, k, v)
    w = dispatch.attention_weights(q, k)
    f32 = [a.astype(np.float32) for a in (q, k, v, g)]
    assert out.dtype == w.dtype == np.float16 and all(a.dtype == np.float16 for a in grads)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    np.testing.assert_array_equal(out, scaled_dot_product_attention(*f32[:3]).astype(np.float16))
    for a, b in zip(grads, scaled_dot_product_attention_backward(f32[3], *f32[:3]), strict=True):
        np.testing.assert_array_equal(a, b.astype(np.float16))


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_float16_large_takes_blockwise_path_in_float32(fused, monkeypatch, pin_cpu):
    pin_cpu("xeon-avx512")  # 2 x 1024^2 float32 scores (8 MiB) overflow twice even a 2 MiB L2
    calls = []
    real = bw.forward_spec
    monkeypatch.setattr(bw, "forward_spec", lambda spec, **kw: calls.append(spec.query.dtype) or real(spec, **kw))
    monkeypatch.setattr(rows, "planned", lambda spec, **kw: False)  # the rows kernel: tests/test_rows.py
    rng = np.random.default_rng(24)
    q, k, v, g = attention_inputs(rng, (1,), 2, 2, 1024, 1024, 32, 32, np.float16)
    f32 = [a.astype(np.float32) for a in (q, k, v, g)]
    with bw.tuned(fused=fused, fused_min_scores=0):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = scaled_dot_product_attention_backward(g, q, k, v, is_causal=True)
        want = scaled_dot_product_attention(*f32[:3], is_causal=True)
        want_g = scaled_dot_product_attention_backward(f32[3], *f32[:3], is_causal=True)
    assert calls[0] == np.float32  # the blockwise kernel ran, in float32
    assert out.dtype == np.float16 and all(a.dtype == np.float16 for a in grads)
    np.testing.assert_array_equal(out, want.astype(np.float16))
    for a, b in zip(grads, want_g, strict=True):
        np.testing.assert_array_equal(a, b.astype(np.float16))


def test_float16_long_sequence_runs_in_linear_memory():
    """30000 tokens in float16: the naive path would hold 30000^2 scores (1.7 GiB in float16,
    3.4 GiB in float32); the blockwise path holds tiles."""
    n = 30000
    rng = np.random.default_rng(25)
    q, k, v = (rng.standard_normal((1, n, 8)).astype(np.float16) for _ in range(3))
    scaled_dot_product_attention(q[:, :2048], k[:, :2048], v[:, :2048])  # imports/compiles
    tracemalloc.start()
    try:
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.dtype == np.float16 and np.isfinite(out).all()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    ref = scaled_dot_product_attention(q[:, -2:].astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_allclose(out[:, -1:].astype(np.float32), ref[:, -1:], atol=2e-3)


# --------------------------------------------------------------------------- threads


def _blas_threads() -> list[int]:
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_100_concurrent_calls_leave_blas_as_found(fused):
    pytest.importorskip("threadpoolctl")
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(26)
    q, k, v, g = attention_inputs(rng, (), 2, 2, 300, 280, 16, 16, np.float32)
    with kernel_tuning(fused):
        want = blockwise_attention(q, k, v, is_causal=True, num_threads=1)
    for blas in (2, 3):  # a count no pool would set by accident
        with threadpool_limits(limits=blas, user_api="blas"):
            before = _blas_threads()
            assert set(before) == {blas}

            def call(i):
                out = blockwise_attention(q, k, v, is_causal=True, num_threads=2 + i % 2)
                return rel_err(out, want)

            with kernel_tuning(fused), ThreadPoolExecutor(16) as ex:
                errors = list(ex.map(call, range(100)))
            assert _blas_threads() == before
            assert threads_mod.BLAS_LIMITER.users == 0
        assert max(errors) <= 1e-6


@pytest.mark.parametrize("fused", ELEMENTWISE_PASSES)
def test_results_agree_across_thread_counts(fused):
    rng = np.random.default_rng(27)
    q, k, v, g = attention_inputs(rng, (2,), 2, 2, 700, 650, 32, 16, np.float32)
    mask = rng.standard_normal((700, 650)).astype(np.float32)
    with kernel_tuning(fused):
        ref = blockwise_attention_backward(g, q, k, v, mask, num_threads=1)
        for n in (2, 3, 4):
            got = blockwise_attention_backward(g, q, k, v, mask, num_threads=n)
            for a, b in zip(got, ref, strict=True):
                assert grad_err(a, b) <= 1e-6


def test_no_nested_pools(monkeypatch):
    """A pool unit that calls the kernel runs it in its own thread: one executor in all."""
    executors = []
    real = threads_mod.ThreadPoolExecutor

    def counting(*args, **kwargs):
        executors.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(threads_mod, "ThreadPoolExecutor", counting)
    monkeypatch.setattr(threads_mod, "_EXECUTOR", None)  # the workers are made once per process
    monkeypatch.setattr(threads_mod, "_EXECUTOR_WORKERS", 0)
    rng = np.random.default_rng(28)
    q, k, v, _ = attention_inputs(rng, (), 4, 4, 200, 200, 8, 8, np.float32)
    inner_threads = []
    real_run = threads_mod.run_units

    def spy(units, run_unit, threads, **kwargs):
        inner_threads.append((threads_mod.in_pool(), threads))
        return real_run(units, run_unit, threads, **kwargs)

    monkeypatch.setattr(bw, "run_units", spy)
    results = {}

    def unit(i, _scratch):
        results[i] = blockwise_attention(q, k, v, num_threads=2)

    with kernel_tuning(False):
        threads_mod.run_units(range(6), unit, 2)
    assert len(executors) == 1  # only the outer pool started threads
    assert all(inside for inside, _ in inner_threads) and len(inner_threads) == 6
    assert not threads_mod.in_pool() and threads_mod.BLAS_LIMITER.users == 0
    assert sorted(results) == list(range(6))


# --------------------------------------------------------------------------- the two passes


@pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float"])
def test_compiled_and_numpy_passes_agree(kind, pin_cpu):
    # The key blocks follow the L2 (more blocks, more rescalings of the running sums, each
    # rounded by the two passes a little differently): the bound holds for Zen 4's blocks.
    # As a 512 KiB-L2 CPU the float-mask gradients differ by 2.2e-6; the comparisons with
    # torch (tests/test_blockwise.py) hold for every CPU at their own tolerances.
    pin_cpu("zen4")
    rng = np.random.default_rng(29)
    q, k, v, g = attention_inputs(rng, (1,), 2, 2, 777, 1030, 64, 48, np.float32)
    kw = {"is_causal": True} if kind == "causal" else {}
    if kind == "bool":
        kw["attn_mask"] = rng.random((777, 1030)) < 0.8
    elif kind == "float":
        kw["attn_mask"] = (rng.standard_normal((777, 1030)) * 3).astype(np.float32)
    results = []
    for fused in (True, False):
        with bw.tuned(fused=fused, fused_min_scores=0):
            out = blockwise_attention(q, k, v, **kw)
            results.append((out, *blockwise_attention_backward(g, q, k, v, **kw)))
    for a, b in zip(*results, strict=True):
        assert grad_err(a, b) <= 2e-6


def test_compiled_pass_needs_numba_only_when_forced(monkeypatch):
    monkeypatch.setattr(bw, "fused_available", lambda: False)
    rng = np.random.default_rng(30)
    q, k, v, _ = attention_inputs(rng, (), 1, 1, 64, 64, 8, 8, np.float32)
    with bw.tuned(fused=None, fused_min_scores=0):  # auto: NumPy without numba
        plan = bw._plan(check_attention_args(q, k, v), None, None, None, 1)
    assert not plan.fused
    with bw.tuned(fused=False, fused_min_scores=0):
        plan = bw._plan(check_attention_args(q, k, v), None, None, None, 1)
    assert not plan.fused


# --------------------------------------------------------------------------- the machine


def test_tile_sizes_follow_the_l2_cache():
    def tiles(l2):
        t = bw.derive_tuning(CPUInfo("x", frozenset(), 32 * 1024, l2, 32 * 2**20, True))
        return t.block_q, t.block_k, t.forward_block_k

    assert tiles(512 * 1024) == (512, 512, 1024)
    assert tiles(1024 * 1024) == (512, 1024, 2048)
    assert tiles(2 * 2**20) == (512, 2048, 2048)
    assert tiles(8 * 2**20) == (512, 2048, 2048)  # clamped
    assert tiles(32 * 1024) == (512, 128, 128)
    with bw.tuned(block_k=48, min_scores_per_thread=0) as t:
        assert bw.tuning() is t and t.block_k == 48
    rng = np.random.default_rng(33)
    q = rng.standard_normal((1, 300, 8)).astype(np.float32)
    seen = []
    original = bw._forward_tile_numpy

    def spy(plan, *args):
        seen.append((plan.bk, plan.bk_forward))
        return original(plan, *args)

    bw._forward_tile_numpy = spy
    try:
        with bw.tuned(block_k=64, forward_block_k=128, fused=False):
            blockwise_attention(q, q, q)  # the tuning's two sizes
            blockwise_attention(q, q, q, block_k=32)  # one size given: both passes
    finally:
        bw._forward_tile_numpy = original
    assert seen[0] == (64, 128) and seen[-1] == (32, 32)
    assert bw.tuning() == bw._machine_tuning()


def test_cpu_description_from_the_os(tmp_path):
    for n, (level, kind, size) in enumerate([("1", "Data", "48K"), ("1", "Instruction", "32K"),
                                             ("2", "Unified", "2048K"), ("3", "Unified", "105M")]):
        d = tmp_path / f"index{n}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    assert _caches(tmp_path) == {"l1d": 48 * 1024, "l2": 2 * 2**20, "l3": 105 * 2**20}
    assert _caches(tmp_path / "missing") == {}
    model, flags = _cpuinfo("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f\n")
    info = CPUInfo(model, flags, 48 * 1024, 2 * 2**20, 105 * 2**20, True)
    assert info.avx2 and info.avx512f and "avx512f yes" in info.describe()


def test_dispatch_threshold_follows_the_l2_cache():
    rng = np.random.default_rng(31)
    q = rng.standard_normal((4, 512, 16)).astype(np.float32)  # 4 x 512^2 scores: 4 MiB
    spec = check_attention_args(q, q, q)
    small = CPUInfo("x", frozenset(), 32768, 512 * 1024, 2**25, True)
    huge = CPUInfo("x", frozenset(), 32768, 8 * 2**20, 2**25, True)
    with pinned_cpu(small):
        assert dispatch.use_blockwise(spec)
    with pinned_cpu(huge):
        assert not dispatch.use_blockwise(spec)  # the naive path's scores still fit in cache


def test_dispatch_threshold_is_lower_when_the_compiled_pass_runs(pin_cpu):
    rng = np.random.default_rng(32)
    q = rng.standard_normal((12, 200, 16)).astype(np.float32)  # 200^2 per head, 1.8 MiB in all
    spec = check_attention_args(q, q, q)
    # a 512 KiB L2 (the scores overflow twice the L2); on a 1 MiB-L2 CPU they would not
    pin_cpu(CPUInfo("x", frozenset(), 32768, 512 * 1024, 2**25, True))
    with bw.tuned(fused=True):
        assert dispatch.use_blockwise(spec)  # compiled pass: blockwise from 192^2 per head
    with bw.tuned(fused=False):
        assert not dispatch.use_blockwise(spec)  # NumPy pass: from 256^2
    with bw.tuned(fused=True):
        q64 = q.astype(np.float64)  # float64 has no compiled pass
        assert not dispatch.use_blockwise(check_attention_args(q64, q64, q64))


def _pooled_sum_in_child(conn):
    """A forked child's first pooled call (the parent's worker threads are not there)."""
    out = []
    threads_mod.run_units(range(8), lambda i, _s: out.append(i), 2)
    conn.send(sorted(out))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_works_in_a_forked_child():
    """The worker threads are kept between calls; a forked child starts its own instead of
    waiting forever on the parent's (which fork does not copy)."""
    import multiprocessing

    threads_mod.run_units(range(4), lambda i, _s: None, 2)  # the parent's workers exist
    assert threads_mod._EXECUTOR is not None
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_pooled_sum_in_child, args=(child,))
    p.start()
    got = parent.recv() if parent.poll(60) else None
    p.join(10)
    if p.is_alive():
        p.kill()
    assert got == list(range(8))


def test_scratch_buffers_outlive_a_call():
    """A kernel's per-thread buffers come back to its pool and the next call reuses them."""
    pool = threads_mod.ScratchPool()
    seen = []

    def unit(i, scratch):
        buf = scratch.setdefault("b", np.empty(16))
        seen.append(id(buf))

    threads_mod.run_units(range(2), unit, 1, scratch=pool)
    threads_mod.run_units(range(2), unit, 1, scratch=pool)
    assert len(set(seen)) == 1


# --------------------------------------------------------------------------- pooled products


@pytest.mark.parametrize(
    "M, K, N",
    [(2048, 64, 256), (512, 576, 1536), (100, 300, 4000), (9000, 40, 100), (64, 576, 192), (8, 64, 64)],
)
def test_matmul_equals_numpy(M, K, N):
    """attnlab._threads.matmul splits large products over the pool (by rows or by columns)
    and runs small ones as they are: the same numbers as one np.matmul in every case (each
    element is still one dot product over K)."""
    rng = np.random.default_rng(M + K + N)
    a = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    want = np.matmul(a, w.T)
    got = threads_mod.matmul(a, w.T)  # a transposed (F-ordered) right operand, as F.linear passes
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    assert got.shape == (M, N) and got.dtype == np.float32
    out = np.full((M, N), np.nan, dtype=np.float32)
    assert threads_mod.matmul(a, w.T, out=out) is out
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))


def test_large_products_run_on_the_pool_with_one_blas_thread(monkeypatch):
    """A product over POOL_MATMUL_MIN is split into one unit per thread, each run while BLAS
    is held to one thread (so BLAS's own threads never wake to spin beside the pool)."""
    calls = []
    real = threads_mod.run_units

    def spy(units, run_unit, threads, **kwargs):
        units = list(units)
        calls.append((len(units), threads))

        def checked(unit, scratch):
            assert threads_mod.BLAS_LIMITER.users >= 1
            run_unit(unit, scratch)

        return real(units, checked, threads, **kwargs)

    monkeypatch.setattr(threads_mod, "run_units", spy)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((512, 576), dtype=np.float32)
    b = rng.standard_normal((576, 1536), dtype=np.float32)
    with threads_mod_threads(2):
        threads_mod.matmul(a, b)
        assert calls == [(2, 2)]
        threads_mod.matmul(a[:8], b)  # 8 rows: a matrix-vector-like product, BLAS's way
        assert calls == [(2, 2)]
        w = rng.standard_normal((1536, 576), dtype=np.float32)
        x64 = rng.standard_normal((64, 576), dtype=np.float32)
        threads_mod.matmul(x64, w.T)  # 64 tokens (57M multiply-adds): BLAS's threads
        assert calls == [(2, 2)]
        g = rng.standard_normal((512, 1536), dtype=np.float32)
        got = threads_mod.matmul(g.T, a, tokens=512)  # a weight gradient over 512 tokens
        assert calls == [(2, 2), (2, 2)]
        np.testing.assert_allclose(got, g.T @ a, rtol=1e-4, atol=1e-3)
        threads_mod.matmul(g[:128].T, a[:128], tokens=128)  # over 128 tokens: BLAS's way
        assert calls == [(2, 2), (2, 2)]
    with threads_mod_threads(1):
        threads_mod.matmul(a, b)
        assert calls == [(2, 2), (2, 2)]


@pytest.mark.parametrize("M, K, N, tokens, one", [
    (512, 576, 8, None, True),    # x A^T: 512 tokens into rank 8
    (512, 8, 576, None, True),    # u B^T
    (8, 512, 576, 512, True),     # A's gradient, summed over 512 tokens
    (576, 512, 8, 512, True),     # B's gradient
    (1, 576, 1536, None, False),  # a decoding step's one token: BLAS's threads read the weight
    (8, 576, 1536, None, False),  # a few tokens, no thin side
    (512, 576, 64, None, False),  # no side under 32
])
def test_low_rank_products_hold_blas_to_one_thread(monkeypatch, M, K, N, tokens, one):
    """Products outside the pool that run many tokens through a side under 32 (a LoRA
    adapter's and its gradients) hold BLAS to one thread: on BLAS's own threads, their idle
    spin slowed the rest of a SmolLM2 LoRA forward pass 1.8 times. Others keep BLAS's
    threads. The numbers are np.matmul's."""
    held = []
    real = threads_mod.one_blas_thread

    @contextlib.contextmanager
    def spy():
        held.append(True)
        with real():
            yield

    monkeypatch.setattr(threads_mod, "one_blas_thread", spy)
    monkeypatch.setattr(threads_mod, "_pooled", lambda a, b, tokens: False)  # the pool's rule aside
    rng = np.random.default_rng(M + K + N)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    got = threads_mod.matmul(a, b, tokens=tokens)
    assert held == ([True] if one else [])
    np.testing.assert_array_equal(got, np.matmul(a, b))


def test_matmuls_share_one_pool_call_and_equal_each_product(monkeypatch):
    """matmuls runs independent large products (a layer's query, key and value input
    gradients) in one pool call, each split as matmul splits it: the same numbers, bit for
    bit, as a matmul per product; where one product is too small for the pool, each takes
    its own matmul (and none shares a pool call)."""
    calls = []
    real = threads_mod.run_units

    def spy(units, run_unit, threads, **kwargs):
        units = list(units)
        calls.append(len(units))
        return real(units, run_unit, threads, **kwargs)

    rng = np.random.default_rng(5)
    g = rng.standard_normal((512, 1536), dtype=np.float32)
    w = rng.standard_normal((1536, 512), dtype=np.float32)
    pairs = [(g[:, a:a + 512], w[a:a + 512]) for a in (0, 512, 1024)]
    with threads_mod_threads(2):
        want = [threads_mod.matmul(a, b) for a, b in pairs]
        monkeypatch.setattr(threads_mod, "run_units", spy)
        got = threads_mod.matmuls(pairs)
        assert calls == [6]  # three products, two parts each, one call
        for x, y, (a, b) in zip(got, want, pairs, strict=True):
            assert x.shape == (512, 512) and x.dtype == np.float32
            np.testing.assert_array_equal(x, y)
            np.testing.assert_allclose(x, a @ b, rtol=1e-4, atol=1e-3)
        calls.clear()
        small = (g[:64, :512], w[:512])  # 64 tokens: BLAS's threads
        got = threads_mod.matmuls([pairs[0], small])
        assert calls == [2]  # the large one alone on the pool
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], small[0] @ small[1], rtol=1e-4, atol=1e-3)
        assert threads_mod.matmuls([]) == []


def _layer_products(T, d):
    """The shapes of a transformer layer's products over ``T`` tokens, ``(a, b, tokens)``:
    its query/key/value, output and feed-forward projections, and gradients of the inputs
    and (tokens on the inner axis) of the weights."""
    return [((T, d), (d, 3 * d), None), ((T, d), (d, d), None), ((T, d), (d, 4 * d), None),
            ((T, 4 * d), (4 * d, d), None), ((T, 3 * d), (3 * d, d), T), ((3 * d, T), (T, d), T),
            ((4 * d, T), (T, d), T), ((d, T), (T, 4 * d), T)]


@pytest.fixture
def pool_rule(monkeypatch):
    """matmul's pool rule on a quiet machine with a pinned threshold (2^24: the host's
    measured one decides nothing here) and no product split before."""
    monkeypatch.setattr(threads_mod, "pool_matmul_min", lambda: 2**24)
    monkeypatch.setattr(threads_mod, "_WATCH", {"busy": False, "seen": True, "at": -float("inf")})
    monkeypatch.setattr(threads_mod, "_SPLIT_AT", [-float("inf")])
    with threads_mod_threads(2):
        yield lambda a, b, tokens=None: threads_mod._pooled(np.empty(a, np.float32), np.empty(b, np.float32), tokens)


def test_a_layers_products_take_one_side_by_its_width(pool_rule):
    """matmul counts a product as its layer's smallest, tokens x width^2 (``width`` the
    narrower of its two sides beside the token axis), so that all of a layer's products and
    their gradients take one side: a 96-wide layer over 1280 tokens (11.8M) keeps BLAS's
    threads for every one (by each product's own multiply-adds its query/key/value
    projection, 35M, went to the pool and its output projection, 12M, to BLAS's threads,
    whose spin then slowed the pool's); a 128-wide one (21M) splits them all; over 255
    tokens none is split."""
    for shapes in _layer_products(1280, 96) + _layer_products(255, 512):
        assert not pool_rule(*shapes), shapes
    assert all(pool_rule(*shapes) for shapes in _layer_products(1280, 128))


def test_products_beside_a_split_one_split_too(pool_rule, monkeypatch):
    """For POOL_SPAN seconds after a product split by its size, every product over as many
    tokens is split too (one on BLAS's threads would leave them spinning beside the pool),
    but a low-rank adapter's (a side under 32) and one too small to cut in two; after that,
    the size decides again. The numbers are np.matmul's (to float32 rounding)."""
    head = ((1280, 192), (192, 40))  # a small vocabulary's output layer: 2M by its width
    assert not pool_rule(*head)
    before = time.monotonic()
    assert pool_rule(*_layer_products(1280, 192)[0])
    assert threads_mod._SPLIT_AT[0] >= before
    threads_mod._SPLIT_AT[0] = time.monotonic() + 3600  # split just now, however slow this machine runs the rest
    assert pool_rule(*head) and pool_rule((40, 1280), (1280, 192), 1280) and pool_rule((1280, 40), (40, 192))
    assert not pool_rule((1280, 192), (192, 8))  # a rank-8 adapter: one BLAS thread (_skinny)
    assert not pool_rule((40, 1280), (1280, 48), 1280)  # 40 x 48: no two parts of 32 rows
    assert not pool_rule((255, 192), (192, 40))  # fewer tokens
    calls = []
    real = threads_mod.run_units
    monkeypatch.setattr(threads_mod, "run_units", lambda units, *a, **kw: calls.append(1) or real(units, *a, **kw))
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((1280, 192), dtype=np.float32), rng.standard_normal((192, 40), dtype=np.float32)
    np.testing.assert_allclose(threads_mod.matmul(a, b), np.matmul(a, b), rtol=1e-5, atol=1e-5 * np.sqrt(192))
    assert calls == [1]
    threads_mod._SPLIT_AT[0] = time.monotonic() - 2 * threads_mod.POOL_SPAN
    assert not pool_rule(*head)


@contextlib.contextmanager
def threads_mod_threads(n):
    old = threads_mod._num_threads
    threads_mod.set_num_threads(n)
    try:
        yield
    finally:
        threads_mod._num_threads = old


def test_blas_limiter_restores_the_thread_count():
    """NumPy's BLAS is held to one thread from the first acquire to the last release, then
    set back (the limiter's libraries: those loaded when it was first used, NumPy's among
    them)."""
    from threadpoolctl import threadpool_info

    def numpy_blas():
        return [i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas" and "numpy" in i["filepath"]]

    libs = threads_mod.BLAS_LIMITER._blas().lib_controllers
    before, mine = numpy_blas(), [lib.get_num_threads() for lib in libs]
    threads_mod.BLAS_LIMITER.acquire()
    threads_mod.BLAS_LIMITER.acquire()
    inside, inside_mine = numpy_blas(), [lib.get_num_threads() for lib in libs]
    threads_mod.BLAS_LIMITER.release()
    still = numpy_blas()
    threads_mod.BLAS_LIMITER.release()
    assert before and inside == [1] * len(before) and still == inside
    assert inside_mine == [1] * len(libs)
    assert numpy_blas() == before and [lib.get_num_threads() for lib in libs] == mine


@pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_weight", [True, False])
def test_layer_norm_backward_compiled_equals_numpy(dtype, with_weight, monkeypatch):
    """LayerNorm's backward in one compiled pass per row gives NumPy's eight-pass numbers."""
    from attnlab.core import _fused
    from attnlab.nn import functional as F

    rng = np.random.default_rng(31)
    x = rng.standard_normal((4, 512, 64)).astype(dtype) * 3 + 1
    w = rng.standard_normal(64).astype(dtype) if with_weight else None
    g = rng.standard_normal((4, 512, 64)).astype(dtype)
    _, x_hat, rstd = F.layer_norm(x, w, None, 1e-5)
    calls = []
    real = _fused.layer_norm_backward
    monkeypatch.setattr(_fused, "layer_norm_backward", lambda *a: calls.append(1) or real(*a))
    got = F.layer_norm_backward(g, x_hat, rstd, w)
    assert calls == [1]
    with kernel_tuning(False):
        want = F.layer_norm_backward(g, x_hat, rstd, w)
    assert calls == [1]  # turned off: NumPy's passes
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())


@pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_compiled_equals_numpy_and_torch(dtype):
    """LayerNorm's forward in one compiled pass per row: NumPy's numbers (within rounding),
    torch's, and the same with and without x_hat (training and eval give equal outputs)."""
    torch = pytest.importorskip("torch")
    from attnlab.nn import LayerNorm
    from attnlab.nn import functional as F

    rng = np.random.default_rng(32)
    x = (rng.standard_normal((3, 700, 96)) * 4 + 2).astype(dtype)
    w, b = rng.standard_normal(96).astype(dtype), rng.standard_normal(96).astype(dtype)
    y, x_hat, rstd = F.layer_norm(x, w, b, 1e-5)
    with kernel_tuning(False):
        y_np, x_hat_np, rstd_np = F.layer_norm(x, w, b, 1e-5)
    tol = 3e-6 if dtype == np.float32 else 1e-13
    for got, want in ((y, y_np), (x_hat, x_hat_np), (rstd, rstd_np)):
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (96,), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    np.testing.assert_allclose(y, ref.numpy(), rtol=tol, atol=tol * 10)
    y_eval, none, _ = F.layer_norm(x, w, b, 1e-5, keep_x_hat=False)
    assert none is None
    np.testing.assert_array_equal(y_eval, y)
    layer = LayerNorm(96, dtype=dtype)
    layer.weight.data[...], layer.bias.data[...] = w, b
    want = layer(x)
    layer.eval()
    np.testing.assert_array_equal(layer(x), want)


_TWO_CPUS = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs two CPUs and Linux's affinity calls")


@pytest.fixture
def pinning(monkeypatch):
    """The pool keeps its threads apart (the default; ATTNLAB_PIN_THREADS=0 turns it off)."""
    monkeypatch.setattr(threads_mod, "_PIN", [True])


def test_pool_keeps_its_threads_apart_unless_told_not_to(monkeypatch):
    for value, want in ((None, True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setattr(threads_mod, "_PIN", [])
        if value is None:
            monkeypatch.delenv("ATTNLAB_PIN_THREADS", raising=False)
        else:
            monkeypatch.setenv("ATTNLAB_PIN_THREADS", value)
        assert threads_mod._pinning() is want, value


@_TWO_CPUS
def test_pool_pins_nothing_when_told_not_to(monkeypatch):
    """With ATTNLAB_PIN_THREADS=0 no thread of the pool is held on a CPU: the caller and
    the workers keep the whole mask."""
    import threading
    import time

    monkeypatch.setattr(threads_mod, "_PIN", [])
    monkeypatch.setenv("ATTNLAB_PIN_THREADS", "0")
    before = frozenset(os.sched_getaffinity(0))
    for tid in threads_mod._WORKER_TIDS:  # as in a process started so: earlier tests' calls kept workers apart
        with contextlib.suppress(OSError):  # a worker of an earlier pool, gone
            os.sched_setaffinity(tid, before)
    threads_mod._WORKERS_OFF[0] = None  # and said so, for the calls of later tests (not restored: it is true)
    seen, unit = _affinity_recorder()
    with threads_mod_threads(2):
        for _ in range(2):
            threads_mod._LAST_POOL_END[0] = -float("inf")  # after a pause (held, where pinning)
            threads_mod.run_units(range(6), unit, 2)
            time.sleep(2 * threads_mod._HOLD_AFTER_IDLE)
    assert {mask for _, mask in seen} == {before}
    assert len({tid for tid, _ in seen}) >= 2 and threading.get_native_id() in {tid for tid, _ in seen}


def test_a_call_does_not_wait_for_a_worker_that_has_not_started():
    """A worker the system gives no core (here: busy with another task) takes no unit, and
    the call does not wait for it: the caller runs every unit."""
    import threading

    gate = threading.Event()
    safety = threading.Timer(30, gate.set)  # a pool that waited would fail below, not hang
    safety.start()
    with threads_mod_threads(2):
        ex = threads_mod._executor(1)
        blocker = ex.submit(gate.wait)  # the only worker is busy until the gate opens
        try:
            ran = []
            threads_mod.run_units(range(5), lambda i, _s: ran.append((i, threading.get_native_id())), 2)
            assert sorted(i for i, _ in ran) == list(range(5))
            assert {tid for _, tid in ran} == {threading.get_native_id()}
            assert not blocker.done()
        finally:
            gate.set()
            safety.cancel()
            blocker.result()


def test_a_failing_unit_stops_the_call_and_raises():
    ran = []

    def unit(i, _scratch):
        if i == 3:
            raise KeyError(i)
        ran.append(i)

    with threads_mod_threads(2), pytest.raises(KeyError):
        threads_mod.run_units(range(100), unit, 2)
    assert 3 not in ran and len(ran) < 99
    with pytest.raises(KeyError):
        threads_mod.run_units(range(10), unit, 1)


def _affinity_recorder():
    """``(seen, unit)``: a pool unit that records ``(thread id, CPU mask)`` into ``seen``
    and sleeps long enough that the worker takes units too."""
    import threading
    import time

    seen = []

    def unit(i, _scratch):
        seen.append((threading.get_native_id(), frozenset(os.sched_getaffinity(0))))
        time.sleep(0.02)

    return seen, unit


@_TWO_CPUS
def test_pool_keeps_caller_and_workers_on_different_cpus(pinning):
    """During a pool call after a pause the caller stays on its CPU and the workers run
    elsewhere (after idling, Linux would otherwise wake them onto one CPU); the caller's
    mask comes back. A call that follows another closely leaves the caller's mask alone."""
    import threading
    import time

    before = os.sched_getaffinity(0)
    caller = threading.get_native_id()
    seen, unit = _affinity_recorder()
    with threads_mod_threads(2):
        threads_mod.run_units(range(8), unit, 2)
        time.sleep(2 * threads_mod._HOLD_AFTER_IDLE)
        threads_mod.run_units(range(8), unit, 2)  # the workers exist now: they are kept apart
        threads_mod.run_units(range(8), unit, 2)  # right after the last: not held
    assert os.sched_getaffinity(0) == before
    mine = {mask for tid, mask in seen[8:16] if tid == caller}
    theirs = {mask for tid, mask in seen[8:16] if tid != caller}
    assert len(mine) == 1 and len(next(iter(mine))) == 1
    assert theirs, "the worker took no unit"
    (cpu,) = next(iter(mine))
    assert all(cpu not in mask for mask in theirs)
    assert {mask for tid, mask in seen[16:] if tid == caller} == {frozenset(before)}


@_TWO_CPUS
def test_a_new_worker_does_not_keep_the_held_callers_cpu(pinning):
    """The pool's first call creates its worker while it holds the caller on one CPU; the
    worker must not inherit that mask (a new thread takes its creator's): the next call,
    close behind, runs it on another CPU than the caller's."""
    import threading

    before = os.sched_getaffinity(0)
    caller = threading.get_native_id()
    seen, unit = _affinity_recorder()
    old = threads_mod._EXECUTOR
    if old is not None:
        old.shutdown(wait=True)
    threads_mod._forget_executor()  # a fresh pool, as in a new process
    assert threads_mod._allowed_cpus() == before  # looked up before the caller is pinned
    cpu = min(before)
    try:
        os.sched_setaffinity(0, {cpu})  # the caller stays on one CPU throughout
        with threads_mod_threads(2):
            threads_mod._LAST_POOL_END[0] = -float("inf")  # after a pause: held
            threads_mod.run_units(range(4), unit, 2)  # creates the worker
            seen.clear()
            threads_mod.run_units(range(8), unit, 2)  # close behind: not held
    finally:
        os.sched_setaffinity(0, before)
    workers = {mask for tid, mask in seen if tid != caller}
    assert workers, "the worker took no unit"
    assert all(cpu not in mask for mask in workers)


@_TWO_CPUS
def test_pool_moves_workers_off_the_callers_new_cpu(pinning):
    """Workers held off one CPU do not stay there when the caller has since moved onto
    their CPU: a call that follows closely (so the caller is not held) still runs them
    elsewhere, and leaves the caller's mask as it was."""
    import threading
    import time

    before = os.sched_getaffinity(0)
    caller = threading.get_native_id()
    seen, unit = _affinity_recorder()
    try:
        with threads_mod_threads(2):
            threads_mod.run_units(range(4), unit, 2)  # the workers exist now
            time.sleep(2 * threads_mod._HOLD_AFTER_IDLE)
            threads_mod.run_units(range(4), unit, 2)  # held: the workers are kept off the caller's CPU
            off = threads_mod._WORKERS_OFF[0]
            theirs = next(mask for tid, mask in seen[4:] if tid != caller)
            assert off is not None and off not in theirs
            moved_to = min(theirs)  # one of the workers' CPUs: the caller goes there
            os.sched_setaffinity(0, {moved_to})
            threads_mod._LAST_POOL_END[0] = time.monotonic()  # the next call follows closely: not held
            seen.clear()
            threads_mod.run_units(range(8), unit, 2)
            assert os.sched_getaffinity(0) == {moved_to}  # a close call does not touch the caller's mask
    finally:
        os.sched_setaffinity(0, before)
    workers = {mask for tid, mask in seen if tid != caller}
    assert workers, "the worker took no unit"
    assert all(moved_to not in mask for mask in workers)
    assert threads_mod._WORKERS_OFF[0] == moved_to


# ------------------------------------------------------- a self-attention layer in one call


def _layer_grads(layer):
    return [p.grad.copy() for p in layer.parameters()]


@pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")
@pytest.mark.parametrize("case", ["mha batch first", "mha sequence first causal", "mha unbatched",
                                  "mha blocks of rows", "attention causal, no bias", "attention causal, cache"])
def test_a_self_attention_layer_runs_in_one_pool_call_with_the_usual_numbers(monkeypatch, case):
    """One sequence through a plain self-attention layer in eval mode (no mask but a causal
    one, no weights wanted, no hooks): the projections and the attention run in one pool
    call (core.rows.self_attention), with the output of the usual path (three pool calls);
    with an empty cache, the cached keys and values serve the next token as the usual
    path's do. In training mode the call keeps what backward needs: the usual path, with
    the same output."""
    import attnlab
    from attnlab.nn.attention import Attention, KVCache

    rng = np.random.default_rng(41)
    E, H = 512, 8
    L = rows.max_keys() if case == "mha blocks of rows" else 256  # longer: each head's rows in blocks
    if case.startswith("mha"):
        layer = attnlab.MultiheadAttention(E, H, batch_first=case != "mha sequence first causal",
                                           rng=np.random.default_rng(0))
        shape = {"mha sequence first causal": (L, 1, E), "mha unbatched": (L, E)}.get(case, (1, L, E))
        causal = "causal" in case

        def call(x):
            return layer(x, x, x, need_weights=False, is_causal=causal)[0]

        def after(g):
            if layer.training:
                return (sum(layer.backward(g)), *_layer_grads(layer))
            return ()
    else:
        layer = Attention(E, H, bias=case.endswith("cache"), causal=True, rng=np.random.default_rng(0))
        shape = (1, L, E)
        cache = KVCache() if case.endswith("cache") else None

        def call(x):
            if cache is not None:
                cache.reset()
            return layer(x, cache=cache)

        def after(g):
            if cache is None:
                return (layer.backward(g), *_layer_grads(layer)) if layer.training else ()
            assert len(cache) == L
            return (layer(g[:, :1], cache=cache),)  # the next token reads the cached keys and values
    for p in layer.parameters():  # biases that are not zero, so a lost bias shows
        p.data[...] = rng.standard_normal(p.data.shape, dtype=np.float32) * (0.05 if p.data.ndim == 2 else 1.0)
    x = rng.standard_normal(shape, dtype=np.float32)
    g = rng.standard_normal(shape, dtype=np.float32)
    pool_calls = []
    real_run_units = rows.run_units

    def spy(units, run_unit, threads, **kwargs):
        pool_calls.append(threads)
        return real_run_units(units, run_unit, threads, **kwargs)

    results = []
    one_calls = []
    real_one_call = rows.self_attention
    monkeypatch.setattr(rows, "self_attention", lambda *a, **k: one_calls.append(1) or real_one_call(*a, **k))
    with threads_mod_threads(2):
        for one_call in (True, False):
            layer.train(not one_call)  # training mode keeps what backward needs: the usual path
            monkeypatch.setattr(rows, "run_units", spy)
            layer.zero_grad()
            out = call(x)
            monkeypatch.setattr(rows, "run_units", real_run_units)
            if one_call:
                assert pool_calls == [2] and one_calls == [1]  # the whole forward pass: one call, on two threads
            results.append((out, *after(g)))
    assert one_calls == [1]
    assert len(pool_calls) == 2  # the usual path's attention kernel (its products: matmul's pool)
    assert results[0][0].shape == shape
    for a, b in zip(results[0], results[1], strict=False):  # the output (and the next token's)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")
def test_a_self_attention_layer_takes_the_usual_path_where_a_step_is_needed_apart(monkeypatch):
    """Weights wanted, a mask, a hook on the heads, several sequences, a short sequence, a
    cache that already holds keys, positions of the wrong shape, a rotary slot, or one
    thread: the usual path. Positions without a rotary slot (what a decoder's blocks pass)
    do not stop the one call."""
    import attnlab
    from attnlab.nn import RotaryEmbedding
    from attnlab.nn.attention import Attention, KVCache

    calls = []
    real = rows.self_attention
    monkeypatch.setattr(rows, "self_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(42)
    mha = attnlab.MultiheadAttention(512, 8, batch_first=True, rng=np.random.default_rng(0))
    x = rng.standard_normal((1, 256, 512), dtype=np.float32)
    with threads_mod_threads(2):
        mha(x, x, x, need_weights=False)  # training mode (a new layer's): what backward needs is kept
        assert calls == []
        mha.eval()
        mha(x, x, x, need_weights=False)
        assert calls == [1]  # the plain inference call takes it
        mha(x, x, x)  # weights wanted
        mha(x, x, x, need_weights=False, attn_mask=np.ones((256, 256), bool))
        mha(x, x, x, need_weights=False, key_padding_mask=np.ones((1, 256), bool))
        x2 = rng.standard_normal((2, 256, 512), dtype=np.float32)
        mha(x2, x2, x2, need_weights=False)  # two sequences
        mha(x[:, :128], x[:, :128], x[:, :128], need_weights=False)  # too few tokens for the pool
        y = x.copy()
        mha(x, y, y, need_weights=False)  # cross-attention inputs
        with mha.hooks([("hook_z", lambda a, name: None)]):
            mha(x, x, x, need_weights=False)
        with mha.hooks(bwd_hooks=[("hook_z", lambda g, name: None)]):
            mha(x, x, x, need_weights=False)  # a backward hook: the call is differentiated
        att = Attention(512, 8, causal=True, rng=np.random.default_rng(0)).eval()
        cache = KVCache()
        att(x[:, :8], cache=cache)
        att(x, cache=cache)  # keys already cached
        with pytest.raises(ValueError, match="positions"):  # checked as the usual path checks them
            att(x, positions=np.arange(255))
        rotary = Attention(512, 8, causal=True, rotary=RotaryEmbedding(64), rng=np.random.default_rng(0)).eval()
        rotary(x, positions=np.arange(256))  # the rotary slot needs the steps apart
        assert calls == [1]
        att(x, positions=np.arange(256))  # without a rotary slot positions change nothing: a decoder's blocks
        assert calls == [1, 1]
    with threads_mod_threads(1):
        mha(x, x, x, need_weights=False)
    assert calls == [1, 1]


@pytest.mark.skipif(not bw.fused_available(), reason="numba (the fast extra) is not installed")
def test_the_one_call_layer_lets_inf_and_nan_through_as_the_usual_path_does(monkeypatch):
    """Out-projection weights near float32's limit: the groups' partial outputs hold +-inf,
    and their sum inf - inf; no RuntimeWarning (the suite makes attnlab's warnings errors),
    and the usual path's NaNs and infinities, value for value."""
    import attnlab

    layer = attnlab.MultiheadAttention(512, 8, batch_first=True, rng=np.random.default_rng(0))
    layer.out_proj.weight.data[...] = 3e38
    x = np.random.default_rng(44).standard_normal((1, 256, 512), dtype=np.float32)
    with threads_mod_threads(2):
        got = layer(x, x, x, need_weights=False)[0]
        monkeypatch.setattr(rows, "self_attention_threads", lambda *a: 0)
        want = layer(x, x, x, need_weights=False)[0]
    assert np.isnan(got).any() and np.isinf(got).any()
    np.testing.assert_array_equal(got, want)  # NaN where NaN, the same infinities


def test_a_few_rows_times_a_weights_transpose_run_weight_first():
    """x @ W.T for 2 to 64 float32 rows and a C-contiguous weight with both sides at least
    256 runs as (W @ x.T).T (the faster order for OpenBLAS at few rows), copied into a
    C-contiguous result equal to NumPy's product; other products are NumPy's."""
    rng = np.random.default_rng(43)
    w = rng.standard_normal((960, 576), dtype=np.float32)
    for m in (2, 17, 64):
        x = rng.standard_normal((m, 576), dtype=np.float32)
        assert threads_mod._weight_first(x, w.T)
        for out in (None, np.empty((m, 960), np.float32)):
            got = threads_mod.matmul(x, w.T, out=out)
            assert got.shape == (m, 960) and got.flags.c_contiguous and (out is None or got is out)
            np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-4)
    x = rng.standard_normal((64, 576), dtype=np.float32)
    assert not threads_mod._weight_first(x[:1], w.T)  # one row: a matrix-vector product
    assert not threads_mod._weight_first(rng.standard_normal((65, 576), dtype=np.float32), w.T)
    assert not threads_mod._weight_first(x, np.ascontiguousarray(w.T))  # already the fast order
    assert not threads_mod._weight_first(x[:, :200], w[:, :200].T.copy(order="F"))  # a side under 256
    assert not threads_mod._weight_first(x.astype(np.float64), w.T.astype(np.float64))
    assert not threads_mod._weight_first(np.asfortranarray(x), w.T)
    # a projection of a short prompt goes this way, with NumPy's numbers
    np.testing.assert_allclose(F.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------- a repeated step's thread count


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _steps(chooser, clock, n, seconds, *, generation=False):
    """Run ``n`` steps; ``seconds(k)`` is how long a step takes on ``k`` threads. The
    thread counts used, in order. ``generation``: the first is a generation's first step."""
    used = []
    for i in range(n):
        with chooser.step(first=generation and i == 0) as k:
            clock.now += seconds(k)
            used.append(k)
        clock.now += 0.001  # the caller's work between two steps
    return used


@pytest.fixture
def adapting(monkeypatch):
    """attnlab decides by what it sees of the machine (the suite turns that off: ATTNLAB_TUNE=off)."""
    monkeypatch.setattr(threads_mod, "_adapts", lambda: True)


def test_step_threads_keep_all_threads_on_a_quiet_machine(adapting):
    clock = _FakeClock()
    chooser = threads_mod.StepThreads(clock=clock, taken=lambda: False)
    with threads_mod_threads(2):
        used = _steps(chooser, clock, 600, lambda k: 0.010 if k == 2 else 0.016)
    probes = sum(k == 1 for k in used)
    assert used[:2] == [2, 2] and not chooser.one_thread
    assert 0 < probes <= 6 * threads_mod.StepThreads.PROBE_STEPS  # probes back off: 2, 32, 64, 128, 256, 512


def test_step_threads_do_not_count_the_first_step_after_a_pause(adapting):
    """A generation's first step pays for what came before it (a long prompt's leftovers):
    slow as it is, it must not make one thread look faster than all."""
    clock = _FakeClock()
    chooser = threads_mod.StepThreads(clock=clock, taken=lambda: False)
    first = [True]

    def seconds(k):
        if first[0]:
            first[0] = False
            return 0.050
        return 0.010 if k == 2 else 0.016

    with threads_mod_threads(2):
        for _ in range(3):  # three generations, a pause before each
            first[0] = True
            used = _steps(chooser, clock, 20, seconds)
            assert not chooser.one_thread and used[-10:] == [2] * 10
            clock.now += 2 * threads_mod.StepThreads.PAUSE


@pytest.mark.parametrize("gap", [0.1, 2.0], ids=["prompt-of-a-tenth", "pause"])
def test_step_threads_compare_the_steps_of_one_generation_only(adapting, gap):
    """Generations of two models in turns (a float32 model's slow steps, then a quantized
    one's fast steps; two threads the faster for both), each after a prompt of ``gap``
    seconds: a probe of one thread compares with its own generation's steps. Compared with
    the slow model's steps, the fast model's one-thread probe looked faster, and it ran on
    one thread until the next probe."""
    clock = _FakeClock()
    chooser = threads_mod.StepThreads(clock=clock, taken=lambda: False)
    slow = {2: 0.019, 1: 0.025}
    fast = {2: 0.009, 1: 0.014}
    with threads_mod_threads(2):
        for _ in range(4):
            for times in (slow, fast):
                used = _steps(chooser, clock, 64, times.__getitem__, generation=True)
                assert used.count(1) <= threads_mod.StepThreads.PROBE_STEPS, used
                assert not chooser.one_thread
                clock.now += gap


def test_step_threads_go_to_one_thread_when_the_cores_are_taken(adapting):
    """Other processes hold the cores from the start: one thread from the first step, and
    no probe of two threads while that lasts; once they are gone, two threads again."""
    clock, busy = _FakeClock(), [3]
    chooser = threads_mod.StepThreads(clock=clock, taken=lambda: busy[0] > 0)

    def seconds(k):
        return 0.016 if k == 1 else (0.5 if busy[0] else 0.010)  # two threads on taken cores: a stall

    with threads_mod_threads(2):
        used = _steps(chooser, clock, 300, seconds)
        assert used == [1] * 300 and chooser.one_thread
        busy[0] = 0
        used = _steps(chooser, clock, 1200, seconds)
    assert used[-10:] == [2] * 10 and not chooser.one_thread


def test_step_threads_leave_two_threads_when_a_load_arrives(adapting):
    """A load that arrives while the steps run on two threads slows them down: a probe of
    one thread follows at once and wins."""
    clock, load = _FakeClock(), [False]
    chooser = threads_mod.StepThreads(clock=clock, taken=lambda: False)  # the load is not seen: only timed

    def seconds(k):
        return (0.016 if k == 1 else 0.2) if load[0] else (0.016 if k == 1 else 0.010)

    with threads_mod_threads(2):
        _steps(chooser, clock, 200, seconds)
        assert not chooser.one_thread
        load[0] = True
        used = _steps(chooser, clock, 20, seconds)
    assert chooser.one_thread and used.count(2) <= 4 and used[-5:] == [1] * 5


def test_a_one_thread_step_holds_blas_and_the_pools_to_one_thread(adapting):
    clock = _FakeClock()
    chooser = threads_mod.StepThreads(clock=clock, taken=lambda: True)
    with threads_mod_threads(2), chooser.step() as k:
        assert k == 1 and threads_mod.get_num_threads() == 1
        assert threads_mod.BLAS_LIMITER.users >= 1
    assert threads_mod.get_num_threads() == 2


def test_a_busy_machine_holds_blas_to_one_thread_and_the_pools_to_the_caller(monkeypatch, adapting):
    """Other processes on the cores (more than half a core beyond what the extra threads
    leave), at two looks in a row: BLAS on one thread and every pool call on its caller;
    the first look that finds the cores free again lets both go."""
    import threading

    others, now = [0], [100.0]
    monkeypatch.setattr(threads_mod, "_other_cores", lambda: others[0])
    monkeypatch.setattr(threads_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(threads_mod, "_WATCH", {"busy": False, "seen": False, "at": -float("inf")})
    users = threads_mod.BLAS_LIMITER.users

    def look(n_others):
        others[0] = n_others
        now[0] += 2 * threads_mod.BUSY_CHECK_SECONDS
        return threads_mod.watch_the_machine()

    def who_runs():
        tids = set()
        threads_mod.run_units(range(8), lambda i, _s: tids.add(threading.get_native_id()), 2)
        return tids

    with threads_mod_threads(2):
        assert not look(0) and not look(1.6)  # one look is not a load
        assert not look(0.4)  # nor is less than half a core
        assert not look(1.6) and look(1.6) and threads_mod.BLAS_LIMITER.users == users + 1
        now[0] += threads_mod.BUSY_CHECK_SECONDS / 10  # too soon to look again: still busy
        assert who_runs() == {threading.get_native_id()}
        a = np.ones((512, 4096), np.float32)
        assert not threads_mod._pooled(a, a.T, None)
        assert not look(0) and threads_mod.BLAS_LIMITER.users == users
        now[0] -= threads_mod.BUSY_CHECK_SECONDS  # (no new look within the next calls)
        assert threads_mod._pooled(a, a.T, None)


def test_with_tune_off_nothing_follows_the_load(monkeypatch):
    """ATTNLAB_TUNE=off (the suite's setting): no watch, and every decoding step on all threads."""
    monkeypatch.setattr(threads_mod, "_other_cores", lambda: 99)
    monkeypatch.setattr(threads_mod, "_WATCH", {"busy": False, "seen": True, "at": -float("inf")})
    assert not threads_mod._adapts()
    assert not threads_mod.watch_the_machine()
    chooser = threads_mod.StepThreads(taken=lambda: True)
    with threads_mod_threads(2):
        assert all(_steps(chooser, _FakeClock(), 10, lambda k: 1.0 if k == 2 else 0.1) == [2] * 10 for _ in range(1))


def test_the_watch_lets_blas_go_when_turned_off(monkeypatch):
    """A watch that held BLAS when the choice was turned off (ATTNLAB_TUNE=off) lets it go at
    its next call, instead of holding it for good."""
    users = threads_mod.BLAS_LIMITER.users
    monkeypatch.setattr(threads_mod, "_WATCH", {"busy": False, "seen": True, "at": -float("inf")})
    monkeypatch.setattr(threads_mod, "_other_cores", lambda: 99)
    with threads_mod_threads(2):
        monkeypatch.setattr(threads_mod, "_adapts", lambda: True)
        assert threads_mod.watch_the_machine() and threads_mod.BLAS_LIMITER.users == users + 1
        monkeypatch.setattr(threads_mod, "_adapts", lambda: False)
        assert not threads_mod.watch_the_machine() and threads_mod.BLAS_LIMITER.users == users


def test_other_processes_cores_from_the_busy_time_of_this_process_cpus(monkeypatch):
    """/proc/stat's busy ticks on this process's CPUs, less its own CPU time, over the wall
    time: here 1.5 cores busy in 0.1 s, 0.05 s of it this process's own."""
    real = threads_mod._cpu_ticks({0})
    assert real is None or (set(real) == {0} and 0 <= real[0][0] <= real[0][1])
    samples = iter([(10.0, 1.00, {0: (100, 1000), 1: (200, 1000)}), (10.1, 1.05, {0: (110, 1010), 1: (210, 1010)})])
    monkeypatch.setattr(threads_mod, "_LAST_SAMPLE", [])
    monkeypatch.setattr(threads_mod, "_allowed_cpus", lambda: {0, 1})

    def fake_sample():
        now, mine, ticks = next(samples)
        monkeypatch.setattr(threads_mod.time, "monotonic", lambda: now)
        monkeypatch.setattr(threads_mod.time, "process_time", lambda: mine)
        return ticks

    first = fake_sample()
    monkeypatch.setattr(threads_mod, "_cpu_ticks", lambda cpus: first)
    assert threads_mod._other_cores() is None  # nothing to compare with yet
    second = fake_sample()
    monkeypatch.setattr(threads_mod, "_cpu_ticks", lambda cpus: second)
    assert threads_mod._other_cores() == pytest.approx((20 * 0.01 - 0.05) / 0.1)
