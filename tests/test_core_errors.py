"""Every bad input raises one clear TypeError/ValueError naming the argument and shapes."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab

f32 = np.float32


def arr(*shape, dtype=f32):
    return np.zeros(shape, dtype)


def test_sdpa_rejects_integer_inputs():
    with pytest.raises(TypeError, match=r"query must be a floating-point array .* got dtype int64"):
        attnlab.scaled_dot_product_attention(np.zeros((2, 3), np.int64), arr(2, 3), arr(2, 3))


def test_sdpa_rejects_bool_inputs():
    with pytest.raises(TypeError, match=r"value must be a floating-point array .* bool"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(2, 3), np.zeros((2, 3), bool))


def test_sdpa_rejects_mixed_dtypes():
    with pytest.raises(TypeError, match=r"query=float32, key=float64"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(2, 3, dtype=np.float64), arr(2, 3))


def test_sdpa_rejects_1d_query():
    with pytest.raises(ValueError, match=r"query has shape \(3,\), but should be \(\.\.\., L, E\)"):
        attnlab.scaled_dot_product_attention(arr(3), arr(2, 3), arr(2, 3))


def test_sdpa_rejects_key_with_wrong_head_dim():
    with pytest.raises(ValueError, match=r"key has shape \(4, 5\), but should be \(\.\.\., S, E=3\)"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(4, 5), arr(4, 5))


def test_sdpa_rejects_value_with_wrong_length():
    with pytest.raises(ValueError, match=r"value has shape \(5, 3\), but should be \(4, Ev\)"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(4, 3), arr(5, 3))


def test_sdpa_rejects_unbroadcastable_batch():
    with pytest.raises(ValueError, match=r"query has shape \(2, 4, 3\) and key has shape \(3, 4, 3\)"):
        attnlab.scaled_dot_product_attention(arr(2, 4, 3), arr(3, 4, 3), arr(3, 4, 3))


def test_sdpa_head_mismatch_suggests_gqa():
    with pytest.raises(ValueError, match=r"enable_gqa=True"):
        attnlab.scaled_dot_product_attention(arr(1, 4, 2, 3), arr(1, 2, 2, 3), arr(1, 2, 2, 3))


def test_gqa_heads_must_divide():
    with pytest.raises(ValueError, match=r"key has shape \(1, 3, 2, 8\).*H dividing query's Hq=4"):
        attnlab.scaled_dot_product_attention(
            arr(1, 4, 2, 8), arr(1, 3, 2, 8), arr(1, 3, 2, 8), enable_gqa=True
        )


def test_mask_with_wrong_shape():
    msg = r"attn_mask has shape \(3, 3\), but should be broadcastable to \(\.\.\., L, S\) = \(2, 4\)"
    with pytest.raises(ValueError, match=msg):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(4, 3), arr(4, 3), attn_mask=np.ones((3, 3), bool))


def test_mask_that_would_enlarge_the_output():
    with pytest.raises(ValueError, match=r"attn_mask has shape \(5, 2, 4\)"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(4, 3), arr(4, 3), attn_mask=np.ones((5, 2, 4), bool))


def test_mask_with_integer_dtype():
    with pytest.raises(TypeError, match=r"attn_mask must be boolean .* or floating-point .* int64"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(4, 3), arr(4, 3), attn_mask=np.ones((2, 4), np.int64))


def test_mask_and_is_causal_conflict():
    with pytest.raises(ValueError, match="either attn_mask or is_causal=True, not both"):
        attnlab.scaled_dot_product_attention(
            arr(2, 3), arr(2, 3), arr(2, 3), attn_mask=np.ones((2, 2), bool), is_causal=True
        )


@pytest.mark.parametrize("p", [-0.1, 1.0, 2])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(2, 3), arr(2, 3), dropout_p=p)


def test_rng_must_be_a_generator():
    with pytest.raises(TypeError, match=r"rng must be a numpy.random.Generator"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(2, 3), arr(2, 3), dropout_p=0.1, rng=42)


def test_scale_must_be_a_number():
    with pytest.raises(TypeError, match="scale must be a float or None"):
        attnlab.scaled_dot_product_attention(arr(2, 3), arr(2, 3), arr(2, 3), scale="1")


def test_zero_head_dim():
    with pytest.raises(ValueError, match=r"query has shape \(2, 0\).*E >= 1"):
        attnlab.scaled_dot_product_attention(arr(2, 0), arr(2, 0), arr(2, 0))


def test_softmax_errors():
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        attnlab.softmax(np.arange(3))
    with pytest.raises(ValueError, match=r"axis=2 is out of range for an array of shape \(2, 3\)"):
        attnlab.softmax(arr(2, 3), axis=2)


def test_mask_helpers_errors():
    with pytest.raises(ValueError, match="align must be one of"):
        attnlab.causal_mask(2, 3, align="center")
    with pytest.raises(ValueError, match="L must be a non-negative int, got -1"):
        attnlab.causal_mask(-1)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=3\]"):
        attnlab.padding_mask([4], 3)
    with pytest.raises(ValueError, match=r"lengths has shape \(1, 2\), but should be \(B,\)"):
        attnlab.padding_mask([[1, 2]], 3)
    with pytest.raises(TypeError, match="mask must be boolean or floating-point"):
        attnlab.convert_mha_mask(np.ones(3, np.int32))


def test_mha_constructor_errors():
    with pytest.raises(ValueError, match="embed_dim=10 must be divisible by num_heads=4"):
        attnlab.MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        attnlab.MultiheadAttention(8, 0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        attnlab.MultiheadAttention(8, 2, dropout=1.5)
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        attnlab.MultiheadAttention(8, 2, dtype=np.int32)


def test_mha_call_errors():
    mha = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"query has shape \(3, 2, 7\), but should be \(L, N, 8\)"):
        mha(arr(3, 2, 7), arr(3, 2, 8), arr(3, 2, 8))
    with pytest.raises(ValueError, match=r"key has shape \(4, 8\).*query is batched"):
        mha(arr(3, 2, 8), arr(4, 8), arr(4, 8))
    with pytest.raises(ValueError, match=r"key has shape \(4, 3, 8\).*batch size differs"):
        mha(arr(3, 2, 8), arr(4, 3, 8), arr(4, 3, 8))
    with pytest.raises(ValueError, match=r"value has shape \(5, 2, 8\), but should be \(4, 2, 8\)"):
        mha(arr(3, 2, 8), arr(4, 2, 8), arr(5, 2, 8))
    with pytest.raises(TypeError, match="query has dtype float64, but the layer's parameters are float32"):
        mha(arr(3, 2, 8, dtype=np.float64), arr(4, 2, 8), arr(4, 2, 8))
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(2, 3\), but should be \(2, 4\)"):
        mha(arr(3, 2, 8), arr(4, 2, 8), arr(4, 2, 8), key_padding_mask=np.ones((2, 3), bool))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(4, 4\), but should be \(3, 4\) or \(4, 3, 4\)"):
        mha(arr(3, 2, 8), arr(4, 2, 8), arr(4, 2, 8), attn_mask=np.ones((4, 4), bool))
    with pytest.raises(TypeError, match="key_padding_mask must be boolean"):
        mha(arr(3, 2, 8), arr(4, 2, 8), arr(4, 2, 8), key_padding_mask=np.ones((2, 4), np.int8))


def test_self_attention_errors():
    layer = attnlab.SelfAttention(3, 2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"x has shape \(6, 4\), but should be \(T, 3\) or \(B, T, 3\)"):
        layer(arr(6, 4))
    with pytest.raises(ValueError, match=r"x has shape \(1, 1, 6, 3\)"):
        layer(arr(1, 1, 6, 3))
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        layer(np.ones((6, 3), int))


def test_load_state_dict_errors():
    mha = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0))
    state = mha.state_dict()
    bad = dict(state, in_proj_weight=np.zeros((24, 7), np.float32))
    msg = r"'in_proj_weight' has shape \(24, 7\) in the state dict, but the model needs \(24, 8\)"
    with pytest.raises(ValueError, match=msg):
        mha.load_state_dict(bad)
    missing = {k: v for k, v in state.items() if k != "out_proj.bias"}
    with pytest.raises(KeyError, match=r"missing keys \['out_proj.bias'\]"):
        mha.load_state_dict(missing)
    with pytest.raises(KeyError, match=r"unexpected keys \['extra'\]"):
        mha.load_state_dict(dict(state, extra=np.zeros(1)))
    before = mha.state_dict()
    with pytest.raises(ValueError):
        mha.load_state_dict(dict(state, **{"out_proj.weight": np.zeros((8, 8)), "in_proj_bias": np.zeros(3)}))
    for k, v in mha.state_dict().items():  # nothing was half-loaded
        np.testing.assert_array_equal(v, before[k])


def test_backward_needs_training_mode():
    mha = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0)).eval()
    x = arr(3, 2, 8)
    out, _ = mha(x, x, x)
    with pytest.raises(RuntimeError, match=r"needs a forward call in training mode"):
        mha.backward(out)
