"""The shared blocks: the key/value cache (incremental decoding equals a full pass), the
models' traces (equal to their attention maps) and names that existing checkpoints use."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.nn import KVCache


def _tiny(dtype="float32", seed=0, **kw):
    cfg = TinyTransformerConfig(vocab_size=11, context_length=12, d_model=16, n_heads=4, n_layers=3,
                                d_ff=24, activation="gelu", dtype=dtype, **kw)
    model = TinyTransformer(cfg, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    for p in model.parameters():  # move LayerNorms and biases off their ones and zeros
        p.data += (rng.standard_normal(p.shape) * 0.1).astype(p.dtype)
    return model.eval()


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("steps", [[1] * 10, [4, 1, 3, 2], [10]])
def test_cached_decoding_equals_the_full_pass(dtype, tol, steps):
    model = _tiny(dtype)
    ids = np.random.default_rng(2).integers(0, 11, size=(3, sum(steps)))
    full = model(ids)
    cache = model.new_cache()
    parts, t = [], 0
    for n in steps:
        parts.append(model(ids[:, t : t + n], cache=cache))
        t += n
    assert [len(c) for c in cache] == [t] * 3
    assert np.abs(np.concatenate(parts, axis=1) - full).max() < tol


def test_greedy_generation_with_and_without_cache():
    model = _tiny()
    seq = [1, 2]
    cache = model.new_cache()
    logits = model(np.array([seq]), cache=cache)
    cached = list(seq)
    for _ in range(6):
        cached.append(int(logits[0, -1].argmax()))
        logits = model(np.array([cached[-1:]]), cache=cache)
        seq.append(int(model(np.array([seq]))[0, -1].argmax()))
    assert cached == seq


def test_cache_errors():
    model = _tiny()
    cache = model.new_cache()
    model(np.zeros((1, 10), np.int64), cache=cache)
    with pytest.raises(ValueError, match="context_length=12 - 10 cached tokens"):
        model(np.zeros((1, 3), np.int64), cache=cache)
    with pytest.raises(ValueError, match=r"key has shape \(2, 4, 1, 4\), but should be \(1, 4, S_new, 4\)"):
        model(np.zeros((2, 1), np.int64), cache=cache)  # another batch size
    with pytest.raises(TypeError, match="cache must be a list of 3 KVCache"):
        model(np.zeros((1, 2), np.int64), cache=[KVCache()])
    cache[0].reset()
    assert len(cache[0]) == 0
    mha = attnlab.MultiheadAttention(8, 2, add_zero_attn=True, rng=np.random.default_rng(0))
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="add_bias_kv or add_zero_attn"):
        mha(x, x, x, cache=KVCache())


def test_no_backward_through_a_cached_call():
    mha = attnlab.MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0))
    x = np.ones((1, 3, 8), np.float32)
    out, _ = mha(x, x, x, cache=KVCache())
    with pytest.raises(RuntimeError, match="no backward pass through a call with a KVCache"):
        mha.backward(np.ones_like(out))


def test_mha_cache_attends_bottom_right_over_cached_keys():
    mha = attnlab.MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0)).eval()
    x = np.random.default_rng(1).standard_normal((2, 7, 8)).astype(np.float32)
    full, w_full = mha(x, x, x, is_causal=True, average_attn_weights=False)
    cache = KVCache()
    mha(x[:, :4], x[:, :4], x[:, :4], is_causal=True, cache=cache)
    last, w = mha(x[:, 4:], x[:, 4:], x[:, 4:], is_causal=True, cache=cache, average_attn_weights=False)
    assert w.shape == (2, 2, 3, 7)
    assert np.abs(w - w_full[:, :, 4:]).max() < 1e-6
    assert np.all(w[..., 0, 5:] == 0) and np.all(w[..., 1, 6:] == 0) and np.all(w[..., 2, :] > 0)
    assert np.abs(last - full[:, 4:]).max() < 1e-5


def _grow(cache, shape, *, seed, times, dtype=np.float32):
    """Append chunks of 5, 20, 1 and 40 tokens of ``shape (N, H, Dh)`` to ``cache``, keys
    ``c`` and values ``times * c``, so that it grows several times: the keys and values the
    last append handed back, the chunks, and all of them in one array."""
    rng = np.random.default_rng(seed)
    N, H, Dh = shape
    chunks = [rng.standard_normal((N, H, n, Dh)).astype(dtype) for n in (5, 20, 1, 40)]
    for c in chunks:
        k, v = cache.append(c, times * c)
    return k, v, chunks, np.concatenate(chunks, axis=2)


def test_kv_cache_grows_and_keeps_what_it_holds():
    cache = KVCache()
    k, v, _, everything = _grow(cache, (1, 2, 3), seed=0, times=2, dtype=np.float64)
    assert np.array_equal(k, everything) and np.array_equal(v, 2 * everything)
    assert "length=66" in repr(cache)


def test_a_float16_cache_stores_half_and_hands_back_the_keys_dtype():
    """``KVCache(dtype="float16")``: storage in float16 (rounded as NumPy's astype rounds),
    every key and value handed back in the dtype it came in, through growth."""
    cache = KVCache(dtype="float16")
    k, v, chunks, everything = _grow(cache, (1, 2, 3), seed=0, times=3)
    assert k.dtype == v.dtype == np.float32 and cache._key.dtype == cache._value.dtype == np.float16
    assert np.array_equal(k, everything.astype(np.float16).astype(np.float32))
    assert np.array_equal(v, (3 * everything).astype(np.float16).astype(np.float32))
    assert not np.array_equal(k, everything)  # rounded: float16 keeps 11 bits
    assert cache._key.nbytes == cache._key.size * 2
    assert repr(cache) == "KVCache(length=66, key shape=(1, 2, 66, 3), dtype=float16)"
    cache.reset()
    assert len(cache) == 0 and cache.dtype == np.float16
    k, _ = cache.append(everything.astype(np.float64), everything.astype(np.float64))  # a new dtype after reset
    assert k.dtype == np.float64 and np.array_equal(k, everything.astype(np.float16).astype(np.float64))
    same = KVCache(dtype="float32")  # the keys' own dtype: views, no copies
    k, _ = same.append(chunks[0], chunks[0])
    assert np.shares_memory(k, same._key)


def test_an_int8_cache_stores_codes_and_a_scale_a_token_and_head():
    """``KVCache(dtype="int8")``: each new token's head as int8 codes and a float32 scale
    (:func:`attnlab.nn.attention.quantize_int8`), every key and value handed back as ``codes
    * scale`` in the dtype it came in, through growth, reset and crop."""
    from attnlab.nn.attention import quantize_int8

    cache = KVCache(dtype="int8")
    k, v, _, everything = _grow(cache, (2, 3, 8), seed=1, times=3)
    codes, scales = quantize_int8(everything)
    assert k.dtype == v.dtype == np.float32 and k.shape == (2, 3, 66, 8)
    assert cache._key.dtype == np.int8 and cache._key_scale.shape == (2, 3, cache._key.shape[2])
    assert np.array_equal(cache._key[:, :, :66], codes) and np.array_equal(cache._key_scale[:, :, :66], scales)
    assert np.array_equal(k, codes * scales[..., None])
    assert np.abs(k - everything).max() <= 0.5 * scales.max() * (1 + 1e-6)
    assert 0.3 * scales.max() < np.abs(k - everything).max()  # the codes' rounding shows
    vc, vs = quantize_int8(3 * everything)
    assert np.array_equal(v, vc * vs[..., None])
    assert [a.dtype for a in cache.dequantized()] == [np.float32] * 2 and np.array_equal(cache.dequantized()[0], k)
    assert repr(cache) == "KVCache(length=66, key shape=(2, 3, 66, 8), dtype=int8)"
    cache.crop(30)
    k, _ = cache.append(everything[:, :, :1], everything[:, :, :1])
    assert k.shape == (2, 3, 31, 8) and np.array_equal(k[:, :, 30], codes[:, :, 0] * scales[:, :, 0, None])
    cache.reset()
    assert len(cache) == 0 and cache.dtype == np.int8 and cache._key_scale is None
    k, _ = cache.append(everything.astype(np.float64), everything.astype(np.float64))  # float64 keys
    assert k.dtype == np.float64 and np.array_equal(k, codes.astype(np.float64) * scales[..., None])  # exact
    half = cache.dequantized(np.float16)[0]  # rounded once, from float32
    assert half.dtype == np.float16 and np.array_equal(half, (codes * scales[..., None]).astype(np.float16))
    with pytest.raises(TypeError, match="dequantized\\(\\) reads an int8 cache, this one stores float16"):
        KVCache(dtype="float16").dequantized()
    with pytest.raises(ValueError, match="the cache is empty"):
        KVCache(dtype="int8").dequantized()


def test_an_int8_cache_refuses_what_it_cannot_hold_and_keeps_what_it_has():
    cache = KVCache(dtype="int8")
    x = np.ones((1, 2, 3, 4), np.float32)
    cache.append(x, x)
    for bad in (np.inf, -np.inf, np.nan):
        y = x.copy()
        y[0, 1, 2, 3] = bad
        with pytest.raises(ValueError, match=r"^an int8 cache stores finite keys and values only, got inf or NaN: "
                                             r"keep this cache in float32$"):
            cache.append(x, y)
    with pytest.raises(ValueError, match="beyond float32's range\\): keep this cache in float64"):
        KVCache(dtype="int8").append(np.full((1, 1, 1, 2), 1e300), np.ones((1, 1, 1, 2)))
    assert len(cache) == 3
    k, v = cache.append(x[:, :, :1], x[:, :, :1])  # the failed tokens were never cached
    assert k.shape == (1, 2, 4, 4) and np.array_equal(v, np.ones_like(v))
    with pytest.raises(TypeError, match="KVCache\\(dtype=int8\\) stores floating NumPy arrays, got numpy.ndarray "
                                        "keys of dtype int8"):
        KVCache(dtype="int8").append(np.ones((1, 1, 1, 2), np.int8), np.ones((1, 1, 1, 2), np.int8))
    torch = pytest.importorskip("torch")
    t = torch.ones((1, 2, 3, 4))
    with pytest.raises(TypeError, match="KVCache\\(dtype=int8\\) stores floating NumPy arrays, got torch.Tensor"):
        KVCache(dtype="int8").append(t, t)


def test_cache_dtype_errors_leave_the_cache_as_it_was():
    for bad in ("int4", "bfloat16", object, "float8", "uint8"):
        with pytest.raises(ValueError, match=r"cache dtype must be one of float16, float32, float64, int8 \(or None: "
                                             r"the keys' own\), got"):
            KVCache(dtype=bad)
    cache = KVCache(dtype="float16")
    x = np.ones((1, 2, 3, 4), np.float32)
    cache.append(x, x)
    big = x.copy()
    big[0, 1, 2, 3] = 7e4  # beyond float16's 65504
    with pytest.raises(ValueError, match=r"beyond float16's range \(the largest finite float16 is 65504\): "
                                         "keep this cache in float32"):
        cache.append(x, big)
    assert len(cache) == 3
    k, v = cache.append(x[:, :, :1], x[:, :, :1])  # the failed tokens were never cached
    assert k.shape == (1, 2, 4, 4) and np.isfinite(v).all()
    with pytest.raises(ValueError, match=r"key has shape \(1, 2, 1, 4\), but should be \(1, 2, S_new, 4\) "
                                         r"\(float32\) like the cached keys"):
        cache.append(x[:, :, :1].astype(np.float64), x[:, :, :1].astype(np.float64))
    torch = pytest.importorskip("torch")
    t = torch.ones((1, 2, 3, 4))
    k, _ = KVCache(dtype="float32").append(t, t)  # the keys' own dtype: stored in their library
    assert isinstance(k, torch.Tensor) and k.shape == (1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"KVCache\(dtype=float16\) stores floating NumPy arrays, got "
                                        "torch.Tensor keys of dtype torch.float32"):
        KVCache(dtype="float16").append(t, t)
    with pytest.raises(TypeError, match="stores floating NumPy arrays, got numpy.ndarray keys of dtype int64"):
        KVCache(dtype="float16").append(np.ones((1, 1, 1, 2), np.int64), np.ones((1, 1, 1, 2), np.int64))


def test_a_forward_pass_that_raises_leaves_every_layer_cache_as_it_was():
    """A hook that raises in the last block: no layer keeps the new tokens (the first blocks
    had cached them), and decoding goes on as if the call had not been made."""
    model = _tiny()
    cache = model.new_cache()
    model(np.array([[1, 2, 3]]), cache=cache)

    def boom(x, name):
        raise RuntimeError("a hook that fails")

    with model.hooks([("blocks.2.hook_attn_out", boom)]), pytest.raises(RuntimeError, match="a hook that fails"):
        model(np.array([[4, 5]]), cache=cache)
    assert [len(c) for c in cache] == [3, 3, 3]
    got = model(np.array([[4, 5]]), cache=cache)
    np.testing.assert_allclose(got, model(np.array([[1, 2, 3, 4, 5]]))[:, 3:], rtol=1e-5, atol=1e-6)


def test_kv_cache_crop():
    cache = KVCache()
    x = np.arange(2 * 6 * 2, dtype=np.float32).reshape(1, 2, 6, 2)
    cache.append(x, x)
    cache.crop(10)
    assert len(cache) == 6
    cache.crop(-2)
    assert len(cache) == 4
    k, _ = cache.append(x[:, :, :1], x[:, :, :1])
    assert np.array_equal(k, np.concatenate([x[:, :, :4], x[:, :, :1]], axis=2))
    cache.crop(-10)
    assert len(cache) == 0
    with pytest.raises(TypeError, match="length must be an int, got float"):
        cache.crop(1.5)
    # immutable storage (JAX) is cut itself: tests/test_to_array_libraries.py (JAX in a process of its own)


def test_generation_with_a_float16_cache():
    """``generate(..., cache_dtype="float16")``: the same greedy tokens as the float32 cache
    here, a float16 cache in every block, and a bad dtype refused before any token."""
    model = _tiny()
    ids = np.array([[1, 2, 3]])
    assert np.array_equal(model.generate(ids, 6, cache_dtype="float16"), model.generate(ids, 6))
    assert all(c.dtype == np.float16 for c in model.new_cache(dtype=np.float16))
    with pytest.raises(ValueError, match="cache dtype must be one of"):
        model.stream(ids, 3, cache_dtype="int4")


def test_generation_with_an_int8_cache():
    """``generate(..., cache_dtype="int8")``: the same greedy tokens as the float32 cache
    here, an int8 cache in every block."""
    model = _tiny()
    ids = np.array([[1, 2, 3]])
    assert np.array_equal(model.generate(ids, 6, cache_dtype="int8"), model.generate(ids, 6))
    assert all(c.dtype == np.int8 for c in model.new_cache(dtype="int8"))


def test_tiny_state_dict_names_are_unchanged():
    names = list(_tiny().state_dict())
    block = ["ln_1.weight", "ln_1.bias", "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
             "attn.out_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight",
             "mlp.2.bias"]
    assert names == ["tok_emb.weight", "pos_emb.weight",
                     *[f"blocks.{i}.{n}" for i in range(3) for n in block],
                     "ln_f.weight", "ln_f.bias", "head.weight"]


@pytest.mark.parametrize("layer, k", [(1, 1), (2, 2), (-1, 3), (-3, 1)])
def test_tiny_trace_is_its_attention_map(layer, k):
    model = _tiny()
    ids = np.array([3, 1, 4, 1, 5, 9])
    maps = model.attention_maps(ids)
    t = model.trace(ids, layer=layer)
    assert t.layer == k and t.tokens == ["3", "1", "4", "1", "5", "9"]
    assert np.abs(np.stack([t.get("weights", h) for h in range(4)]) - maps[k - 1]).max() == 0
    assert "masked_scores" in t.names()  # causal
    one = model.trace(ids, layer=layer, head=1, tokens=list("abcdef"))
    assert {s.head for s in one.steps} == {None, 1} and one.tokens == list("abcdef")
    assert model.training is False


def test_tiny_trace_refuses_layer_zero():
    with pytest.raises(ValueError, match="layer 0 is the embeddings, which have no attention"):
        _tiny().trace(np.array([1, 2]), layer=0)
