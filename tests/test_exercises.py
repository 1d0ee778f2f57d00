"""The course's exercises (attnlab.exercises): every solution passes, typical wrong answers
(written here as a learner would write them) fail with the mistake named, a learner's
faults are reported as the learner's, and a function plugged into SmolLM2 keeps or loses
its answer "Paris"."""

from __future__ import annotations

import inspect
import time

import numpy as np
import pytest

from attnlab.exercises import check, names, solution, task
from attnlab.exercises import solutions as sol


def _fails(name, fn, *needles, **kw):
    r = check(name, fn, model=False, **kw)
    assert not r.passed
    text = str(r)
    for needle in needles:
        assert needle in text, text
    return r


@pytest.mark.parametrize("name", names())
def test_every_solution_passes(name):
    r = check(name, solution(name), model=False)
    assert r.passed, str(r)
    assert r.cases == r.total >= 4
    assert r.failure is None and "passed" in str(r)


def test_the_exercises_are_the_course_ideas():
    assert names() == ["softmax", "scaled_dot_product_attention", "causal_mask", "split_heads", "merge_heads",
                       "multi_head_attention", "cross_attention", "apply_rotary", "grouped_query_attention",
                       "cached_attention", "online_softmax_attention"]
    for n in names():
        doc = task(n).__doc__
        assert "Exercise" in doc and "Returns:" in doc and "Args:" in doc, n
        required = [p for p in inspect.signature(task(n)).parameters.values() if p.default is p.empty]
        with pytest.raises(NotImplementedError, match="write it yourself"):
            task(n)(*([None] * len(required)))
    for n in ("scaled_dot_product_attention", "causal_mask", "multi_head_attention", "grouped_query_attention"):
        assert "True" in task(n).__doc__  # the mask convention is stated
    assert "(out, in)" in task("multi_head_attention").__doc__  # the weight layout
    with pytest.raises(ValueError, match="no exercise 'softmx'; the exercises are softmax"):
        check("softmx", sol.softmax)
    with pytest.raises(TypeError, match="fn must be your function"):
        check("softmax", "not a function")


# ---- typical wrong answers, as a learner writes them -------------------------------------------
def softmax_no_max(x, axis=-1):
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def softmax_axis0(x, axis=-1):
    e = np.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)


def softmax_last_axis(x, axis=-1):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_whole(x, axis=-1):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("fn, mistake", [
    (softmax_no_max, "the largest score is not subtracted"),
    (softmax_axis0, "softmax over the wrong axis"),
    (softmax_last_axis, "the `axis` argument is ignored"),
    (softmax_whole, "normalized over the whole array"),
])
def test_softmax_mistakes(fn, mistake):
    r = _fails("softmax", fn, mistake, "case ")
    assert r.mistake.startswith(mistake)


def sdpa_no_scale(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return sol.softmax(s) @ v


def sdpa_queries_axis(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    return sol.softmax(s, axis=-2) @ v


def sdpa_torch_mask(q, k, v, mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, -np.inf, s)  # True = hidden, as torch's MultiheadAttention
    return sol.softmax(s) @ v


def sdpa_mask_after(q, k, v, mask=None):
    w = sol.softmax(q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]))
    return (w if mask is None else w * mask) @ v


@pytest.mark.parametrize("fn, mistake", [
    (sdpa_no_scale, "the scores are not scaled"),
    (sdpa_queries_axis, "softmax over the wrong axis"),
    (sdpa_torch_mask, "the mask is read the wrong way round"),
    (sdpa_mask_after, "the mask is applied after the softmax"),
])
def test_attention_mistakes(fn, mistake):
    r = _fails("scaled_dot_product_attention", fn, mistake, "q (", "mask")
    assert r.mistake.startswith(mistake)


@pytest.mark.parametrize("fn, mistake", [
    (lambda L, S: np.tril(np.ones((L, S), bool), S - L - 1), "off by one: a query must also see its own key"),
    (lambda L, S: np.tril(np.ones((L, S), bool), S - L + 1), "off by one: each query sees one key in its future"),
    (lambda L, S: np.tril(np.ones((L, S), bool)), "aligned top-left"),
    (lambda L, S: np.triu(np.ones((L, S), bool), S - L + 1), "True marks the keys to hide"),
])
def test_causal_mask_mistakes(fn, mistake):
    r = _fails("causal_mask", fn, mistake, "differs at [")
    assert r.mistake.startswith(mistake)


def test_an_additive_causal_mask_is_named():
    def additive(L, S):
        return np.where(np.tril(np.ones((L, S), bool), S - L), 0.0, -np.inf)

    _fails("causal_mask", additive, "is float64; it must be bool")


@pytest.mark.parametrize("fn, mistake", [
    (lambda x, H: x.reshape(*x.shape[:-2], H, x.shape[-2], x.shape[-1] // H), "reshaped straight to (H, L, D)"),
    (lambda x, H: np.moveaxis(x.reshape(*x.shape[:-1], x.shape[-1] // H, H), -1, -3), "the heads interleaved"),
    (lambda x, H: x.reshape(*x.shape[:-1], H, x.shape[-1] // H), "the L and H axes are not swapped"),
])
def test_split_heads_mistakes(fn, mistake):
    _fails("split_heads", fn, mistake)


@pytest.mark.parametrize("fn, mistake", [
    (lambda x: x.reshape(*x.shape[:-3], x.shape[-2], -1), "heads merged in the wrong order"),
    (lambda x: np.moveaxis(x, -3, -1).reshape(*x.shape[:-3], x.shape[-2], -1), "the heads interleaved"),
    (lambda x: x.reshape(*x.shape[:-3], -1, x.shape[-1]), "stacked along the tokens"),
])
def test_merge_heads_mistakes(fn, mistake):
    _fails("merge_heads", fn, mistake)


def _mha(x, w_q, w_k, w_v, w_o, num_heads, mask=None, *, context=None, scale=None, merge=None, proj=None):
    c = x if context is None else context
    proj = proj or (lambda a, w: a @ w.T)
    q, k, v = (sol.split_heads(proj(a, w), num_heads) for a, w in ((x, w_q), (c, w_k), (c, w_v)))
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale(x))
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    z = sol.softmax(s) @ v
    return proj((merge or sol.merge_heads)(z), w_o)


@pytest.mark.parametrize("fn, mistake", [
    (lambda *a: _mha(*a, scale=lambda x: 1.0), "the scores are not scaled"),
    (lambda *a: _mha(*a, scale=lambda x: 1 / np.sqrt(x.shape[-1])), "scaled by the model width"),
    (lambda *a: _mha(*a, merge=lambda z: z.reshape(*z.shape[:-3], z.shape[-2], -1)), "heads merged in the wrong order"),
    (lambda *a: _mha(*a, proj=lambda a, w: a @ w), "the weights are used as (in, out)"),
])
def test_multi_head_attention_mistakes(fn, mistake):
    _fails("multi_head_attention", fn, mistake)


@pytest.mark.parametrize("fn, mistake", [
    (lambda x, c, *w: _mha(x, *w), "the keys and values came from x"),
    (lambda x, c, *w: _mha(x, *w, context=c, scale=lambda x: 1.0), "the scores are not scaled"),
    (lambda x, c, *w: _mha(x, *w, context=c, merge=lambda z: z.reshape(*z.shape[:-3], z.shape[-2], -1)),
     "heads merged in the wrong order"),
    (lambda x, c, wq, wk, wv, wo, H, mask=None: _mha(c, wq, wk, wv, wo, H, None if mask is None else mask.T, context=x),
     "queries and keys swapped"),
])
def test_cross_attention_mistakes(fn, mistake):
    _fails("cross_attention", fn, mistake)


def rotary_interleaved(x, positions, theta=10000.0):
    D = x.shape[-1]
    angle = np.asarray(positions)[:, None] * theta ** (-2 * np.arange(D // 2) / D)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * np.cos(angle) - x2 * np.sin(angle)
    out[..., 1::2] = x2 * np.cos(angle) + x1 * np.sin(angle)
    return out


def rotary_from_zero(x, positions, theta=10000.0):
    return sol.apply_rotary(x, np.arange(x.shape[-2]), theta)


def rotary_backwards(x, positions, theta=10000.0):
    return sol.apply_rotary(x, -np.asarray(positions), theta)


def rotary_wrong_freq(x, positions, theta=10000.0):
    D = x.shape[-1]
    angle = np.asarray(positions)[:, None] * theta ** (-np.arange(D // 2) / D)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    c, s = np.cos(angle).astype(x.dtype), np.sin(angle).astype(x.dtype)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize("fn, mistake", [
    (rotary_interleaved, "rotary on the wrong pairs"),
    (rotary_from_zero, "the positions are taken as 0..L-1"),
    (rotary_backwards, "rotated the wrong way"),
    (rotary_wrong_freq, "the frequencies are theta ** (-f / D)"),
])
def test_rotary_mistakes(fn, mistake):
    _fails("apply_rotary", fn, mistake)


def gqa_tiled(q, k, v, mask=None):
    G = q.shape[-3] // k.shape[-3]
    reps = (1,) * (k.ndim - 3) + (G, 1, 1)
    return sol.scaled_dot_product_attention(q, np.tile(k, reps), np.tile(v, reps), mask)


def gqa_head0(q, k, v, mask=None):
    return sol.scaled_dot_product_attention(q, k[..., :1, :, :], v[..., :1, :, :], mask)


def gqa_unscaled(q, k, v, mask=None):
    G = q.shape[-3] // k.shape[-3]
    return sdpa_no_scale(q, np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3), mask)


@pytest.mark.parametrize("fn, mistake", [
    (gqa_tiled, "query heads matched to key/value heads round-robin"),
    (gqa_head0, "every query head uses key/value head 0"),
    (gqa_unscaled, "the scores are not scaled"),
])
def test_grouped_query_mistakes(fn, mistake):
    _fails("grouped_query_attention", fn, mistake)


def cache_no_mask(q, k, v, k_cache, v_cache):
    keys, values = np.concatenate([k_cache, k], -2), np.concatenate([v_cache, v], -2)
    return sol.scaled_dot_product_attention(q, keys, values), keys, values


def cache_top_left(q, k, v, k_cache, v_cache):
    keys, values = np.concatenate([k_cache, k], -2), np.concatenate([v_cache, v], -2)
    mask = np.tril(np.ones((q.shape[-2], keys.shape[-2]), bool))
    return sol.scaled_dot_product_attention(q, keys, values, mask), keys, values


def cache_prepended(q, k, v, k_cache, v_cache):
    keys, values = np.concatenate([k, k_cache], -2), np.concatenate([v, v_cache], -2)
    return sol.scaled_dot_product_attention(q, keys, values, sol.causal_mask(q.shape[-2], keys.shape[-2])), keys, values


def cache_not_returned(q, k, v, k_cache, v_cache):
    out, _, _ = sol.cached_attention(q, k, v, k_cache, v_cache)
    return out, k_cache, v_cache


@pytest.mark.parametrize("fn, mistake", [
    (cache_no_mask, "no causal mask"),
    (cache_top_left, "the causal mask aligned top-left"),
    (cache_prepended, "the new keys and values go before the cached ones"),
    (cache_not_returned, "the cache is returned as it came in"),
])
def test_kv_cache_mistakes(fn, mistake):
    _fails("cached_attention", fn, mistake)


def online(q, k, v, block_size, mask=None, *, rescale=True, guard=True, scale=True):
    sc = 1 / np.sqrt(q.shape[-1]) if scale else 1.0
    S = k.shape[-2]
    if mask is not None:
        mask = np.broadcast_to(mask, (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], S))
    m = np.full(q.shape[:-1] + (1,), -np.inf)
    total = np.zeros(q.shape[:-1] + (1,))
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for a in range(0, S, block_size):
        s = q @ np.swapaxes(k[..., a:a + block_size, :], -1, -2) * sc
        if mask is not None:
            s = np.where(mask[..., a:a + block_size], s, -np.inf)
        m_new = np.maximum(m, s.max(-1, keepdims=True))
        ref = np.where(np.isfinite(m_new), m_new, 0.0) if guard else m_new
        c, p = np.exp(m - ref), np.exp(s - ref)
        total = total * c + p.sum(-1, keepdims=True)
        acc = (acc * c if rescale else acc) + p @ v[..., a:a + block_size, :]
        m = m_new
    return (acc / total).astype(q.dtype)


@pytest.mark.parametrize("kw, mistake", [
    ({"rescale": False}, "the accumulator is not rescaled"),
    ({"guard": False}, "NaN where a whole block is masked"),
    ({"scale": False}, "the scores are not scaled"),
])
def test_online_softmax_mistakes(kw, mistake):
    _fails("online_softmax_attention", lambda *a: online(*a, **kw), mistake)


# ---- a learner's faults: the learner's error, with the case ---------------------------------------
def test_a_raising_function_is_reported_as_the_learners():
    def broken(x, axis=-1):
        return x / undefined_name  # noqa: F821

    r = _fails("softmax", broken, "your function raised NameError", "test_exercises.py, line", "case 1 of 7")
    assert "Traceback" not in str(r) and "attnlab/" not in str(r)


def test_wrong_shape_dtype_nan_and_none():
    _fails("scaled_dot_product_attention", lambda q, k, v, mask=None: q @ np.swapaxes(k, -1, -2),
           "the output has shape (4, 4); it must be (4, 8)")
    _fails("softmax", lambda x, axis=-1: sol.softmax(x, axis).astype(np.float32), "is float32; it must be float64")
    _fails("softmax", lambda x, axis=-1: x * np.nan, "holds nan at [")
    _fails("softmax", lambda x, axis=-1: None, "returned None", "forget to `return`")
    _fails("softmax", lambda x, axis=-1: "weights", "it must return a NumPy array")
    _fails("cached_attention", lambda q, k, v, kc, vc: q, "it must return a tuple (out, k_cache, v_cache)")


def test_a_function_that_calls_exit_is_reported_not_obeyed(smollm2_model):
    def exits(q, k, v, mask=None):
        raise SystemExit(0)  # what sys.exit(0) raises

    r = check("grouped_query_attention", exits, model=smollm2_model)
    assert not r.passed and "your function called sys.exit(0) on case 1 of 4" in r.failure
    assert r.model.error.startswith("in the model, your function called sys.exit(0) on block 0 of the model")


def test_a_slow_function_hits_the_time_limit():
    def slow(x, axis=-1):
        while True:
            time.sleep(0.01)

    start = time.perf_counter()
    _fails("softmax", slow, "took more than 0.3 s on case 1 of 7 (the time limit)", seconds=0.3)
    assert time.perf_counter() - start < 5


def test_the_cases_follow_the_seed():
    a = check("softmax", softmax_whole, model=False, seed=3).failure
    b = check("softmax", softmax_whole, model=False, seed=3).failure
    c = check("softmax", softmax_whole, model=False, seed=4).failure
    assert a == b and a != c


# ---- inside SmolLM2 ------------------------------------------------------------------------------
def test_a_correct_attention_still_answers_paris_in_smollm2(smollm2_model):
    r = check("grouped_query_attention", solution("grouped_query_attention"), model=smollm2_model)
    assert r.passed, str(r)
    assert r.model.paris and "Paris" in r.model.answer and r.model.answer == r.model.reference
    assert r.model.logit_change < 1e-3
    assert "still answers Paris" in str(r)


def test_a_wrong_attention_is_caught_in_smollm2(smollm2_model):
    r = check("grouped_query_attention", gqa_tiled, model=smollm2_model)
    assert not r.passed
    assert not r.model.paris and r.model.logit_change > 1.0
    assert "no longer answers Paris" in str(r)


def test_the_model_runs_even_after_a_failed_case_and_reports_a_crash(smollm2_model):
    def crashes_in_the_model(q, k, v, mask=None):
        if q.shape[-3] == 9:  # SmolLM2's query heads
            raise ValueError("boom")
        return sol.grouped_query_attention(q, k, v, mask)

    r = check("grouped_query_attention", crashes_in_the_model, model=smollm2_model)
    assert r.failure is not None  # the 9-over-3 case raised too
    assert r.model is not None and "your function raised ValueError: boom" in r.model.error
    assert "block 0 of the model" in r.model.error and not r.passed


def test_a_function_too_slow_inside_the_model_hits_the_time_limit(smollm2_model):
    from attnlab.core import scaled_dot_product_attention

    def slow_in_the_model(q, k, v, mask=None):
        while q.shape[-1] == 64:  # SmolLM2's head width; the random cases' are 8 to 32
            time.sleep(0.01)
        return sol.grouped_query_attention(q, k, v, mask)

    r = check("grouped_query_attention", slow_in_the_model, model=smollm2_model, model_seconds=0.5)
    assert r.failure is None and not r.passed
    assert r.model.error.startswith("the model took more than 0.5 s with your function (the time limit)")
    assert all(layer.attn.attention_fn is scaled_dot_product_attention for layer in smollm2_model.layers)


def test_nan_inside_the_model_is_named(smollm2_model):
    def nan_attention(q, k, v, mask=None):
        return sol.grouped_query_attention(q, k, v, mask) * np.nan

    r = check("grouped_query_attention", nan_attention, model=smollm2_model)
    assert not r.passed and r.model.error is None and not r.model.paris
    assert "its logits became NaN" in str(r)


def test_the_rotation_goes_into_the_position_slot_and_comes_out(smollm2_model):
    from attnlab.core import scaled_dot_product_attention

    r = check("apply_rotary", solution("apply_rotary"), model=smollm2_model)
    assert r.passed and r.model.paris and r.model.logit_change < 1e-3, str(r)
    wrong = check("apply_rotary", rotary_interleaved, model=smollm2_model)
    assert not wrong.model.paris
    for layer in smollm2_model.layers:  # the model is as it was
        assert type(layer.attn.rotary).__name__ == "RotaryEmbedding"
        assert layer.attn.attention_fn is scaled_dot_product_attention
