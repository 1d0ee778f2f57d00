"""Backward passes of the functional core against torch autograd and finite differences:
softmax and scaled_dot_product_attention (bool/float masks, causal, scale, GQA,
broadcast batch dims, dropout with the forward pass's mask)."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab
from attnlab.core import scaled_dot_product_attention_backward
from helpers import TOL, numerical_grad  # noqa: E402
from helpers import grad_rel_err as rel_err  # noqa: E402

torch = pytest.importorskip("torch", reason="torch is the test oracle for gradients")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_backward_matches_torch(dtype, axis):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 7)) * 3).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    p = attnlab.softmax(x, axis=axis)
    got = attnlab.softmax_backward(g, p, axis=axis)
    tx = torch.tensor(x, requires_grad=True)
    torch.softmax(tx, dim=axis).backward(torch.tensor(g))
    assert rel_err(got, tx.grad.numpy()) <= TOL[dtype]


def test_softmax_backward_finite_differences():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6))
    g = rng.standard_normal(x.shape)
    got = attnlab.softmax_backward(g, attnlab.softmax(x))
    num = numerical_grad(lambda: float(np.sum(attnlab.softmax(x) * g)), x)
    assert np.abs(got - num).max() < 1e-8


def test_softmax_backward_fully_masked_row_is_zero():
    x = np.array([[-np.inf, -np.inf], [0.0, 1.0]])
    g = attnlab.softmax_backward(np.ones((2, 2)), attnlab.softmax(x))
    assert np.all(np.isfinite(g)) and np.all(g[0] == 0)


# ---- scaled dot-product attention ---------------------------------------------------------
def _sdpa_case(rng, dtype, *, qshape=(2, 3, 5, 8), kshape=(2, 3, 7, 8), ev=6):
    q = rng.standard_normal(qshape).astype(dtype)
    k = rng.standard_normal(kshape).astype(dtype)
    v = rng.standard_normal((*kshape[:-1], ev)).astype(dtype)
    return q, k, v


def _torch_sdpa_grads(q, k, v, g, **kw):
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    mask = kw.pop("attn_mask", None)
    if mask is not None:
        mask = torch.tensor(mask)
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, **kw)
    out.backward(torch.tensor(g))
    return out.detach().numpy(), (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.37},
    "bool_mask": {"attn_mask": "bool"},
    "float_mask": {"attn_mask": "float"},
    "bool_mask_broadcast": {"attn_mask": "bool_row"},
    "gqa": {"enable_gqa": True, "kv_heads": 1},
    "gqa_causal": {"enable_gqa": True, "kv_heads": 3, "is_causal": True, "q_heads": 6},
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_backward_matches_torch(dtype, case):
    opts = dict(CASES[case])
    rng = np.random.default_rng(list(CASES).index(case))
    hq = opts.pop("q_heads", 3)
    hk = opts.pop("kv_heads", hq)
    q, k, v = _sdpa_case(rng, dtype, qshape=(2, hq, 5, 8), kshape=(2, hk, 7, 8))
    mask_kind = opts.pop("attn_mask", None)
    if mask_kind == "bool":
        mask = rng.random((2, hq, 5, 7)) < 0.7
        mask[..., 0] = True  # no fully masked rows (torch gives NaN there)
        opts["attn_mask"] = mask
    elif mask_kind == "float":
        opts["attn_mask"] = rng.standard_normal((5, 7)).astype(dtype)
    elif mask_kind == "bool_row":
        mask = rng.random((2, 1, 1, 7)) < 0.6
        mask[..., 0] = True
        opts["attn_mask"] = mask
    g = rng.standard_normal((2, hq, 5, 6)).astype(dtype)
    got = scaled_dot_product_attention_backward(g, q, k, v, **opts)
    want_out, want = _torch_sdpa_grads(q, k, v, g, **dict(opts))
    assert rel_err(attnlab.scaled_dot_product_attention(q, k, v, **opts), want_out) <= TOL[dtype]
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == dtype, name
        assert rel_err(a, b) <= TOL[dtype], name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sdpa_backward_broadcast_batch_dims(dtype):
    """A key/value shared across the batch gets the gradient summed over it."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 2, 5, 8)).astype(dtype)
    k = rng.standard_normal((1, 2, 6, 8)).astype(dtype)
    v = rng.standard_normal((1, 2, 6, 3)).astype(dtype)
    g = rng.standard_normal((4, 2, 5, 3)).astype(dtype)
    got = scaled_dot_product_attention_backward(g, q, k, v)
    _, want = _torch_sdpa_grads(q, k, v, g)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and rel_err(a, b) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("p", [0.3, 0.6])
def test_sdpa_dropout_backward_uses_the_forward_mask(dtype, p):
    """torch cannot take a given dropout mask, so rebuild attnlab's mask from the same
    Generator state and let torch differentiate ``softmax(scores) * keep @ v``."""
    rng = np.random.default_rng(4)
    q, k, v = _sdpa_case(rng, dtype)
    g = rng.standard_normal((2, 3, 5, 6)).astype(dtype)
    out = attnlab.scaled_dot_product_attention(q, k, v, dropout_p=p, rng=np.random.default_rng(9))
    got = scaled_dot_product_attention_backward(g, q, k, v, dropout_p=p, rng=np.random.default_rng(9))
    keep = (np.random.default_rng(9).random((2, 3, 5, 7)) >= p) / (1 - p)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    probs = torch.softmax(tq @ tk.transpose(-1, -2) / np.sqrt(8), dim=-1)
    t_out = (probs * torch.tensor(keep.astype(dtype))) @ tv
    t_out.backward(torch.tensor(g))
    assert rel_err(out, t_out.detach().numpy()) <= TOL[dtype]
    for a, b in zip(got, (tq.grad, tk.grad, tv.grad), strict=True):
        assert rel_err(a, b.numpy()) <= TOL[dtype]


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"is_causal": True},
        {"attn_mask": "bool"},
        {"attn_mask": "float", "scale": 0.5},
        {"dropout_p": 0.4},
        {"enable_gqa": True},
    ],
    ids=["plain", "causal", "bool_mask", "float_mask_scale", "dropout", "gqa"],
)
def test_sdpa_backward_finite_differences(opts):
    opts = dict(opts)
    rng = np.random.default_rng(5)
    kv_heads = 1 if opts.get("enable_gqa") else 2
    q = rng.standard_normal((1, 2, 3, 4))
    k = rng.standard_normal((1, kv_heads, 5, 4))
    v = rng.standard_normal((1, kv_heads, 5, 3))
    if opts.get("attn_mask") == "bool":
        mask = rng.random((3, 5)) < 0.6
        mask[:, 0] = True
        opts["attn_mask"] = mask
    elif opts.get("attn_mask") == "float":
        opts["attn_mask"] = rng.standard_normal((3, 5))
    g = rng.standard_normal((1, 2, 3, 3))

    def loss():
        extra = {"rng": np.random.default_rng(7)} if "dropout_p" in opts else {}
        return float(np.sum(attnlab.scaled_dot_product_attention(q, k, v, **opts, **extra) * g))

    extra = {"rng": np.random.default_rng(7)} if "dropout_p" in opts else {}
    got = scaled_dot_product_attention_backward(g, q, k, v, **opts, **extra)
    for name, x, a in zip("qkv", (q, k, v), got, strict=True):
        assert np.abs(a - numerical_grad(loss, x)).max() < 1e-7, name


def test_sdpa_backward_fully_masked_rows_give_zero_gradients():
    rng = np.random.default_rng(6)
    q, k, v = _sdpa_case(rng, np.float64, qshape=(1, 1, 3, 4), kshape=(1, 1, 4, 4), ev=2)
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    g = rng.standard_normal((1, 1, 3, 2))
    dq, dk, dv = scaled_dot_product_attention_backward(g, q, k, v, attn_mask=mask)
    assert all(np.all(np.isfinite(a)) for a in (dq, dk, dv))
    assert np.all(dq[..., 1, :] == 0)


def test_sdpa_backward_rejects_a_wrong_grad_shape():
    rng = np.random.default_rng(0)
    q, k, v = _sdpa_case(rng, np.float64)
    with pytest.raises(ValueError, match="grad_out has shape"):
        scaled_dot_product_attention_backward(np.ones((2, 3, 5, 5)), q, k, v)
