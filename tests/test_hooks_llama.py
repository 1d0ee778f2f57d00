"""Hook parity with TransformerLens 4.3 (an oracle only) on random-weight grouped-query
Llama models written by transformers: every hook both libraries have (rotary ones
included), head ablation and resid_pre patching."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")
pytest.importorskip("tokenizers")

from attnlab.models.llama import Llama  # noqa: E402
from helpers import assert_head_ablation_matches, assert_resid_pre_patching_matches, random_llama  # noqa: E402

SHAPES = [
    dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2),
    dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
         tie_word_embeddings=True),
    dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
         rope_theta=500.0),
]


@pytest.fixture(scope="module", params=range(len(SHAPES)), ids=lambda i: f"shape{i}")
def llama_pair(request, tmp_path_factory):
    from transformer_lens.model_bridge import TransformerBridge

    folder = tmp_path_factory.mktemp(f"llama_{request.param}")
    hf = random_llama(folder, seed=request.param, **SHAPES[request.param])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(
            str(folder), hf_model=hf, load_weights=True,
            tokenizer=transformers.AutoTokenizer.from_pretrained(folder))
        bridge.enable_compatibility_mode(no_processing=True)
    ids = np.random.default_rng(request.param).integers(3, 64, size=(2, 8))
    return Llama.from_pretrained(folder), bridge, ids


def _np(t):
    return t.detach().numpy()


def test_every_shared_hook_agrees_with_transformer_lens(llama_pair):
    model, bridge, ids = llama_pair
    logits, cache = model.run_with_cache(ids)
    tl_logits, tl_cache = bridge.run_with_cache(torch.tensor(ids))
    np.testing.assert_allclose(logits, _np(tl_logits), atol=1e-5)
    shared = [n for n in model.hook_names() if n in tl_cache]
    for must in ("blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", "blocks.0.mlp.hook_pre_linear",
                 "ln_final.hook_normalized", "blocks.1.attn.hook_k"):
        assert must in shared
    assert cache["blocks.0.attn.hook_k"].shape[2] == model.layers[0].attn.num_kv_heads
    for name in shared:
        a, b = cache[name], _np(tl_cache[name])
        assert a.shape == b.shape, name
        keep = np.isfinite(a) & np.isfinite(b)
        np.testing.assert_allclose(a[keep], b[keep], atol=1e-5, rtol=0, err_msg=name)


def test_zero_ablating_a_head_and_patching_resid_pre_match_transformer_lens(llama_pair):
    model, bridge, ids = llama_pair
    H = model.layers[0].attn.num_heads
    assert_head_ablation_matches(model, bridge, ids, range(len(model.layers)), (0, H - 1))
    assert_resid_pre_patching_matches(model, bridge, ids[:1], ids[1:])
