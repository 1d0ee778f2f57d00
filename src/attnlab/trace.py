"""Every intermediate of one attention call, as data (seed 001's walk-through).

:func:`trace` runs a self-attention layer on one sequence step by step with the same
operations the layer uses, and records each array. The CLI prints the steps
(``attnlab explain --steps``), the HTML report draws them, ``to_dict`` gives JSON.

The step records are a stable interface. For a :class:`~attnlab.MultiheadAttention` with
``H`` heads, model width ``E``, head width ``D = E / H`` and ``T`` tokens they come in this
order (``head`` is None for whole-layer steps, else the head index ``0..H-1``):

============== ========= ===== ====================================================
name           shape     head  what
============== ========= ===== ====================================================
X              (T, E)    None  the input token vectors
W_q W_k W_v    (E, D)    h     head ``h``'s projections, written so that ``Q = X W_q``
b_q b_k b_v    (D,)      h     their biases (only if the layer has biases)
Q K V          (T, D)    h     queries, keys, values
scores         (T, T)    h     raw scores ``Q K^T``
scaled_scores  (T, T)    h     ``scores * scale`` (``scale = 1/sqrt(D)``)
masked_scores  (T, T)    h     scaled scores with ``-inf`` where the mask forbids
                               (only if a mask or ``is_causal`` was given)
weights        (T, T)    h     ``softmax(scaled or masked scores)``; rows sum to 1
head_output    (T, D)    h     ``weights V``
concat         (T, E)    None  the head outputs side by side
W_o            (E, E)    None  the output projection, ``output = concat W_o``
b_o            (E,)      None  its bias (only if the layer has biases)
output         (T, E)    None  the layer's output (the contextual vectors)
============== ========= ===== ====================================================

Per-head steps are grouped by step (all heads' ``W_q``, then all heads' ``W_k``, ...). For
a single-head :class:`~attnlab.SelfAttention` the per-head steps have ``head=0``, ``W_*``
are ``(E_in, D)``, and the last steps are ``weights`` then ``output`` (``weights V``; the
layer has no output projection).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from attnlab._validation import shape_error
from attnlab.core.masks import causal_mask
from attnlab.core.softmax import softmax
from attnlab.nn import functional as F
from attnlab.nn.attention import MultiheadAttention, SelfAttention
from attnlab.nn.linear import check_input

_DESCRIPTIONS = {
    "X": "input token vectors, one row per token",
    "W_q": "query projection of this head (Q = X W_q)",
    "W_k": "key projection of this head (K = X W_k)",
    "W_v": "value projection of this head (V = X W_v)",
    "b_q": "query bias",
    "b_k": "key bias",
    "b_v": "value bias",
    "Q": "queries: what each token looks for",
    "K": "keys: what each token offers to be found by",
    "V": "values: what each token passes on",
    "scores": "raw scores Q K^T: row i compares token i's query with every key",
    "scaled_scores": "scores times 1/sqrt({D}) = {scale:.4g}, so the softmax does not saturate",
    "masked_scores": "scaled scores with -inf where a token may not look",
    "weights": "softmax over each row: how much each token attends to each other; rows sum to 1",
    "head_output": "weights V: each token's weighted mix of the values",
    "concat": "the heads' outputs side by side",
    "W_o": "output projection (output = concat W_o)",
    "b_o": "output bias",
    "output": "the layer's output: one contextual vector per token",
}


@dataclass(frozen=True)
class TraceStep:
    """One recorded array.

    Attributes:
        name: the step's name (see the table in :mod:`attnlab.trace`).
        values: the array.
        head: the head index, or None for a step of the whole layer.
        description: one sentence saying what the array is.
    """

    name: str
    values: np.ndarray
    head: int | None
    description: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def to_dict(self, *, decimals: int | None = None) -> dict:
        v = self.values.astype(np.float64)
        if decimals is not None:
            v = np.round(v, decimals)
        # -inf (masked scores) is not JSON: written as None
        values = np.where(np.isfinite(v), v, np.nan).tolist()
        values = _nan_to_none(values)
        return {
            "name": self.name,
            "shape": list(self.shape),
            "head": self.head,
            "description": self.description,
            "values": values,
        }


def _nan_to_none(x):
    if isinstance(x, list):
        return [_nan_to_none(i) for i in x]
    return None if isinstance(x, float) and math.isnan(x) else x


@dataclass
class Trace:
    """The steps of one attention call, in order.

    Attributes:
        steps: the :class:`TraceStep` records.
        tokens: the ``T`` token strings (or ``"0"``, ``"1"``, ... when none were given).
        num_heads: ``H``.
        scale: the factor applied to the scores.
    """

    steps: list[TraceStep]
    tokens: list[str]
    num_heads: int
    scale: float

    def __iter__(self) -> Iterator[TraceStep]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def names(self) -> list[str]:
        """The distinct step names, in order."""
        return list(dict.fromkeys(s.name for s in self.steps))

    def get(self, name: str, head: int | None = None) -> np.ndarray:
        """The values of step ``name`` (of ``head`` for a per-head step)."""
        for s in self.steps:
            if s.name == name and s.head == head:
                return s.values
        have = ", ".join(self.names())
        raise KeyError(f"no step {name!r} with head={head} (steps: {have})")

    def to_dict(self, *, decimals: int | None = None) -> dict:
        """JSON-ready: ``{"tokens", "num_heads", "scale", "steps": [{"name", "shape",
        "head", "description", "values"}]}``; ``-inf`` values become ``null``."""
        return {
            "tokens": list(self.tokens),
            "num_heads": self.num_heads,
            "scale": self.scale,
            "steps": [s.to_dict(decimals=decimals) for s in self.steps],
        }


def _mask_for(attn_mask, is_causal: bool, T: int, dtype) -> np.ndarray | None:
    if attn_mask is not None and is_causal:
        raise ValueError("give attn_mask or is_causal, not both")
    if is_causal:
        return causal_mask(T, T)
    if attn_mask is None:
        return None
    m = np.asarray(attn_mask)
    if m.shape != (T, T):
        raise shape_error("attn_mask", m.shape, f"({T}, {T})")
    if m.dtype != np.bool_ and not np.issubdtype(m.dtype, np.floating):
        raise TypeError(f"attn_mask must be bool (True = takes part) or float, got {m.dtype}")
    return m if m.dtype == np.bool_ else m.astype(dtype)


def _apply_mask(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    if mask.dtype == np.bool_:
        return np.where(mask, scores, -np.inf).astype(scores.dtype)
    return scores + mask


def trace(
    layer: MultiheadAttention | SelfAttention,
    x: np.ndarray,
    *,
    tokens: Sequence[str] | None = None,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
) -> Trace:
    """Run ``layer`` as self-attention on one sequence and record every intermediate.

    The values are those the layer computes (same operations, same order), without
    dropout. The layer's own call is not touched (no caches are written).

    Args:
        layer: a :class:`~attnlab.MultiheadAttention` (``kdim == vdim == embed_dim``, no
            ``add_bias_kv``/``add_zero_attn``) or a :class:`~attnlab.SelfAttention`.
        x: ``(T, E)`` or ``(1, T, E)`` token vectors, the layer's dtype.
        tokens: ``T`` labels for the rows (default ``"0"``, ``"1"``, ...).
        attn_mask: ``(T, T)``: bool (True = takes part) or float (added to the scores).
        is_causal: token ``i`` sees tokens ``j <= i``.

    Returns:
        A :class:`Trace`; see the module docstring for the steps.

    >>> import attnlab
    >>> mha = attnlab.MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0))
    >>> x = np.random.default_rng(1).standard_normal((1, 3, 8)).astype(np.float32)
    >>> t = attnlab.trace(mha, x, tokens=["a", "b", "c"])
    >>> [(s.name, s.shape) for s in t.steps if s.head in (None, 0)][:6]
    [('X', (3, 8)), ('W_q', (8, 4)), ('W_k', (8, 4)), ('W_v', (8, 4)), ('b_q', (4,)), ('b_k', (4,))]
    >>> bool(np.allclose(t.get("output"), mha(x, x, x)[0][0]))
    True
    """
    if isinstance(layer, MultiheadAttention):
        E, H = layer.embed_dim, layer.num_heads
        if not layer._qkv_same_embed_dim or layer.bias_k is not None or layer.add_zero_attn:
            raise ValueError(
                "trace supports MultiheadAttention with kdim == vdim == embed_dim and no "
                "add_bias_kv/add_zero_attn"
            )
        dtype = layer.dtype
    elif isinstance(layer, SelfAttention):
        E, H = layer.d_in, 1
        dtype = layer.W_q.weight.dtype
    else:
        raise TypeError(
            f"layer must be attnlab.MultiheadAttention or attnlab.SelfAttention, got "
            f"{type(layer).__name__}"
        )
    x = check_input(x, "x", dtype, E, "(T, {d}) or (1, T, {d})")
    if x.ndim == 3 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 2:
        raise shape_error("x", x.shape, f"(T, {E}) or (1, T, {E}): one sequence")
    T = x.shape[0]
    if tokens is None:
        tokens = [str(i) for i in range(T)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != T:
        raise ValueError(f"tokens has {len(tokens)} entries, but x has T={T} rows")
    mask = _mask_for(attn_mask, is_causal, T, dtype)

    steps: list[TraceStep] = []
    D = layer.d_out if isinstance(layer, SelfAttention) else layer.head_dim

    def add(name, values, head=None):
        desc = _DESCRIPTIONS[name].format(D=D, scale=1.0 / math.sqrt(D))
        steps.append(TraceStep(name, np.array(values, copy=True), head, desc))

    add("X", x)
    if isinstance(layer, SelfAttention):
        ws = [layer.W_q.weight.data, layer.W_k.weight.data, layer.W_v.weight.data]  # (D, E)
        lins = (layer.W_q, layer.W_k, layer.W_v)
        bs = [None if lin.bias is None else lin.bias.data for lin in lins]
        D = layer.d_out
    else:
        (wq, wk, wv), (bq, bk, bv) = layer._in_proj()
        ws, bs, D = [wq, wk, wv], [bq, bk, bv], layer.head_dim

    # the projections exactly as the layer computes them: (T, E) -> (T, H*D)
    proj = [F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)]
    # (T, H*D) -> (H, T, D)
    q, k, v = (p.reshape(T, H, D).transpose(1, 0, 2) for p in proj)
    for name, w in zip(("W_q", "W_k", "W_v"), ws, strict=True):
        for h in range(H):
            add(name, w[h * D : (h + 1) * D].T, h)  # (D, E) rows of head h -> (E, D)
    if bs[0] is not None:
        for name, b in zip(("b_q", "b_k", "b_v"), bs, strict=True):
            for h in range(H):
                add(name, b[h * D : (h + 1) * D], h)
    for name, arr in (("Q", q), ("K", k), ("V", v)):
        for h in range(H):
            add(name, arr[h], h)

    scale = 1.0 / math.sqrt(D)
    scores = np.matmul(q, np.swapaxes(k, -1, -2))  # (H, T, T)
    scaled = scores * np.asarray(scale, dtype=scores.dtype)
    masked = None if mask is None else _apply_mask(scaled, mask)
    weights = softmax(scaled if masked is None else masked, axis=-1)
    head_out = np.matmul(weights, v)  # (H, T, D)
    for name, arr in (("scores", scores), ("scaled_scores", scaled), ("masked_scores", masked),
                      ("weights", weights)):
        if arr is not None:
            for h in range(H):
                add(name, arr[h], h)

    if isinstance(layer, SelfAttention):
        add("output", head_out[0])
    else:
        for h in range(H):
            add("head_output", head_out[h], h)
        concat = head_out.transpose(1, 0, 2).reshape(T, E)  # (H, T, D) -> (T, E)
        add("concat", concat)
        w_o = layer.out_proj.weight.data
        b_o = None if layer.out_proj.bias is None else layer.out_proj.bias.data
        add("W_o", w_o.T)
        if b_o is not None:
            add("b_o", b_o)
        add("output", F.linear(concat, w_o, b_o))
    return Trace(steps=steps, tokens=tokens, num_heads=H, scale=scale)
