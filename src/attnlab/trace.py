"""Every intermediate of one attention call, as data: the step-by-step walk-through.

:func:`trace` runs an attention layer on one sequence and records each array through the
layer's hook points (:meth:`~attnlab.nn.Module.run_with_cache`): the recorded queries,
keys, values, masked scores, weights, head outputs and output *are* what the layer
computed, not a second computation. The raw and the scaled scores, which the layer never
materialises on its own, are computed from the recorded queries and keys. ``str(trace)``
(what printing shows) gives the steps as tables,
``to_dict`` gives JSON, the HTML report draws them. Models give the trace of any of their
layers (``model.trace(...)``).

The step records are a stable interface. For a :class:`~attnlab.MultiheadAttention` with
``H`` heads, model width ``E``, head width ``D = E / H``, ``L`` queries and ``S`` keys
(``S = L`` for self-attention) they come in this order (``head`` is None for whole-layer
steps, else the head index ``0..H-1``):

============== ========= ===== ====================================================
name           shape     head  what
============== ========= ===== ====================================================
X              (L, E)    None  the input token vectors (the queries' input)
X_kv           (S, E)    None  the keys' and values' input (cross-attention only)
W_q W_k W_v    (E, D)    h     head ``h``'s projections, written so that ``Q = X W_q``
b_q b_k b_v    (D,)      h     their biases (only if the layer has biases)
Q              (L, D)    h     queries
K V            (S, D)    h     keys, values
scores         (L, S)    h     raw scores ``Q K^T``
scaled_scores  (L, S)    h     ``(Q * scale) K^T`` (``scale = 1/sqrt(D)``)
masked_scores  (L, S)    h     scaled scores with ``-inf`` where the mask forbids
                               (only if a mask or ``is_causal`` was given)
weights        (L, S)    h     ``softmax(scaled or masked scores)``; rows sum to 1
head_output    (L, D)    h     ``weights V``
concat         (L, E)    None  the head outputs side by side
W_o            (E, E)    None  the output projection, ``output = concat W_o``
b_o            (E,)      None  its bias (only if the layer has biases)
output         (L, E)    None  the layer's output (the contextual vectors)
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
from attnlab.core import attention_scores, attention_weights
from attnlab.nn import functional as F
from attnlab.nn.attention import Attention, MultiheadAttention, SelfAttention

__all__ = ["Trace", "TraceStep", "format_table", "trace", "trace_from_cache", "trace_model"]

_DESCRIPTIONS = {
    "X": "input token vectors, one row per token",
    "X_kv": "the vectors the keys and values are made from, one row per token",
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
# Rows labelled by the query tokens, by the key tokens; columns by the key tokens.
_QUERY_ROWS = {"X", "Q", "scores", "scaled_scores", "masked_scores", "weights", "head_output",
               "concat", "output"}
_KEY_ROWS = {"X_kv", "K", "V"}
_KEY_COLS = {"scores", "scaled_scores", "masked_scores", "weights"}


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


def format_table(
    matrix: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    *,
    decimals: int = 2,
    color: bool = False,
) -> str:
    """An aligned text table of ``matrix`` labelled by tokens; ``color`` shades the cells
    (ANSI escapes, for a terminal).

    >>> print(format_table(np.array([[0.25, 0.75]]), ["a"], ["x", "y"]))
          x    y
    a  0.25 0.75
    """
    matrix = np.asarray(matrix)
    cells = [[f"{v:.{decimals}f}" for v in row] for row in matrix]
    rw = max([len(s) for s in row_labels] + [0])
    cw = max([len(s) for s in col_labels] + [len(c) for row in cells for c in row] + [1])
    lines = [" " * rw + "  " + " ".join(c.rjust(cw) for c in col_labels)]
    vmax = float(np.nanmax(matrix)) if matrix.size else 1.0
    for label, row, values in zip(row_labels, cells, matrix, strict=True):
        parts = []
        for text, v in zip(row, values, strict=True):
            text = text.rjust(cw)
            if color and vmax > 0:
                level = int(232 + min(23, max(0, round(23 * float(v) / vmax))))
                fg = 16 if level > 244 else 255
                text = f"\x1b[38;5;{fg};48;5;{level}m{text}\x1b[0m"
            parts.append(text)
        lines.append(label.rjust(rw) + "  " + " ".join(parts))
    return "\n".join(lines)


def _trim(labels: Sequence[str], width: int = 12) -> list[str]:
    return [t if len(t) <= width else t[: width - 1] + "…" for t in labels]


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


@dataclass
class Trace:
    """The steps of one attention call, in order.

    Attributes:
        steps: the :class:`TraceStep` records.
        tokens: the ``L`` query token strings (or ``"0"``, ``"1"``, ... when none were given).
        num_heads: ``H``.
        scale: the factor applied to the scores.
        key_tokens: the ``S`` key token strings (the same as ``tokens`` for self-attention).
        layer: the model layer traced (``1..n``; see :func:`attnlab._validation.layer_number`),
            or None for a lone layer.
        head: the only head whose per-head steps are kept, or None for every head.

    >>> import attnlab
    >>> mha = attnlab.MultiheadAttention(4, 2, rng=np.random.default_rng(0))
    >>> t = attnlab.trace(mha, np.eye(3, 4, dtype=np.float32), tokens=["a", "b", "c"])
    >>> print("\\n".join(str(t).splitlines()[1:6]))
    step by step (head 0 (of 0-1))
    <BLANKLINE>
     1. X  (3, 4): input token vectors, one row per token
          0    1    2    3
    a  1.00 0.00 0.00 0.00
    """

    steps: list[TraceStep]
    tokens: list[str]
    num_heads: int
    scale: float
    key_tokens: list[str] | None = None
    layer: int | None = None
    head: int | None = None

    def __post_init__(self) -> None:
        if self.key_tokens is None:
            self.key_tokens = list(self.tokens)

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
        """JSON-ready: ``{"tokens", "key_tokens", "num_heads", "scale", "layer", "head",
        "steps": [{"name", "shape", "head", "description", "values"}]}``; ``-inf`` values
        become ``null``."""
        return {
            "tokens": list(self.tokens),
            "key_tokens": list(self.key_tokens),
            "num_heads": self.num_heads,
            "scale": self.scale,
            "layer": self.layer,
            "head": self.head,
            "steps": [s.to_dict(decimals=decimals) for s in self.steps],
        }

    def format(
        self,
        head: int | None = None,
        *,
        color: bool = False,
        max_rows: int = 8,
        max_cols: int = 8,
        more_hint: str = "to_dict() has every value",
    ) -> str:
        """The steps of one head as text: a numbered title per step (name, shape, head,
        description) and its first ``max_rows`` x ``max_cols`` values, labelled by tokens.

        Args:
            head: the head shown (default: the trace's ``head``, else 0).
            color: bold titles and shaded weights (ANSI escapes, for a terminal).
            max_rows, max_cols: the largest table shown per step.
            more_hint: said after a table that was cut.
        """
        if head is None:
            head = 0 if self.head is None else self.head
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head must be in 0..{self.num_heads - 1}, got {head}")
        q_tok, k_tok = _trim(self.tokens), _trim(self.key_tokens)
        steps = [s for s in self.steps if s.head in (None, head)]
        where = [f"layer {self.layer}"] if self.layer is not None else []
        if self.num_heads > 1:
            where.append(f"head {head} (of 0-{self.num_heads - 1})")
        lines = ["", "step by step" + (f" ({', '.join(where)})" if where else "")]
        for i, s in enumerate(steps, 1):
            at = "" if s.head is None else f"  head {s.head}"
            title = f"{i:>2}. {s.name}  {_shape(s.shape)}{at}: {s.description}"
            lines += ["", f"\x1b[1m{title}\x1b[0m" if color else title]
            v = s.values
            if v.ndim == 1:
                v = v[None, :]
                rows = [""]
            elif s.name in _QUERY_ROWS:
                rows = q_tok
            elif s.name in _KEY_ROWS:
                rows = k_tok
            else:
                rows = [str(r) for r in range(v.shape[0])]
            cols = k_tok if s.name in _KEY_COLS else [str(c) for c in range(v.shape[-1])]
            r, c = min(v.shape[0], max_rows), min(v.shape[1], max_cols)
            shaded = color and s.name == "weights"
            lines.append(format_table(v[:r, :c], rows[:r], cols[:c], decimals=2, color=shaded))
            more = []
            if v.shape[0] > r:
                more.append(f"{v.shape[0] - r} more rows")
            if v.shape[1] > c:
                more.append(f"{v.shape[1] - c} more columns")
            if more:
                lines.append(f"  ... {', '.join(more)} ({more_hint})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _labels(tokens, n: int, name: str, what: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    if isinstance(tokens, str):
        raise TypeError(f"{name} must be a sequence of str (one per token), not one str")
    labels = [str(t) for t in tokens]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} entries, but {what} has {n} rows")
    return labels


def _one_sequence(arr: np.ndarray, name: str, layer, d: int) -> np.ndarray:
    """The rows of one sequence: ``arr`` is ``(T, d)`` or a batch of one in the layer's layout."""
    batch_axis = 0 if getattr(layer, "batch_first", True) else 1
    if arr.ndim == 3 and arr.shape[batch_axis] == 1:
        return arr[0] if batch_axis == 0 else arr[:, 0]
    need = f"(T, {d}) or " + (f"(1, T, {d})" if batch_axis == 0 else f"(T, 1, {d})")
    raise shape_error(name, arr.shape, need + ": one sequence")


def trace(
    layer: Attention | SelfAttention,
    query: np.ndarray,
    key_value: np.ndarray | None = None,
    *,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    head: int | None = None,
) -> Trace:
    """Run ``layer`` on one sequence and record every intermediate.

    Self-attention when ``key_value`` is None (``query`` is the query, key and value
    input, as in ``layer(x, x, x)``), else cross-attention (``layer(query, key_value,
    key_value)``, ``L != S`` allowed). The arrays come from the functions the layer itself
    calls, so the recorded ``weights`` equal the layer's ``need_weights`` maps exactly and
    ``output`` its output (eval mode; no dropout). Nothing in the layer is changed (no
    backward caches are written).

    Args:
        layer: a :class:`~attnlab.MultiheadAttention` (no ``add_bias_kv``/``add_zero_attn``;
            with ``key_value``, ``kdim == vdim``) or a :class:`~attnlab.SelfAttention`.
        query: ``(L, E)``, or a batch of one in the layer's layout (``(1, L, E)`` when
            ``batch_first``, else ``(L, 1, E)``); the layer's dtype.
        key_value: ``(S, kdim)`` (or a batch of one) for cross-attention.
        tokens: ``L`` labels for the query rows (default ``"0"``, ``"1"``, ...).
        key_tokens: ``S`` labels for the keys (default: ``tokens`` for self-attention,
            ``"0"``, ``"1"``, ... for cross-attention).
        attn_mask: ``(L, S)``: bool (True = takes part) or float (added to the scores).
        is_causal: query ``i`` sees keys ``j <= i``.
        head: keep only this head's per-head steps (``None``: every head).

    Returns:
        A :class:`Trace`; see the module docstring for the steps.

    >>> import attnlab
    >>> mha = attnlab.MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0))
    >>> x = np.random.default_rng(1).standard_normal((1, 3, 8)).astype(np.float32)
    >>> t = attnlab.trace(mha, x, tokens=["a", "b", "c"])
    >>> [(s.name, s.shape) for s in t.steps if s.head in (None, 0)][:6]
    [('X', (3, 8)), ('W_q', (8, 4)), ('W_k', (8, 4)), ('W_v', (8, 4)), ('b_q', (4,)), ('b_k', (4,))]
    >>> out, w = mha(x, x, x, average_attn_weights=False)
    >>> bool((t.get("weights", 1) == w[0, 1]).all()), bool((t.get("output") == out[0]).all())
    (True, True)
    """
    if isinstance(layer, Attention):
        if getattr(layer, "bias_k", None) is not None or layer.add_zero_attn:
            raise ValueError("trace supports MultiheadAttention without add_bias_kv/add_zero_attn "
                             "(their extra key is no token)")
        if key_value is not None and layer.kdim != layer.vdim:
            raise ValueError(f"key_value is both the key and the value input, so the layer needs "
                             f"kdim == vdim, got kdim={layer.kdim}, vdim={layer.vdim}")
        H, d_q = layer.num_heads, layer.embed_dim
    elif isinstance(layer, SelfAttention):
        H, d_q = 1, layer.d_in
    else:
        raise TypeError(
            f"layer must be attnlab.nn.Attention (MultiheadAttention included) or attnlab.SelfAttention, "
            f"got {type(layer).__name__}"
        )
    head = _check_head(head, H)
    if not isinstance(is_causal, bool | np.bool_):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    cross = key_value is not None
    masked = attn_mask is not None or bool(is_causal)
    if isinstance(layer, SelfAttention):
        return _self_attention_trace(layer, query, key_value, tokens, key_tokens, attn_mask, bool(is_causal), head)
    # One run of the layer itself, recorded through its hook points: the steps are what the
    # layer computed, not a second computation.
    if np.ndim(query) == 3:
        _one_sequence(np.asarray(query), "query", layer, d_q)
    was_training = layer.training
    layer.eval()
    try:
        if isinstance(layer, MultiheadAttention):
            kv_in = key_value if cross else query
            (out, _), cache = layer.run_with_cache(query, kv_in, kv_in, attn_mask=attn_mask, is_causal=is_causal,
                                                   average_attn_weights=False)
        else:
            out, cache = layer.run_with_cache(query, key_value=key_value, attn_mask=attn_mask, is_causal=is_causal)
    finally:
        layer.train(was_training)
    X = np.asarray(query).reshape(-1, d_q)
    X_kv = np.asarray(key_value).reshape(-1, layer.kdim) if cross else None
    return trace_from_cache(layer, cache, X=X, X_kv=X_kv, output=np.asarray(out).reshape(-1, layer.embed_dim),
                            tokens=tokens, key_tokens=key_tokens, masked=masked, head=head)


def _check_head(head, H: int) -> int | None:
    if head is not None and (isinstance(head, bool) or not isinstance(head, int | np.integer)
                             or not 0 <= head < H):
        raise ValueError(f"head must be None or in 0..{H - 1}, got {head!r}")
    return head


class _Steps:
    """The step list of one trace, keeping only the chosen head's per-head steps."""

    def __init__(self, head: int | None, D: int, scale: float):
        self.steps: list[TraceStep] = []
        self.head, self.D, self.scale = head, D, scale

    def add(self, name, values, h=None):
        if self.head is not None and h is not None and h != self.head:
            return
        desc = _DESCRIPTIONS[name].format(D=self.D, scale=self.scale)
        self.steps.append(TraceStep(name, np.array(values, copy=True), h, desc))

    def per_head(self, name, arr, H: int):  # arr (H, T, D), (1, H, T, D) or, one head, (T, D)
        arr = arr.reshape(-1, H, *arr.shape[-2:])[0]
        for h in range(H):
            self.add(name, arr[h], h)

    def weights(self, names, ws, bs, H: int, G: int):
        """Each head's projections ``(E_in, D)`` and biases; head ``h`` reads key/value
        head ``h // G``."""
        D = self.D
        for name, w in zip(names[:3], ws, strict=True):
            for h in range(H):
                g = h if name == "W_q" else h // G
                self.add(name, w[g * D : (g + 1) * D].T, h)  # (D, E_in) rows -> (E_in, D)
        if bs[0] is not None:
            for name, b in zip(names[3:], bs, strict=True):
                for h in range(H):
                    g = h if name == "b_q" else h // G
                    self.add(name, b[g * D : (g + 1) * D], h)


def _labelled(tokens, key_tokens, L: int, S: int, cross: bool):
    tokens = _labels(tokens, L, "tokens", "query")
    if key_tokens is None and not cross:
        key_tokens = tokens
    return tokens, _labels(key_tokens, S, "key_tokens", "key_value" if cross else "query")


def trace_from_cache(
    layer: Attention,
    cache,
    *,
    X: np.ndarray,
    output: np.ndarray,
    prefix: str = "",
    X_kv: np.ndarray | None = None,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    masked: bool = True,
    head: int | None = None,
    batch: int = 0,
) -> Trace:
    """The :class:`Trace` of one attention call from what its hook points recorded.

    Args:
        layer: the :class:`~attnlab.nn.Attention` that ran.
        cache: a mapping from hook names to arrays (:meth:`~attnlab.nn.Module.run_with_cache`)
            holding ``{prefix}hook_q``, ``hook_k``, ``hook_v``, ``hook_attn_scores``,
            ``hook_pattern``, ``hook_z`` (and ``hook_rot_q``/``hook_rot_k`` with rotary).
        X: ``(L, E)`` the attention's input; ``X_kv`` ``(S, kdim)`` for cross-attention.
        output: ``(L, E)`` the attention's output.
        prefix: the layer's place in the cache's names (``"blocks.2.attn."``).
        tokens, key_tokens, head: as :func:`trace`.
        masked: whether the call had a mask (the ``masked_scores`` step).
        batch: the sequence of the batch to show.
    """
    H, D = layer.num_heads, layer.head_dim
    G = H // layer.num_kv_heads  # query heads per key/value head
    head = _check_head(head, H)
    q4 = cache[f"{prefix}hook_rot_q"] if f"{prefix}hook_rot_q" in cache else cache[f"{prefix}hook_q"]
    k4 = cache[f"{prefix}hook_rot_k"] if f"{prefix}hook_rot_k" in cache else cache[f"{prefix}hook_k"]
    qh = q4[batch].transpose(1, 0, 2)  # (L, H, D) -> (H, L, D)
    kh = np.repeat(k4[batch].transpose(1, 0, 2), G, axis=0)  # (H, S, D): head h reads h // G
    vh = np.repeat(cache[f"{prefix}hook_v"][batch].transpose(1, 0, 2), G, axis=0)
    z = cache[f"{prefix}hook_z"][batch]  # (L, H, D)
    cross = X_kv is not None
    L, S = qh.shape[1], kh.shape[1]
    tokens, key_tokens = _labelled(tokens, key_tokens, L, S, cross)
    scale = layer.scale if layer.scale is not None else 1.0 / math.sqrt(D)
    s = _Steps(head, D, scale)
    s.add("X", X)
    if cross:
        s.add("X_kv", X_kv)
    ws, bs = layer.in_projections()
    s.weights(("W_q", "W_k", "W_v", "b_q", "b_k", "b_v"), ws, bs, H, G)
    # The raw and scaled scores are the display's own steps (the layer goes straight to the
    # masked, scaled scores): Q K^T from the queries and keys the layer attended with.
    s.per_head("Q", qh, H)
    s.per_head("K", kh, H)
    s.per_head("V", vh, H)
    s.per_head("scores", attention_scores(qh, kh, scale=1.0), H)
    s.per_head("scaled_scores", attention_scores(qh, kh, scale=layer.scale), H)
    if masked:
        s.per_head("masked_scores", cache[f"{prefix}hook_attn_scores"][batch], H)
    s.per_head("weights", cache[f"{prefix}hook_pattern"][batch], H)
    s.per_head("head_output", z.transpose(1, 0, 2), H)
    s.add("concat", z.reshape(L, H * D))
    s.add("W_o", layer.out_proj.weight.data.T)
    if layer.out_proj.bias is not None:
        s.add("b_o", layer.out_proj.bias.data)
    s.add("output", output)  # the layer's own output
    return Trace(steps=s.steps, tokens=tokens, num_heads=H, scale=scale, key_tokens=key_tokens, head=head)


def trace_model(model, layer: int, run, *, tokens, head: int | None = None, masked: bool = True) -> Trace:
    """The :class:`Trace` of block ``layer``'s attention (``1..n``) inside a model's own
    forward pass ``run()`` on one sequence, from its hook points: what every model's
    ``trace`` method returns.

    The recorded arrays are the model's (no layer is run again); ``X`` is the attention's
    input, ``ln_1`` of the block's input pre-norm (the norm applied again for display).
    """
    i = layer - 1
    block = model.layers[i]
    want = [f"blocks.{i}.{n}" for n in ("hook_resid_pre", "hook_attn_out")]
    want += [f"blocks.{i}.attn.{n}" for n in block.attn.hook_names() if n.startswith("hook_")]
    store: dict[str, np.ndarray] = {}

    def keep(x, name):
        store[name] = np.array(x, copy=True)

    with model.hooks([(n, keep) for n in want]):
        run()
    X = block.attention_input(store[want[0]])[0]
    output = store[want[1]][0]
    if getattr(block, "ln_1_post", None) is not None:  # the residual receives the normed output:
        z = store[f"blocks.{i}.attn.hook_z"]  # the attention's own output is concat @ W_o^T + b_o
        output = block.attn.out_proj(z.reshape(*z.shape[:2], -1))[0]
    t = trace_from_cache(block.attn, store, prefix=f"blocks.{i}.attn.", X=X, output=output,
                         tokens=tokens, masked=masked, head=head)
    t.layer = layer
    return t


def _self_attention_trace(layer, query, key_value, tokens, key_tokens, mask, causal, head) -> Trace:
    """The one-head :class:`~attnlab.SelfAttention`'s steps (it has no hook points: each
    array comes from the function the layer calls)."""
    D = layer.d_out
    x, c = layer.check_inputs(query, key_value)
    if x.ndim == 3 and x.shape[0] != 1:
        raise shape_error("query", x.shape, f"(T, {layer.d_in}) or (1, T, {layer.d_in}): one sequence")
    lin = (layer.W_q, layer.W_k, layer.W_v)
    ws = [m.weight.data for m in lin]  # (D, E_in)
    bs = [None if m.bias is None else m.bias.data for m in lin]
    # the projections as the layer's Linear layers compute them: F.linear
    q, k, v = F.linear(x, ws[0], bs[0]), F.linear(c, ws[1], bs[1]), F.linear(c, ws[2], bs[2])
    X, X_kv = (a[0] if a.ndim == 3 else a for a in (x, c))
    cross = key_value is not None
    tokens, key_tokens = _labelled(tokens, key_tokens, X.shape[0], X_kv.shape[0], cross)
    s = _Steps(head, D, 1.0 / math.sqrt(D))
    s.add("X", X)
    if cross:
        s.add("X_kv", X_kv)
    s.weights(("W_q", "W_k", "W_v", "b_q", "b_k", "b_v"), ws, bs, 1, 1)
    qh, kh = q.reshape(1, -1, D), k.reshape(1, -1, D)
    s.per_head("Q", qh, 1)
    s.per_head("K", kh, 1)
    s.per_head("V", v.reshape(1, -1, D), 1)
    s.per_head("scores", attention_scores(qh, kh, scale=1.0), 1)
    s.per_head("scaled_scores", attention_scores(qh, kh), 1)
    if mask is not None or causal:
        s.per_head("masked_scores", attention_scores(q, k, mask, causal), 1)
    s.per_head("weights", attention_weights(q, k, mask, 0.0, causal), 1)
    s.add("output", layer.attention_fn(q, k, v, attn_mask=mask, is_causal=causal).reshape(-1, D))
    return Trace(steps=s.steps, tokens=tokens, num_heads=1, scale=s.scale, key_tokens=key_tokens, head=head)
