"""Hook points, run_with_cache and run_with_hooks: the API, its errors, and parity with
TransformerLens 4.3 (an oracle only) on random-weight GPT-2s written by transformers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from attnlab.models import GPT2, GPT2Config, TinyTransformer, TinyTransformerConfig
from attnlab.nn import ActivationCache, Attention, MultiheadAttention
from attnlab.nn.hooks import hook_points
from helpers import assert_head_ablation_matches, assert_resid_pre_patching_matches

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _gpt2(rng_seed=0, **kw):
    cfg = GPT2Config(vocab_size=kw.pop("vocab_size", 60), n_positions=32, n_embd=kw.pop("n_embd", 16),
                     n_layer=kw.pop("n_layer", 2), n_head=kw.pop("n_head", 2))
    return GPT2(cfg, rng=np.random.default_rng(rng_seed))


GPT2_BLOCK_HOOKS = [
    "hook_resid_pre", "hook_q_input", "hook_k_input", "hook_v_input", "ln1.hook_normalized", "attn.hook_q",
    "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out",
    "hook_resid_mid", "hook_mlp_in", "ln2.hook_normalized", "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out",
    "hook_resid_post",
]


def test_gpt2_hook_names_are_transformer_lens_names_in_forward_order():
    model = _gpt2()
    want = ["hook_embed", "hook_pos_embed"]
    for i in range(2):
        want += [f"blocks.{i}.{n}" for n in GPT2_BLOCK_HOOKS]
    assert model.hook_names() == want + ["ln_final.hook_normalized"]


def test_cache_shapes_and_read_only():
    model = _gpt2(n_embd=24, n_head=3)
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    logits, cache = model.run_with_cache(ids)
    assert isinstance(cache, ActivationCache)
    assert np.array_equal(logits, model(ids))
    assert cache["blocks.1.attn.hook_q"].shape == (2, 4, 3, 8)
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, 3, 4, 4)
    assert cache["blocks.0.mlp.hook_pre"].shape == (2, 4, 96)
    assert cache["hook_pos_embed"].shape == (2, 4, 24)
    with pytest.raises(ValueError, match="read-only"):
        cache["blocks.0.hook_resid_pre"][0, 0, 0] = 1.0
    # the cache holds copies: the residual, updated in place by the block, is the input
    assert np.array_equal(cache["blocks.0.hook_resid_pre"], cache["hook_embed"] + cache["hook_pos_embed"])


@pytest.mark.parametrize("names_filter, expect", [
    ("blocks.0.hook_resid_post", ["blocks.0.hook_resid_post"]),
    (["blocks.1.attn.hook_z", "hook_embed"], ["hook_embed", "blocks.1.attn.hook_z"]),
    (lambda n: n.endswith("hook_pattern"), ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]),
])
def test_names_filter_keeps_only_what_was_asked(names_filter, expect):
    _, cache = _gpt2().run_with_cache(np.array([[1, 2, 3]]), names_filter=names_filter)
    assert list(cache) == expect
    assert cache.nbytes == sum(cache[n].nbytes for n in expect)


def test_hook_errors_name_the_hook_and_the_value():
    model = _gpt2()
    ids = np.array([[1, 2, 3]])
    with pytest.raises(KeyError, match=r"blocks.0.attn.hook_pattern"):
        model.run_with_cache(ids, names_filter=["blocks.0.attn.hook_patern"])
    with pytest.raises(KeyError, match=r"closest: blocks.1.hook_resid_post"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_pst", lambda x, n: None)])
    with pytest.raises(TypeError, match="names_filter must be"):
        model.run_with_cache(ids, names_filter=3)
    with pytest.raises(TypeError, match="names_filter must be"):
        model.run_with_cache(ids, names_filter=[1, 2])

    def bad_shape(x, name):
        return x[..., :-1]

    with pytest.raises(ValueError, match=r"hook on 'blocks.0.hook_attn_out' returned an array \(1, 3, 15\).*"
                       r"activation is \(1, 3, 16\)"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_attn_out", bad_shape)])
    with pytest.raises(ValueError, match="dtype float64"):
        model.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda x, n: x.astype(np.float64))])
    with pytest.raises(TypeError, match="returned list"):
        model.run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda x, n: [1])])


def test_hooks_are_removed_after_the_call_even_when_it_raises():
    model = _gpt2()
    ids = np.array([[1, 2, 3]])
    clean = model(ids)

    def boom(x, name):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_resid_mid", boom)])
    zero = [("blocks.1.hook_mlp_out", lambda x, n: np.zeros_like(x))]
    assert not np.array_equal(model.run_with_hooks(ids, fwd_hooks=zero), clean)
    assert np.array_equal(model(ids), clean)
    assert all(not point._fns for _, point in hook_points(model))


def test_replacing_an_activation_changes_what_follows_and_only_that():
    model = _gpt2()
    ids = np.array([[1, 2, 3, 4]])
    _, clean = model.run_with_cache(ids)

    def patch(x, name):
        y = x.copy()
        y[:, 2] = 0.0
        return y

    _, cache = model.run_with_cache(ids, names_filter=lambda n: n.startswith("blocks.1."))
    with model.hooks([("blocks.1.hook_resid_pre", patch)]):
        _, patched = model.run_with_cache(ids)
    assert np.array_equal(patched["blocks.1.hook_resid_pre"][:, 2], np.zeros((1, 16), np.float32))
    # earlier positions cannot see position 2 (causal): unchanged; position 2 changes
    np.testing.assert_array_equal(patched["blocks.1.hook_resid_post"][:, :2], clean["blocks.1.hook_resid_post"][:, :2])
    assert not np.allclose(patched["blocks.1.hook_resid_post"][:, 2], clean["blocks.1.hook_resid_post"][:, 2])


def test_hooks_run_once_per_step_in_generate():
    model = _gpt2()
    seen = []
    with model.hooks([("blocks.0.attn.hook_pattern", lambda x, n: seen.append(x.shape))]):
        out = model.generate(np.array([[1, 2, 3]]), 4)
    assert out.shape == (1, 7)
    assert seen == [(1, 2, 3, 3), (1, 2, 1, 4), (1, 2, 1, 5), (1, 2, 1, 6)]
    assert np.array_equal(model.generate(np.array([[1, 2, 3]]), 4), out)


def test_maps_are_computed_once_and_output_is_weights_times_values():
    mha = MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    calls = []

    def counting_fn(*args, **kwargs):
        calls.append(1)
        raise AssertionError("the kernel must not run when the weights are wanted")

    mha.attention_fn = counting_fn
    out, w = mha(x, x, x, average_attn_weights=False)
    assert calls == []
    # the output equals weights @ V through the layer's own projections
    _, cache = mha.run_with_cache(x, x, x)
    z = np.einsum("nhls,nshd->nlhd", cache["hook_pattern"], cache["hook_v"])
    np.testing.assert_allclose(cache["hook_z"], z, atol=1e-6)
    np.testing.assert_array_equal(cache["hook_pattern"], w)


def test_grouped_query_attention_hooks_have_the_key_value_head_count():
    attn = Attention(12, 6, num_kv_heads=2, causal=True, rng=np.random.default_rng(0))
    x = np.random.default_rng(2).standard_normal((2, 5, 12)).astype(np.float32)
    out, cache = attn.run_with_cache(x)
    assert cache["hook_q"].shape == (2, 5, 6, 2) and cache["hook_k"].shape == (2, 5, 2, 2)
    # query head h reads key/value head h // 3
    k = np.repeat(cache["hook_k"], 3, axis=2)
    scores = np.einsum("blhd,bshd->bhls", cache["hook_q"], k) / np.sqrt(2)
    scores[:, :, ~np.tri(5, dtype=bool)] = -np.inf
    np.testing.assert_allclose(cache["hook_attn_scores"], scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, attn(x), atol=1e-6)


# ---------------------------------------------------------------------------- TransformerLens


def _write_gpt2(tmp_path, seed, **cfg):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **cfg)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    return hf


def _bridge(folder, hf):
    tl = pytest.importorskip("transformer_lens.model_bridge")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = tl.TransformerBridge.boot_transformers(str(folder), hf_model=hf, load_weights=True)
        bridge.enable_compatibility_mode(no_processing=True)
    return bridge


SHAPES = [
    dict(vocab_size=80, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    dict(vocab_size=50, n_positions=24, n_embd=48, n_layer=3, n_head=3, activation_function="gelu"),
    dict(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=1),
]


@pytest.fixture(scope="module", params=range(len(SHAPES)), ids=lambda i: f"shape{i}")
def gpt2_pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gpt2_{request.param}")
    cfg = SHAPES[request.param]
    hf = _write_gpt2(folder, request.param, **cfg)
    bridge = _bridge(folder, hf)
    ids = np.random.default_rng(request.param).integers(0, cfg["vocab_size"], size=(2, 9))
    return GPT2.from_pretrained(folder), bridge, ids


def _to_np(t):
    return t.detach().numpy()


def test_every_shared_hook_agrees_with_transformer_lens(gpt2_pair):
    model, bridge, ids = gpt2_pair
    logits, cache = model.run_with_cache(ids)
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(ids))
    np.testing.assert_allclose(logits, _to_np(tl_logits), atol=1e-5)
    shared = [n for n in model.hook_names() if n in tl_cache]
    # GPT-2: TransformerLens caches every one we cache (by default neither caches the per-head
    # inputs and hook_mlp_in, which fire only when named)
    assert shared == list(cache)
    for name in shared:
        a, b = cache[name], _to_np(tl_cache[name])
        assert a.shape == b.shape, name
        keep = np.isfinite(a) & np.isfinite(b)  # masked scores: -inf here, a large negative there
        if name.endswith("hook_attn_scores"):
            causal = np.tri(ids.shape[1], dtype=bool)
            assert keep[..., causal].all() and not np.isfinite(a[..., ~causal]).any()
        np.testing.assert_allclose(a[keep], b[keep], atol=1e-5, rtol=0, err_msg=name)


def test_zero_ablating_each_head_matches_transformer_lens(gpt2_pair):
    model, bridge, ids = gpt2_pair
    assert_head_ablation_matches(model, bridge, ids, range(model.config.n_layer), range(model.config.n_head))


def test_patching_resid_pre_at_each_block_and_position_matches_transformer_lens(gpt2_pair):
    model, bridge, ids = gpt2_pair
    assert_resid_pre_patching_matches(model, bridge, ids[:1], ids[1:])


def test_tiny_transformer_and_bert_have_the_same_names():
    tiny = TinyTransformer(TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32),
                           rng=np.random.default_rng(0))
    names = tiny.hook_names()
    assert names[:3] == ["hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre"]
    assert names[-1] == "ln_final.hook_normalized"
    _, cache = tiny.run_with_cache(np.array([[1, 2, 3]]))
    assert cache["blocks.0.attn.hook_pattern"].shape == (1, tiny.config.n_heads, 3, 3)
