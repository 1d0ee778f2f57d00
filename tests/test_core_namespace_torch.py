"""The functional core on torch tensors (through array_api_compat): torch in, torch out, equal
to torch's own scaled_dot_product_attention, softmax and autograd."""

from __future__ import annotations

import numpy as np
import pytest

import attnlab

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")
F = torch.nn.functional

DTYPES = [torch.float32, torch.float64]
# float32: max abs error relative to the reference's largest entry; float64: max abs error.
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
MASKS = ["none", "bool", "float", "causal", "bool-broadcast"]
# (Hq, H, L, S): plain, L != S both ways, grouped-query attention.
SHAPES = [(2, 2, 5, 5), (2, 2, 4, 9), (3, 3, 7, 3), (4, 2, 5, 7), (6, 2, 1, 6)]


def tensor_error(ours, ref) -> float:
    """Worst error of ``ours`` against ``ref``, after checking type, dtype, shape and device."""
    assert isinstance(ours, torch.Tensor), type(ours)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape and ours.device == ref.device
    err = (ours.double() - ref.double()).abs().max().item() if ours.numel() else 0.0
    if ours.dtype == torch.float32:
        err /= max(ref.abs().max().item(), 1e-30)
    return err


def assert_close(ours, ref) -> float:
    err = tensor_error(ours, ref)
    assert err <= TOL[ref.dtype], f"{ref.dtype} error {err:.3g} > {TOL[ref.dtype]:.1g}"
    return err


def make_inputs(seed, dtype, shape, mask_kind, *, batch=2, E=8, Ev=6):
    gen = torch.Generator().manual_seed(seed)
    Hq, H, L, S = shape
    q = torch.randn(batch, Hq, L, E, generator=gen, dtype=dtype)
    k = torch.randn(batch, H, S, E, generator=gen, dtype=dtype)
    v = torch.randn(batch, H, S, Ev, generator=gen, dtype=dtype)
    mask = None
    if mask_kind in ("bool", "bool-broadcast"):
        mshape = (batch, Hq, L, S) if mask_kind == "bool" else (1, S)
        mask = torch.rand(mshape, generator=gen) < 0.6
        mask[..., 0] = True  # no fully masked rows: torch's SDPA gives NaN there
    elif mask_kind == "float":
        mask = torch.randn(batch, Hq, L, S, generator=gen, dtype=dtype)
    return q, k, v, mask, mask_kind == "causal", Hq != H


def reference_weights(q, k, mask, causal, gqa):
    """softmax(q k^T / sqrt(E) + mask) in plain torch, GQA heads repeated."""
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    L, S = s.shape[-2:]
    if causal:
        mask = torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_sdpa_on_torch_equals_torch_sdpa(dtype, shape, mask_kind):
    seed = SHAPES.index(shape) * 10 + MASKS.index(mask_kind)
    q, k, v, mask, causal, gqa = make_inputs(seed, dtype, shape, mask_kind)
    ours = attnlab.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    assert_close(ours, ref)
    weights = attnlab.attention_weights(q, k, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    assert_close(weights, reference_weights(q, k, mask, causal, gqa))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_on_torch_keep_minus_inf_and_dtype(dtype):
    q, k, _, _, _, _ = make_inputs(1, dtype, (2, 2, 3, 4), "none")
    s = attnlab.attention_scores(q, k, is_causal=True, scale=0.5)
    want = (q @ k.transpose(-2, -1) * 0.5).masked_fill(~torch.ones(3, 4, dtype=torch.bool).tril(), float("-inf"))
    assert isinstance(s, torch.Tensor) and s.dtype == dtype
    assert torch.equal(torch.isinf(s), torch.isinf(want))
    assert_close(s.masked_fill(torch.isinf(s), 0), want.masked_fill(torch.isinf(want), 0))


def test_fully_masked_row_gives_zeros_on_torch():
    q, k, v, _, _, _ = make_inputs(2, torch.float64, (1, 1, 2, 3), "none", batch=1)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    out = attnlab.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[..., 1, :], torch.zeros_like(out[..., 1, :]))
    ref = F.scaled_dot_product_attention(q[..., :1, :], k, v, attn_mask=mask[:1])
    assert_close(out[..., :1, :], ref)


def test_dropout_on_torch_draws_numpys_mask():
    """The keep-mask comes from the NumPy Generator, so a seed gives the same output in both libraries."""
    q, k, v, _, _, _ = make_inputs(3, torch.float64, (2, 2, 4, 5), "none")
    ours = attnlab.scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=np.random.default_rng(7))
    ref = attnlab.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), dropout_p=0.3, rng=np.random.default_rng(7)
    )
    assert isinstance(ours, torch.Tensor)
    np.testing.assert_allclose(ours.numpy(), ref, rtol=0, atol=1e-12)
    undropped = attnlab.scaled_dot_product_attention(q, k, v)
    assert not torch.allclose(ours, undropped)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", [(2, 2, 4, 9), (4, 2, 5, 7)])
def test_backward_on_torch_equals_autograd(shape, mask_kind):
    q, k, v, mask, causal, gqa = make_inputs(4, torch.float64, shape, mask_kind)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    want = torch.autograd.grad(out, (q, k, v), g)
    with torch.no_grad():
        ours = attnlab.scaled_dot_product_attention_backward(
            g, q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa
        )
    for a, b in zip(ours, want, strict=True):
        assert_close(a, b)


def test_torch_autograd_runs_through_attnlab():
    """The namespace path is plain torch ops, so torch's autograd differentiates it."""
    q, k, v, mask, _, _ = make_inputs(6, torch.float64, (4, 2, 3, 5), "float")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours = attnlab.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    ours.square().sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref_leaves, attn_mask=mask, enable_gqa=True).square().sum().backward()
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert_close(a.grad, b.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_on_torch_equals_torch(dtype, axis):
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(8), dtype=dtype)
    assert_close(attnlab.softmax(x, axis=axis), torch.softmax(x, dim=axis))
    g = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(9), dtype=dtype)
    xl = x.clone().requires_grad_()
    want = torch.autograd.grad(torch.softmax(xl, dim=axis), xl, g)[0]
    assert_close(attnlab.softmax_backward(g, torch.softmax(x, dim=axis), axis=axis), want)


def test_softmax_on_torch_all_minus_inf_row_is_zero():
    x = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]])
    p = attnlab.softmax(x)
    assert torch.equal(p[1], torch.zeros(2)) and torch.allclose(p[0], torch.softmax(x[0], dim=0))


def test_masks_on_torch_equal_numpys():
    q = torch.zeros(3, 4, dtype=torch.float64)
    for align in ("top-left", "bottom-right"):
        m = attnlab.causal_mask(3, 5, align=align, like=q)
        assert isinstance(m, torch.Tensor) and m.dtype == torch.bool
        np.testing.assert_array_equal(m.numpy(), attnlab.causal_mask(3, 5, align=align))
    pad = attnlab.padding_mask(torch.tensor([0, 2, 4]), 4)
    assert isinstance(pad, torch.Tensor)
    np.testing.assert_array_equal(pad.numpy(), attnlab.padding_mask([0, 2, 4], 4))
    assert torch.equal(attnlab.convert_mha_mask(torch.tensor([True, False])), torch.tensor([False, True]))
    fm = torch.tensor([0.5, -1.0])
    assert attnlab.convert_mha_mask(fm) is fm
    for dtype in (np.float64, torch.float64):
        bias = attnlab.mask_to_bias(torch.tensor([True, False]), dtype)
        assert bias.dtype == torch.float64 and bias.tolist() == [0.0, float("-inf")]


def test_bottom_right_mask_on_torch_equals_torch_lower_right():
    """A KV-cache style mask built with like= works as attn_mask and matches torch's causal_lower_right."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, _, _, _ = make_inputs(10, torch.float64, (2, 2, 3, 6), "none")
    mask = attnlab.causal_mask(3, 6, align="bottom-right", like=q)
    ours = attnlab.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 6))
    assert_close(ours, ref)


def test_float16_on_torch_keeps_dtype():
    q, k, v, _, _, _ = make_inputs(11, torch.float32, (2, 2, 4, 4), "none")
    half = [x.half() for x in (q, k, v)]
    out = attnlab.scaled_dot_product_attention(*half, is_causal=True)
    assert out.dtype == torch.float16
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out.float() - ref).abs().max().item() < 5e-3


def test_errors_name_the_torch_array_type():
    q = torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"query must be a floating-point array, got dtype torch.int64 \(torch.Tens"):
        attnlab.scaled_dot_product_attention(torch.zeros(2, 3, dtype=torch.int64), q, q)
    with pytest.raises(TypeError, match=r"attn_mask is numpy.ndarray.*like=query"):
        attnlab.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((2, 2), bool))
    with pytest.raises(TypeError, match=r"query is torch.Tensor, key is numpy.ndarray"):
        attnlab.attention_weights(q, np.zeros((2, 3)))
    with pytest.raises(TypeError, match=r"attn_mask must be boolean .* got dtype torch.int64 \(torch.Tensor\)"):
        attnlab.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key has shape \(4, 5\), but should be \(\.\.\., S, E=3\)"):
        attnlab.scaled_dot_product_attention(q, torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"key has shape \(2, 5, 3\).*with H dividing query's Hq=3 \(enable_gqa\)"):
        kv = torch.zeros(2, 5, 3)
        attnlab.scaled_dot_product_attention(torch.zeros(3, 4, 3), kv, kv, enable_gqa=True)
    with pytest.raises(ValueError, match=r"attn_mask has shape \(3, 2\), but should be broadcastable to .* \(2, 2\)"):
        attnlab.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"grad_out has shape \(3, 3\), but should be \(2, 3\)"):
        attnlab.scaled_dot_product_attention_backward(torch.zeros(3, 3), q, q, q)
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype torch.float32 \(torch.Tensor\)"):
        attnlab.padding_mask(torch.tensor([1.0]), 3)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=3\], got values in \[1, 4\]"):
        attnlab.padding_mask(torch.tensor([1, 4]), 3)
