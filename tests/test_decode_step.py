"""The compiled decoding step of a block with quantized or float32 weights (each
:class:`~attnlab.nn.TransformerBlock` runs :mod:`attnlab._decode_kernels` on one new token):
it must give the modules' logits, fill the cache as they do, and stand aside whenever
something (a hook, float64 weights, numba turned off) needs the modules."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from attnlab import _decode_kernels  # noqa: E402
from attnlab.core.blockwise import tuned  # noqa: E402
from attnlab.models.llama import Llama, LlamaConfig  # noqa: E402
from attnlab.quant import QuantizedTensor  # noqa: E402

CONFIGS = {
    "llama-gqa": {},
    "biases": dict(qkv_bias=True, out_bias=True, mlp_bias=True),
    "qk-norm": dict(qk_norm=True, num_key_value_heads=4),
    "window-partial-rope": dict(sliding_windows=(3, None), partial_rotary_factor=0.5, num_key_value_heads=1),
    "llama3-rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def quantized_llama(kind: str, seed: int = 0, family=Llama, config_class=LlamaConfig, **config) -> Llama:
    """A 2-block Llama (or ``family``) whose block weights are ``kind`` (a quantized type, or
    ``"float32"``: kept as they are), with norm weights and biases moved away from their
    start values (so a step that skipped one would be caught)."""
    cfg = config_class(**{**dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                          **config})
    model = family(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for name, p in model.named_parameters():
        if p.data.ndim == 1:
            p.data[...] = rng.uniform(0.5, 1.5, p.data.shape) if "norm" in name or "ln" in name \
                else rng.normal(0.0, 0.1, p.data.shape)
        elif name.startswith("blocks."):
            w = rng.normal(0.0, 0.15, p.data.shape).astype(np.float32)
            p.data = w if kind == "float32" else QuantizedTensor.quantize(w, kind)
    return model


def modules_only(model):
    """A hook on every block that reads and changes nothing: the modules run (each block's
    compiled step stands aside for a hook on its own points)."""
    return model.hooks([(f"blocks.{i}.hook_resid_pre", lambda x, name: None) for i in range(len(model.layers))])


@pytest.fixture
def calls(monkeypatch):
    """How many times the compiled block ran."""
    seen = []
    real = _decode_kernels.decode_layer

    def counting(*args):
        seen.append(1)
        return real(*args)

    monkeypatch.setattr(_decode_kernels, "decode_layer", counting)
    return seen


def _close(a, b):
    return float(np.abs(a - b).max()) <= 1e-4 * max(1.0, float(np.abs(b).max()))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "float32"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_steps_give_the_modules_logits_and_cache(kind, config, calls):
    model = quantized_llama(kind, **CONFIGS[config])
    ids = np.array([[5, 9, 77, 3, 20, 8]])
    fast, slow = model.new_cache(), model.new_cache()
    logits = model(ids, cache=fast)
    model(ids, cache=slow)
    nxt = logits[:, -1:].argmax(-1)
    for step in range(7):
        got = model(nxt, cache=fast)
        with modules_only(model):
            want = model(nxt, cache=slow)
        assert got.shape == want.shape == (1, 1, 96)
        assert _close(got, want), (step, float(np.abs(got - want).max()))
        nxt = want[:, -1:].argmax(-1)
    assert len(calls) == 7 * 2  # every step, every block, compiled
    for a, b in zip(fast, slow, strict=True):
        assert len(a) == len(b) == 13
        k_a, v_a = a._key[:, :, :13], a._value[:, :, :13]
        np.testing.assert_allclose(k_a, b._key[:, :, :13], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v_a, b._value[:, :, :13], rtol=1e-5, atol=1e-5)


# The step reads a float16 cache only where the CPU converts half precision itself (F16C on
# x86: every AVX2 CPU); elsewhere the modules run it, and there is no step to test.
needs_half = pytest.mark.skipif(not _decode_kernels.HALF_CONVERSIONS,
                                reason="this CPU cannot convert half precision (x86 without F16C)")


def _steps_against_the_modules(model, dtype, calls):
    """Seven greedy steps after a prompt, each run by the compiled step over a cache of
    ``dtype`` and by the modules over another: their logits within float32 round-off of
    each other at every step. Returns both caches and the largest difference from a float32
    cache's logits, relative to their largest (what the storage's rounding moved)."""
    ids = np.array([[5, 9, 77, 3, 20, 8]])
    fast, slow, ref = model.new_cache(dtype=dtype), model.new_cache(dtype=dtype), model.new_cache()
    logits = model(ids, cache=fast)
    model(ids, cache=slow)
    model(ids, cache=ref)
    nxt = logits[:, -1:].argmax(-1)
    worst = 0.0
    for step in range(7):
        got = model(nxt, cache=fast)
        with modules_only(model):
            want = model(nxt, cache=slow)
        exact = model(nxt, cache=ref)
        assert _close(got, want), (step, float(np.abs(got - want).max()))
        worst = max(worst, float(np.abs(got - exact).max() / np.abs(exact).max()))
        nxt = want[:, -1:].argmax(-1)
    assert len(calls) == 2 * 7 * 2  # this cache's steps and the float32 cache's, every block compiled
    return fast, slow, worst


@needs_half
@pytest.mark.parametrize("kind", ["Q4_1", "float32"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_steps_read_and_write_a_float16_cache(kind, config, calls):
    """With ``KVCache(dtype="float16")`` the compiled step reads the float16 keys and values
    and writes the new ones rounded as NumPy rounds: the modules' logits (which widen the
    same cache to float32), and the same cache to within one float16 step where the two
    paths' float32 keys round to either side of a float16 midpoint."""
    fast, slow, worst = _steps_against_the_modules(quantized_llama(kind, **CONFIGS[config]), "float16", calls)
    assert 1e-6 < worst < 5e-3  # float16's rounding shows, and stays small
    for a, b in zip(fast, slow, strict=True):
        assert a._key.dtype == b._key.dtype == np.float16 and len(a) == len(b) == 13
        for x, y in ((a._key, b._key), (a._value, b._value)):
            x, y = x[:, :, :13].astype(np.float32), y[:, :, :13].astype(np.float32)
            np.testing.assert_allclose(x, y, rtol=2.0**-10, atol=1e-5)  # atol: as the float32 cache's test


@pytest.mark.parametrize("kind", ["Q4_1", "float32"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_steps_read_and_write_an_int8_cache(kind, config, calls):
    """With ``KVCache(dtype="int8")`` the compiled step reads the codes and their scales and
    quantizes the new key and value as :func:`attnlab.nn.attention.quantize_int8` does: the
    modules' logits (which attend over ``codes * scale``), and the same codes to within one
    step where the two paths' float32 keys fall to either side of a code's midpoint."""
    fast, slow, worst = _steps_against_the_modules(quantized_llama(kind, **CONFIGS[config]), "int8", calls)
    assert 1e-5 < worst < 5e-2  # the codes' rounding shows, and stays small
    for a, b in zip(fast, slow, strict=True):
        assert a._key.dtype == np.int8 and a._key_scale.dtype == np.float32 and len(a) == len(b) == 13
        for x, y in ((a._key, b._key), (a._value, b._value)):
            assert np.abs(x[:, :, :13].astype(int) - y[:, :, :13]).max() <= 1
        for x, y in ((a._key_scale, b._key_scale), (a._value_scale, b._value_scale)):
            np.testing.assert_allclose(x[:, :, :13], y[:, :, :13], rtol=1e-5)


def test_an_int8_cache_is_quantized_as_numpy_quantizes():
    """The step's quantization of a new key or value (:func:`attnlab._decode_kernels._quantize`)
    is bit for bit :func:`attnlab.nn.attention.quantize_int8`: rows of every magnitude, rows
    with ties at a code's midpoint, a zero row, rows below the smallest magnitude kept, and
    a row with a non-finite value (counted, stored as zeros)."""
    from attnlab.nn.attention import INT8_SMALLEST, quantize_int8

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((200, 64)) * 10.0 ** rng.integers(-30, 30, (200, 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = np.arange(64) - 31.5  # top 32: a step of 32 / 127, ties where x * 127 / 32 ends in .5
    x[2, :] = INT8_SMALLEST / 2  # below the smallest kept
    x[3, :] = INT8_SMALLEST  # the smallest kept
    x[4, 5] = -np.float32(3e38)
    want_codes, want_scales = quantize_int8(x)
    codes = np.full(x.shape, 99, np.int8)
    scales = np.full(x.shape[0], np.nan, np.float32)
    for i in range(x.shape[0]):
        assert _decode_kernels._quantize(codes[i], scales[i:i + 1], x[i]) == 0
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)
    assert not codes[0].any() and not codes[2].any() and scales[2] == 0 and codes[3].max() == 127
    kept = scales > 0  # every value within half a step of its code (and round-off)
    steps = np.abs(codes * scales[:, None].astype(np.float64) - x)[kept] / scales[kept, None]
    assert 0.49 < steps.max() <= 0.5 + 1e-5
    bad = x[5].copy()
    bad[[7, 9]] = np.inf, np.nan
    assert _decode_kernels._quantize(codes[5], scales[5:6], bad) == 2
    assert not codes[5].any() and scales[5] == 0


@pytest.mark.parametrize("dtype, break_values, message", [
    pytest.param("float16", lambda w: np.concatenate([w[:-32], w[-32:] * 1e6]),
                 r"beyond float16's range \(the largest finite float16 is 65504\): keep this cache in float32",
                 marks=needs_half),
    ("int8", lambda w: np.concatenate([w[:-32], np.full_like(w[-32:], np.inf)]),
     "an int8 cache stores finite keys and values only, got inf or NaN: keep this cache in float32"),
])
def test_a_value_the_cache_cannot_hold_raises_and_is_not_cached(dtype, break_values, message, calls):
    """The value rows of block 1 made too large for the cache (float16: beyond 65504; int8:
    infinite): the compiled step and the modules raise the cache's error, and the step
    takes back the token it had cached in block 0."""
    model = quantized_llama("Q8_0")
    cache = model.new_cache(dtype=dtype)
    model(np.array([[5, 9, 77]]), cache=cache)
    dense = break_values(model.layers[1].attn.in_proj_weight.data.dequantize())
    model.layers[1].attn.in_proj_weight.data = QuantizedTensor.quantize(dense, "Q8_0") if dtype == "float16" \
        else dense.astype(np.float32)
    with pytest.raises(ValueError, match=message):
        model(np.array([[4]]), cache=cache)
    assert len(calls) == 2 and [len(c) for c in cache] == [3, 3]  # block 0's token taken back too
    with modules_only(model), pytest.raises(ValueError, match=message):
        model(np.array([[4]]), cache=model.new_cache(dtype=dtype))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("config", [
    dict(sliding_windows=(3, None), attn_logit_softcapping=4.0, query_pre_attn_scalar=24),  # Gemma 2
    dict(sliding_windows=(3, None), qk_norm=True, local_rope_theta=100.0, hidden_act="gelu"),  # Gemma 3
])
def test_gemma_blocks_give_the_modules_logits(kind, config, calls):
    """The block's other slots (sandwich and unit-offset norms, soft-capped scores, GELU,
    a scale of its own, local and global rotary) reach the compiled step through the
    blocks' records: a left-padded batch's steps equal the modules'."""
    from attnlab.models.gemma import Gemma, GemmaConfig

    model = quantized_llama(kind, family=Gemma, config_class=GemmaConfig, head_dim=16, **config)
    ids = np.array([[0, 0, 5, 9, 77, 3], [20, 8, 1, 2, 3, 4]])
    mask = (np.arange(6) >= np.array([[2], [0]])).astype(np.int64)
    fast, slow = model.new_cache(), model.new_cache()
    model(ids, mask, cache=fast)
    model(ids, mask, cache=slow)
    nxt = np.array([[7], [11]])
    for step in range(6):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        got = model(nxt, mask, cache=fast)
        with modules_only(model):
            want = model(nxt, mask, cache=slow)
        assert _close(got, want), (step, float(np.abs(got - want).max()))
        nxt = want[:, -1:].argmax(-1)
    assert len(calls) == 6 * 2


def test_a_left_padded_batch_generates_the_modules_tokens(calls):
    model = quantized_llama("Q4_1", num_key_value_heads=1)
    ids = np.array([[0, 0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6], [0, 11, 12, 13, 14, 15]])
    mask = (np.arange(6) >= np.array([[3], [0], [1]])).astype(np.int64)
    got = model.generate(ids, 8, attention_mask=mask)
    assert len(calls) == 7 * 2
    with modules_only(model):
        want = model.generate(ids, 8, attention_mask=mask)
    np.testing.assert_array_equal(got, want)
    # and one padded step's logits directly
    cf, cs = model.new_cache(), model.new_cache()
    model(ids, mask, cache=cf)
    model(ids, mask, cache=cs)
    step_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
    nxt = np.array([[3], [4], [5]])
    got = model(nxt, step_mask, cache=cf)
    with modules_only(model):
        want = model(nxt, step_mask, cache=cs)
    assert _close(got, want)


def test_the_modules_run_when_a_hook_is_attached(calls):
    """A hook on one block's point runs that block through its modules; the other blocks
    stay compiled, and the tokens are the same."""
    model = quantized_llama("Q8_0")
    seen = []
    with model.hooks([("blocks.1.mlp.hook_post", lambda x, name: seen.append(x.shape))]):
        hooked = model.generate(np.array([[1, 2, 3]]), 4)
    assert len(calls) == 3 and seen == [(1, 3, 128)] + [(1, 1, 128)] * 3  # block 0 only
    with model.hooks([("hook_embed", lambda x, name: seen.append(x.shape))]):
        embedded = model.generate(np.array([[1, 2, 3]]), 4)
    assert len(calls) == 3 + 3 * 2 and seen[-1] == (1, 1, 64)  # the embedding's hook: every block compiled
    plain = model.generate(np.array([[1, 2, 3]]), 4)
    assert len(calls) == 3 + 3 * 2 * 2  # detached: compiled again
    np.testing.assert_array_equal(hooked, plain)
    np.testing.assert_array_equal(embedded, plain)


def test_float64_weights_and_numba_turned_off_take_the_modules(calls):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    Llama(cfg, rng=np.random.default_rng(0), dtype=np.float64).generate(np.array([[1, 2, 3]]), 4)
    assert calls == []
    Llama(cfg, rng=np.random.default_rng(0)).generate(np.array([[1, 2, 3]]), 4)  # float32: the step
    assert len(calls) == 3 * 2
    calls.clear()
    model = quantized_llama("Q4_0")
    with tuned(fused=False):
        a = model.generate(np.array([[1, 2, 3]]), 4)
    assert calls == []
    b = model.generate(np.array([[1, 2, 3]]), 4)
    assert len(calls) == 3 * 2
    np.testing.assert_array_equal(a, b)


def test_a_slot_set_after_a_step_is_seen(calls):
    """An attention function put in a layer's slot after the model has decoded (an
    exercise's, a user's) runs in the steps that follow: the block's compiled plan is
    rebuilt, not kept."""
    from attnlab import scaled_dot_product_attention

    model = quantized_llama("Q4_1")
    ids = np.array([[1, 2, 3]])
    model.generate(ids, 3)
    assert len(calls) == 2 * 2
    seen = []

    def mine(*args, **kwargs):
        seen.append(1)
        return scaled_dot_product_attention(*args, **kwargs)

    calls.clear()
    model.layers[0].attn.attention_fn = mine
    model.generate(ids, 3)
    assert len(seen) == 3 and len(calls) == 2  # block 0 on the modules (prompt + 2 steps), block 1 compiled
    model.layers[0].attn.attention_fn = scaled_dot_product_attention
    calls.clear()
    model.generate(ids, 3)
    assert len(seen) == 3 and len(calls) == 2 * 2


def test_a_replaced_weight_is_seen(calls):
    model = quantized_llama("Q4_1")
    ids = np.array([[4, 5, 6]])
    model.generate(ids, 3)  # the step's plan is built
    rng = np.random.default_rng(7)
    up = model.layers[1].mlp.up_proj.weight
    up.data = QuantizedTensor.quantize(rng.normal(0.0, 0.3, up.data.shape).astype(np.float32), "Q8_0")
    model.layers[0].ln_2.weight.data = np.full(64, 2.0, np.float32)
    cf, cs = model.new_cache(), model.new_cache()
    model(ids, cache=cf)
    model(ids, cache=cs)
    got = model(np.array([[9]]), cache=cf)
    with modules_only(model):
        want = model(np.array([[9]]), cache=cs)
    assert _close(got, want)
    assert len(calls) == 2 * 2 + 2


def test_bad_input_gets_the_modules_errors():
    model = quantized_llama("Q8_0")
    cache = model.new_cache()
    model(np.array([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match="input_ids"):
        model(np.array([[96]]), cache=cache)  # out of the vocabulary
    with pytest.raises(ValueError, match="attention_mask"):
        model(np.array([[1]]), np.array([[1, 1, 2, 1]]), cache=cache)
    assert len(cache[0]) == 3  # nothing appended by a refused step


@pytest.mark.parametrize("config", ["llama-gqa", "window-partial-rope"])
def test_the_cache_past_its_length_is_never_read(config, calls, monkeypatch):
    """A cache's storage past its length is left unfilled (attention.KVCache._reserve): with
    that storage NaN, the compiled steps and the modules give the tokens and logits they give
    with it zero, through the storage's growth (16, then 32 tokens) and a left-padded row."""
    from attnlab.nn import attention

    model = quantized_llama("Q4_1", **CONFIGS[config])
    ids = np.array([[0, 0, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]])
    mask = (np.arange(6) >= np.array([[2], [0]])).astype(np.int64)
    runs = {}
    for fill in (0.0, np.nan):
        monkeypatch.setattr(attention, "_empty", lambda shape, like, fill=fill: np.full(shape, fill, like.dtype))
        fast = model.generate(ids, 14, attention_mask=mask)
        with modules_only(model):
            slow = model.generate(ids, 14, attention_mask=mask)
        cache = model.new_cache()
        logits = model(ids, mask, cache=cache)
        runs[fill] = fast, slow, logits
    assert calls and np.isfinite(runs[np.nan][2]).all()
    for a, b in zip(runs[0.0], runs[np.nan], strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(runs[np.nan][0], runs[np.nan][1])


@pytest.mark.parametrize("quantized", [True, False])
def test_generation_gives_the_same_tokens_whatever_thread_count_a_step_takes(quantized, monkeypatch):
    """generate() runs each decoding step on the threads that are fastest now
    (attnlab._threads.StepThreads): one thread or all gives the same tokens."""
    from attnlab import _threads

    class Fixed(_threads.StepThreads):  # always the same arm (the real choice goes by timings)
        def __init__(self, one):
            super().__init__()
            self.fixed, self.seen = one, []

        def _pick_one(self, first=False):
            return self.fixed

        def _record(self, one, seconds, first=False):
            self.seen.append(_threads.get_num_threads() if not one else 1)

    monkeypatch.setattr(_threads, "_adapts", lambda: True)  # the steps' choice is on (the suite turns it off)
    monkeypatch.setattr(_threads, "watch_the_machine", lambda: False)  # but not the busy-machine watch
    model = quantized_llama("Q4_1", seed=3) if quantized else Llama(
        LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64), rng=np.random.default_rng(3))
    prompt = np.array([[5, 17, 42, 8], [9, 9, 1, 60]])
    runs = {}
    old = _threads._num_threads
    _threads.set_num_threads(2)
    try:
        for one in (False, True):
            chooser = Fixed(one)
            monkeypatch.setattr("attnlab.models.generate.DECODE_STEPS", chooser)
            runs[one] = model.generate(prompt, 12)
            assert chooser.seen == [1 if one else 2] * 11  # every step after the prompt's
    finally:
        _threads._num_threads = old
    np.testing.assert_array_equal(runs[False], runs[True])


def _attention_reference(qkv, keys, values, start, stop, key_mask, Hq, Hkv, Dh, scale, softcap):
    """One query per row and head against the cached keys, in float64 NumPy."""
    N, G = qkv.shape[0], Hq // Hkv
    q = qkv[:, :Hq * Dh].reshape(N, Hkv, G, Dh).astype(np.float64)
    k = keys[:, :, start:stop].astype(np.float64)
    s = np.einsum("ngd,nsd->ngs", q.reshape(N * Hkv, G, Dh), k.reshape(N * Hkv, -1, Dh)).reshape(N, Hkv, G, -1)
    s *= scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if key_mask.shape[0]:
        s = np.where(key_mask[:, None, None, start:stop], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("nhgs,nhsd->nhgd", w, values[:, :, start:stop].astype(np.float64))
    return out.reshape(N, Hq * Dh)


@pytest.mark.parametrize("N, Hq, Hkv, stop, start, masked, softcap", [
    (1, 9, 3, 301, 0, False, 0.0),    # SmolLM2's heads: runs of an odd length merged
    (1, 2, 1, 1000, 0, False, 0.0),   # one group
    (2, 4, 2, 700, 37, True, 0.0),    # a left-padded batch after a sliding window's start
    (3, 4, 4, 600, 0, True, 50.0),    # soft-capped scores, one query head per group
    (1, 4, 2, 5, 0, False, 0.0),      # a short cache: one run
    (1, 8, 2, 400, 0, True, 0.0),     # four query heads a group: one pass
    (1, 7, 1, 300, 0, False, 0.0),    # seven: passes of four and three
    (2, 10, 2, 260, 0, True, 30.0),   # five: passes of four and one, masked and capped
    (1, 6, 3, 4501, 0, False, 0.0),   # a long cache: runs cut at their longest, two heads a group
])
@pytest.mark.parametrize("threads", [1, 2, 3, 16])
@pytest.mark.parametrize("stored", ["float32", pytest.param("float16", marks=needs_half), "int8"])
def test_attend_kernel_matches_numpy(N, Hq, Hkv, stop, start, masked, softcap, threads, stored):
    """The compiled step's attention over a cache (:func:`attnlab._decode_kernels._attend`:
    runs of keys per task, partial softmaxes merged, a polynomial exp) gives float64
    NumPy's attention within float32 round-off, its keys cut for one to 16 threads (numba
    runs on as many as this machine has), with masks, a window's start and soft-capping; a
    float16 cache (its bits, uint16) as its float16 values, an int8 cache (codes and a
    scale a row) as ``codes * scale``."""
    _check_attend(N, Hq, Hkv, stop, start, masked, softcap, threads, stored, Dh=64)


@pytest.mark.parametrize("Dh, Hq, Hkv, stop", [
    (128, 8, 2, 700),   # Llama's head width: the explicit vectors two heads at a time
    (256, 8, 1, 333),   # Gemma's, eight heads a group: the loops
    (80, 6, 2, 500),    # another width the vectors do not take
    (32, 4, 4, 90),     # another
])
@pytest.mark.parametrize("stored", ["float32", pytest.param("float16", marks=needs_half), "int8"])
def test_attend_kernel_matches_numpy_at_other_head_widths(Dh, Hq, Hkv, stop, stored):
    """The same at head widths other than 64: one the explicit vectors take
    (64 and 128: :func:`attnlab._decode_kernels._lanes_done`) and three they do not."""
    _check_attend(1, Hq, Hkv, stop, 0, True, 0.0, 2, stored, Dh=Dh)


def _check_attend(N, Hq, Hkv, stop, start, masked, softcap, threads, dtype, *, Dh):
    import numba

    from attnlab.nn.attention import quantize_int8

    C = max(1024, stop)
    rng = np.random.default_rng(stop + N)
    qkv = rng.standard_normal((N, (Hq + 2 * Hkv) * Dh)).astype(np.float32)
    keys = (2.0 * rng.standard_normal((N, Hkv, C, Dh))).astype(np.float32)
    values = rng.standard_normal((N, Hkv, C, Dh)).astype(np.float32)
    key_mask = np.zeros((0, 0), np.bool_)
    if masked:
        key_mask = rng.random((N, C)) > 0.3
        key_mask[:, stop - 1] = True  # the new token takes part
        key_mask[0, :stop - 1] = False  # a row that sees only its new token
    z = np.full((N, Hq * Dh), np.nan, np.float32)
    stored = keys, values, None, None
    if dtype == "float16":
        stored = keys.astype(np.float16).view(np.uint16), values.astype(np.float16).view(np.uint16), None, None
        keys, values = (a.view(np.float16).astype(np.float32) for a in stored[:2])
    elif dtype == "int8":
        (kc, ks), (vc, vs) = quantize_int8(keys), quantize_int8(values)
        stored = kc, vc, ks, vs
        keys, values = kc * ks[..., None], vc * vs[..., None]
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _decode_kernels._attend(qkv, *stored, start, stop, key_mask, Hq, Hkv, Dh, np.float32(0.125),
                                np.float32(softcap), z, threads)
    finally:
        numba.set_num_threads(before)
    want = _attention_reference(qkv, keys, values, start, stop, key_mask, Hq, Hkv, Dh, 0.125, softcap)
    np.testing.assert_allclose(z, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("Dh", [64, 128, 256, 48])  # the last two: the loops only
@pytest.mark.parametrize("h", [1, 2, 3, 4])
@pytest.mark.parametrize("stored", ["float32", pytest.param("float16", marks=needs_half), "int8"])
def test_dot_products_and_weighted_sums_of_a_run_match_numpy(Dh, h, stored):
    """The two passes of a run of keys (:func:`attnlab._decode_kernels._dots` and
    :func:`~attnlab._decode_kernels._accumulate`), each key and value row read once for
    ``h`` query heads: float64 NumPy's products within float32 round-off for runs of 0 to
    290 keys from an odd offset (whole 16s through the explicit vectors where the width
    allows, the rest through the loops), from rows apart from each other, and from rows
    whose values are not contiguous (the loops only); nothing outside the run is written.
    An int8 cache's codes: the dot products with the codes (the scales are the scores'),
    and the weighted sum of ``codes * scale``."""
    rng = np.random.default_rng(Dh * 10 + h)
    if stored == "int8":
        rows = rng.integers(-127, 128, (301, 2 * Dh)).astype(np.int8)
    else:
        rows = rng.standard_normal((301, 2 * Dh)).astype(stored)
    scales = rng.random(301).astype(np.float32) if stored == "int8" else None
    unit = 127.0 if stored == "int8" else 1.0  # the rows' magnitude, which the round-off scales with
    for keys in (rows[:, :Dh].copy(), rows[:, :Dh], rows[:, ::2]):  # contiguous, rows apart, strided rows
        stored = keys.view(np.uint16) if keys.dtype == np.float16 else keys
        exact = keys.astype(np.float64)
        weighed = exact if scales is None else exact * scales[:, None].astype(np.float64)
        q = rng.standard_normal((h, Dh)).astype(np.float32)
        for n in (0, 15, 16, 17, 290):
            p = np.full((h, 300), np.nan, np.float32)
            _decode_kernels._dots(q, h, stored, 3, n, p)
            want = q.astype(np.float64) @ exact[3:3 + n].T
            np.testing.assert_allclose(p[:, :n], want, rtol=1e-5, atol=1e-5 * np.sqrt(Dh) * unit)
            assert np.isnan(p[:, n:]).all()
            w = rng.random((h, 300)).astype(np.float32)
            out = rng.standard_normal((h, Dh)).astype(np.float32)
            want = out + w[:, :n].astype(np.float64) @ weighed[3:3 + n]
            _decode_kernels._accumulate(w, stored, scales, 3, n, out)
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.sqrt(n + 1) * unit)


def test_explicit_vectors_take_whole_16s_of_contiguous_rows_at_their_widths():
    """:func:`attnlab._decode_kernels._lanes_done`: the keys the explicit vectors take."""
    done = _decode_kernels._lanes_done
    rows = np.zeros((100, 128), np.float32)
    assert done(rows[:, :64].copy(), 37, 4, 4) == 32
    assert done(rows, 16, 4) == 16
    assert done(rows.view(np.uint16)[:, :128].copy(), 47, 4) == 32  # float16 bits
    assert done(rows[:, :64], 37, 4) == 32  # rows apart from each other are fine...
    assert done(rows[:, ::2], 37, 4) == 0  # ...but values within a row must be
    assert done(rows[:, :48].copy(), 37, 4) == 0  # widths they do not take
    assert done(rows.view(np.uint16)[:, :256].copy(), 37, 4) == 0
    assert done(rows[:, :64].copy(), 37, 8) == 0  # another array strided


_X86 = __import__("platform").machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not _X86, reason="the targets pinned are x86 CPUs")
@pytest.mark.parametrize("features, converts", [("+sse2,+sse4.2", False), ("+sse2,+avx,+f16c", True)])
def test_half_conversions_follow_the_target_numba_compiles_for(features, converts, tmp_path):
    """:data:`attnlab._decode_kernels.HALF_CONVERSIONS` reads the code numba's own target
    machine makes of half precision, for a target pinned here (``NUMBA_CPU_NAME`` and
    ``NUMBA_CPU_FEATURES``, whatever this machine is): an x86-64 without F16C would call a
    library function numba does not link (which aborted the process), one with it converts
    in instructions."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": features,
           "NUMBA_CACHE_DIR": str(tmp_path)}
    code = "from attnlab import _decode_kernels as d; print(d.HALF_CONVERSIONS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout.strip()) == (0, str(converts)), out.stderr[-2000:]


@pytest.mark.skipif(not _X86, reason="the target pinned is an x86 CPU")
def test_a_float16_cache_generates_under_a_target_without_half_conversions(tmp_path):
    """Under ``NUMBA_CPU_NAME=generic`` (code for any x86-64, as for a numba cache shared
    between machines) a float16 cache's generation runs through the modules and gives the
    tokens this process gives, where the compiled step's code aborted the process (LLVM:
    ``Symbol not found: __extendhfsf2``)."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from attnlab.models.llama import Llama, LlamaConfig\n"
            "from attnlab import _decode_kernels\n"
            "cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
            "                  num_attention_heads=4, num_key_value_heads=2)\n"
            "model = Llama(cfg, rng=np.random.default_rng(0))\n"
            "out = model.generate(np.array([[1, 2, 3]]), 6, cache_dtype='float16')\n"
            "print(_decode_kernels.HALF_CONVERSIONS, out.tolist())\n")
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    want = Llama(cfg, rng=np.random.default_rng(0)).generate(np.array([[1, 2, 3]]), 6, cache_dtype="float16")
    assert out.stdout.strip() == f"False {want.tolist()}"


def test_attend_cuts_keys_into_the_fewest_runs_that_share_out_evenly():
    """:func:`attnlab._decode_kernels._runs`: as many runs a key/value head as make the tasks
    a multiple of the threads, more where a run would pass 2,048 keys, fewer where it would
    fall under 64 (for the thread counts given, not this machine's)."""
    runs = _decode_kernels._runs
    assert runs(3040, 3, 1) == 2    # one thread: two runs, as 3,040 keys pass 2,048
    assert runs(1500, 3, 1) == 1
    assert runs(3040, 3, 2) == 2    # 6 tasks, 3 a thread
    assert runs(3040, 4, 2) == 2    # 8 tasks: 3040 > 2048
    assert runs(1500, 4, 2) == 1    # 4 rows x heads: 2 tasks a thread
    assert runs(3040, 3, 16) == 16  # 48 tasks, 3 a thread
    assert runs(3040, 12, 16) == 4  # 48 tasks
    assert runs(10000, 1, 2) == 6   # 5 runs for the length, rounded up to a multiple of 2
    assert runs(140, 3, 16) == 2    # no run under 64 keys
    assert runs(5, 3, 2) == 1       # a short cache: one run


def test_exp_of_the_compiled_softmax_is_within_float32_round_off():
    """The vectorised exp of the compiled step's softmax: within 1.5e-7 relative of the
    exact value on [-87, 0], 0 below (and for -inf), the sum returned in float64."""
    x = np.concatenate([np.linspace(-87.0, 0.0, 200_001), [-90.0, -1e30, -np.inf]]).astype(np.float32)
    p = x.copy()
    total = _decode_kernels._exp_sub(p, np.float32(0.0), p.shape[0])
    exact = np.exp(x[:-3].astype(np.float64))
    assert np.abs(p[:-3] - exact).max() <= 1.5e-7 * 1.0 and (np.abs(p[:-3] - exact) / exact).max() <= 1.5e-7
    assert p[-3:].tolist() == [0.0, 0.0, 0.0]
    assert total == pytest.approx(float(np.sum(p, dtype=np.float64)), rel=1e-12)


def test_the_scores_largest_is_numpys_over_whole_16s_and_the_tail():
    """:func:`attnlab._decode_kernels._largest` (an explicit vector over whole 16s, then the
    rest): NumPy's maximum of the first ``n`` values and -3.4e38 (every key forbidden: all
    ``-inf``), wherever the largest lies, and nothing past ``n`` read."""
    rng = np.random.default_rng(7)
    for n in (0, 1, 15, 16, 17, 33, 100):
        for where in range(0, n, 7):
            p = rng.standard_normal(n + 40).astype(np.float32)
            p[n:] = 1e30  # past the run: never read
            p[where] = 50.0
            assert _decode_kernels._largest(p, n) == 50.0, (n, where)
        p = np.full(n + 3, -np.inf, np.float32)
        assert _decode_kernels._largest(p, n) == np.float32(-3.4e38)


@needs_half
def test_a_float16_cache_is_written_and_read_as_numpy_rounds():
    """The step's float16 conversions (:func:`attnlab._decode_kernels._store` and the reads
    of :func:`~attnlab._decode_kernels._dots`): bit for bit NumPy's ``astype(float16)``
    (round to nearest even: ties, subnormals, signed zeros, infinities) and back, and a
    count of the finite values that became infinite."""
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 5, 4000),  # normals and subnormals of float16
        np.arange(2049, 2200, dtype=np.float64),  # integers past 2048: every other one a tie
        [0.0, -0.0, 65504.0, 65519.99, 65520.0, -1e6, np.inf, -np.inf, 2.0**-25, 3 * 2.0**-26],
    ]).astype(np.float32)
    bits = np.zeros(x.shape, np.uint16)
    lost = _decode_kernels._store(bits, x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(bits, want.view(np.uint16))
    assert lost == 2  # 65520 and -1e6 (65519.99 rounds down to 65504; the infinities were infinite)
    q = np.ones((1, 1), np.float32)
    p = np.empty((1, x.shape[0]), np.float32)
    _decode_kernels._dots(q, 1, bits[:, None], 0, x.shape[0], p)
    assert np.array_equal(p[0], want.astype(np.float32))


@needs_half
def test_a_float16_cache_takes_the_modules_where_the_cpu_cannot_convert(calls, monkeypatch):
    """On an x86 CPU without F16C the step cannot read a float16 cache: the modules run it,
    with the same cache and the same tokens as the step on a CPU that can."""
    model = quantized_llama("Q4_1")
    ids = np.array([[5, 9, 77, 3]])
    want = model.generate(ids, 4, cache_dtype="float16")
    assert len(calls) == 3 * 2
    monkeypatch.setattr(_decode_kernels, "HALF_CONVERSIONS", False)
    assert np.array_equal(model.generate(ids, 4, cache_dtype="float16"), want)
    assert len(calls) == 3 * 2  # none more
    model.generate(ids, 4)  # a float32 cache still takes the step
    assert len(calls) == 2 * 3 * 2
