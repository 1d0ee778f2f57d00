"""Backward passes of the layers against torch autograd (weights copied across) and
finite differences: Linear, SelfAttention, MultiheadAttention (every option), Embedding,
LayerNorm, GELU, ReLU, Dropout, FeedForward, TransformerBlock (pre- and post-norm),
CrossEntropyLoss."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.nn import functional as F

torch = pytest.importorskip("torch", reason="torch is the test oracle for gradients")

from helpers import TOL, numerical_grad  # noqa: E402
from helpers import grad_rel_err as rel_err  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")

TDTYPE = {np.float64: torch.float64, np.float32: torch.float32}


def load_into_torch(layer, tlayer):
    tlayer.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in layer.state_dict().items()})


def assert_param_grads(layer, tlayer, dtype, skip=()):
    tparams = dict(tlayer.named_parameters())
    names = [n for n, _ in layer.named_parameters()]
    assert sorted(names) == sorted(tparams), (names, list(tparams))
    for name, p in layer.named_parameters():
        if name in skip:
            continue
        assert p.grad is not None, name
        assert p.grad.dtype == dtype, name
        assert rel_err(p.grad, tparams[name].grad.numpy()) <= TOL[dtype], name


def perturb(layer, rng, scale=0.3):
    """Random non-trivial values (e.g. LayerNorm's ones/zeros, MHA's zero biases)."""
    for p in layer.parameters():
        p.data += (rng.standard_normal(p.shape) * scale).astype(p.dtype)


# ---- Linear -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_backward_matches_torch(dtype, bias):
    rng = np.random.default_rng(0)
    layer = attnlab.Linear(5, 3, bias, rng=rng, dtype=dtype)
    tlayer = torch.nn.Linear(5, 3, bias, dtype=TDTYPE[dtype])
    load_into_torch(layer, tlayer)
    x = rng.standard_normal((2, 4, 5)).astype(dtype)
    g = rng.standard_normal((2, 4, 3)).astype(dtype)
    layer(x)
    gx = layer.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    tlayer(tx).backward(torch.tensor(g))
    assert rel_err(gx, tx.grad.numpy()) <= TOL[dtype]
    assert_param_grads(layer, tlayer, dtype)


def test_gradients_accumulate_until_zero_grad():
    rng = np.random.default_rng(0)
    layer = attnlab.Linear(3, 2, rng=rng, dtype=np.float64)
    x, g = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    layer(x)
    layer.backward(g)
    first = layer.weight.grad.copy()
    layer(x)
    layer.backward(g)
    assert np.allclose(layer.weight.grad, 2 * first)
    layer.zero_grad()
    assert all(p.grad is None for p in layer.parameters())


def test_an_owned_fresh_gradient_is_kept_without_a_copy():
    """Parameter.accumulate(grad, owned=True) keeps a fresh array as the gradient on first
    use (no copy); a view, another dtype or shape, or an unowned array is copied; later
    calls add in place."""
    from attnlab.nn.module import Parameter

    p = Parameter(np.zeros((3, 2), dtype=np.float32))
    fresh = np.ones((3, 2), dtype=np.float32)
    p.accumulate(fresh, owned=True)
    assert p.grad is fresh
    p.accumulate(np.ones((3, 2), dtype=np.float32), owned=True)
    assert p.grad is fresh and np.all(fresh == 2)
    for grad, owned in ((np.ones((3, 2), np.float32), False), (np.ones((6, 2), np.float32)[:3], True),
                        (np.ones((3, 2), np.float64), True), (np.ones((2, 3), np.float32).T, True)):
        p.grad = None
        p.accumulate(grad, owned=owned)
        assert p.grad is not grad and p.grad.dtype == np.float32 and p.grad.shape == (3, 2)
        assert not np.shares_memory(p.grad, grad) and np.all(p.grad == 1)
    # A layer's backward hands over its fresh weight gradient: kept as it is.
    layer = attnlab.Linear(4, 3, rng=np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((5, 4), dtype=np.float32)
    layer(x)
    layer.backward(np.ones((5, 3), dtype=np.float32))
    assert layer.weight.grad.base is None and layer.weight.grad.flags.writeable
    np.testing.assert_allclose(layer.weight.grad, np.ones((3, 5), np.float32) @ x, rtol=1e-6)


def test_backward_without_training_forward_is_a_clear_error():
    layer = attnlab.Linear(3, 2, rng=np.random.default_rng(0)).eval()
    layer(np.ones((1, 3), dtype=np.float32))
    with pytest.raises(RuntimeError, match="training mode"):
        layer.backward(np.ones((1, 2), dtype=np.float32))


# ---- SelfAttention ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True}, {"attn_mask": True}, {"qkv_bias": True}])
def test_self_attention_backward_matches_torch(dtype, opts):
    rng = np.random.default_rng(1)
    layer = attnlab.SelfAttention(5, 4, qkv_bias=bool(opts.get("qkv_bias")), rng=rng, dtype=dtype)
    perturb(layer, rng, 0.1)
    x = rng.standard_normal((2, 6, 5)).astype(dtype)
    g = rng.standard_normal((2, 6, 4)).astype(dtype)
    call = {}
    mask = None
    if opts.get("is_causal"):
        call["is_causal"] = True
        mask = attnlab.causal_mask(6)
    if opts.get("attn_mask"):
        mask = rng.random((6, 6)) < 0.6
        mask[:, 0] = True
        call["attn_mask"] = mask
    context, weights = layer(x, **call)
    gx = layer.backward(g)

    tx = torch.tensor(x, requires_grad=True)
    tw = {n: torch.tensor(p.data, requires_grad=True) for n, p in layer.named_parameters()}

    def proj(name):
        y = tx @ tw[f"{name}.weight"].T
        return y + tw[f"{name}.bias"] if f"{name}.bias" in tw else y

    scores = proj("W_q") @ proj("W_k").transpose(-1, -2) / np.sqrt(4)
    if mask is not None:
        scores = scores.masked_fill(~torch.tensor(mask), float("-inf"))
    t_weights = torch.softmax(scores, dim=-1)
    t_context = t_weights @ proj("W_v")
    t_context.backward(torch.tensor(g))
    assert rel_err(context, t_context.detach().numpy()) <= TOL[dtype]
    assert rel_err(weights, t_weights.detach().numpy()) <= TOL[dtype]
    assert rel_err(gx, tx.grad.numpy()) <= TOL[dtype]
    scale = max(float(np.abs(t.grad.numpy()).max()) for t in tw.values())
    for name, p in layer.named_parameters():
        if name == "W_k.bias":  # zero in exact arithmetic (softmax ignores a shift): rounding only
            assert np.abs(p.grad).max() <= TOL[dtype] * scale
            continue
        assert rel_err(p.grad, tw[name].grad.numpy()) <= TOL[dtype], name


def test_self_attention_backward_finite_differences():
    rng = np.random.default_rng(2)
    layer = attnlab.SelfAttention(3, 2, qkv_bias=True, rng=rng, dtype=np.float64)
    perturb(layer, rng, 0.2)
    x = rng.standard_normal((4, 3))
    g = rng.standard_normal((4, 2))
    layer(x, is_causal=True)
    gx = layer.backward(g)

    def loss():
        return float(np.sum(layer(x, is_causal=True)[0] * g))

    assert np.abs(gx - numerical_grad(loss, x)).max() < 1e-7
    for name, p in layer.named_parameters():
        assert np.abs(p.grad - numerical_grad(loss, p.data)).max() < 1e-7, name


# ---- MultiheadAttention -----------------------------------------------------------------
MHA_CASES = {
    "self": ({}, {}),
    "no_bias": ({"bias": False}, {}),
    "bias_kv": ({"add_bias_kv": True}, {}),
    "zero_attn": ({"add_zero_attn": True}, {}),
    "bias_kv_zero_attn_masks": (
        {"add_bias_kv": True, "add_zero_attn": True},
        {"key_padding_mask": "bool", "attn_mask": "bool2d"},
    ),
    "kdim_vdim": ({"kdim": 5, "vdim": 3}, {"cross": True}),
    "kdim_vdim_bias_kv": ({"kdim": 5, "vdim": 3, "add_bias_kv": True}, {"cross": True}),
    "cross_same_dims": ({}, {"cross": True}),
    "batch_first": ({"batch_first": True}, {"cross": True}),
    "unbatched": ({}, {"unbatched": True, "cross": True}),
    "unbatched_masks": ({}, {"unbatched": True, "key_padding_mask": "bool", "attn_mask": "float3d"}),
    "kpm_bool": ({}, {"key_padding_mask": "bool"}),
    "kpm_float": ({}, {"key_padding_mask": "float"}),
    "mask_bool2d": ({}, {"attn_mask": "bool2d"}),
    "mask_float2d": ({}, {"attn_mask": "float2d"}),
    "mask_bool3d": ({}, {"attn_mask": "bool3d"}),
    "mask_float3d_kpm_bool": ({"batch_first": True}, {"attn_mask": "float3d", "key_padding_mask": "bool"}),
    "causal": ({"batch_first": True}, {"is_causal": True}),
    "no_weights": ({}, {"need_weights": False}),
    "no_weights_causal_kpm": ({}, {"need_weights": False, "is_causal": True, "key_padding_mask": "bool"}),
    "per_head_weights": ({}, {"average_attn_weights": False}),
}


def _mha_inputs(rng, dtype, ctor, call):
    E, H, N, L = 8, 2, 3, 4
    S = 5 if call.get("cross") else L
    kdim, vdim = ctor.get("kdim", E), ctor.get("vdim", E)
    unbatched = call.get("unbatched")
    bf = ctor.get("batch_first")

    def arr(T, d):
        shape = (T, d) if unbatched else ((N, T, d) if bf else (T, N, d))
        return rng.standard_normal(shape).astype(dtype)

    q = arr(L, E)
    if call.get("cross"):
        k, v = arr(S, kdim), arr(S, vdim)
    else:
        k = v = q
    ours, theirs = {}, {}
    kpm = call.get("key_padding_mask")
    if kpm:
        keep = rng.random((S,) if unbatched else (N, S)) < 0.7
        keep[..., 0] = True
        if kpm == "bool":
            ours["key_padding_mask"], theirs["key_padding_mask"] = keep, torch.tensor(~keep)
        else:
            fm = np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(dtype)
            ours["key_padding_mask"], theirs["key_padding_mask"] = fm, torch.tensor(fm)
    am = call.get("attn_mask")
    if am:
        shape = (L, S) if am.endswith("2d") else ((H, L, S) if unbatched else (N * H, L, S))
        if am.startswith("bool"):
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True
            ours["attn_mask"], theirs["attn_mask"] = keep, torch.tensor(~keep)
        else:
            fm = rng.standard_normal(shape).astype(dtype)
            ours["attn_mask"], theirs["attn_mask"] = fm, torch.tensor(fm)
    if call.get("is_causal"):
        ours["is_causal"] = True
        theirs["is_causal"] = True
        if "attn_mask" not in theirs:  # torch wants the mask with is_causal
            theirs["attn_mask"] = torch.tensor(~attnlab.causal_mask(L, S))
    for name in ("need_weights", "average_attn_weights"):
        if name in call:
            ours[name] = theirs[name] = call[name]
    return (q, k, v), ours, theirs


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_mha_backward_matches_torch(dtype, case):
    ctor, call = MHA_CASES[case]
    rng = np.random.default_rng(list(MHA_CASES).index(case))
    mha = attnlab.MultiheadAttention(8, 2, **ctor, rng=rng, dtype=dtype)
    perturb(mha, rng, 0.1)
    tmha = torch.nn.MultiheadAttention(8, 2, **ctor, dtype=TDTYPE[dtype])
    load_into_torch(mha, tmha)
    (q, k, v), ours, theirs = _mha_inputs(rng, dtype, ctor, call)
    self_attn = k is q
    out, weights = mha(q, k, v, **ours)
    g = rng.standard_normal(out.shape).astype(dtype)
    gq, gk, gv = mha.backward(g)

    tq = torch.tensor(q, requires_grad=True)
    tk, tv = (tq, tq) if self_attn else (torch.tensor(a, requires_grad=True) for a in (k, v))
    t_out, t_weights = tmha(tq, tk, tv, **theirs)
    t_out.backward(torch.tensor(g))
    assert rel_err(out, t_out.detach().numpy()) <= TOL[dtype]
    if call.get("need_weights", True):
        assert rel_err(weights, t_weights.detach().numpy()) <= TOL[dtype]
    else:
        assert weights is None
    if self_attn:
        assert rel_err(gq + gk + gv, tq.grad.numpy()) <= TOL[dtype]
    else:
        for a, b in ((gq, tq), (gk, tk), (gv, tv)):
            assert a.shape == b.shape and rel_err(a, b.grad.numpy()) <= TOL[dtype]
    assert_param_grads(mha, tmha, dtype)


@pytest.mark.parametrize(
    "ctor,call",
    [
        ({"add_bias_kv": True, "add_zero_attn": True}, {"key_padding_mask": "bool"}),
        ({"kdim": 3, "vdim": 2}, {"cross": True, "attn_mask": "float2d"}),
        ({"dropout": 0.3, "batch_first": True}, {"cross": True}),
        ({"dropout": 0.3}, {"need_weights": False, "is_causal": True}),
    ],
    ids=["bias_kv_zero_attn", "kdim_vdim", "dropout", "dropout_sdpa_path"],
)
def test_mha_backward_finite_differences(ctor, call):
    """float64 central differences; with dropout the Generator is reset before each
    forward pass so every pass draws the same mask."""
    rng = np.random.default_rng(11)
    mha = attnlab.MultiheadAttention(4, 2, **ctor, rng=np.random.default_rng(3), dtype=np.float64)
    perturb(mha, rng, 0.2)
    call = {**call}
    E, N, L, S = 4, 2, 3, 4 if call.get("cross") else 3
    bf = ctor.get("batch_first")
    shape = (lambda T, d: (N, T, d)) if bf else (lambda T, d: (T, N, d))
    q = rng.standard_normal(shape(L, E))
    k = rng.standard_normal(shape(S, ctor.get("kdim", E)))
    v = rng.standard_normal(shape(S, ctor.get("vdim", E)))
    ours = {}
    if call.get("key_padding_mask"):
        keep = rng.random((N, S)) < 0.7
        keep[:, 0] = True
        ours["key_padding_mask"] = keep
    if call.get("attn_mask"):
        ours["attn_mask"] = rng.standard_normal((L, S))
    for name in ("need_weights", "is_causal"):
        if name in call:
            ours[name] = call[name]
    state = mha._rng.bit_generator.state
    g = rng.standard_normal(q.shape[:-1] + (E,))

    def loss():
        mha._rng.bit_generator.state = state
        return float(np.sum(mha(q, k, v, **ours)[0] * g))

    loss()
    grads = mha.backward(g)
    for name, x, a in zip(("query", "key", "value"), (q, k, v), grads, strict=True):
        assert np.abs(a - numerical_grad(loss, x)).max() < 1e-7, name
    for name, p in mha.named_parameters():
        assert np.abs(p.grad - numerical_grad(loss, p.data)).max() < 1e-7, name


# ---- Embedding, LayerNorm, activations, Dropout ----------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_embedding_backward_matches_torch(dtype):
    rng = np.random.default_rng(0)
    emb = attnlab.Embedding(7, 3, rng=rng, dtype=dtype)
    temb = torch.nn.Embedding(7, 3, dtype=TDTYPE[dtype])
    load_into_torch(emb, temb)
    ids = rng.integers(0, 7, size=(4, 5))
    g = rng.standard_normal((4, 5, 3)).astype(dtype)
    out = emb(ids)
    assert emb.backward(g) is None
    t_out = temb(torch.from_numpy(ids))
    t_out.backward(torch.tensor(g))
    assert rel_err(out, t_out.detach().numpy()) == 0
    assert_param_grads(emb, temb, dtype)


def test_embedding_rejects_bad_ids():
    emb = attnlab.Embedding(4, 2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        emb(np.array([0, 4]))
    with pytest.raises(TypeError, match="integer"):
        emb(np.array([0.0]))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_backward_matches_torch(dtype, affine):
    rng = np.random.default_rng(1)
    ln = attnlab.LayerNorm(6, elementwise_affine=affine, dtype=dtype)
    perturb(ln, rng)
    tln = torch.nn.LayerNorm(6, elementwise_affine=affine, dtype=TDTYPE[dtype])
    load_into_torch(ln, tln)
    x = (rng.standard_normal((3, 4, 6)) * 2 + 1).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    out = ln(x)
    gx = ln.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    t_out = tln(tx)
    t_out.backward(torch.tensor(g))
    assert rel_err(out, t_out.detach().numpy()) <= TOL[dtype]
    assert rel_err(gx, tx.grad.numpy()) <= TOL[dtype]
    assert_param_grads(ln, tln, dtype)


def test_layer_norm_backward_finite_differences():
    rng = np.random.default_rng(2)
    ln = attnlab.LayerNorm(5, dtype=np.float64)
    perturb(ln, rng)
    x, g = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    ln(x)
    gx = ln.backward(g)

    def loss():
        return float(np.sum(ln(x) * g))

    assert np.abs(gx - numerical_grad(loss, x)).max() < 1e-7
    for name, p in ln.named_parameters():
        assert np.abs(p.grad - numerical_grad(loss, p.data)).max() < 1e-7, name


def test_erf_matches_torch_to_1e_12():
    x = np.concatenate(
        [np.linspace(-7, 7, 20001), np.random.default_rng(0).standard_normal(5000) * 3,
         [0.0, -0.0, 1e-300, 2.0, 2.0000001, 6.0, 30.0, np.inf, -np.inf]]
    )
    want = torch.special.erf(torch.tensor(x)).numpy()
    assert np.abs(F.erf(x) - want).max() <= 1e-12
    assert np.isnan(F.erf(np.array([np.nan]))[0])
    x32 = x.astype(np.float32)
    got32 = F.erf(x32)
    assert got32.dtype == np.float32
    assert np.abs(got32 - torch.special.erf(torch.tensor(x32)).numpy()).max() <= 1e-6


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    "make,tmake",
    [
        (lambda: attnlab.GELU(), lambda: torch.nn.GELU()),
        (lambda: attnlab.GELU("tanh"), lambda: torch.nn.GELU(approximate="tanh")),
        (lambda: attnlab.ReLU(), lambda: torch.nn.ReLU()),
    ],
    ids=["gelu", "gelu_tanh", "relu"],
)
def test_activation_backward_matches_torch(dtype, make, tmake):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 50)) * 3).astype(dtype)
    x[0, :3] = [0.0, 8.0, -8.0]
    g = rng.standard_normal(x.shape).astype(dtype)
    act = make()
    out = act(x)
    gx = act.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    t_out = tmake()(tx)
    t_out.backward(torch.tensor(g))
    tol = 1e-12 if dtype == np.float64 else TOL[dtype]
    assert out.dtype == gx.dtype == dtype
    assert rel_err(out, t_out.detach().numpy()) <= tol
    assert rel_err(gx, tx.grad.numpy()) <= tol


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward_finite_differences(approximate):
    x = np.random.default_rng(4).standard_normal(20) * 3
    act = attnlab.GELU(approximate)
    act(x)
    gx = act.backward(np.ones_like(x))
    assert np.abs(gx - numerical_grad(lambda: float(act(x).sum()), x)).max() < 1e-8


def test_dropout_backward_uses_its_mask():
    x = np.ones((100, 10))
    drop = attnlab.Dropout(0.25, rng=np.random.default_rng(0))
    y = drop(x)
    assert set(np.unique(y)) <= {0.0, 1 / 0.75}
    g = drop.backward(np.ones_like(x))
    assert np.array_equal(g, y)
    drop.eval()
    assert drop(x) is x


# ---- composite layers and the loss -----------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_feed_forward_backward_matches_torch(dtype, activation):
    rng = np.random.default_rng(5)
    ff = attnlab.FeedForward(6, 10, activation=activation, rng=rng, dtype=dtype)
    act = torch.nn.GELU() if activation == "gelu" else torch.nn.ReLU()
    tff = torch.nn.Sequential(torch.nn.Linear(6, 10), act, torch.nn.Linear(10, 6)).to(TDTYPE[dtype])
    load_into_torch(ff, tff)
    x = rng.standard_normal((2, 3, 6)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    ff(x)
    gx = ff.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    tff(tx).backward(torch.tensor(g))
    assert rel_err(gx, tx.grad.numpy()) <= TOL[dtype]
    assert_param_grads(ff, tff, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_transformer_block_backward_matches_torch(dtype, causal):
    from attnlab.models.tiny import TinyTransformerConfig
    from attnlab.models.tiny_torch import torch_tiny_transformer

    rng = np.random.default_rng(6)
    block = attnlab.TransformerBlock(8, 2, 12, causal=causal, rng=rng, dtype=dtype)
    perturb(block, rng, 0.1)
    cfg = TinyTransformerConfig(
        d_model=8, n_heads=2, d_ff=12, n_layers=1, activation="gelu", dtype=np.dtype(dtype).name
    )
    tblock = torch_tiny_transformer(cfg).blocks[0]
    load_into_torch(block, tblock)
    x = rng.standard_normal((2, 5, 8)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    out = block(x)
    gx = block.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    mask = torch.tensor(~attnlab.causal_mask(5)) if causal else None
    if causal:
        t_out = tblock(tx, mask)
    else:
        h = tblock.ln_1(tx)
        t_out = tx + tblock.attn(h, h, h, need_weights=False)[0]
        t_out = t_out + tblock.mlp(tblock.ln_2(t_out))
    t_out.backward(torch.tensor(g))
    assert rel_err(out, t_out.detach().numpy()) <= TOL[dtype]
    assert rel_err(gx, tx.grad.numpy()) <= TOL[dtype]
    assert_param_grads(block, tblock, dtype)


# torch.nn.TransformerEncoderLayer's names for the post-norm block's parameters
_POST_NORM_NAMES = {
    "attn.in_proj_weight": "self_attn.in_proj_weight", "attn.in_proj_bias": "self_attn.in_proj_bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
    "ln_1.weight": "norm1.weight", "ln_1.bias": "norm1.bias", "ln_2.weight": "norm2.weight",
    "ln_2.bias": "norm2.bias", "mlp.0.weight": "linear1.weight", "mlp.0.bias": "linear1.bias",
    "mlp.2.weight": "linear2.weight", "mlp.2.bias": "linear2.bias",
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_post_norm_block_matches_torch_encoder_layer(dtype):
    """The BERT-style block (post-norm, GELU, padding mask): forward and backward."""
    rng = np.random.default_rng(8)
    block = attnlab.TransformerBlock(8, 2, 12, causal=False, norm_first=False, layer_norm_eps=1e-12,
                                     rng=rng, dtype=dtype)
    perturb(block, rng, 0.1)
    tlayer = torch.nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu", batch_first=True,
                                              norm_first=False, layer_norm_eps=1e-12, dtype=TDTYPE[dtype])
    tlayer.load_state_dict({_POST_NORM_NAMES[k]: torch.from_numpy(v.copy()) for k, v in block.state_dict().items()})
    x = rng.standard_normal((2, 5, 8)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    keep = np.ones((2, 5), bool)
    keep[1, 3:] = False
    out = block(x, key_padding_mask=keep)
    gx = block.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    t_out = tlayer(tx, src_key_padding_mask=torch.from_numpy(~keep))
    t_out.backward(torch.tensor(g))
    assert rel_err(out, t_out.detach().numpy()) <= TOL[dtype]
    assert rel_err(gx, tx.grad.numpy()) <= TOL[dtype]
    tparams = dict(tlayer.named_parameters())
    for name, p in block.named_parameters():
        assert rel_err(p.grad, tparams[_POST_NORM_NAMES[name]].grad.numpy()) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cross_entropy_matches_torch(dtype):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((12, 5)) * 3).astype(dtype)
    target = rng.integers(0, 5, size=12)
    target[[1, 4, 5]] = -100
    loss_fn = attnlab.CrossEntropyLoss()
    loss = loss_fn(logits, target)
    grad = loss_fn.backward()
    tl = torch.tensor(logits, requires_grad=True)
    t_loss = torch.nn.functional.cross_entropy(tl, torch.from_numpy(target))
    t_loss.backward()
    assert abs(loss - t_loss.item()) <= TOL[dtype] * abs(t_loss.item())
    assert grad.dtype == dtype
    assert rel_err(grad, tl.grad.numpy()) <= TOL[dtype]
    assert np.all(grad[[1, 4, 5]] == 0)


def test_cross_entropy_all_ignored_is_nan_and_bad_targets_fail():
    loss_fn = attnlab.CrossEntropyLoss()
    assert np.isnan(loss_fn(np.zeros((2, 3)), np.array([-100, -100])))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        loss_fn(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="target has shape"):
        loss_fn(np.zeros((2, 3)), np.array([0]))
