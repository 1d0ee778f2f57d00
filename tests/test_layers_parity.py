"""Layer parity with PyTorch: MultiheadAttention (every option), SelfAttention, Linear,
state-dict round trips and interop."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import attnlab
from attnlab.interop import from_torch, to_torch
from conftest import assert_parity

torch = pytest.importorskip("torch")

DTYPES = [np.float32, np.float64]
TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}


def t(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


def torch_mask(mask):
    """attnlab's bool convention (True = takes part) -> torch MHA's (True = ignore)."""
    return None if mask is None else t(attnlab.convert_mha_mask(mask))


def make_pair(dtype, seed=0, **options):
    """An attnlab MHA and a torch MHA with the same weights (copied from torch)."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(dtype=TORCH_DTYPE[dtype], **options)
    ours = from_torch(ref, rng=np.random.default_rng(seed))
    return ours, ref


def inputs(rng, dtype, N, L, S, E, kdim, vdim, batch_first, batched):
    def shape(T, d):
        if not batched:
            return (T, d)
        return (N, T, d) if batch_first else (T, N, d)
    q = rng.standard_normal(shape(L, E)).astype(dtype)
    k = rng.standard_normal(shape(S, kdim)).astype(dtype)
    v = rng.standard_normal(shape(S, vdim)).astype(dtype)
    return q, k, v


OPTIONS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(kdim=5, vdim=3),
    dict(kdim=5, vdim=7, bias=False, add_bias_kv=True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "causal"])
def test_mha_matches_torch(dtype, options, batch_first, batched, masks):
    E, H, N, L, S = 12, 3, 2, 4, 6
    kdim, vdim = options.get("kdim", E), options.get("vdim", E)
    ours, ref = make_pair(dtype, embed_dim=E, num_heads=H, batch_first=batch_first, **options)
    rng = np.random.default_rng(len(str(options)) + 100 * batched + 10 * batch_first)
    q, k, v = inputs(rng, dtype, N, L, S, E, kdim, vdim, batch_first, batched)
    kpm = am = None
    causal = False
    extra_keys = options.get("add_bias_kv", False) or options.get("add_zero_attn", False)
    if masks == "bool":
        kpm = rng.random((N, S) if batched else (S,)) < 0.7
        kpm[..., 0] = True
        am = rng.random((L, S)) < 0.7
        am[:, 1] = True
    elif masks == "float":
        kpm = rng.standard_normal((N, S) if batched else (S,)).astype(dtype)
        am = rng.standard_normal((N * H, L, S) if batched else (H, L, S)).astype(dtype)
    elif masks == "causal":
        causal = True
    for need_weights, average in [(True, True), (True, False), (False, True)]:
        out, w = ours(q, k, v, key_padding_mask=kpm, need_weights=need_weights, attn_mask=am,
                      average_attn_weights=average, is_causal=causal)
        ref_am = torch_mask(am)
        if causal:  # torch needs the mask along with the hint
            ref_am = torch.ones(L, S, dtype=torch.bool).tril().logical_not()
        # torch quirk: with is_causal and need_weights=False it drops the padded mask and
        # applies SDPA's causal mask over the extra bias_kv/zero_attn keys too, unlike its
        # need_weights=True path. attnlab keeps one definition: extra keys stay visible.
        ref_need = need_weights or (causal and extra_keys)
        with torch.no_grad():
            ref_out, ref_w = ref(t(q), t(k), t(v), key_padding_mask=torch_mask(kpm), need_weights=ref_need,
                                 attn_mask=ref_am, average_attn_weights=average, is_causal=causal)
        assert_parity(out, ref_out)
        if need_weights:
            assert_parity(w, ref_w)
        else:
            assert w is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_eval_mode_and_cross_attention(dtype):
    """Eval mode (torch may take its fused fast path) and L != S cross-attention."""
    ours, ref = make_pair(dtype, embed_dim=16, num_heads=4, batch_first=True)
    ours.eval()
    ref.eval()
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 5, 16)).astype(dtype)
    mem = rng.standard_normal((3, 9, 16)).astype(dtype)
    with torch.no_grad():
        for q, kv in [(x, x), (x, mem)]:
            out, w = ours(q, kv, kv)
            ref_out, ref_w = ref(t(q), t(kv), t(kv))
            assert_parity(out, ref_out)
            assert_parity(w, ref_w)
            out, _ = ours(q, kv, kv, need_weights=False)
            ref_out, _ = ref(t(q), t(kv), t(kv), need_weights=False)
            assert_parity(out, ref_out)


def test_mha_fully_padded_row_outputs_zeros_where_torch_gives_nan():
    ours, ref = make_pair(np.float64, embed_dim=8, num_heads=2, batch_first=True)
    x = np.random.default_rng(12).standard_normal((2, 3, 8))
    keep = np.array([[True, True, False], [False, False, False]])  # sequence 1: nothing to attend
    out, w = ours(x, x, x, key_padding_mask=keep)
    with torch.no_grad():
        ref_out, ref_w = ref(t(x), t(x), t(x), key_padding_mask=torch_mask(keep))
    assert np.isnan(ref_out[1].numpy()).all()
    assert np.isfinite(out).all() and np.all(w[1] == 0)
    # the attention part is zero, so the output is the output projection's bias
    np.testing.assert_allclose(out[1], np.broadcast_to(ours.out_proj.bias.data, (3, 8)))
    assert_parity(out[0], ref_out[0])


def test_mha_dropout_train_and_eval():
    mha = attnlab.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, rng=np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)
    a, wa = mha(x, x, x)
    b, wb = mha(x, x, x)
    assert not np.allclose(a, b)  # dropout active in training mode, as in torch
    assert np.any(wa == 0)
    mha.eval()
    c, wc = mha(x, x, x)
    d, _ = mha(x, x, x)
    np.testing.assert_array_equal(c, d)
    np.testing.assert_allclose(wc.sum(-1), 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_state_dict_round_trips_both_ways(dtype, options):
    E = 12
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, 3, dtype=TORCH_DTYPE[dtype], **options)
    # torch -> attnlab: the recipe from the docs loads straight in
    ours = attnlab.MultiheadAttention(E, 3, rng=np.random.default_rng(1), dtype=dtype, **options)
    ours.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    assert list(ours.state_dict()) == list(ref.state_dict())
    for name, value in ours.state_dict().items():
        assert value.shape == tuple(ref.state_dict()[name].shape)
        np.testing.assert_array_equal(value, ref.state_dict()[name].numpy())
    # attnlab -> torch
    fresh = attnlab.MultiheadAttention(E, 3, rng=np.random.default_rng(2), dtype=dtype, **options)
    back = torch.nn.MultiheadAttention(E, 3, dtype=TORCH_DTYPE[dtype], **options)
    back.load_state_dict({k: torch.from_numpy(v) for k, v in fresh.state_dict().items()})
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), fresh.state_dict()[name])


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_initialisation_follows_torch(options):
    E = 64
    mha = attnlab.MultiheadAttention(E, 4, rng=np.random.default_rng(0), **options)
    ref = torch.nn.MultiheadAttention(E, 4, **options)
    for name, p in mha.named_parameters():
        r = dict(ref.named_parameters())[name].detach().numpy()
        assert p.shape == r.shape and p.dtype == np.float32
        if np.all(r == 0):
            assert np.all(p.data == 0), name
        elif "bias_" in name:  # xavier normal: same spread
            assert 0.5 < p.data.std() / r.std() < 2.0, name
        else:  # uniform initialisers: the same bound
            bound = np.abs(r).max()
            assert np.abs(p.data).max() <= bound * 1.05 and np.abs(p.data).max() > bound * 0.8, name
    # an explicit Generator makes it reproducible
    again = attnlab.MultiheadAttention(E, 4, rng=np.random.default_rng(0), **options)
    for (_, a), (_, b) in zip(mha.named_parameters(), again.named_parameters(), strict=True):
        np.testing.assert_array_equal(a.data, b.data)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_self_attention_matches_torch(dtype, qkv_bias, batched):
    ours = attnlab.SelfAttention(3, 2, qkv_bias=qkv_bias, rng=np.random.default_rng(123), dtype=dtype)
    ref = to_torch(ours)
    x = np.random.default_rng(0).random((2, 6, 3) if batched else (6, 3)).astype(dtype)
    ctx, w = ours(x)
    with torch.no_grad():
        ref_ctx, ref_w = ref(t(x))
    assert_parity(ctx, ref_ctx)
    assert_parity(w, ref_w)
    back = from_torch(ref)
    np.testing.assert_array_equal(back(x)[0], ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_interop_round_trip(dtype):
    lin = attnlab.Linear(5, 3, rng=np.random.default_rng(0), dtype=dtype)
    ref = to_torch(lin)
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(dtype)
    with torch.no_grad():
        assert_parity(lin(x), ref(t(x)))
    mha = attnlab.MultiheadAttention(8, 2, kdim=4, vdim=6, add_bias_kv=True, rng=np.random.default_rng(0), dtype=dtype)
    again = from_torch(to_torch(mha))
    for (n1, a), (n2, b) in zip(mha.named_parameters(), again.named_parameters(), strict=True):
        assert n1 == n2
        np.testing.assert_array_equal(a.data, b.data)


def test_layer_uses_its_attention_function():
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return attnlab.scaled_dot_product_attention(*args, **kwargs)

    mha = attnlab.MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0), attention_fn=spy)
    x = np.ones((1, 3, 8), np.float32)
    mha(x, x, x, need_weights=False, is_causal=True)
    assert len(calls) == 1 and calls[0]["is_causal"] is True


def test_option_grid_smoke():
    """Every constructor flag combination builds and runs batched and unbatched."""
    for bias, bkv, zero, kv in itertools.product([True, False], repeat=4):
        dims = dict(kdim=5, vdim=7) if kv else {}
        mha = attnlab.MultiheadAttention(8, 2, bias=bias, add_bias_kv=bkv, add_zero_attn=zero,
                                         rng=np.random.default_rng(0), **dims)
        q = np.ones((3, 2, 8), np.float32)
        k = np.ones((4, 2, dims.get("kdim", 8)), np.float32)
        v = np.ones((4, 2, dims.get("vdim", 8)), np.float32)
        out, w = mha(q, k, v)
        assert out.shape == (3, 2, 8) and w.shape == (2, 3, 4 + bkv + zero)
        out, w = mha(q[:, 0], k[:, 0], v[:, 0], average_attn_weights=False)
        assert out.shape == (3, 8) and w.shape == (2, 3, 4 + bkv + zero)


def test_load_state_dict_assign_adopts_fresh_arrays_and_copies_the_rest():
    layer = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    state = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in layer.state_dict().items()}
    state["out_proj.weight"] = np.asfortranarray(state["out_proj.weight"])  # not C-contiguous
    state["in_proj_bias"] = state["in_proj_bias"].astype(np.float64)  # another dtype
    layer.load_state_dict(state, assign=True)
    assert layer.in_proj_weight.data is state["in_proj_weight"]
    assert layer.out_proj.weight.data is not state["out_proj.weight"]
    assert layer.out_proj.weight.data.flags.c_contiguous
    assert layer.in_proj_bias.data is not state["in_proj_bias"] and layer.in_proj_bias.dtype == np.float32
    for k, v in layer.state_dict().items():
        np.testing.assert_array_equal(v, state[k].astype(np.float32))
    copied = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0))
    copied.load_state_dict(state)
    assert copied.in_proj_weight.data is not state["in_proj_weight"]
