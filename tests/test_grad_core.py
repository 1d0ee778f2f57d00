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


# ---- soft-capped scores (softcap=) ---------------------------------------------------------
def _torch_capped(q, k, v, g, *, cap, scale=None, attn_mask=None, is_causal=False, enable_gqa=False):
    """``softmax(mask(cap * tanh(q k^T * scale / cap))) @ v`` in plain torch (Gemma 2's
    eager order), its output and its inputs' gradients by autograd."""
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    kk, vv = tk, tv
    if enable_gqa:
        G = q.shape[-3] // k.shape[-3]
        kk, vv = tk.repeat_interleave(G, dim=-3), tv.repeat_interleave(G, dim=-3)
    s = tq @ kk.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = cap * torch.tanh(s / cap)
    L, S = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    elif attn_mask is not None and attn_mask.dtype == np.bool_:
        s = s.masked_fill(~torch.from_numpy(attn_mask), float("-inf"))
    elif attn_mask is not None:
        s = s + torch.from_numpy(attn_mask)
    out = torch.softmax(s, dim=-1) @ vv
    out.backward(torch.from_numpy(g))
    return out.detach().numpy(), (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())


CAPPED = {
    "bool_mask": {"attn_mask": "bool"},
    "float_mask": {"attn_mask": "float", "scale": 0.6},
    "causal": {"is_causal": True},
    "gqa_causal": {"enable_gqa": True, "kv_heads": 2, "is_causal": True},
    "gqa_bool_mask": {"enable_gqa": True, "kv_heads": 1, "attn_mask": "bool"},
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", list(CAPPED))
def test_softcapped_sdpa_forward_and_backward_match_torch(dtype, case):
    """``softcap=``: the scores ``s`` become ``cap * tanh(s / cap)`` before the mask; the
    output and every input's gradient equal torch autograd on that formula."""
    opts = dict(CAPPED[case])
    rng = np.random.default_rng(20 + list(CAPPED).index(case))
    hk = opts.pop("kv_heads", 4)
    q, k, v = _sdpa_case(rng, dtype, qshape=(2, 4, 5, 8), kshape=(2, hk, 7, 8))
    q *= 4  # scores well past the cap
    mask_kind = opts.pop("attn_mask", None)
    if mask_kind == "bool":
        mask = rng.random((2, 4, 5, 7)) < 0.6
        mask[..., 0] = True  # no fully masked rows (torch gives NaN there)
        opts["attn_mask"] = mask
    elif mask_kind == "float":
        opts["attn_mask"] = rng.standard_normal((5, 7)).astype(dtype)
    g = rng.standard_normal((2, 4, 5, 6)).astype(dtype)
    cap = 1.5
    out = attnlab.scaled_dot_product_attention(q, k, v, **opts, softcap=cap)
    got = scaled_dot_product_attention_backward(g, q, k, v, **opts, softcap=cap)
    want_out, want = _torch_capped(q, k, v, g, cap=cap, **opts)
    assert out.dtype == dtype and rel_err(out, want_out) <= TOL[dtype]
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == dtype, name
        assert rel_err(a, b) <= TOL[dtype], name
    # the cap is reached and matters: uncapped attention is another function
    scores = attnlab.attention_scores(q, k, opts.get("attn_mask"), opts.get("is_causal", False),
                                      opts.get("scale"), opts.get("enable_gqa", False), softcap=cap)
    finite = scores[np.isfinite(scores)] if mask_kind != "float" else scores - opts["attn_mask"]
    assert 0.9 * cap < np.abs(finite).max() <= cap  # float32 tanh rounds to 1 far out
    assert rel_err(attnlab.scaled_dot_product_attention(q, k, v, **opts), want_out) > 1e-2


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softcapped_scores_and_their_backward_match_torch(dtype):
    """The explicit route's core steps: ``attention_scores(softcap=)`` and
    ``attention_scores_backward`` (no gradient through a bool mask's -inf), then
    ``apply_attention_weights`` and its backward with grouped-query heads."""
    rng = np.random.default_rng(30)
    cap, G = 2.0, 3
    q, k, v = _sdpa_case(rng, dtype, qshape=(2, 6, 5, 8), kshape=(2, 2, 7, 8))
    q *= 4
    mask = rng.random((2, 1, 5, 7)) < 0.6
    mask[..., 0] = True
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ts = cap * torch.tanh(tq @ tk.repeat_interleave(G, dim=1).transpose(-1, -2) / np.sqrt(8) / cap)
    ts = ts.masked_fill(~torch.from_numpy(mask), float("-inf"))
    s = attnlab.attention_scores(q, k, mask, enable_gqa=True, softcap=cap)
    np.testing.assert_array_equal(np.isneginf(s), ~np.broadcast_to(mask, s.shape))
    assert rel_err(np.where(mask, s, 0), np.where(mask, ts.detach().numpy(), 0)) <= TOL[dtype]
    g_s = rng.standard_normal(s.shape).astype(dtype)  # a gradient on the masked entries too
    ts.backward(torch.from_numpy(g_s))
    gq, gk = attnlab.attention_scores_backward(g_s, q, k, mask, enable_gqa=True, softcap=cap)
    assert gq.dtype == gk.dtype == dtype
    assert rel_err(gq, tq.grad.numpy()) <= TOL[dtype] and rel_err(gk, tk.grad.numpy()) <= TOL[dtype]

    w = attnlab.softmax(s)
    tw = torch.tensor(w, requires_grad=True)
    out = tw @ tv.repeat_interleave(G, dim=1)
    g = rng.standard_normal(out.shape).astype(dtype)
    out.backward(torch.from_numpy(g))
    got = attnlab.apply_attention_weights(w, v, enable_gqa=True)
    assert rel_err(got, out.detach().numpy()) <= TOL[dtype]
    gw, gv = attnlab.apply_attention_weights_backward(g, w, v, enable_gqa=True)
    assert gw.shape == w.shape and gv.shape == v.shape
    assert rel_err(gw, tw.grad.numpy()) <= TOL[dtype] and rel_err(gv, tv.grad.numpy()) <= TOL[dtype]


def test_softcap_holds_whichever_kernel_runs():
    """A float32 problem the size the rows or blockwise kernels take: with ``softcap`` the
    output is still the soft-capped one (numbers only; no kernel named)."""
    rng = np.random.default_rng(31)
    q, k, v = _sdpa_case(rng, np.float32, qshape=(1, 4, 512, 32), kshape=(1, 2, 512, 32), ev=32)
    q *= 4
    g = rng.standard_normal((1, 4, 512, 32)).astype(np.float32)
    for opts in ({"is_causal": True, "enable_gqa": True}, {"enable_gqa": True}):
        want = attnlab.apply_attention_weights(attnlab.attention_weights(q, k, **opts, softcap=2.0), v,
                                               enable_gqa=True)
        got = attnlab.scaled_dot_product_attention(q, k, v, **opts, softcap=2.0)
        assert rel_err(got, want) <= 1e-5
        assert rel_err(attnlab.scaled_dot_product_attention(q, k, v, **opts), want) > 1e-2
        grads = scaled_dot_product_attention_backward(g, q, k, v, **opts, softcap=2.0)
        _, ref = _torch_capped(q, k, v, g, cap=2.0, **opts)
        for a, b in zip(grads, ref, strict=True):
            assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize(("softcap", "error", "match"), [
    (0.0, ValueError, "softcap must be a positive finite float or None, got 0.0"),
    (float("inf"), ValueError, "softcap must be a positive finite float or None, got inf"),
    (True, TypeError, "softcap must be a positive finite float or None, got bool"),
    ("2", TypeError, "softcap must be a positive finite float or None, got str"),
])
def test_softcap_rejects_what_is_not_a_positive_number(softcap, error, match):
    q = np.ones((2, 3, 4))
    for call in (lambda: attnlab.scaled_dot_product_attention(q, q, q, softcap=softcap),
                 lambda: attnlab.attention_scores(q, q, softcap=softcap),
                 lambda: scaled_dot_product_attention_backward(q, q, q, q, softcap=softcap)):
        with pytest.raises(error, match=match):
            call()


def test_score_and_weight_backward_reject_wrong_gradients():
    q = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match=r"grad_scores has shape \(2, 3, 4\), but should be \(2, 3, 3\)"):
        attnlab.attention_scores_backward(q, q, q)
    with pytest.raises(TypeError, match="grad_scores"):
        attnlab.attention_scores_backward(np.ones((2, 3, 3), np.float32), q, q)
    w, v = np.full((4, 2, 3), 1 / 3), np.ones((2, 3, 5))
    with pytest.raises(ValueError, match=r"grad_out has shape \(4, 2, 4\), but should be \(4, 2, 5\)"):
        attnlab.apply_attention_weights_backward(np.ones((4, 2, 4)), w, v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"value has shape \(2, 4, 5\), but should be \(..., S=3, Ev\)"):
        attnlab.apply_attention_weights(w, np.ones((2, 4, 5)))
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        attnlab.apply_attention_weights(w, v)
