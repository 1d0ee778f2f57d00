"""What each exercise checks: its random cases, attnlab's reference answer, and the typical
wrong answers whose output names the mistake when a learner's function returns it.

A mistake is a small function computing what the wrong idea gives ("the scores are not
scaled"): when a learner's output equals it on the failing case, the report names it.
Shapes: ``...`` batch dims, ``H`` heads, ``L`` queries, ``S`` keys, ``E`` width, ``D``
one head's width; boolean masks are True where a query may attend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from attnlab.core import causal_mask as _causal_mask
from attnlab.core import scaled_dot_product_attention as _sdpa
from attnlab.core import softmax as _softmax
from attnlab.exercises import solutions as sol


@dataclass(frozen=True)
class Case:
    """One call of the learner's function: its arguments and what the case is about."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    about: str = ""


@dataclass(frozen=True)
class Mistake:
    """A typical wrong idea: ``fn`` computes what it gives, ``text`` says what it is."""

    text: str
    fn: Callable


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function to write (``name``), the course idea and page it belongs
    to, its cases, attnlab's reference, the known mistakes and how its output is read."""

    name: str
    idea: str
    page: str
    cases: Callable[[np.random.Generator], list[Case]]
    reference: Callable
    mistakes: tuple[Mistake, ...]
    outputs: tuple[str, ...] = ("output",)
    #: the result's dtype: "bool", or "like" (the first float argument's)
    dtype: str = "like"
    #: relative tolerance (float64 cases; float32 ones take 1e-4)
    rtol: float = 1e-7
    #: plugged into SmolLM2 (attnlab.exercises.plugged)
    in_model: bool = True


def _f(rng, *shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _ints(rng, lo, hi) -> int:
    return int(rng.integers(lo, hi + 1))


def _mask(rng, L: int, S: int) -> np.ndarray:
    """A random bool (L, S) mask with at least one True per row."""
    m = rng.random((L, S)) < 0.6
    m[np.arange(L), rng.integers(0, S, size=L)] = True
    return m


def _swap(x):
    return np.swapaxes(x, -1, -2)


# ---- softmax ------------------------------------------------------------------------------------
def _softmax_cases(rng):
    with_inf = _f(rng, 4, 6)
    with_inf[rng.random((4, 6)) < 0.3] = -np.inf
    with_inf[:, 0] = 0.5
    return [
        Case((_f(rng, _ints(rng, 3, 8)),), about="one row"),
        Case((_f(rng, _ints(rng, 2, 5), _ints(rng, 6, 9)),), about="rows of scores"),
        Case((_f(rng, 3, 4, 5), 1), about="axis=1 of a 3-D array"),
        Case((_f(rng, 5, 3), 0), about="axis=0"),
        Case((_f(rng, 3, 7, scale=400.0),), about="scores in the thousands (exp overflows unless the max "
                                                  "is subtracted)"),
        Case((with_inf,), about="-inf scores (masked keys)"),
        Case((_f(rng, 2, 6, 9, dtype=np.float32), -1), about="float32"),
    ]


def _softmax_wrong_axis(x, axis=-1):
    other = -2 if axis in (-1, x.ndim - 1) else -1
    return sol.softmax(x, other) if x.ndim > 1 else None


def _softmax_no_shift(x, axis=-1):
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)
        return e / e.sum(axis=axis, keepdims=True)


def _softmax_last_axis(x, axis=-1):
    return sol.softmax(x, -1) if axis not in (-1, x.ndim - 1) else None


def _softmax_whole(x, axis=-1):
    e = np.exp(x - x.max())
    return e / e.sum()


def _softmax_no_exp(x, axis=-1):
    with np.errstate(divide="ignore", invalid="ignore"):
        return x / x.sum(axis=axis, keepdims=True)


SOFTMAX = Exercise(
    "softmax", "the softmax", "weight-free-attention", _softmax_cases, _softmax,
    (Mistake("the `axis` argument is ignored: the softmax always runs over the last axis", _softmax_last_axis),
     Mistake("softmax over the wrong axis: each slice along `axis` must sum to 1", _softmax_wrong_axis),
     Mistake("the largest score is not subtracted before exp: exp(1000) overflows to inf and inf / inf is NaN",
             _softmax_no_shift),
     Mistake("normalized over the whole array instead of along `axis`", _softmax_whole),
     Mistake("no exp: the scores are divided by their sum, not exp(scores) by theirs", _softmax_no_exp)),
)


# ---- scaled dot-product attention --------------------------------------------------------------
def _qkv(rng, batch, L, S, E, Ev, dtype=np.float64):
    return _f(rng, *batch, L, E, dtype=dtype), _f(rng, *batch, S, E, dtype=dtype), _f(rng, *batch, S, Ev, dtype=dtype)


def _sdpa_cases(rng):
    L, S = _ints(rng, 3, 6), _ints(rng, 7, 9)
    return [
        Case(_qkv(rng, (), 4, 4, 8, 8), about="one head, L = S"),
        Case(_qkv(rng, (2, 3), L, S, 16, 5), about="batch and heads, L != S, E != Ev"),
        Case((*_qkv(rng, (), L, S, 64, 4), _mask(rng, L, S)), about="a boolean mask (True = attends), E = 64"),
        Case((*_qkv(rng, (2,), 5, 5, 32, 32), _causal_mask(5, 5)), about="a causal mask"),
        Case((*_qkv(rng, (2, 4), L, S, 16, 8, np.float32), _mask(rng, L, S)), about="float32 with a mask"),
    ]


def _ref_sdpa(q, k, v, mask=None):
    return _sdpa(q, k, v, attn_mask=mask)


def _attend(q, k, v, mask=None, *, scale=None, axis=-1, masked=-np.inf, after=False, inverted=False):
    """Attention with one thing changed (the mistakes below)."""
    s = q @ _swap(k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None and inverted:
        mask = ~mask
    if mask is not None and not after:
        s = np.where(mask, s, masked)
    with np.errstate(invalid="ignore", over="ignore"):
        w = sol.softmax(s, axis)
    if mask is not None and after:
        w = w * mask
    return w @ v


SDPA_MISTAKES = (
    Mistake("the scores are not scaled: divide q @ kᵀ by sqrt(E)", lambda q, k, v, mask=None: _attend(
        q, k, v, mask, scale=1.0)),
    Mistake("the scores are divided by E instead of sqrt(E)", lambda q, k, v, mask=None: _attend(
        q, k, v, mask, scale=1 / q.shape[-1])),
    Mistake("the scores are scaled by the values' width Ev instead of the keys' E: 1 / sqrt(E)",
            lambda q, k, v, mask=None: _attend(q, k, v, mask, scale=1 / np.sqrt(v.shape[-1]))),
    Mistake("softmax over the wrong axis: over the queries (axis -2) instead of the keys (axis -1), so "
            "the weights of one query do not sum to 1", lambda q, k, v, mask=None: _attend(q, k, v, mask, axis=-2)),
    Mistake("the mask is ignored: the keys it hides (False) must get weight 0",
            lambda q, k, v, mask=None: None if mask is None else _attend(q, k, v)),
    Mistake("the mask is read the wrong way round: True means the query may attend (attnlab's convention; "
            "torch.nn.MultiheadAttention's attn_mask is the opposite)",
            lambda q, k, v, mask=None: None if mask is None else _attend(q, k, v, mask, inverted=True)),
    Mistake("the mask is applied after the softmax (weights zeroed, not renormalized): set the hidden "
            "scores to -inf before it", lambda q, k, v, mask=None: None if mask is None else _attend(
                q, k, v, mask, after=True)),
    Mistake("hidden scores set to 0 instead of -inf: exp(0) = 1 still gives them weight",
            lambda q, k, v, mask=None: None if mask is None else _attend(q, k, v, mask, masked=0.0)),
)

SDPA = Exercise("scaled_dot_product_attention", "scaled dot-product attention", "attention-step-by-step",
                _sdpa_cases, _ref_sdpa, SDPA_MISTAKES)


# ---- the causal mask ------------------------------------------------------------------------------
def _causal_cases(rng):
    L = _ints(rng, 2, 5)
    return [Case((4, 4), about="L = S"), Case((1, 1), about="one token"), Case((L, L + _ints(rng, 2, 4)),
            about="S > L: cached keys before the queries"), Case((1, _ints(rng, 5, 9)), about="one new "
            "token after a cache (a decoding step)"), Case((6, 6), about="L = S = 6")]


def _ref_causal(L, S):
    return _causal_mask(L, S, align="bottom-right")


def _offset_mask(k: int):
    def fn(L, S):
        return np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L) + k
    return fn


CAUSAL = Exercise(
    "causal_mask", "the causal mask", "modern-decoder", _causal_cases, _ref_causal,
    (Mistake("off by one: a query must also see its own key (the diagonal is True)", _offset_mask(-1)),
     Mistake("off by one: each query sees one key in its future", _offset_mask(1)),
     Mistake("aligned top-left: with S > L, query i is at position S - L + i (the last query sees every "
             "key), not at position i", lambda L, S: np.arange(S)[None, :] <= np.arange(L)[:, None]),
     Mistake("True marks the keys to hide (torch.nn.MultiheadAttention's convention): attnlab's True = "
             "takes part", lambda L, S: ~_ref_causal(L, S)),
     Mistake("the wrong triangle: each query sees its own position and the keys after it, not before",
             lambda L, S: np.arange(S)[None, :] >= np.arange(L)[:, None] + (S - L)),
     Mistake("an additive mask (0 and -inf): return the boolean mask (True = takes part)",
             lambda L, S: np.where(_ref_causal(L, S), 0.0, -np.inf))),
    dtype="bool",
)


# ---- splitting and merging heads --------------------------------------------------------------------
def _ref_split(x, num_heads):
    *batch, L, HD = x.shape
    return np.swapaxes(x.reshape(*batch, L, num_heads, HD // num_heads), -2, -3)


def _ref_merge(x):
    *batch, H, L, D = x.shape
    return np.swapaxes(x, -2, -3).reshape(*batch, L, H * D)


def _split_cases(rng):
    return [Case((_f(rng, 5, 12), 3), about="(L, H * D) = (5, 12), 3 heads"),
            Case((_f(rng, 2, 7, 8), 2), about="a batch"),
            Case((_f(rng, 2, 4, 6, 15, dtype=np.float32), 5), about="two batch dims, float32"),
            Case((_f(rng, 3, 8), 1), about="one head")]


def _merge_cases(rng):
    return [Case((_f(rng, 3, 5, 4),), about="(H, L, D) = (3, 5, 4)"),
            Case((_f(rng, 2, 2, 7, 4),), about="a batch"),
            Case((_f(rng, 2, 3, 5, 6, 3, dtype=np.float32),), about="two batch dims, float32"),
            Case((_f(rng, 1, 6, 4),), about="one head")]


def _split_interleaved(x, num_heads):
    *batch, L, HD = x.shape
    return np.moveaxis(x.reshape(*batch, L, HD // num_heads, num_heads), -1, -3)


SPLIT = Exercise(
    "split_heads", "splitting and merging heads", "multi-head-self-attention", _split_cases, _ref_split,
    (Mistake("reshaped straight to (H, L, D): each 'head' is a run of whole rows, mixing tokens; reshape to "
             "(L, H, D), then swap the L and H axes", lambda x, num_heads: x.reshape(
                 *x.shape[:-2], num_heads, x.shape[-2], x.shape[-1] // num_heads)),
     Mistake("the heads interleaved: head h took every H-th column, not the block of D columns "
             "h * D .. (h + 1) * D - 1", _split_interleaved),
     Mistake("the L and H axes are not swapped: the result is (..., L, H, D), the heads must come before L",
             lambda x, num_heads: x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads))),
)


def _merge_interleaved(x):
    *batch, H, L, D = x.shape
    return np.moveaxis(x, -3, -1).reshape(*batch, L, D * H)


MERGE = Exercise(
    "merge_heads", "splitting and merging heads", "multi-head-self-attention", _merge_cases, _ref_merge,
    (Mistake("heads merged in the wrong order: (H, L, D) reshaped straight to (L, H * D) mixes tokens; swap "
             "the H and L axes first", lambda x: x.reshape(*x.shape[:-3], x.shape[-2], x.shape[-3] * x.shape[-1])),
     Mistake("the heads interleaved: column c holds head c % H, not head c // D (one block of D columns a "
             "head)", _merge_interleaved),
     Mistake("the heads stacked along the tokens ((H * L, D)) instead of side by side ((L, H * D))",
             lambda x: x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))),
)


# ---- multi-head attention ------------------------------------------------------------------------
def _weights(rng, n_out, n_in, dtype=np.float64):
    return _f(rng, n_out, n_in, dtype=dtype, scale=1 / np.sqrt(n_in))


def _mha_cases(rng):
    L = _ints(rng, 3, 6)
    c32 = [_f(rng, 2, 5, 8, dtype=np.float32), *(_weights(rng, 8, 8, np.float32) for _ in range(4)), 2]
    return [
        Case((_f(rng, 4, 8), *(_weights(rng, 8, 8) for _ in range(4)), 2), about="E = 8, 2 heads"),
        Case((_f(rng, 2, L, 16), *(_weights(rng, 16, 16) for _ in range(4)), 4, _causal_mask(L, L)),
             about="a batch, 4 heads, a causal mask"),
        Case((_f(rng, L, 6), _weights(rng, 12, 6), _weights(rng, 12, 6), _weights(rng, 12, 6), _weights(rng, 6, 12),
              3, _mask(rng, L, L)), about="H * D = 12 != E = 6, a random mask"),
        Case(tuple(c32), about="float32"),
    ]


def _attention_layer(w_q, w_k, w_v, w_o, num_heads, kdim=None):
    from attnlab.nn import Attention

    HD, E = w_q.shape
    layer = Attention(E, num_heads, head_dim=HD // num_heads, bias=False, kdim=kdim, vdim=kdim,
                      separate_projections=kdim is not None, dtype=w_q.dtype)
    layer.out_proj = _linear(w_o)
    if kdim is None:
        layer.in_proj_weight.data = np.concatenate([w_q, w_k, w_v], axis=0)
    else:
        layer.q_proj_weight.data, layer.k_proj_weight.data, layer.v_proj_weight.data = w_q, w_k, w_v
    return layer


def _linear(w):
    from attnlab.nn.linear import Linear

    lin = Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight.data = np.ascontiguousarray(w)
    return lin


def _ref_mha(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
    layer = _attention_layer(w_q, w_k, w_v, w_o, num_heads)
    xb = x.reshape(-1, *x.shape[-2:])
    return layer.forward_with_weights(xb, attn_mask=mask)[0].reshape(*x.shape[:-1], w_o.shape[0])


def _mha_variant(x, w_q, w_k, w_v, w_o, num_heads, mask=None, *, context=None, scale=None, merge=None,
                 transposed=False, project=True, axis=-1):
    c = x if context is None else context
    proj = (lambda a, w: a @ w) if transposed else (lambda a, w: a @ w.T)
    if transposed and w_q.shape[0] != w_q.shape[1]:
        return None
    q, k, v = (_ref_split(proj(a, w), num_heads) for a, w in ((x, w_q), (c, w_k), (c, w_v)))
    D = q.shape[-1]
    if mask is not None:
        mask = np.expand_dims(mask, -3)
    z = _attend(q, k, v, mask, scale=1 / np.sqrt(D) if scale is None else scale(x, D), axis=axis)
    z = (merge or _ref_merge)(z)
    return proj(z, w_o) if project else z


def _mha_mistakes(cross: bool):
    def v(**kw):
        if cross:
            return lambda x, context, w_q, w_k, w_v, w_o, num_heads, mask=None: _mha_variant(
                x, w_q, w_k, w_v, w_o, num_heads, mask, context=context, **kw)
        return lambda x, w_q, w_k, w_v, w_o, num_heads, mask=None: _mha_variant(
            x, w_q, w_k, w_v, w_o, num_heads, mask, **kw)

    def wrong_merge(z):
        return z.reshape(*z.shape[:-3], z.shape[-2], z.shape[-3] * z.shape[-1])

    return (
        Mistake("the scores are not scaled: each head's scores need 1 / sqrt(D)", v(scale=lambda x, D: 1.0)),
        Mistake("scaled by the model width: 1 / sqrt(E), with E = x's width, instead of each head's "
                "1 / sqrt(D), D = w_q.shape[0] // num_heads", v(scale=lambda x, D: 1 / np.sqrt(x.shape[-1]))),
        Mistake("heads merged in the wrong order: (H, L, D) reshaped straight to (L, H * D) mixes tokens; "
                "swap the H and L axes first", v(merge=wrong_merge)),
        Mistake("the weights are used as (in, out): they are torch.nn.Linear's (out, in), so a projection is "
                "x @ W.T", v(transposed=True)),
        Mistake("the output projection w_o is left out: return merged @ w_o.T", v(project=False)),
        Mistake("softmax over the wrong axis: over the queries instead of the keys", v(axis=-2)),
    )


MHA = Exercise("multi_head_attention", "multi-head attention", "multi-head-self-attention", _mha_cases, _ref_mha,
               _mha_mistakes(False))


# ---- cross-attention --------------------------------------------------------------------------
def _cross_cases(rng):
    L, S = _ints(rng, 2, 4), _ints(rng, 5, 8)
    return [
        Case((_f(rng, L, 8), _f(rng, S, 8), *(_weights(rng, 8, 8) for _ in range(4)), 2),
             about="L != S, 2 heads"),
        Case((_f(rng, 2, L, 8), _f(rng, 2, S, 6), _weights(rng, 12, 8), _weights(rng, 12, 6), _weights(rng, 12, 6),
              _weights(rng, 8, 12), 3), about="a batch, context 6 wide, H * D = 12"),
        Case((_f(rng, S, 8), _f(rng, L, 8), *(_weights(rng, 8, 8) for _ in range(4)), 4, _mask(rng, S, L)),
             about="more queries than keys, a mask (L, S)"),
        Case((_f(rng, 2, L, 8, dtype=np.float32), _f(rng, 2, S, 8, dtype=np.float32),
              *(_weights(rng, 8, 8, np.float32) for _ in range(4)), 2), about="float32"),
    ]


def _ref_cross(x, context, w_q, w_k, w_v, w_o, num_heads, mask=None):
    layer = _attention_layer(w_q, w_k, w_v, w_o, num_heads, kdim=context.shape[-1])
    xb, cb = x.reshape(-1, *x.shape[-2:]), context.reshape(-1, *context.shape[-2:])
    return layer.forward_with_weights(xb, key_value=cb, attn_mask=mask)[0].reshape(*x.shape[:-1], w_o.shape[0])


def _cross_self(x, context, w_q, w_k, w_v, w_o, num_heads, mask=None):
    if w_k.shape[1] != x.shape[-1] or (mask is not None and mask.shape[-1] != x.shape[-2]):
        return None
    return _mha_variant(x, w_q, w_k, w_v, w_o, num_heads, mask)


def _cross_swapped(x, context, w_q, w_k, w_v, w_o, num_heads, mask=None):
    if w_q.shape[1] != context.shape[-1] or w_k.shape[1] != x.shape[-1]:
        return None
    return _mha_variant(context, w_q, w_k, w_v, w_o, num_heads, None if mask is None else _swap(mask), context=x)


CROSS = Exercise(
    "cross_attention", "cross-attention", "cross-attention", _cross_cases, _ref_cross,
    (Mistake("the keys and values came from x: in cross-attention they come from `context`", _cross_self),
     Mistake("queries and keys swapped: the queries come from x (one output row per row of x), the keys "
             "and values from `context`", _cross_swapped),
     *_mha_mistakes(True)),
)


# ---- rotary positions -----------------------------------------------------------------------------
def _rotary_cases(rng):
    P = _ints(rng, 3, 12)
    L = _ints(rng, 3, 6)
    return [
        Case((_f(rng, 5, 8), np.arange(5)), about="positions 0..4, D = 8"),
        Case((_f(rng, 2, 3, L, 16), np.arange(P, P + L)), about=f"positions {P}.. (after {P} cached tokens)"),
        Case((_f(rng, 4, 64), np.array([0, 7, 30, 100]), 100000.0), about="D = 64, theta = 100000"),
        Case((_f(rng, 2, L, 32, dtype=np.float32), np.arange(L) + 3, 500.0), about="float32, theta = 500"),
    ]


def _ref_rotary(x, positions, theta=10000.0):
    from attnlab.core.rotary import RopeConfig, apply_rotary, rope_cos_sin, rope_inv_freq

    inv, _ = rope_inv_freq(RopeConfig(x.shape[-1], theta=float(theta)))
    cos, sin = rope_cos_sin(inv, np.asarray(positions), dtype=x.dtype)
    return apply_rotary(x, cos, sin)


def _rotary_variant(x, positions, theta=10000.0, *, pairs=False, sign=1.0, exponent=2.0, from_zero=False):
    D = x.shape[-1]
    F = D // 2
    pos = np.arange(len(positions)) if from_zero else np.asarray(positions)
    angle = pos[:, None] * float(theta) ** (-exponent * np.arange(F) / D)
    cos, sin = np.cos(angle), sign * np.sin(angle)
    if pairs:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty(x.shape)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return out
    x1, x2 = x[..., :F], x[..., F:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


ROTARY = Exercise(
    "apply_rotary", "rotary positions", "modern-decoder", _rotary_cases, _ref_rotary,
    (Mistake("rotary on the wrong pairs: interleaved (x[2f], x[2f + 1]) as in Meta's original code; attnlab, "
             "Hugging Face and SmolLM2 pair x[f] with x[f + D/2], the two halves",
             lambda x, p, theta=10000.0: _rotary_variant(x, p, theta, pairs=True)),
     Mistake("rotated the wrong way (by -angle): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin",
             lambda x, p, theta=10000.0: _rotary_variant(x, p, theta, sign=-1.0)),
     Mistake("the frequencies are theta ** (-f / D); they are theta ** (-2 f / D)",
             lambda x, p, theta=10000.0: _rotary_variant(x, p, theta, exponent=1.0)),
     Mistake("the positions are taken as 0..L-1: use the `positions` given (after a cache they continue)",
             lambda x, p, theta=10000.0: _rotary_variant(x, p, theta, from_zero=True)),
     Mistake("`theta` is ignored: the frequencies must use the theta given (SmolLM2's is 100000)",
             lambda x, p, theta=10000.0: None if theta == 10000.0 else _rotary_variant(x, p))),
    rtol=1e-5,  # attnlab's angles are float32 products, as transformers'
)


# ---- grouped-query heads -------------------------------------------------------------------------
def _gqa_cases(rng):
    L, S = _ints(rng, 3, 5), _ints(rng, 5, 8)
    return [
        Case((_f(rng, 4, L, 8), _f(rng, 2, S, 8), _f(rng, 2, S, 8)), about="4 query heads over 2"),
        Case((_f(rng, 2, 9, L, 16), _f(rng, 2, 3, S, 16), _f(rng, 2, 3, S, 6), _mask(rng, L, S)),
             about="9 over 3 (SmolLM2's grouping), a mask"),
        Case((_f(rng, 6, 5, 8), _f(rng, 1, 5, 8), _f(rng, 1, 5, 8), _causal_mask(5, 5)),
             about="one key/value head (multi-query), causal"),
        Case((_f(rng, 1, 8, L, 32, dtype=np.float32), _f(rng, 1, 2, S, 32, dtype=np.float32),
              _f(rng, 1, 2, S, 32, dtype=np.float32)), about="float32, 8 over 2"),
    ]


def _ref_gqa(q, k, v, mask=None):
    return _sdpa(q, k, v, attn_mask=mask, enable_gqa=True)


def _gqa_variant(q, k, v, mask=None, *, tile=False, first=False, **kw):
    G = q.shape[-3] // k.shape[-3]
    if first:
        k, v = k[..., :1, :, :], v[..., :1, :, :]
        G = q.shape[-3]
    if tile:
        reps = [1] * k.ndim
        reps[-3] = G
        k, v = np.tile(k, reps), np.tile(v, reps)
    else:
        k, v = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)
    return _attend(q, k, v, mask, **kw)


GQA = Exercise(
    "grouped_query_attention", "grouped-query heads", "modern-decoder", _gqa_cases, _ref_gqa,
    (Mistake("query heads matched to key/value heads round-robin (h % H, np.tile): consecutive query heads "
             "share one key/value head, h // (Hq / H) (np.repeat)",
             lambda q, k, v, mask=None: None if k.shape[-3] == 1 else _gqa_variant(q, k, v, mask, tile=True)),
     Mistake("every query head uses key/value head 0", lambda q, k, v, mask=None: None if k.shape[-3] == 1
             else _gqa_variant(q, k, v, mask, first=True)),
     Mistake("the scores are not scaled: divide q @ kᵀ by sqrt(E)",
             lambda q, k, v, mask=None: _gqa_variant(q, k, v, mask, scale=1.0)),
     Mistake("softmax over the wrong axis: over the queries instead of the keys",
             lambda q, k, v, mask=None: _gqa_variant(q, k, v, mask, axis=-2)),
     Mistake("the mask is read the wrong way round: True means the query may attend",
             lambda q, k, v, mask=None: None if mask is None else _gqa_variant(q, k, v, mask, inverted=True))),
)


# ---- the key/value cache ------------------------------------------------------------------------
def _cache_cases(rng):
    P, L = _ints(rng, 3, 7), _ints(rng, 2, 4)

    def case(batch, P, L, E=8, Ev=8, dtype=np.float64, about=""):
        q, k, v = _qkv(rng, batch, L, L, E, Ev, dtype)
        return Case((q, k, v, _f(rng, *batch, P, E, dtype=dtype), _f(rng, *batch, P, Ev, dtype=dtype)), about=about)

    return [case((), 0, 4, about="an empty cache (the prompt): P = 0, L = 4"),
            case((2,), P, 1, 16, 6, about=f"one new token after {P} cached"),
            case((2, 3), P, L, about=f"{L} new tokens after {P} cached"),
            case((3,), 5, 1, dtype=np.float32, about="float32, one new token")]


def _ref_cache(q, k, v, k_cache, v_cache):
    keys, values = np.concatenate([k_cache, k], axis=-2), np.concatenate([v_cache, v], axis=-2)
    L, S = q.shape[-2], keys.shape[-2]
    return _sdpa(q, keys, values, attn_mask=_causal_mask(L, S, align="bottom-right")), keys, values


def _cache_variant(q, k, v, k_cache, v_cache, *, prepend=False, mask="bottom-right", only_new=False):
    keys = np.concatenate([k, k_cache] if prepend else [k_cache, k], axis=-2)
    values = np.concatenate([v, v_cache] if prepend else [v_cache, v], axis=-2)
    ak, av = (k, v) if only_new else (keys, values)
    L, S = q.shape[-2], ak.shape[-2]
    m = None if mask is None else _causal_mask(L, S, align=mask)
    return _attend(q, ak, av, m), keys, values


CACHE = Exercise(
    "cached_attention", "the key/value cache", "modern-decoder", _cache_cases, _ref_cache,
    (Mistake("no causal mask: with L > 1 new tokens, new query i may see keys up to position P + i only",
             lambda *a: None if a[0].shape[-2] == 1 else _cache_variant(*a, mask=None)),
     Mistake("the causal mask aligned top-left: new query i is at position P + i, so it sees the P cached "
             "keys too", lambda *a: None if a[3].shape[-2] == 0 else _cache_variant(*a, mask="top-left")),
     Mistake("the new keys and values go before the cached ones: the cache keeps positions in order, oldest "
             "first", lambda *a: None if a[3].shape[-2] == 0 else _cache_variant(*a, prepend=True)),
     Mistake("the cached keys are ignored: the new queries attend to the new keys only",
             lambda *a: None if a[3].shape[-2] == 0 else _cache_variant(*a, only_new=True)),
     Mistake("the cache is returned as it came in: return it with the new keys and values appended",
             lambda q, k, v, kc, vc: (_ref_cache(q, k, v, kc, vc)[0], kc, vc))),
    outputs=("out", "k_cache", "v_cache"),
)


# ---- the online softmax --------------------------------------------------------------------------
def _online_cases(rng):
    L, S = _ints(rng, 3, 6), _ints(rng, 9, 14)
    left = np.ones((5, 10), dtype=bool)
    left[:, :4] = False  # the first keys are padding: the first blocks are masked for every query
    return [
        Case((*_qkv(rng, (), 4, 8, 8, 8), 3), about="S = 8 in blocks of 3"),
        Case((*_qkv(rng, (2, 2), L, S, 16, 6), 4), about="a batch, blocks of 4"),
        Case((*_qkv(rng, (), 6, 6, 8, 8), 2, _causal_mask(6, 6)), about="causal, blocks of 2"),
        Case((*_qkv(rng, (2,), 5, 10, 8, 8), 2, left),
             about="the first 4 keys masked for every query (left padding): whole blocks of -inf"),
        Case((*_qkv(rng, (), 5, 12, 8, 8), 5, _mask(rng, 5, 12)), about="a random mask, blocks of 5"),
        Case((*_qkv(rng, (3,), L, S, 32, 32, np.float32), 4), about="float32"),
        Case((_f(rng, 4, 8, scale=6.0), _f(rng, 9, 8, scale=6.0), _f(rng, 9, 8), 3),
             about="large scores: the maximum changes from block to block"),
    ]


def _ref_online(q, k, v, block_size, mask=None):
    return _sdpa(q, k, v, attn_mask=mask)


def _online_variant(q, k, v, block_size, mask=None, *, rescale_acc=True, rescale_sum=True, scale=None,
                    per_block=False):
    S = k.shape[-2]
    sc = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    if mask is not None:
        mask = np.broadcast_to(mask, (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2], S))
    if per_block:  # each block's softmax on its own, averaged
        outs = [_attend(q, k[..., a:a + block_size, :], v[..., a:a + block_size, :],
                        None if mask is None else mask[..., a:a + block_size], scale=sc)
                for a in range(0, S, block_size)]
        return np.mean(outs, axis=0)
    m = np.full(q.shape[:-1] + (1,), -np.inf)
    total = np.zeros(q.shape[:-1] + (1,))
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],))
    with np.errstate(invalid="ignore"):
        for a in range(0, S, block_size):
            s = q @ _swap(k[..., a:a + block_size, :]) * sc
            if mask is not None:
                s = np.where(mask[..., a:a + block_size], s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            c = np.exp(m - m_new)
            p = np.exp(s - m_new)
            total = (total * c if rescale_sum else total) + p.sum(axis=-1, keepdims=True)
            acc = (acc * c if rescale_acc else acc) + p @ v[..., a:a + block_size, :]
            m = m_new
        return acc / total


ONLINE = Exercise(
    "online_softmax_attention", "the online softmax", "fast-attention", _online_cases, _ref_online,
    (Mistake("NaN where a whole block is masked: while the running maximum is -inf, exp(m_old - m_new) is "
             "exp(-inf + inf) = NaN; skip such a block (or start from a finite maximum)",
             lambda *a, **kw: _online_variant(*a, **kw)),
     Mistake("the accumulator is not rescaled: when a block brings a larger maximum, multiply acc by "
             "exp(m_old - m_new)", lambda *a, **kw: _online_variant(*a, **kw, rescale_acc=False)),
     Mistake("the running sum is not rescaled: when a block brings a larger maximum, multiply l by "
             "exp(m_old - m_new)", lambda *a, **kw: _online_variant(*a, **kw, rescale_sum=False)),
     Mistake("the scores are not scaled: divide q @ kᵀ by sqrt(E)",
             lambda *a, **kw: _online_variant(*a, **kw, scale=1.0)),
     Mistake("each block normalized on its own and the blocks averaged: the weights of all blocks share one "
             "denominator", lambda *a, **kw: _online_variant(*a, **kw, per_block=True))),
)

EXERCISES: dict[str, Exercise] = {e.name: e for e in (SOFTMAX, SDPA, CAUSAL, SPLIT, MERGE, MHA, CROSS, ROTARY, GQA,
                                                      CACHE, ONLINE)}
