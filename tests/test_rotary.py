"""Rotary position embedding against transformers (inverse frequencies of every scaling
type, cos/sin, ``apply_rotary_pos_emb``) and its backward pass against torch autograd;
the sliding-window causal mask against transformers' mask functions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.core.masks import causal_mask, sliding_window_mask
from attnlab.core.rotary import (
    ROPE_TYPES,
    RopeConfig,
    apply_rotary,
    apply_rotary_backward,
    rope_cos_sin,
    rope_inv_freq,
)
from attnlab.nn import RotaryEmbedding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

# One parameter set per scaling type (dynamic and yarn also with their options).
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default-100k": {"rope_type": "default", "rope_theta": 100000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                    "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0,
                    "rope_theta": 10000.0},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
                              "attention_factor": 1.3, "rope_theta": 10000.0},
}


def hf_config(params, head_dim=16, max_pos=32, **extra):
    return LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters=dict(params), **extra)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(SCALINGS))
@pytest.mark.parametrize("batched", [False, True])
def test_cos_sin_and_rotation_match_transformers(name, batched):
    cfg = hf_config(SCALINGS[name])
    hf = LlamaRotaryEmbedding(cfg)
    rope = RotaryEmbedding(RopeConfig.from_hf(cfg.to_dict()))
    rng = np.random.default_rng(3)
    T = 48  # past max_position_embeddings=32: dynamic scaling recomputes
    pos = np.stack([np.arange(T), np.arange(T) + 5]) if batched else np.arange(T)
    tpos = torch.from_numpy(pos if batched else pos[None])
    cos_t, sin_t = hf(torch.zeros(1), tpos)
    cos, sin = rope.cos_sin(pos)
    want_c, want_s = (cos_t, sin_t) if batched else (cos_t[0], sin_t[0])
    assert np.abs(cos - want_c.numpy()).max() <= 1e-6
    assert np.abs(sin - want_s.numpy()).max() <= 1e-6
    B = 2 if batched else 1
    q = rng.standard_normal((B, 4, T, 16)).astype(np.float32)
    k = rng.standard_normal((B, 2, T, 16)).astype(np.float32)
    rq, rk = rope(q, k, pos)
    tq, tk = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos_t, sin_t)
    assert np.abs(rq - tq.numpy()).max() <= 1e-6 * np.abs(tq.numpy()).max()
    assert np.abs(rk - tk.numpy()).max() <= 1e-6 * np.abs(tk.numpy()).max()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_match_transformers_init_functions(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config(SCALINGS[name], head_dim=32)
    kind = SCALINGS[name]["rope_type"]
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    for seq_len in (None, 20, 100):
        want, want_att = init(cfg, "cpu", seq_len=seq_len) if kind != "default" else init(cfg)
        got, att = rope_inv_freq(RopeConfig.from_hf(cfg.to_dict()), seq_len=seq_len)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
        assert att == pytest.approx(want_att, rel=1e-12)


def test_partial_rotary_rotates_the_leading_dims_as_neox_does():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply

    cfg = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=64)
    hf = GPTNeoXRotaryEmbedding(cfg)
    rc = RopeConfig.from_hf(cfg.to_dict())
    assert rc.rotary_dim == 4
    rope = RotaryEmbedding(rc)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 9, 16)).astype(np.float32)
    pos = np.arange(9)
    cos_t, sin_t = hf(torch.zeros(1), torch.from_numpy(pos[None]))
    tq, tk = neox_apply(torch.from_numpy(q), torch.from_numpy(q), cos_t, sin_t)
    rq, rk = rope(q, q, pos)
    assert np.abs(rq - tq.numpy()).max() <= 1e-6
    np.testing.assert_array_equal(rq[..., 4:], q[..., 4:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("partial", [None, 0.5])
def test_backward_matches_autograd(dtype, partial):
    rng = np.random.default_rng(1)
    rope = RotaryEmbedding(RopeConfig(8, theta=1000.0, partial_rotary_factor=partial))
    q = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    k = rng.standard_normal((2, 1, 5, 8)).astype(dtype)
    pos = np.array([[0, 1, 2, 3, 4], [7, 1, 1, 2, 9]])
    gq = rng.standard_normal(q.shape).astype(dtype)
    gk = rng.standard_normal(k.shape).astype(dtype)
    rq, rk = rope(q, k, pos)
    dq, dk = rope.backward(gq, gk)
    cos, sin = (torch.from_numpy(a) for a in rope.cos_sin(pos, dtype))
    tq, tk = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    R = rope.rotary_dim
    oq = torch.cat([apply_rotary_pos_emb(tq[..., :R], tk[..., :R], cos, sin)[0], tq[..., R:]], -1)
    ok = torch.cat([apply_rotary_pos_emb(tq[..., :R], tk[..., :R], cos, sin)[1], tk[..., R:]], -1)
    (oq * torch.from_numpy(gq)).sum().add((ok * torch.from_numpy(gk)).sum()).backward()
    tol = 1e-6 if dtype == np.float32 else 1e-13
    assert np.abs(rq - oq.detach().numpy()).max() <= tol * 10
    assert np.abs(dq - tq.grad.numpy()).max() <= tol * 10
    assert np.abs(dk - tk.grad.numpy()).max() <= tol * 10
    assert dq.dtype == dtype and dk.dtype == dtype


@pytest.mark.parametrize(("x_shape", "cos_shape"), [
    ((1, 9, 512, 64), (512, 64)),  # one rotation for every row and head
    ((2, 3, 512, 64), (2, 1, 512, 64)),  # per-row positions (a left-padded batch)
    ((1, 4, 512, 64), (1, 1, 512, 32)),  # partial rotary: the last 32 dims pass through
])
def test_large_float32_rotations_run_compiled_with_the_same_numbers(x_shape, cos_shape, monkeypatch):
    """From rotary._COMPILED_MIN elements a float32 rotation (forward and transposed, of a
    head-transposed projection: strided) runs on the compiled loop, and gives the NumPy
    path's numbers bit for bit; other shapes, dtypes and sizes keep the NumPy path."""
    pytest.importorskip("numba")
    from attnlab.core import rotary

    rng = np.random.default_rng(9)
    N, H, T, D = x_shape
    x = rng.standard_normal((N, T, H, D)).astype(np.float32).transpose(0, 2, 1, 3)
    cos, sin = (rng.standard_normal(cos_shape).astype(np.float32) for _ in range(2))
    got = apply_rotary(x, cos, sin), apply_rotary_backward(x, cos, sin)
    assert rotary._rotate_compiled(x, cos, sin, 1.0) is not None
    monkeypatch.setattr(rotary, "_rotate_compiled", lambda *args: None)
    want = apply_rotary(x, cos, sin), apply_rotary_backward(x, cos, sin)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()
    small = x[:, :, :8]
    for args in ((x.astype(np.float64), cos, sin),  # float64
                 (x, cos[..., :8, :], sin[..., :8, :]),  # positions of another length: NumPy decides
                 (small, cos[..., :8, :], sin[..., :8, :]),  # too small
                 (x[0], cos, sin)):  # 3-D
        assert rotary._rotate_compiled(*args, 1.0) is None


def test_rotation_keeps_norms_and_relative_positions():
    """A rotation keeps each vector's length, and q.k depends only on the position offset."""
    rng = np.random.default_rng(2)
    inv, _ = rope_inv_freq(RopeConfig(16))
    q = rng.standard_normal(16)
    k = rng.standard_normal(16)

    def rot(x, p):
        c, s = rope_cos_sin(inv, np.array([p]), dtype=np.float64)
        return apply_rotary(x[None], c, s)[0]

    assert np.linalg.norm(rot(q, 7)) == pytest.approx(np.linalg.norm(q), rel=1e-6)
    assert rot(q, 9) @ rot(k, 4) == pytest.approx(rot(q, 25) @ rot(k, 20), rel=1e-5)
    c, s = rope_cos_sin(inv, np.arange(3), dtype=np.float64)
    x = rng.standard_normal((3, 16))
    np.testing.assert_allclose(apply_rotary_backward(apply_rotary(x, c, s), c, s), x, atol=1e-6)


def test_unsupported_scaling_type_is_named_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"'longrope' is not supported; supported types: default, linear, "
                                         r"dynamic, llama3, yarn"):
        RopeConfig.from_hf({"hidden_size": 64, "num_attention_heads": 4,
                            "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    assert set(ROPE_TYPES) == {"default", "linear", "dynamic", "llama3", "yarn"}
    with pytest.raises(ValueError, match="'llama3' needs .*low_freq_factor"):
        RopeConfig(8, rope_type="llama3", factor=8.0)


def test_bad_positions_and_shapes_are_refused():
    rope = RotaryEmbedding(8)
    q = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"positions has shape \(4,\), but should be \(3,\)"):
        rope(q, q, np.arange(4))
    with pytest.raises(TypeError, match="integer"):
        rope(q, q, np.arange(3.0))
    with pytest.raises(ValueError, match=">= 0"):
        rope(q, q, np.array([-1, 0, 1]))
    with pytest.raises(ValueError, match=r"q has shape \(1, 2, 3, 4\)"):
        rope(q[..., :4], q, np.arange(3))


def test_the_cos_table_grows_and_equals_a_direct_computation():
    rope = RotaryEmbedding(RopeConfig(8, theta=10000.0))
    small = rope.cos_sin(np.arange(10))[0]
    big = rope.cos_sin(np.array([1000, 3]))[0]
    inv, _ = rope_inv_freq(rope.config)
    np.testing.assert_array_equal(big, rope_cos_sin(inv, np.array([1000, 3]))[0])
    np.testing.assert_array_equal(small, rope.cos_sin(np.arange(10))[0])


# ---- sliding-window masks ------------------------------------------------------------
def hf_sliding(L, S, window, offset):
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    fn = and_masks(causal_mask_function, sliding_window_overlay(window))
    return np.array([[bool(fn(0, 0, torch.tensor(i + offset), torch.tensor(j))) for j in range(S)]
                     for i in range(L)])


@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 7), past=st.integers(0, 9), window=st.integers(1, 12))
def test_sliding_window_mask_matches_transformers(L, past, window):
    S = L + past
    got = sliding_window_mask(L, S, window=window, align="bottom-right")
    np.testing.assert_array_equal(got, hf_sliding(L, S, window, past))
    assert (got.sum(-1) == np.minimum(window, np.arange(L) + past + 1)).all()
    if window >= S:
        np.testing.assert_array_equal(got, causal_mask(L, S, align="bottom-right"))


def test_sliding_window_mask_in_torch_and_bad_window():
    m = sliding_window_mask(3, 5, window=2, align="bottom-right", like=torch.zeros(1))
    assert isinstance(m, torch.Tensor)
    np.testing.assert_array_equal(m.numpy(), sliding_window_mask(3, 5, window=2, align="bottom-right"))
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        sliding_window_mask(3, window=0)
