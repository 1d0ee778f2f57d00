"""Attention layers: the trainable one-head ``SelfAttention`` and ``MultiheadAttention``
(mirroring ``torch.nn.MultiheadAttention``), and the ``KVCache`` for incremental decoding.

Layers own parameters and call the functional core; the attention function is a parameter
(``attention_fn``), so a faster kernel drops in without a second copy of the math. Both
layers always compute their output with ``attention_fn`` and their weights (the maps)
with :func:`attnlab.attention_weights`.
Boolean masks are True where a query may attend to a key (the opposite of torch's
MultiheadAttention; see :func:`attnlab.convert_mha_mask`). Float masks are added to the scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from attnlab._validation import (
    float_dtype,
    fmt_shape,
    generator,
    positive_int,
    probability,
    shape_error,
)
from attnlab.core import (
    attention_weights,
    causal_mask,
    mask_to_bias,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnlab.core._namespace import as_dtype, device, is_bool, is_floating, namespace
from attnlab.nn import functional as F
from attnlab.nn import init
from attnlab.nn.linear import Linear, check_input
from attnlab.nn.module import Module, Parameter


# Array operations whose NumPy spelling is not the Array API's (the layers' weights may be
# another library's after Module.to); NumPy keeps its own, cheapest, call.
def _permute(x, axes: tuple[int, ...]):
    """``x`` with its axes reordered."""
    return x.transpose(axes) if isinstance(x, np.ndarray) else namespace(x).permute_dims(x, axes)


def _reshape(x, shape: tuple[int, ...]):
    return x.reshape(shape) if isinstance(x, np.ndarray) else namespace(x).reshape(x, shape)


def _split_heads(x, N: int, H: int, D: int):
    """``(N, S, H * D) -> (N, S, H, D) -> (N, H, S, D)``."""
    if isinstance(x, np.ndarray):
        return x.reshape(N, -1, H, D).transpose(0, 2, 1, 3)
    xp = namespace(x)
    return xp.permute_dims(xp.reshape(x, (N, -1, H, D)), (0, 2, 1, 3))


def _concat(arrays: list, axis: int):
    a = arrays[0]
    return np.concatenate(arrays, axis=axis) if isinstance(a, np.ndarray) else namespace(a).concat(arrays, axis=axis)


def _full(shape: tuple[int, ...], value, like):
    """A new array of ``shape`` filled with ``value``, in ``like``'s library, device and dtype."""
    if isinstance(like, np.ndarray):
        return np.full(shape, value, dtype=like.dtype)
    return namespace(like).full(shape, value, dtype=like.dtype, device=device(like))


def _replay(rng: np.random.Generator, state) -> np.random.Generator | None:
    """A Generator in the saved ``state``: it redraws the forward pass's dropout mask."""
    if state is None:
        return None
    gen = np.random.Generator(type(rng.bit_generator)())
    gen.bit_generator.state = state
    return gen


class SelfAttention(Module):
    """Single-head attention with trainable ``W_q``, ``W_k``, ``W_v`` (``d_in -> d_out``).

    ``Q = x W_q^T, K = c W_k^T, V = c W_v^T`` with ``c = x`` (self-attention) or
    ``c = key_value`` (cross-attention); ``weights = softmax(Q K^T / sqrt(d_out))``;
    ``context = weights V``. The projections are :class:`~attnlab.Linear` layers
    (``state_dict`` keys ``W_q.weight`` …, plus ``.bias`` with ``qkv_bias``).

    Args:
        d_in: input width (of ``x`` and ``key_value``).
        d_out: width of queries, keys, values and the context.
        qkv_bias: give the projections a bias.
        rng: Generator for the initial weights (torch ``nn.Linear``'s initialisation).
        dtype: ``np.float32`` or ``np.float64``.
        attention_fn: computes the context; defaults to
            :func:`attnlab.scaled_dot_product_attention` and takes its signature. The
            returned weights come from :func:`attnlab.attention_weights`.

    Call with ``x`` of shape ``(L, d_in)`` or ``(B, L, d_in)``, optionally ``key_value``
    ``(S, d_in)`` or ``(B, S, d_in)`` (default ``x``), ``attn_mask`` ``(L, S)`` or
    ``is_causal``; returns ``(context (..., L, d_out), weights (..., L, S))``.

    >>> layer = SelfAttention(3, 2, rng=np.random.default_rng(123))
    >>> context, weights = layer(np.ones((6, 3), dtype=np.float32))
    >>> context.shape, weights.shape
    ((6, 2), (6, 6))
    """

    def __init__(
        self, d_in: int, d_out: int, *, qkv_bias: bool = False, rng=None, dtype=np.float32,
        attention_fn: Callable[..., np.ndarray] | None = None,
    ):
        super().__init__()
        self.attention_fn = attention_fn or scaled_dot_product_attention
        self.d_in = positive_int(d_in, "d_in")
        self.d_out = positive_int(d_out, "d_out")
        rng = generator(rng)
        dtype = float_dtype(dtype)
        self.W_q = Linear(d_in, d_out, qkv_bias, rng=rng, dtype=dtype)
        self.W_k = Linear(d_in, d_out, qkv_bias, rng=rng, dtype=dtype)
        self.W_v = Linear(d_in, d_out, qkv_bias, rng=rng, dtype=dtype)

    def check_inputs(self, x: np.ndarray, key_value: np.ndarray | None = None):
        """``(x, key_value)`` checked: float arrays of the layer's dtype, ``(..., T, d_in)``."""
        d = self.d_in
        x = check_input(x, "x", self.W_q.weight.data, d, "(T, {d}) or (B, T, {d})")
        if x.ndim not in (2, 3):
            raise shape_error("x", x.shape, f"(T, {d}) or (B, T, {d})")
        if key_value is None:
            return x, x
        need = f"(S, {d})" if x.ndim == 2 else f"({x.shape[0]}, S, {d})"
        kv = check_input(key_value, "key_value", self.W_q.weight.data, d, need)
        if kv.ndim != x.ndim or kv.shape[:-2] != x.shape[:-2]:
            raise shape_error("key_value", kv.shape, need, "it must match x's batch layout")
        return x, kv

    def project(self, x: np.ndarray, key_value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(Q, K, V)``: ``W_q(x)``, ``W_k(key_value)``, ``W_v(key_value)`` (what the layer
        attends with; :func:`attnlab.trace` records the same arrays)."""
        return self.W_q(x), self.W_k(key_value), self.W_v(key_value)

    def forward(self, x: np.ndarray, key_value: np.ndarray | None = None, *, attn_mask=None,
                is_causal: bool = False):
        cross = key_value is not None
        x, kv = self.check_inputs(x, key_value)
        q, k, v = self.project(x, kv)
        context = self.attention_fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        weights = attention_weights(q, k, attn_mask=attn_mask, is_causal=is_causal)
        self._save(q=q, k=k, v=v, attn_mask=attn_mask, is_causal=is_causal, cross=cross)
        return context, weights

    def backward(self, grad_context: np.ndarray):
        """Gradient of the input ``x`` (for cross-attention: ``(grad_x, grad_key_value)``);
        parameter gradients accumulate in ``.grad``."""
        c = self._saved()
        gq, gk, gv = scaled_dot_product_attention_backward(
            grad_context, c["q"], c["k"], c["v"], attn_mask=c["attn_mask"], is_causal=c["is_causal"]
        )
        gx = self.W_q.backward(gq)
        g_kv = self.W_k.backward(gk) + self.W_v.backward(gv)
        return (gx, g_kv) if c["cross"] else gx + g_kv

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, qkv_bias={self.W_q.bias is not None}"


class KVCache:
    """The keys and values one attention layer has seen, for incremental decoding.

    Pass it as ``cache=`` to :class:`MultiheadAttention` (or a transformer block): each
    call appends the new tokens' projected keys and values, and the new queries attend to
    every cached key (with ``is_causal``, bottom-right aligned: the ``L`` new queries
    come after the ``S - L`` cached keys). Storage grows by doubling, so appending one
    token at a time costs amortised ``O(1)`` copies per token.

    Attributes:
        length: the number of cached tokens ``S``.

    >>> cache = KVCache()
    >>> k, v = cache.append(np.ones((1, 2, 3, 4)), np.ones((1, 2, 3, 4)))
    >>> k, v = cache.append(np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))
    >>> len(cache), k.shape
    (4, (1, 2, 4, 4))
    """

    def __init__(self) -> None:
        self._key: np.ndarray | None = None
        self._value: np.ndarray | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        shape = None if self._key is None else fmt_shape((*self._key.shape[:-2], self.length, self._key.shape[-1]))
        return f"KVCache(length={self.length}, key shape={shape})"

    def reset(self) -> None:
        """Forget every cached token."""
        self._key = self._value = None
        self.length = 0

    def append(self, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add ``key (N, H, S_new, E)`` and ``value (N, H, S_new, Ev)``; return every cached
        key and value, ``(N, H, S, E)`` and ``(N, H, S, Ev)`` (views of the storage)."""
        if namespace(key, value, names=("key", "value")) is np:
            key, value = np.asarray(key), np.asarray(value)
        if key.ndim != 4 or value.shape[:-1] != key.shape[:-1] or value.dtype != key.dtype:
            raise shape_error("value", value.shape, f"(N, H, S_new, Ev) with N, H, S_new of key "
                              f"{fmt_shape(key.shape)} and its dtype")
        n = key.shape[2]
        if self._key is not None:
            have = self._key
            if key.shape[:2] != have.shape[:2] or key.shape[3] != have.shape[3] or key.dtype != have.dtype \
                    or value.shape[3] != self._value.shape[3]:
                need = fmt_shape((*have.shape[:2], "S_new", have.shape[3]))
                raise shape_error("key", key.shape, f"{need} ({have.dtype}) like the cached keys")
        if self._key is None or self.length + n > self._key.shape[2]:
            capacity = max(16, 2 * (self.length + n))
            grown = []
            for old, new in ((self._key, key), (self._value, value)):
                buf = _full((*new.shape[:2], capacity, new.shape[3]), 0, new)  # in new's library
                if old is not None:
                    buf[:, :, : self.length, :] = old[:, :, : self.length, :]
                grown.append(buf)
            self._key, self._value = grown
        self._key[:, :, self.length : self.length + n, :] = key
        self._value[:, :, self.length : self.length + n, :] = value
        self.length += n
        return self._key[:, :, : self.length, :], self._value[:, :, : self.length, :]


@dataclass
class AttentionInputs:
    """What a :class:`MultiheadAttention` call attends with (internal to the layer and to
    :func:`attnlab.trace`, which records the same arrays).

    ``q``, ``k``, ``v`` are the checked inputs, batch first ``(N, L, E)``/``(N, S, kdim)``;
    ``qh``, ``kh``, ``vh`` the projected heads ``(N, H, L, D)``/``(N, H, S, D)`` (cached
    keys and values included); ``mask`` and ``causal`` what the core receives.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    qh: np.ndarray
    kh: np.ndarray
    vh: np.ndarray
    mask: np.ndarray | None
    causal: bool
    batched: bool
    cached: bool


class MultiheadAttention(Module):
    """Multi-head attention with ``torch.nn.MultiheadAttention``'s arguments, shapes and
    parameter names, so ``state_dict``s move across unchanged.

    ``output = concat_h(attention(query W_q^h, key W_k^h, value W_v^h)) W_o^T + b_o``.

    Args:
        embed_dim: model width ``E``; split into ``num_heads`` heads of ``E // num_heads``.
        num_heads: number of heads; must divide ``embed_dim``.
        dropout: dropout probability on the attention weights (training mode only).
        bias: biases on the input and output projections.
        add_bias_kv: learn an extra key and value (``bias_k``, ``bias_v``) appended to the
            key/value sequences.
        add_zero_attn: append an all-zero key and value after the projections.
        kdim, vdim: widths of ``key`` and ``value`` (default ``embed_dim``); when they differ
            the projections are ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``.
        batch_first: inputs are ``(N, L, E)`` instead of ``(L, N, E)``.
        separate_projections: keep ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``
            even when ``kdim == vdim == embed_dim`` (default: one fused ``in_proj_weight``
            ``(3E, E)``, which self-attention applies in one matrix product).
        rng: Generator for the initial weights (xavier-uniform projections, zero biases,
            as torch) and for dropout.
        dtype: ``np.float32`` or ``np.float64``.
        attention_fn: the attention function that computes the output, always; defaults
            to :func:`attnlab.scaled_dot_product_attention` and takes its signature. With
            ``need_weights=True`` the maps come from :func:`attnlab.attention_weights`
            (with the same dropout mask).

    Call with ``(query, key, value, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False, *, cache=None)``:

    - ``query`` ``(L, N, E)`` (``(N, L, E)`` if batch_first, ``(L, E)`` unbatched),
      ``key`` ``(S, N, kdim)``, ``value`` ``(S, N, vdim)``;
    - ``key_padding_mask`` ``(N, S)`` (``(S,)`` unbatched): bool True = takes part, or float;
    - ``attn_mask`` ``(L, S)`` or ``(N * num_heads, L, S)``: bool True = takes part, or float;
    - ``is_causal`` alone applies a causal mask (torch needs ``attn_mask`` with it; with
      ``attn_mask`` given it is only a hint, as in torch);
    - ``cache`` a :class:`KVCache`: the new keys and values are appended to it and the
      queries attend to all cached ones (``S`` then counts them all; ``is_causal`` aligns
      the mask bottom-right). No backward pass through a cached call.

    Returns ``(output, weights)``: output shaped like ``query``; weights ``(N, L, S)``
    averaged over heads or ``(N, num_heads, L, S)`` (no ``N`` unbatched), or ``None`` when
    ``need_weights=False``. In training mode with dropout the returned weights are the
    dropped ones, as in torch.

    Difference from torch: a query whose keys are all masked outputs zeros (weights 0);
    torch gives NaN there.

    >>> mha = MultiheadAttention(8, 2, batch_first=True, rng=np.random.default_rng(0))
    >>> x = np.ones((1, 5, 8), dtype=np.float32)
    >>> out, w = mha(x, x, x)
    >>> out.shape, w.shape
    ((1, 5, 8), (1, 5, 5))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        *,
        separate_projections: bool = False,
        rng: np.random.Generator | None = None,
        dtype=np.float32,
        attention_fn: Callable[..., np.ndarray] | None = None,
    ):
        super().__init__()
        E = self.embed_dim = positive_int(embed_dim, "embed_dim")
        self.num_heads = positive_int(num_heads, "num_heads")
        if E % self.num_heads:
            raise ValueError(f"embed_dim={E} must be divisible by num_heads={self.num_heads}")
        self.head_dim = E // self.num_heads
        self.kdim = E if kdim is None else positive_int(kdim, "kdim")
        self.vdim = E if vdim is None else positive_int(vdim, "vdim")
        self.dropout = probability(dropout, "dropout")
        self.batch_first = bool(batch_first)
        self.add_zero_attn = bool(add_zero_attn)
        self._qkv_same_embed_dim = self.kdim == E and self.vdim == E and not separate_projections
        self.attention_fn = attention_fn or scaled_dot_product_attention
        dtype = float_dtype(dtype)
        rng = generator(rng)
        object.__setattr__(self, "_rng", rng)
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(init.xavier_uniform(rng, (3 * E, E), dtype))
        else:
            self.q_proj_weight = Parameter(init.xavier_uniform(rng, (E, E), dtype))
            self.k_proj_weight = Parameter(init.xavier_uniform(rng, (E, self.kdim), dtype))
            self.v_proj_weight = Parameter(init.xavier_uniform(rng, (E, self.vdim), dtype))
        self.in_proj_bias = Parameter(init.zeros(3 * E, dtype)) if bias else None
        if add_bias_kv:
            self.bias_k = Parameter(init.xavier_normal(rng, (1, 1, E), dtype))
            self.bias_v = Parameter(init.xavier_normal(rng, (1, 1, E), dtype))
        else:
            self.bias_k = self.bias_v = None
        self.out_proj = Linear(E, E, bias, rng=rng, dtype=dtype)
        if bias:
            self.out_proj.bias.data[...] = 0

    @property
    def dtype(self) -> np.dtype:
        return self.out_proj.weight.dtype

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}"
        )

    # ---- helpers -----------------------------------------------------------------------
    def in_projections(self):
        """``((W_q, W_k, W_v), (b_q, b_k, b_v))``: ``(E, E)``/``(E, kdim)``/``(E, vdim)``
        weights (torch's layout, ``Q = query W_q^T + b_q``) and ``(E,)`` biases or Nones."""
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight.data
            ws = (w[:E, :], w[E : 2 * E, :], w[2 * E :, :])
        else:
            ws = (self.q_proj_weight.data, self.k_proj_weight.data, self.v_proj_weight.data)
        if self.in_proj_bias is None:
            return ws, (None, None, None)
        b = self.in_proj_bias.data
        return ws, (b[:E], b[E : 2 * E], b[2 * E :])

    def _to_batch_first(self, x, batched):
        if not batched:
            return x[None] if isinstance(x, np.ndarray) else namespace(x).expand_dims(x, axis=0)
        return x if self.batch_first else _permute(x, (1, 0, 2))

    def _from_batch_first(self, x, batched):
        if not batched:
            return x[0, ...]
        return x if self.batch_first else _permute(x, (1, 0, 2))

    def _check_mask(self, mask, name, need_shapes, query):
        if mask is None:
            return None
        if namespace(query, mask, names=("query", name)) is np:  # one library for both
            mask = np.asarray(mask)
        if not (is_bool(mask) or is_floating(mask)):
            raise TypeError(
                f"{name} must be boolean (True = takes part) or floating-point (added to the "
                f"scores), got dtype {mask.dtype}"
            )
        if tuple(mask.shape) not in need_shapes:
            raise shape_error(name, tuple(mask.shape), " or ".join(fmt_shape(s) for s in need_shapes))
        if not is_bool(mask):
            mask = as_dtype(mask, query.dtype)
        return mask

    @staticmethod
    def _pad_keys(mask):
        """Append one key that takes part to a mask (for bias_kv / zero_attn)."""
        if mask is None:
            return None
        return _concat([mask, _full((*mask.shape[:-1], 1), is_bool(mask), mask)], axis=-1)

    def _merge_masks(self, attn_mask, key_padding_mask):
        if attn_mask is None or key_padding_mask is None:
            return key_padding_mask if attn_mask is None else attn_mask
        if is_bool(attn_mask) and is_bool(key_padding_mask):
            return attn_mask & key_padding_mask
        def as_bias(m):
            return mask_to_bias(m, self.dtype) if is_bool(m) else m
        return as_bias(attn_mask) + as_bias(key_padding_mask)

    def _project(self, q, k, v, self_attention: bool):
        """The in-projections ``(N, L, E)``, ``(N, S, E)``, ``(N, S, E)``: one matrix product
        for self-attention with the fused weight, else one per input."""
        if self_attention and self._qkv_same_embed_dim:
            E = self.embed_dim
            b = None if self.in_proj_bias is None else self.in_proj_bias.data
            qkv = F.linear(q, self.in_proj_weight.data, b)  # (N, L, 3E)
            return qkv[..., :E], qkv[..., E : 2 * E], qkv[..., 2 * E :]
        (wq, wk, wv), (bq, bk, bv) = self.in_projections()
        return F.linear(q, wq, bq), F.linear(k, wk, bk), F.linear(v, wv, bv)

    def attention_inputs(
        self,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        key_padding_mask: np.ndarray | None = None,
        attn_mask: np.ndarray | None = None,
        is_causal: bool = False,
        *,
        cache: KVCache | None = None,
    ) -> AttentionInputs:
        """Check a call's arguments and project the heads: everything :meth:`forward`
        hands the core (``attention_fn`` and :func:`attnlab.attention_weights`).
        :func:`attnlab.trace` calls it too, so it records what the layer computes."""
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        self_attention = query is key and key is value
        lay = "(N, {L}, {d})" if self.batch_first else "({L}, N, {d})"
        like = self.out_proj.weight.data  # inputs must be of its library, device and dtype
        q_in = check_input(query, "query", like, E, lay.format(L="L", d="{d}") + " or (L, {d})")
        if q_in.ndim not in (2, 3):
            raise shape_error("query", q_in.shape, lay.format(L="L", d=E) + f" or (L, {E})")
        batched = q_in.ndim == 3
        kv_lay = (lay.format(L="S", d="{d}") if batched else "(S, {d})")
        k_in = check_input(key, "key", like, self.kdim, kv_lay)
        v_in = check_input(value, "value", like, self.vdim, kv_lay)
        for name, arr, d in (("key", k_in, self.kdim), ("value", v_in, self.vdim)):
            if arr.ndim != q_in.ndim:
                state = "batched" if batched else "unbatched"
                raise shape_error(name, arr.shape, kv_lay.format(d=d), f"query is {state}")
        q = self._to_batch_first(q_in, batched)
        k = self._to_batch_first(k_in, batched)
        v = self._to_batch_first(v_in, batched)
        N, L, _ = q.shape
        S = k.shape[1]
        if k.shape[0] != N:
            need = kv_lay.format(d=self.kdim).replace("N", str(N))
            raise shape_error("key", tuple(k_in.shape), need, "batch size differs from query's")
        if tuple(v.shape[:2]) != (N, S):
            raise shape_error("value", tuple(v_in.shape), f"{fmt_shape((*k_in.shape[:-1], self.vdim))} to match key")
        extra_keys = (self.bias_k is not None) + self.add_zero_attn
        past = 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be an attnlab KVCache, got {type(cache).__name__}")
            if extra_keys:
                raise ValueError("a KVCache does not work with add_bias_kv or add_zero_attn")
            past = cache.length
        S_all = past + S

        kpm = self._check_mask(key_padding_mask, "key_padding_mask", [(N, S_all)] if batched else [(S_all,)], q)
        am = self._check_mask(
            attn_mask, "attn_mask", [(L, S_all), (N * H, L, S_all)] if batched else [(L, S_all), (H, L, S_all)], q
        )
        if kpm is not None:
            kpm = _reshape(kpm, (N, 1, 1, S_all))
        if am is not None and am.ndim == 3:
            am = _reshape(am, (N, H, L, S_all))
        causal_flag = bool(is_causal) and am is None and kpm is None and not extra_keys and not past
        if is_causal and am is None and not causal_flag:
            am = causal_mask(L, S_all, align="bottom-right" if past else "top-left", like=q)

        qp, kp, vp = self._project(q, k, v, self_attention)
        if self.bias_k is not None:
            xp = namespace(kp)
            kp = _concat([kp, xp.broadcast_to(self.bias_k.data[0, ...], (N, 1, E))], axis=1)
            vp = _concat([vp, xp.broadcast_to(self.bias_v.data[0, ...], (N, 1, E))], axis=1)
            am, kpm = self._pad_keys(am), self._pad_keys(kpm)
        qh, kh, vh = _split_heads(qp, N, H, D), _split_heads(kp, N, H, D), _split_heads(vp, N, H, D)
        if self.add_zero_attn:
            zeros = _full((N, H, 1, D), 0.0, kh)
            kh = _concat([kh, zeros], axis=2)
            vh = _concat([vh, zeros], axis=2)
            am, kpm = self._pad_keys(am), self._pad_keys(kpm)
        if cache is not None:
            kh, vh = cache.append(kh, vh)
        mask = self._merge_masks(am, kpm)
        return AttentionInputs(q, k, v, qh, kh, vh, mask, causal_flag, batched, cache is not None)

    def merge_heads(self, out_h: np.ndarray) -> np.ndarray:
        """The heads' outputs side by side: ``(N, H, L, D) -> (N, L, E)``."""
        N, H, L, D = out_h.shape
        if isinstance(out_h, np.ndarray):
            return out_h.transpose(0, 2, 1, 3).reshape(N, L, H * D)
        return _reshape(_permute(out_h, (0, 2, 1, 3)), (N, L, H * D))

    # ---- forward / backward ------------------------------------------------------------
    def forward(
        self,
        query: np.ndarray,
        key: np.ndarray,
        value: np.ndarray,
        key_padding_mask: np.ndarray | None = None,
        need_weights: bool = True,
        attn_mask: np.ndarray | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cache: KVCache | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        a = self.attention_inputs(query, key, value, key_padding_mask, attn_mask, is_causal, cache=cache)
        p = self.dropout if self.training else 0.0
        rng_state = self._rng.bit_generator.state if p > 0 else None
        weights = None
        if need_weights:  # the maps, with the dropout mask the output is about to draw
            weights = attention_weights(
                a.qh, a.kh, a.mask, p, a.causal, rng=_replay(self._rng, rng_state) or self._rng
            )
        out_h = self.attention_fn(
            a.qh, a.kh, a.vh, attn_mask=a.mask, dropout_p=p, is_causal=a.causal, rng=self._rng
        )
        out = self.out_proj(self.merge_heads(out_h))
        self._save(inputs=a, p=p, rng_state=rng_state)
        if weights is not None:
            if average_attn_weights:
                weights = namespace(weights).mean(weights, axis=1)
            if not a.batched:
                weights = weights[0, ...]
        return self._from_batch_first(out, a.batched), weights

    def backward(self, grad_output: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(grad_query, grad_key, grad_value)`` in the inputs' layouts; parameter gradients
        accumulate in ``.grad``. For self-attention (one tensor as query, key and value) its
        gradient is the sum of the three."""
        c = self._saved()
        a: AttentionInputs = c["inputs"]
        if a.cached:
            raise RuntimeError("MultiheadAttention has no backward pass through a call with a KVCache")
        E, H, D = self.embed_dim, self.num_heads, self.head_dim
        g = self._to_batch_first(np.asarray(grad_output), a.batched)
        if g.shape != a.q.shape[:2] + (E,):
            raise shape_error("grad_output", np.shape(grad_output), "the output's shape")
        N, L, _ = g.shape
        g_attn = self.out_proj.backward(g)
        gh = g_attn.reshape(N, L, H, D).transpose(0, 2, 1, 3)
        gqh, gkh, gvh = scaled_dot_product_attention_backward(
            gh, a.qh, a.kh, a.vh, attn_mask=a.mask, dropout_p=c["p"],
            is_causal=a.causal, rng=_replay(self._rng, c["rng_state"]),
        )
        if self.add_zero_attn:
            gkh, gvh = gkh[:, :, :-1], gvh[:, :, :-1]
        # (N, H, S, D) -> (N, S, E)
        gqp = self.merge_heads(gqh)
        gkp = self.merge_heads(gkh)
        gvp = self.merge_heads(gvh)
        if self.bias_k is not None:
            self.bias_k.accumulate(gkp[:, -1].sum(axis=0)[None, None])
            self.bias_v.accumulate(gvp[:, -1].sum(axis=0)[None, None])
            gkp, gvp = gkp[:, :-1], gvp[:, :-1]
        (wq, wk, wv), _ = self.in_projections()
        has_bias = self.in_proj_bias is not None
        gq, gwq, gbq = F.linear_backward(gqp, a.q, wq, has_bias=has_bias)
        gk, gwk, gbk = F.linear_backward(gkp, a.k, wk, has_bias=has_bias)
        gv, gwv, gbv = F.linear_backward(gvp, a.v, wv, has_bias=has_bias)
        if self._qkv_same_embed_dim:
            self.in_proj_weight.accumulate(np.concatenate([gwq, gwk, gwv]))
        else:
            self.q_proj_weight.accumulate(gwq)
            self.k_proj_weight.accumulate(gwk)
            self.v_proj_weight.accumulate(gwv)
        if has_bias:
            self.in_proj_bias.accumulate(np.concatenate([gbq, gbk, gbv]))
        b = a.batched
        return self._from_batch_first(gq, b), self._from_batch_first(gk, b), self._from_batch_first(gv, b)
