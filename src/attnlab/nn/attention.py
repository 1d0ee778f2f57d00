"""Attention layers: :class:`Attention`, the one multi-head layer every model uses
(grouped-query heads, fused or separate projections, a position slot for rotary
embeddings, QK-norm, sliding windows, a key/value cache and hook points);
``MultiheadAttention``, the same layer with ``torch.nn.MultiheadAttention``'s call; the
trainable one-head ``SelfAttention``; and the ``KVCache`` for incremental decoding.

Layers own parameters and call the functional core; the attention function is a parameter
(``attention_fn``), so a faster kernel drops in without a second copy of the math. Both
layers always compute their output with ``attention_fn`` and their weights (the maps)
with :func:`attnlab.attention_weights`.
Boolean masks are True where a query may attend to a key (the opposite of torch's
MultiheadAttention; see :func:`attnlab.convert_mha_mask`). Float masks are added to the scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from attnlab._threads import matmuls
from attnlab._validation import (
    float_dtype,
    fmt_shape,
    generator,
    positive_float,
    positive_int,
    probability,
    shape_error,
)
from attnlab.core import (
    apply_attention_weights,
    apply_attention_weights_backward,
    attention_scores,
    attention_scores_backward,
    attention_weights,
    causal_mask,
    mask_to_bias,
    rows,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
    softmax_backward,
)
from attnlab.core._namespace import (
    as_dtype,
    device,
    is_bool,
    is_floating,
    namespace,
    writeable,
)
from attnlab.core._reduce import col_sum
from attnlab.core.masks import sliding_window_mask
from attnlab.core.naive import dropout_mask
from attnlab.core.softmax import softmax_
from attnlab.nn import functional as F
from attnlab.nn import init
from attnlab.nn._context import may_fuse, parameters_frozen
from attnlab.nn.hooks import HookPoint
from attnlab.nn.linear import Linear, check_input
from attnlab.nn.module import Module, Parameter
from attnlab.quant import product_record

_NO_KEY_MASK = np.ones((0, 0), dtype=np.bool_)  # the compiled decoding step's: every key


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


def _empty(shape: tuple[int, ...], like):
    """A new uninitialised array of ``shape``, in ``like``'s library, device and dtype."""
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype=like.dtype)
    return namespace(like).empty(shape, dtype=like.dtype, device=device(like))


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


# what the compiled decoding step reads
_STEP_CACHE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8))

#: The storage dtypes a :class:`KVCache` takes (``dtype=``): NumPy's floating types, and
#: ``int8`` (codes with a scale a token and head).
CACHE_DTYPES = ("float16", "float32", "float64", "int8")

#: An int8 cache stores a token's head as zeros where its largest magnitude is below this
#: (``127 / top`` would overflow float32 for ``top`` under about ``3.7e-37``).
INT8_SMALLEST = np.float32(1e-30)


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x (..., E)`` as int8 codes ``(..., E)`` and float32 scales ``(...)``, one a row:
    ``top = max |x|`` over the row (in float32), ``codes = rint(x * (127 / top))``,
    ``scale = top * (1 / 127)``, so that ``codes * scale`` is within ``scale / 2`` of ``x``
    (a row whose ``top`` is below :data:`INT8_SMALLEST`: zeros, scale 0). The row format of
    :class:`KVCache` ``(dtype="int8")`` (llama.cpp's ``q8_0`` cache type takes blocks of 32
    values; here a block is a head). The compiled decoding step quantizes a new token's
    key and value the same way, bit for bit. Raises ValueError for a value that is not
    finite (inf or NaN, or beyond float32's range).

    >>> codes, scale = quantize_int8(np.array([[0.5, -1.0, 0.25]]))
    >>> codes.tolist(), round(float(scale[0]) * 127, 6)
    ([[64, -127, 32]], 1.0)
    """
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("an int8 cache stores finite keys and values only, got inf or NaN "
                         "(or a value beyond float32's range)")
    top = np.abs(x).max(axis=-1, initial=np.float32(0.0))
    keep = top >= INT8_SMALLEST
    with np.errstate(divide="ignore"):
        inv = np.where(keep, np.float32(127.0) / np.where(keep, top, np.float32(1.0)), np.float32(0.0))
    codes = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
    return codes, np.where(keep, top * np.float32(1.0 / 127.0), np.float32(0.0)).astype(np.float32)


def cache_dtype(dtype) -> np.dtype | None:
    """``dtype`` checked as a :class:`KVCache` storage dtype (None: the keys' own), as a
    NumPy dtype.

    >>> cache_dtype("float16"), cache_dtype(None)
    (dtype('float16'), None)
    """
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)} (or None: the keys' own), "
                         f"got {dtype!r}")
    return dt


class KVCache:
    """The keys and values one attention layer has seen, for incremental decoding.

    Pass it as ``cache=`` to :class:`MultiheadAttention` (or a transformer block): each
    call appends the new tokens' projected keys and values, and the new queries attend to
    every cached key (with ``is_causal``, bottom-right aligned: the ``L`` new queries
    come after the ``S - L`` cached keys). Storage grows by doubling, so appending one
    token at a time costs amortised ``O(1)`` copies per token.

    With ``dtype`` (``"float16"``, ``"float32"`` or ``"float64"``; NumPy arrays only) the
    keys and values are stored in that dtype, rounded to nearest as NumPy's ``astype``
    rounds, and handed back in the dtype they came in (a copy when the two differ). A
    ``float16`` cache takes half a float32 cache's memory, and the compiled decoding step
    (:mod:`attnlab._decode_kernels`) reads it as it is: half the bytes a token reads from
    a long cache (llama.cpp's default cache type). Its keys and values carry float16's
    relative error (at most ``2^-11``, about ``4.9e-4``) and must lie within ``±65504``.

    ``dtype="int8"`` stores each token's head as int8 codes and one float32 scale
    (:func:`quantize_int8`: each value within half a step, ``max |row| / 254``, of the
    float32 value), about a quarter of a float32 cache's memory (``E + 4`` bytes a token
    and head); it hands back ``codes * scale`` in the keys' dtype, and the decoding step
    reads the codes as they are. Its keys and values must be finite.

    Attributes:
        length: the number of cached tokens ``S``.
        dtype: the storage dtype given (None: the keys' own).

    >>> cache = KVCache()
    >>> k, v = cache.append(np.ones((1, 2, 3, 4)), np.ones((1, 2, 3, 4)))
    >>> k, v = cache.append(np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))
    >>> len(cache), k.shape
    (4, (1, 2, 4, 4))
    >>> half = KVCache(dtype="float16")
    >>> k, v = half.append(np.full((1, 2, 3, 4), 0.1), np.ones((1, 2, 3, 4)))
    >>> k.dtype, float(k[0, 0, 0, 0])  # the stored float16 value, handed back as float64
    (dtype('float64'), 0.0999755859375)
    >>> codes = KVCache(dtype="int8")
    >>> k, v = codes.append(np.array([[[[0.5, -1.0, 0.3]]]]), np.ones((1, 1, 1, 3)))
    >>> np.round(k[0, 0, 0], 4).tolist()  # 0.3 is 38 steps of 1/127
    [0.5039, -1.0, 0.2992]
    """

    def __init__(self, *, dtype=None) -> None:
        self.dtype = cache_dtype(dtype)
        self._key: np.ndarray | None = None
        self._value: np.ndarray | None = None
        # an int8 cache's scales, (N, H, capacity) float32 each (None otherwise)
        self._key_scale: np.ndarray | None = None
        self._value_scale: np.ndarray | None = None
        self._given: np.dtype | None = None  # the dtype the keys come in (set by the first append)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        shape = None if self._key is None else fmt_shape((*self._key.shape[:-2], self.length, self._key.shape[-1]))
        stored = "" if self.dtype is None else f", dtype={self.dtype.name}"
        return f"KVCache(length={self.length}, key shape={shape}{stored})"

    def reset(self) -> None:
        """Forget every cached token (the storage dtype stays)."""
        self._key = self._value = self._given = self._key_scale = self._value_scale = None
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (a negative ``length``: drop that many
        from the end), as ``transformers``' ``DynamicCache.crop``; a ``length`` at or past
        the cached length keeps them all.

        >>> cache = KVCache()
        >>> _ = cache.append(np.ones((1, 1, 5, 2)), np.ones((1, 1, 5, 2)))
        >>> cache.crop(3); len(cache)
        3
        >>> cache.crop(-1); len(cache)
        2
        """
        if not isinstance(length, int | np.integer) or isinstance(length, bool):
            raise TypeError(f"length must be an int, got {type(length).__name__}")
        length = int(length)
        keep = max(0, self.length + length) if length < 0 else min(length, self.length)
        if self._key is not None and type(self._key) is not np.ndarray and not writeable(self._key):
            self._key, self._value = self._key[:, :, :keep], self._value[:, :, :keep]  # immutable: sliced
        self.length = keep

    def append(self, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add ``key (N, H, S_new, E)`` and ``value (N, H, S_new, Ev)``; return every cached
        key and value, ``(N, H, S, E)`` and ``(N, H, S, Ev)`` (views of the storage; copies
        in the keys' dtype when the storage dtype differs)."""
        if namespace(key, value, names=("key", "value")) is np:
            key, value = np.asarray(key), np.asarray(value)
        if key.ndim != 4 or value.shape[:-1] != key.shape[:-1] or value.dtype != key.dtype:
            raise shape_error("value", value.shape, f"(N, H, S_new, Ev) with N, H, S_new of key "
                              f"{fmt_shape(key.shape)} and its dtype")
        converted = self._converts(key) or self.dtype == np.int8
        if converted and (type(key) is not np.ndarray or not np.issubdtype(key.dtype, np.floating)):
            raise TypeError(f"KVCache(dtype={self.dtype.name}) stores floating NumPy arrays, got "
                            f"{type(key).__module__}.{type(key).__name__} keys of dtype {key.dtype}")
        n = key.shape[2]
        if self._key is not None:
            have = self._key
            if key.shape[:2] != have.shape[:2] or key.shape[3] != have.shape[3] or key.dtype != self._given \
                    or value.shape[3] != self._value.shape[3]:
                need = fmt_shape((*have.shape[:2], "S_new", have.shape[3]))
                raise shape_error("key", key.shape, f"{need} ({self._given}) like the cached keys")
        self._given = key.dtype
        if type(key) is not np.ndarray and not writeable(key):  # immutable arrays (JAX): grown by concatenation
            xp = namespace(key)
            if self._key is not None:
                key, value = xp.concat([self._key, key], axis=2), xp.concat([self._value, value], axis=2)
            self._key, self._value, self.length = key, value, self.length + n
            return key, value
        if self.dtype == np.int8:
            return self._append_codes(key, value)
        self._reserve(n, key, value)
        with np.errstate(over="raise") if converted else nullcontext():
            try:
                self._key[:, :, self.length : self.length + n, :] = key
                self._value[:, :, self.length : self.length + n, :] = value
            except FloatingPointError:
                raise self.range_error(key.dtype) from None
        self.length += n
        k, v = self._key[:, :, : self.length, :], self._value[:, :, : self.length, :]
        return (k.astype(key.dtype), v.astype(key.dtype)) if converted else (k, v)

    def _append_codes(self, key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`append` to an int8 cache: the new rows quantized (nothing stored where one
        is not finite), every row handed back as ``codes * scale`` in the keys' dtype."""
        try:
            (kc, ks), (vc, vs) = quantize_int8(key), quantize_int8(value)
        except ValueError:
            raise self.range_error(key.dtype) from None
        n, at = key.shape[2], self.length
        self._reserve(n, key, value)
        self._key[:, :, at:at + n], self._key_scale[:, :, at:at + n] = kc, ks
        self._value[:, :, at:at + n], self._value_scale[:, :, at:at + n] = vc, vs
        self.length += n
        return self.dequantized(key.dtype)

    def dequantized(self, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """An int8 cache's keys and values as ``codes * scale`` in ``dtype`` (a float
        type), ``(N, H, S, E)`` each: new arrays, the values every attention over this cache
        reads."""
        if self.dtype != np.int8:
            raise TypeError(f"dequantized() reads an int8 cache, this one stores {self.dtype}")
        if self._key is None:
            raise ValueError("the cache is empty: nothing to dequantize")
        dt = np.dtype(dtype)
        wide = np.result_type(dt, np.float32)  # float16: computed in float32, then rounded once
        S = self.length
        return tuple((codes[:, :, :S].astype(wide) * scale[:, :, :S, None].astype(wide)).astype(dt, copy=False)
                     for codes, scale in ((self._key, self._key_scale), (self._value, self._value_scale)))

    def _converts(self, a) -> bool:
        """Whether storing ``a`` (an array of any library) changes its dtype: a storage
        :attr:`dtype` given and another than ``a``'s (compared by name: ``torch.float32``
        is ``float32``)."""
        return self.dtype is not None and str(a.dtype).rpartition(".")[2] != self.dtype.name

    def range_error(self, given) -> ValueError:
        """The error for a key or value of dtype ``given`` beyond the storage dtype's range
        (raised by :meth:`append`, and by the compiled decoding step, which writes the
        storage itself)."""
        if self.dtype == np.int8:
            name = np.dtype(given).name
            wider = f" (or a {name} beyond float32's range)" if np.dtype(given).itemsize > 4 else ""
            return ValueError(f"an int8 cache stores finite keys and values only, got inf or NaN{wider}: "
                              f"keep this cache in {name}")
        return ValueError(f"a key or value beyond {self.dtype.name}'s range (the largest finite {self.dtype.name} "
                          f"is {float(np.finfo(self.dtype).max):g}): keep this cache in {np.dtype(given).name}")

    def _reserve(self, n: int, key_like, value_like) -> None:
        """Room for ``n`` more tokens (the storage doubles when full; new storage takes the
        layout and library of ``key_like``/``value_like (N, H, *, E)``, and their dtype or
        :attr:`dtype`). The storage past ``length`` is never read, so it is left unfilled
        (filling a 512-token prompt's 1024-token storage with zeros took 2% of GPT-2
        small's prefill)."""
        if self._key is None or self.length + n > self._key.shape[2]:
            capacity = max(16, 2 * (self.length + n))
            grown = []
            for new in (key_like, value_like):
                shape = (*new.shape[:2], capacity, new.shape[3])
                grown.append(np.empty(shape, self.dtype) if self._converts(new) else _empty(shape, new))
            if self.dtype == np.int8:  # and the scales, a token and head
                grown += [np.empty((*key_like.shape[:2], capacity), np.float32) for _ in range(2)]
            kept = (self._key, self._value, self._key_scale, self._value_scale)
            for old, buf in zip(kept, grown, strict=False):
                if old is not None:
                    buf[:, :, : self.length] = old[:, :, : self.length]
            self._key, self._value = grown[:2]
            if self.dtype == np.int8:
                self._key_scale, self._value_scale = grown[2:]


def _explicit_backward(grad_z, a: AttentionInputs, saved: _Explicit, scale: float | None, softcap: float | None,
                       pattern_hook, scores_hook):
    """``(grad_q, grad_k, grad_v)`` through the explicit path ``z = drop(hook_pattern(
    softmax(hook_attn_scores(attention_scores(q, k, ...))))) @ v`` (NumPy), from the weights
    the forward pass kept: the core's backward passes of each step
    (:func:`attnlab.apply_attention_weights_backward`, :func:`attnlab.softmax_backward`,
    :func:`attnlab.attention_scores_backward`, grouped-query heads and the soft-cap
    included), with the hook points' backward passes (their backward hooks) between them."""
    gqa = a.kh.shape[1] != a.qh.shape[1]
    grad_w, grad_v = apply_attention_weights_backward(grad_z, saved.weights, a.vh, enable_gqa=gqa)
    if saved.drop is not None:
        grad_w *= saved.drop
    grad_s = scores_hook.backward(softmax_backward(pattern_hook.backward(grad_w), saved.probs))
    grad_q, grad_k = attention_scores_backward(grad_s, a.qh, a.kh, a.mask, a.causal, scale, gqa, softcap=softcap)
    return grad_q, grad_k, grad_v


@dataclass
class _Explicit:
    """What the explicit path's backward reads: the softmax's output ``probs`` (before
    ``hook_pattern``), the ``weights`` that multiplied the values (after the hook and the
    dropout) and the dropout's scaled keep-mask, all ``(N, H, L, S)`` (None: no dropout)."""

    probs: np.ndarray
    weights: np.ndarray
    drop: np.ndarray | None


@dataclass
class AttentionInputs:
    """What an attention call attends with (internal to the layers).

    ``q``, ``k``, ``v`` are the checked inputs, batch first ``(N, L, E)``/``(N, S, kdim)``;
    ``qh``, ``kh``, ``vh`` the projected heads ``(N, H, L, D)``/``(N, Hkv, S, D)`` (cached
    keys and values included, rotary positions applied); ``mask`` and ``causal`` what the
    core receives.
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


class Attention(Module):
    """Multi-head attention, the one layer every attnlab model attends with.

    ``output = concat_h(attention(rot(norm(x W_q^h)), rot(norm(c W_k^{g(h)})), c W_v^{g(h)})) W_o^T + b_o``

    with ``c = x`` (self-attention) or ``key_value``; ``g(h) = h // (H / H_kv)`` the key/value
    head that query head ``h`` shares (grouped-query attention; ``H_kv = 1`` is multi-query).

    Args:
        embed_dim: model width ``E``.
        num_heads: query heads ``H``.
        num_kv_heads: key/value heads ``H_kv`` (must divide ``H``; None: ``H``).
        head_dim: width ``D`` of each head (None: ``E // H``, which must then divide).
        bias: biases on the q/k/v projections.
        out_bias: a bias on the output projection (None: as ``bias``).
        separate_projections: keep ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``
            instead of one fused ``in_proj_weight`` ``((H + 2 H_kv) D, E)``, which
            self-attention applies in one matrix product. Always separate when ``kdim`` or
            ``vdim`` differ from ``E``.
        kdim, vdim: widths of the keys' and values' input (None: ``E``).
        qk_norm: a factory ``f(n) -> Module`` for a norm of the queries and the keys
            (QK-norm), kept as ``q_norm`` and ``k_norm``: over each head's ``n = D``
            features (Qwen3, Gemma 3), or with ``qk_norm_per_head=False`` over the whole
            projection, ``n = H D`` for the queries and ``H_kv D`` for the keys (OLMo-2).
            Either way between ``hook_q``/``hook_k`` and the rotary slot.
        qk_norm_per_head: see ``qk_norm``.
        rotary: the position slot, a module with ``forward(q, k, positions) -> (q, k)`` on
            ``(N, H, L, D)``/``(N, H_kv, S, D)`` and ``backward(grad_q, grad_k)`` (rotary
            position embedding). Applied after the QK-norm, before the key/value cache.
        scale: the score scale (None: ``1 / sqrt(D)``; Gemma's ``query_pre_attn_scalar ** -0.5``).
        softcap: soft-capping of the scores (Gemma 2): the scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` before the mask and the softmax (None: off).
            Passed on as ``attention_fn(..., softcap=softcap)`` (and to the core's scores
            and backward passes), so an ``attention_fn`` of a soft-capped layer must take
            that keyword; the backward pass goes through the tanh.
        dropout: dropout on the attention weights (training mode only).
        causal: attend only to earlier positions unless a call says otherwise.
        sliding_window: with ``causal``, each query sees only the ``sliding_window`` most
            recent keys (itself included), also through the cache.
        rng: Generator for the initial weights (xavier-uniform, zero biases) and dropout.
        dtype: ``np.float32`` or ``np.float64``.
        attention_fn: computes the output when no weights are wanted; defaults to
            :func:`attnlab.scaled_dot_product_attention` and takes its signature. When the
            weights are wanted (:meth:`forward_with_weights`, a hook on the scores or the
            pattern) they are computed once and the output is ``weights @ V``.

    Call with ``x (N, L, E)`` (or ``(L, E)``); see :meth:`forward`. Hook points (names
    relative to the layer): ``hook_q`` ``(N, L, H, D)``, ``hook_k``, ``hook_v``
    ``(N, S, H_kv, D)``, ``hook_rot_q``, ``hook_rot_k`` (with ``rotary``),
    ``hook_attn_scores`` (scaled, soft-capped with ``softcap``, masked with ``-inf``;
    before the softmax) and ``hook_pattern`` ``(N, H, L, S)``, ``hook_z`` ``(N, L, H, D)`` (the heads' outputs
    before the output projection).

    >>> attn = Attention(8, 4, num_kv_heads=2, causal=True, rng=np.random.default_rng(0))
    >>> x = np.ones((1, 5, 8), dtype=np.float32)
    >>> out, cache = attn.run_with_cache(x)
    >>> out.shape, cache["hook_k"].shape, cache["hook_pattern"].shape
    ((1, 5, 8), (1, 5, 2, 2), (1, 4, 5, 5))
    """

    _extra_keys = 0  # keys a subclass appends (torch's add_bias_kv, add_zero_attn)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        separate_projections: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        qk_norm: Callable[[int], Module] | None = None,
        rotary: Module | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
        causal: bool = False,
        sliding_window: int | None = None,
        rng: np.random.Generator | None = None,
        dtype=np.float32,
        attention_fn: Callable[..., np.ndarray] | None = None,
        softcap: float | None = None,
        qk_norm_per_head: bool = True,
    ):
        super().__init__()
        self.softcap = positive_float(softcap, "softcap")
        E = self.embed_dim = positive_int(embed_dim, "embed_dim")
        H = self.num_heads = positive_int(num_heads, "num_heads")
        Hkv = self.num_kv_heads = H if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
        if H % Hkv:
            raise ValueError(f"num_heads={H} must be divisible by num_kv_heads={Hkv}")
        if head_dim is None:
            if E % H:
                raise ValueError(f"embed_dim={E} must be divisible by num_heads={H}")
            head_dim = E // H
        D = self.head_dim = positive_int(head_dim, "head_dim")
        self.kdim = E if kdim is None else positive_int(kdim, "kdim")
        self.vdim = E if vdim is None else positive_int(vdim, "vdim")
        self.dropout = probability(dropout, "dropout")
        self.causal = bool(causal)
        self.sliding_window = None if sliding_window is None else positive_int(sliding_window, "sliding_window")
        if scale is not None and not (isinstance(scale, int | float) and not isinstance(scale, bool)
                                      and np.isfinite(scale)):
            raise TypeError(f"scale must be a finite float or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self._qkv_same_embed_dim = self.kdim == E and self.vdim == E and not separate_projections
        self.attention_fn = attention_fn or scaled_dot_product_attention
        dtype = float_dtype(dtype)
        rng = generator(rng)
        object.__setattr__(self, "_rng", rng)
        Dq, Dkv = H * D, Hkv * D
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(init.xavier_uniform(rng, (Dq + 2 * Dkv, E), dtype))
        else:
            self.q_proj_weight = Parameter(init.xavier_uniform(rng, (Dq, E), dtype))
            self.k_proj_weight = Parameter(init.xavier_uniform(rng, (Dkv, self.kdim), dtype))
            self.v_proj_weight = Parameter(init.xavier_uniform(rng, (Dkv, self.vdim), dtype))
        self.in_proj_bias = Parameter(init.zeros(Dq + 2 * Dkv, dtype)) if bias else None
        self._init_extra_keys(rng, dtype)
        out_bias = bias if out_bias is None else bool(out_bias)
        self.out_proj = Linear(Dq, E, out_bias, rng=rng, dtype=dtype)
        if out_bias:
            self.out_proj.bias.data[...] = 0
        self.qk_norm_per_head = bool(qk_norm_per_head)
        widths = (D, D) if self.qk_norm_per_head else (Dq, Dkv)
        self.q_norm = qk_norm(widths[0]) if qk_norm is not None else None
        self.k_norm = qk_norm(widths[1]) if qk_norm is not None else None
        if rotary is not None and not isinstance(rotary, Module):
            raise TypeError(f"rotary must be an attnlab Module (the position slot), got {type(rotary).__name__}")
        self.rotary = rotary
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        if rotary is not None:
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    def _init_extra_keys(self, rng, dtype) -> None:
        """Parameters a subclass creates between the in- and out-projections."""

    @property
    def dtype(self) -> np.dtype:
        return self.out_proj.weight.dtype

    @property
    def W_O(self) -> np.ndarray:
        """The output projection per head, ``(H, D, E)``: ``output = sum_h z_h @ W_O[h] + b_O``."""
        w = self.out_proj.weight.data  # (E, H * D)
        return w.T.reshape(self.num_heads, self.head_dim, self.embed_dim)

    @property
    def b_O(self) -> np.ndarray | None:
        """The output projection's bias ``(E,)``, or None."""
        return None if self.out_proj.bias is None else self.out_proj.bias.data

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        extra = ", causal=True" if self.causal else ""
        if self.sliding_window is not None:
            extra += f", sliding_window={self.sliding_window}"
        if self.softcap is not None:
            extra += f", softcap={self.softcap}"
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, head_dim={self.head_dim}{extra}"

    # ---- the projections --------------------------------------------------------------
    def in_projections(self):
        """``((W_q, W_k, W_v), (b_q, b_k, b_v))``: ``(H D, E)``/``(H_kv D, kdim)``/
        ``(H_kv D, vdim)`` weights (torch's layout, ``Q = x W_q^T + b_q``) and biases or Nones."""
        Dq, Dkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        cuts = (0, Dq, Dq + Dkv, Dq + 2 * Dkv)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight.data
            ws = tuple(w[a:b, :] for a, b in zip(cuts, cuts[1:], strict=False))
        else:
            ws = (self.q_proj_weight.data, self.k_proj_weight.data, self.v_proj_weight.data)
        if self.in_proj_bias is None:
            return ws, (None, None, None)
        b = self.in_proj_bias.data
        return ws, tuple(b[a:c] for a, c in zip(cuts, cuts[1:], strict=False))

    # The adapter slot of the in-projection (attnlab.nn.adapters): None, or an Adapters
    # module adding to the columns of the stacked (N, L, Dq + 2 Dkv) projection.
    adapters = None

    def _project(self, q, k, v, self_attention: bool):
        """The in-projections ``(N, L, H D)``, ``(N, S, H_kv D)``, ``(N, S, H_kv D)``: one
        matrix product for self-attention with the fused weight, else one per input."""
        if self_attention and self._qkv_same_embed_dim:
            Dq, Dkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            b = None if self.in_proj_bias is None else self.in_proj_bias.data
            qkv = F.linear(q, self.in_proj_weight.data, b)  # (N, L, Dq + 2 Dkv)
            if self.adapters is not None:
                qkv = self.adapters(q, qkv)
            return qkv[..., :Dq], qkv[..., Dq : Dq + Dkv], qkv[..., Dq + Dkv :]
        self._check_adapters(False)
        (wq, wk, wv), (bq, bk, bv) = self.in_projections()
        return F.linear(q, wq, bq), F.linear(k, wk, bk), F.linear(v, wv, bv)

    def _check_adapters(self, fused: bool) -> None:
        """Refuse adapters on an in-projection the call does not run through the fused weight."""
        if self.adapters is not None and not fused:
            raise ValueError(f"{type(self).__name__} has adapters on its in-projection, which apply to "
                             "self-attention through the fused in_proj_weight only (not to cross-attention "
                             "or separate projections)")

    def _project_per_head(self, xq, xk, xv):
        """The in-projections of per-head inputs ``(N, L, H, E)``, ``(N, S, H_kv, kdim)``,
        ``(N, S, H_kv, vdim)``: head ``h`` projects its own input with its rows of the weight,
        giving ``(N, L, H D)`` and ``(N, S, H_kv D)`` twice (what :meth:`_project` gives when
        every head's input is the same)."""
        D = self.head_dim
        out = []
        for x, w, b in zip((xq, xk, xv), *self.in_projections(), strict=True):
            if not isinstance(w, np.ndarray):
                raise TypeError("per-head inputs (hook_q_input, hook_k_input, hook_v_input) need NumPy float weights, "
                                f"but this layer's are {type(w).__name__}: load the model dequantized, on NumPy")
            n = x.shape[-2]
            y = np.einsum("nlhe,hde->nlhd", x, w.reshape(n, D, -1))
            if b is not None:
                y += b.reshape(n, D)
            out.append(y.reshape(*y.shape[:2], n * D))
        if self.adapters is not None:  # each head's input through its rows of the adapters
            self._check_adapters(self._qkv_same_embed_dim)
            self.adapters.forward_heads((xq, xk, xv), out, self._in_proj_cuts(), D)
        return tuple(out)

    def _in_proj_cuts(self) -> tuple[tuple[int, int], ...]:
        """The q, k and v columns ``(a, b)`` of the stacked in-projection's output."""
        Dq, Dkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (0, Dq), (Dq, Dq + Dkv), (Dq + Dkv, Dq + 2 * Dkv)

    def merge_heads(self, out_h: np.ndarray) -> np.ndarray:
        """The heads' outputs side by side: ``(N, H, L, D) -> (N, L, H D)``."""
        N, H, L, D = out_h.shape
        if isinstance(out_h, np.ndarray):
            return out_h.transpose(0, 2, 1, 3).reshape(N, L, H * D)
        return _reshape(_permute(out_h, (0, 2, 1, 3)), (N, L, H * D))

    def _heads(self, qp, kp, vp, positions, cache: KVCache | None, past: int, zero_attn: bool = False):
        """``(N, L, H D)`` projections -> hooked, normed, rotated heads ``(N, H, L, D)``,
        ``(N, H_kv, S_all, D)`` (the cache appended)."""
        N, L, S = qp.shape[0], qp.shape[1], kp.shape[1]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q4 = self.hook_q(_reshape(qp, (N, L, H, D)))  # (N, L, H, D): TransformerLens's layout
        k4 = self.hook_k(_reshape(kp, (N, S, Hkv, D)))
        v4 = self.hook_v(_reshape(vp, (N, S, Hkv, D)))
        if self.q_norm is not None:
            q4, k4 = self._qk_norm(self.q_norm, q4), self._qk_norm(self.k_norm, k4)
        qh, kh, vh = _permute(q4, (0, 2, 1, 3)), _permute(k4, (0, 2, 1, 3)), _permute(v4, (0, 2, 1, 3))
        if self.rotary is not None:
            if positions is None:
                positions = np.arange(past, past + L)
            qh, kh = self.rotary(qh, kh, positions)
            if self.hook_rot_q.hooked or self.hook_rot_k.hooked:
                qh = _permute(self.hook_rot_q(_permute(qh, (0, 2, 1, 3))), (0, 2, 1, 3))
                kh = _permute(self.hook_rot_k(_permute(kh, (0, 2, 1, 3))), (0, 2, 1, 3))
        if zero_attn:
            zeros = _full((N, Hkv, 1, D), 0.0, kh)
            kh, vh = _concat([kh, zeros], axis=2), _concat([vh, zeros], axis=2)
        if cache is not None:
            kh, vh = cache.append(kh, vh)
        return qh, kh, vh

    def _qk_norm(self, norm: Module, x4, backward: bool = False):
        """``norm`` (or its backward pass) on ``(N, L, H, D)`` heads: per head, or over the
        whole projection ``(N, L, H D)``."""
        run = norm.backward if backward else norm
        if self.qk_norm_per_head:
            return run(x4)
        return _reshape(run(_reshape(x4, (*x4.shape[:2], -1))), tuple(x4.shape))

    def _attend(self, qh, kh, vh, mask, causal: bool, need_weights: bool):
        """The attention of the heads: ``(z (N, H, L, D), weights (N, H, L, S) or None,
        dropout rng state, what the explicit path's backward reads or None)``. The weights
        are computed once when wanted or hooked (the explicit path); otherwise
        ``attention_fn`` computes ``z``."""
        p = self.dropout if self.training else 0.0
        rng_state = self._rng.bit_generator.state if p > 0 else None
        gqa = self.num_kv_heads != self.num_heads
        cap = self.softcap
        if not (need_weights or self.hook_attn_scores.hooked or self.hook_pattern.hooked):
            options = {} if cap is None else {"softcap": cap}  # an attention_fn without it serves uncapped layers
            try:
                z = self.attention_fn(qh, kh, vh, attn_mask=mask, dropout_p=p, is_causal=causal,
                                      scale=self.scale, enable_gqa=gqa, rng=self._rng, **options)
            except TypeError as e:
                if cap is not None and "unexpected keyword argument 'softcap'" in str(e):
                    raise TypeError(f"this layer soft-caps its scores (softcap={cap}), but its attention_fn "
                                    f"{getattr(self.attention_fn, '__name__', self.attention_fn)!s} takes no "
                                    "softcap= keyword") from e
                raise
            return z, None, rng_state, None
        scores = self.hook_attn_scores(attention_scores(qh, kh, mask, causal, self.scale, gqa, softcap=cap))
        probs = softmax_(scores)  # fresh scores (a hook's are copies): in place
        keeping = self._keeping()
        weights = self.hook_pattern(probs.copy() if keeping and self.hook_pattern.hooked else probs)
        drop = dropout_mask(weights, p, tuple(weights.shape), self._rng) if p > 0 else None
        if drop is not None:  # the keep-mask the core's backward would redraw from the same state
            weights = weights * drop
        saved = _Explicit(probs, weights, drop) if keeping and isinstance(probs, np.ndarray) else None
        return apply_attention_weights(weights, vh, enable_gqa=gqa), weights, rng_state, saved

    def _finish(self, z, a: AttentionInputs, weights, rng_state, explicit: _Explicit | None = None):
        """Hook the heads' outputs, project them out and keep what backward needs."""
        N, H, L, D = z.shape
        z4 = self.hook_z(_permute(z, (0, 2, 1, 3)))  # (N, L, H, D)
        out = self.out_proj(_reshape(z4, (N, L, H * D)))
        self._save(inputs=a, rng_state=rng_state, p=self.dropout if self.training else 0.0, explicit=explicit)
        return out

    # ---- the call ---------------------------------------------------------------------
    def _check_x(self, x, name: str, d: int, need: str):
        like = self.out_proj.weight.data  # inputs must be of its library, device and dtype
        x = check_input(x, name, like, d, need)
        if x.ndim not in (2, 3):
            raise shape_error(name, x.shape, need.format(d=d))
        return x

    def _inputs(self, x, key_value, key_padding_mask, attn_mask, is_causal, cache, positions,
                per_head=None) -> AttentionInputs:
        E = self.embed_dim
        x = self._check_x(x, "x", E, "(N, L, {d}) or (L, {d})")
        batched = x.ndim == 3
        q = x if batched else x[None]
        if key_value is None:
            k = v = q
        else:
            need = "(N, S, {d})" if batched else "(S, {d})"
            kv = self._check_x(key_value, "key_value", self.kdim, need)
            if kv.ndim != x.ndim or (batched and kv.shape[0] != x.shape[0]):
                raise shape_error("key_value", kv.shape, need.format(d=self.kdim).replace("N", str(q.shape[0])),
                                  "it must match x's batch layout")
            k = v = kv if batched else kv[None]
        N, L, _ = q.shape
        past = 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be an attnlab KVCache, got {type(cache).__name__}")
            past = cache.length
        S_all = past + k.shape[1]
        causal = self.causal if is_causal is None else bool(is_causal)
        kpm = _check_mask(key_padding_mask, "key_padding_mask", [(N, S_all)] if batched else [(S_all,)], q)
        am = _check_mask(attn_mask, "attn_mask", [(L, S_all), (N, self.num_heads, L, S_all)] if batched
                         else [(L, S_all), (self.num_heads, L, S_all)], q)
        if kpm is not None:
            kpm = _reshape(kpm, (N, 1, 1, S_all))
        if am is not None and am.ndim == 3:
            am = _reshape(am, (1, *am.shape))
        window = self.sliding_window if causal else None
        causal_flag = causal and am is None and kpm is None and not past and window is None and S_all == L
        # One query after the cache (a decoding step) sees every key: no mask to build.
        if causal and not causal_flag and not (L == 1 and window is None):
            c = (causal_mask(L, S_all, align="bottom-right", like=q) if window is None
                 else sliding_window_mask(L, S_all, window=window, align="bottom-right", like=q))
            am = c if am is None else (am & c if is_bool(am) else am + mask_to_bias(c, self.dtype))
        if positions is not None:
            positions = np.asarray(positions)
            if positions.shape not in ((L,), (N, L)) or not np.issubdtype(positions.dtype, np.integer):
                raise shape_error("positions", positions.shape, f"({L},) or ({N}, {L}) integers")
        if per_head is None:
            qp, kp, vp = self._project(q, k, v, key_value is None)
        else:  # each head's own copy of the input, batch first also for an unbatched x (see _run)
            q, k, v = per_head
            qp, kp, vp = self._project_per_head(q, k, v)
        qh, kh, vh = self._heads(qp, kp, vp, positions, cache, past)
        return AttentionInputs(q, k, v, qh, kh, vh, _merge_masks(am, kpm, self.dtype), causal_flag, batched,
                               cache is not None)

    def forward(
        self,
        x: np.ndarray,
        *,
        key_value: np.ndarray | None = None,
        key_padding_mask: np.ndarray | None = None,
        attn_mask: np.ndarray | None = None,
        is_causal: bool | None = None,
        cache: KVCache | None = None,
        positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Attend: ``x (N, L, E)`` (or ``(L, E)``) -> ``(N, L, E)``.

        Args:
            x: the queries' input (and the keys' and values', for self-attention).
            key_value: ``(N, S, kdim)``: cross-attention to these instead.
            key_padding_mask: ``(N, S_all)``, True where a key takes part (the cached keys
                included: ``S_all = P + S``).
            attn_mask: ``(L, S_all)`` or ``(N, H, L, S_all)``: bool True = takes part, or
                float added to the scores.
            is_causal: a causal mask, aligned bottom-right when there are cached keys (None:
                the layer's ``causal``); with ``sliding_window``, windowed.
            cache: a :class:`KVCache`: the new keys and values are appended and the
                queries attend to all of them.
            positions: ``(L,)`` or ``(N, L)`` integer positions for the position slot
                (None: ``P .. P + L - 1``).
        """
        return self._run(x, key_value, key_padding_mask, attn_mask, is_causal, cache, positions, False)[0]

    def forward_with_weights(self, x: np.ndarray, **kwargs) -> tuple[np.ndarray, np.ndarray]:
        """``(output, weights)``: :meth:`forward`'s output and the attention weights
        ``(N, H, L, S_all)`` (``(H, L, S_all)`` unbatched), computed once; the output is
        ``weights @ V``."""
        return self._run(x, kwargs.pop("key_value", None), kwargs.pop("key_padding_mask", None),
                         kwargs.pop("attn_mask", None), kwargs.pop("is_causal", None), kwargs.pop("cache", None),
                         kwargs.pop("positions", None), True, **kwargs)

    def _run(self, x, key_value, key_padding_mask, attn_mask, is_causal, cache, positions, need_weights,
             per_head=None):
        """The call. ``per_head``: ``(x_q (N, L, H, E), x_k (N, S, H_kv, E), x_v)``, each
        query head's and each key/value head's own input, batch first (N = 1 for an
        unbatched ``x``; a block's split inputs, which a hook may have made differ per head;
        ``x`` then gives only the shapes): head ``h``'s
        queries are ``x_q[:, :, h] W_q^h``, and so on. :meth:`backward` then returns the
        gradients of the three."""
        if not need_weights and key_value is None and key_padding_mask is None and attn_mask is None \
                and per_head is None:
            causal = self.causal if is_causal is None else bool(is_causal)
            if not (causal and self.sliding_window is not None):
                out = self._one_pool_call(x, causal, cache, batch_first=True, positions=positions)
                if out is not None:
                    return (out if x.ndim == 3 else out[0]), None
        a = self._inputs(x, key_value, key_padding_mask, attn_mask, is_causal, cache, positions, per_head)
        z, weights, rng_state, explicit = self._attend(a.qh, a.kh, a.vh, a.mask, a.causal, need_weights)
        out = self._finish(z, a, weights, rng_state, explicit)
        if not a.batched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    # ---- the whole forward pass in one pool call ----------------------------------------
    def _plain_self_attention(self) -> bool:
        """Whether a self-attention call may run as :func:`attnlab.core.rows.self_attention`:
        an inference call that may take a fused kernel (:func:`attnlab.nn._context.may_fuse`:
        eval mode, nothing kept for backward, no backward hooks, no hooks on the heads),
        nothing between the projections and the attention that the layer would do apart (no
        rotary slot, QK-norm, soft-cap, extra keys, own attention function), one fused
        float32 NumPy in-projection and a plain ``Linear`` out-projection, as many key/value
        heads as query heads."""
        if not (self._qkv_same_embed_dim and self.num_kv_heads == self.num_heads and self.rotary is None
                and self.q_norm is None and self.softcap is None
                and self.attention_fn is scaled_dot_product_attention
                and getattr(self, "bias_k", None) is None and self.adapters is None
                and self.out_proj.adapters is None
                and not self.add_zero_attn and type(self.out_proj) is Linear):
            return False
        w, wo = self.in_proj_weight.data, self.out_proj.weight.data
        if type(w) is not np.ndarray or type(wo) is not np.ndarray or w.dtype != np.float32 or wo.dtype != np.float32:
            return False
        return may_fuse(self.training, (self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores,
                                        self.hook_pattern, self.hook_z))

    def _one_pool_call(self, x, causal: bool, cache, *, batch_first: bool, positions=None):
        """Self-attention on ``x`` (no mask but ``causal``, no weights wanted) in one pool
        call (:func:`attnlab.core.rows.self_attention`), its output ``(N, L, E)`` (batch
        first, also for an unbatched ``x``), or None where the call takes the usual path:
        see :meth:`_plain_self_attention` and :func:`attnlab.core.rows.self_attention_threads`;
        an ``x`` that is not a float32 NumPy array of 2 or 3 dims and the layer's width, a
        cache that already holds keys, or ``positions`` that are not ``(L,)`` or ``(N, L)``
        integers also go there (and are checked there). Without a rotary slot the positions
        change nothing (a decoder's blocks pass them to every layer). It keeps nothing for a
        backward pass: it never runs in training mode."""
        if type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim not in (2, 3) \
                or x.shape[-1] != self.embed_dim or (cache is not None and (type(cache) is not KVCache or len(cache))) \
                or not self._plain_self_attention():
            return None
        batched = x.ndim == 3
        xb = (x if batch_first else x.transpose(1, 0, 2)) if batched else x[None]
        N, L, E = xb.shape
        H, D = self.num_heads, self.head_dim
        if positions is not None and not (type(positions) is np.ndarray and positions.shape in ((L,), (N, L))
                                          and np.issubdtype(positions.dtype, np.integer)):
            return None
        threads = rows.self_attention_threads(N, L, E, H, D)
        if not threads:
            return None
        b, bo = self.in_proj_bias, self.out_proj.bias
        scale = 1.0 / math.sqrt(D) if self.scale is None else self.scale  # as the core's default
        out, qkv, z = rows.self_attention(
            xb, self.in_proj_weight.data, None if b is None else b.data, self.out_proj.weight.data,
            None if bo is None else bo.data, num_heads=H, scale=scale, is_causal=causal, threads=threads)
        HD = H * D
        self._heads(qkv[..., :HD], qkv[..., HD:2 * HD], qkv[..., 2 * HD:], None, cache, 0)  # fills the cache
        return out

    # ---- the compiled decoding step's view of this layer ----------------------------------
    def decode_record(self) -> tuple | None:
        """This layer's slots for the compiled decoding step (:mod:`attnlab._decode_kernels`):
        ``(qkv, out, q_norm, k_norm, num_heads, num_kv_heads, head_dim, scale, softcap)``,
        or None where the step cannot compute this layer. It computes causal
        self-attention with one fused in-projection and an out-projection, quantized or float32
        (:func:`attnlab.quant.product_record`; biases included), a rotary slot that gives
        its rotation (:meth:`~attnlab.nn.RotaryEmbedding.decode_rows`), QK-norms that give
        their record (:meth:`~attnlab.nn.RMSNorm.decode_record`; None for none), any
        ``scale``, soft-cap (0 for none), grouped-query heads and sliding window
        (:meth:`decode_rows`); not dropout, adapters, another ``attention_fn`` or a
        subclass."""
        if type(self) is not Attention or not (self.causal and self._qkv_same_embed_dim and self.dropout == 0.0
                                               and self.attention_fn is scaled_dot_product_attention
                                               and self.adapters is None and self.rotary is not None
                                               and hasattr(self.rotary, "decode_rows")):
            return None
        b, w, o = self.in_proj_bias, self.in_proj_weight.data, self.out_proj
        H, Hkv, D, E = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        if w.shape != ((H + 2 * Hkv) * D, E) or (o.in_features, o.out_features) != (H * D, E):
            return None
        qkv = product_record(w, None if b is None else b.data)
        out = o.decode_record() if type(o) is Linear else None
        norms = [None if n is None else n.decode_record() if getattr(n, "normalized_shape", None) == D
                 and hasattr(n, "decode_record") else False for n in (self.q_norm, self.k_norm)]
        if qkv is None or out is None or any(r is None and n is not None or r is False
                                             for n, r in zip((self.q_norm, self.k_norm), norms, strict=True)):
            return None
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale  # as the core's default
        return (qkv, out, *norms, H, Hkv, D, np.float32(scale), np.float32(self.softcap or 0.0))

    def decode_rows(self, n: int, key_padding_mask, cache, positions) -> tuple | None:
        """The rows of one compiled decoding step (:mod:`attnlab._decode_kernels`): ``(cos,
        sin, keys, values, key_scales, value_scales, slot, start, key_mask)`` for one new
        token in each of ``n`` rows after the ``cache`` (a non-empty NumPy :class:`KVCache`
        of float32 keys, stored as float32, float16 (then ``keys``/``values`` are its bits,
        uint16) or int8 (its codes, with their scales; None for a float cache)), with
        room made for it (``slot``, counted in ``cache``); ``start`` is the first key the
        sliding window keeps. None (the cache untouched) where the step does not apply: an
        empty or foreign cache, a ``key_padding_mask`` that is not a bool ``(n, S + 1)``
        array allowing every new token, positions the rotary slot does not take (None:
        after the cached ones)."""
        k, v, past = cache._key, cache._value, cache.length
        if type(cache) is not KVCache or not past or type(k) is not np.ndarray or type(v) is not np.ndarray \
                or cache._given != np.float32 or k.dtype not in _STEP_CACHE_DTYPES or v.dtype != k.dtype \
                or k.shape[0] != n or k.shape[1] != self.num_kv_heads or k.shape[3] != self.head_dim \
                or k.shape != v.shape or not (k.flags.c_contiguous and v.flags.c_contiguous):
            return None
        if key_padding_mask is None:
            key_mask = _NO_KEY_MASK
        elif type(key_padding_mask) is not np.ndarray or key_padding_mask.dtype != np.bool_ \
                or key_padding_mask.shape != (n, past + 1) or not key_padding_mask[:, -1].all():
            return None  # a new token that takes no part: the modules decide
        else:
            key_mask = np.ascontiguousarray(key_padding_mask)
        rotation = self.rotary.decode_rows(np.array([past]) if positions is None else positions, n)
        if rotation is None:
            return None
        cache._reserve(1, k, v)
        slot = cache.length
        cache.length += 1
        start = 0 if self.sliding_window is None else max(0, slot + 1 - self.sliding_window)
        keys, values = cache._key, cache._value
        if keys.dtype == np.float16:  # numba has no float16: the kernel reads the bits
            keys, values = keys.view(np.uint16), values.view(np.uint16)
        return (*rotation, keys, values, cache._key_scale, cache._value_scale, slot, start, key_mask)

    def backward(self, grad_output: np.ndarray):
        """Gradient of the input ``x`` (cross-attention: ``(grad_x, grad_key_value)``);
        parameter gradients accumulate in ``.grad``. Through the rotary slot and the
        QK-norm too; not through a call with a KVCache."""
        (gq, gk, gv), a = self._backward_qkv(grad_output, batch_first=True, summed=True)
        if a.q.ndim == 4:  # a call with per-head inputs: the gradient of each
            return (gq, gk, gv) if a.batched else (gq[0], gk[0], gv[0])
        if a.k is a.q:
            g = gq if gk is None else gq + gk + gv
            return g if a.batched else g[0]
        g_kv = gk + gv
        return (gq, g_kv) if a.batched else (gq[0], g_kv[0])

    def _backward_qkv(self, grad_output, *, batch_first: bool, summed: bool = False):
        """``((grad_q, grad_k, grad_v), inputs)``: the gradients batch first ``(N, L, E)``/
        ``(N, S, kdim)``/``(N, S, vdim)`` and the call's :class:`AttentionInputs`.

        With ``summed`` and self-attention through the fused in-projection weight:
        ``(grad_q + grad_k + grad_v, None, None)`` from one matrix product."""
        c = self._saved()
        a: AttentionInputs = c["inputs"]
        return self._qkv_grads(grad_output, c, a, batch_first, summed), a

    def _qkv_grads(self, grad_output, c: dict, a: AttentionInputs, batch_first: bool, summed: bool):
        if a.cached:
            raise RuntimeError(f"{type(self).__name__} has no backward pass through a call with a KVCache")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        g = np.asarray(grad_output)
        if not a.batched:
            g = g[None]
        elif not batch_first:
            g = g.transpose(1, 0, 2)
        N, L = a.q.shape[:2]
        if g.shape != (N, L, self.embed_dim):
            raise shape_error("grad_output", np.shape(grad_output), "the output's shape")
        gz4 = self.hook_z.backward(self.out_proj.backward(g).reshape(N, L, H, D))
        gh = gz4.transpose(0, 2, 1, 3)
        explicit: _Explicit | None = c.get("explicit")
        if explicit is not None:
            gqh, gkh, gvh = _explicit_backward(gh, a, explicit, self.scale, self.softcap, self.hook_pattern,
                                               self.hook_attn_scores)
        else:
            options = {} if self.softcap is None else {"softcap": self.softcap}
            gqh, gkh, gvh = scaled_dot_product_attention_backward(
                gh, a.qh, a.kh, a.vh, attn_mask=a.mask, dropout_p=c["p"], is_causal=a.causal, scale=self.scale,
                enable_gqa=Hkv != H, rng=_replay(self._rng, c["rng_state"]), **options,
            )
        if self.add_zero_attn:
            gkh, gvh = gkh[:, :, :-1], gvh[:, :, :-1]
        if self.rotary is not None:
            gqh = self.hook_rot_q.backward(gqh.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
            gkh = self.hook_rot_k.backward(gkh.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
            gqh, gkh = self.rotary.backward(gqh, gkh)
        gq4, gk4, gv4 = gqh.transpose(0, 2, 1, 3), gkh.transpose(0, 2, 1, 3), gvh.transpose(0, 2, 1, 3)
        if self.q_norm is not None:
            gk4, gq4 = self._qk_norm(self.k_norm, gk4, True), self._qk_norm(self.q_norm, gq4, True)
        gq4, gk4, gv4 = self.hook_q.backward(gq4), self.hook_k.backward(gk4), self.hook_v.backward(gv4)
        S = gk4.shape[1]
        frozen = parameters_frozen()
        has_bias = self.in_proj_bias is not None and self.in_proj_bias.requires_grad and not frozen
        if self._qkv_same_embed_dim and a.k is a.q and a.v is a.q and S == L and isinstance(gq4, np.ndarray):
            return self._fused_in_proj_backward(gq4, gk4, gv4, a.q, has_bias, summed)
        (wq, wk, wv), _ = self.in_projections()
        ws = (self.in_proj_weight,) * 3 if self._qkv_same_embed_dim else \
            (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        if a.q.ndim == 4:  # per-head inputs: head h's rows of the weight met its own input
            grads, wgrads, bgrads = [], [], []
            for g4, x, w, p in ((gq4, a.q, wq, ws[0]), (gk4, a.k, wk, ws[1]), (gv4, a.v, wv, ws[2])):
                grads.append(np.einsum("nlhd,hde->nlhe", g4, w.reshape(g4.shape[2], D, -1)))
                # A weight whose gradient nobody keeps (frozen) costs no product.
                keep = p.requires_grad and not frozen
                wgrads.append(np.einsum("nlhd,nlhe->hde", g4, x).reshape(-1, x.shape[-1]) if keep else None)
                bgrads.append(g4.sum(axis=(0, 1)).reshape(-1) if has_bias else None)
            self._accumulate_in_proj(*wgrads, *bgrads)
            if self.adapters is not None:
                parts = self.adapters.backward_heads([g4.reshape(*g4.shape[:2], -1) for g4 in (gq4, gk4, gv4)])
                grads = [g if ga is None else g + ga for g, ga in zip(grads, parts, strict=True)]
            return tuple(grads)
        gqp, gkp, gvp = gq4.reshape(N, L, H * D), gk4.reshape(N, S, Hkv * D), gv4.reshape(N, S, Hkv * D)
        gkp, gvp = self._extra_keys_backward(gkp, gvp)
        gq, gwq, gbq = F.linear_backward(gqp, a.q, wq, has_bias=has_bias, weight_grad=ws[0].requires_grad)
        gk, gwk, gbk = F.linear_backward(gkp, a.k, wk, has_bias=has_bias, weight_grad=ws[1].requires_grad)
        gv, gwv, gbv = F.linear_backward(gvp, a.v, wv, has_bias=has_bias, weight_grad=ws[2].requires_grad)
        if self.adapters is not None:  # self-attention with extra keys: the adapters saw x once
            parts = self.adapters.backward(np.concatenate([gqp, gkp, gvp], axis=-1), list(self._in_proj_cuts()))
            gq, gk, gv = (g if ga is None else g + ga for g, ga in zip((gq, gk, gv), parts, strict=True))
        self._accumulate_in_proj(gwq, gwk, gwv, gbq, gbk, gbv)
        return gq, gk, gv

    def _accumulate_in_proj(self, gwq, gwk, gwv, gbq, gbk, gbv) -> None:
        """Add the q, k and v projections' weight and bias gradients to the parameters (a
        None gradient, of a frozen parameter or with frozen parameters, adds nothing)."""
        if self._qkv_same_embed_dim:
            if gwq is not None:
                self.in_proj_weight.accumulate(np.concatenate([gwq, gwk, gwv]), owned=True)
        else:
            for p, gw in zip((self.q_proj_weight, self.k_proj_weight, self.v_proj_weight), (gwq, gwk, gwv),
                             strict=True):
                if gw is not None:
                    p.accumulate(gw)
        if self.in_proj_bias is not None and gbq is not None:
            self.in_proj_bias.accumulate(np.concatenate([gbq, gbk, gbv]), owned=True)

    def _fused_in_proj_backward(self, gq4, gk4, gv4, x, has_bias: bool, summed: bool):
        """Self-attention through ``in_proj_weight`` (one ``(Dq + 2 Dkv, E)`` matrix): the
        heads' gradients ``(N, L, H|Hkv, D)`` are written side by side into one
        ``(N, L, Dq + 2 Dkv)`` array (the copy their merge needs anyway), so the weight and
        bias gradients are one matrix product and one sum, and (``summed``) the input's
        gradient ``grad_q + grad_k + grad_v`` is one product too."""
        N, L = x.shape[:2]
        Dq, Dkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        g = np.empty((N, L, Dq + 2 * Dkv), dtype=gq4.dtype)
        for part, (a, b) in zip((gq4, gk4, gv4), ((0, Dq), (Dq, Dq + Dkv), (Dq + Dkv, Dq + 2 * Dkv)), strict=True):
            np.copyto(g[..., a:b].reshape(part.shape, copy=False), part)  # splitting the last axis: a view
        w = self.in_proj_weight.data
        weight_grad = self.in_proj_weight.requires_grad and not parameters_frozen()
        if summed:
            gx, gw, gb = F.linear_backward(g, x, w, has_bias=has_bias, weight_grad=weight_grad)
            grads = (gx, None, None)
        else:
            g2 = g.reshape(N * L, -1)
            gb = col_sum(g2) if has_bias else None
            cuts = self._in_proj_cuts()
            # The weight's gradient and the three inputs' in one wake of the pool.
            pairs = [(g2[:, a:b], w[a:b]) for a, b in cuts]
            if weight_grad:
                pairs.insert(0, (g2.T, x.reshape(N * L, -1)))
            grads = matmuls(pairs, tokens=N * L)
            gw = grads.pop(0) if weight_grad else None
            grads = tuple(part.reshape(N, L, -1) for part in grads)
        if gw is not None:
            self.in_proj_weight.accumulate(gw, owned=True)
        if has_bias:
            self.in_proj_bias.accumulate(gb, owned=True)
        if self.adapters is not None:  # the adapters' part of the input's gradient (of each input's)
            if summed:
                ga = self.adapters.backward(g)
                grads = grads if ga is None else (grads[0] + ga, *grads[1:])
            else:
                parts = self.adapters.backward(g, list(self._in_proj_cuts()))
                grads = tuple(gx if ga is None else gx + ga for gx, ga in zip(grads, parts, strict=True))
        return grads

    add_zero_attn = False

    def _extra_keys_backward(self, gkp, gvp):
        return gkp, gvp


def _check_mask(mask, name, need_shapes, query):
    """A bool (True = takes part) or float mask of one of ``need_shapes``, in ``query``'s
    library (float masks in its dtype)."""
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


def _merge_masks(attn_mask, key_padding_mask, dtype):
    """One mask from an attention mask and a key padding mask (bool AND, or summed biases)."""
    if attn_mask is None or key_padding_mask is None:
        return key_padding_mask if attn_mask is None else attn_mask
    if is_bool(attn_mask) and is_bool(key_padding_mask):
        return attn_mask & key_padding_mask

    def as_bias(m):
        return mask_to_bias(m, dtype) if is_bool(m) else m

    return as_bias(attn_mask) + as_bias(key_padding_mask)


class MultiheadAttention(Attention):
    """Multi-head attention with ``torch.nn.MultiheadAttention``'s arguments, shapes and
    parameter names, so ``state_dict``s move across unchanged. It is an :class:`Attention`
    with torch's call: the same parameters, hook points and math.

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
        attention_fn: the attention function that computes the output when no weights are
            wanted; defaults to :func:`attnlab.scaled_dot_product_attention` and takes its
            signature. With ``need_weights=True`` the weights are computed once (with the
            dropout mask) and the output is ``weights @ V``.

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
        object.__setattr__(self, "_add_bias_kv", bool(add_bias_kv))
        super().__init__(
            embed_dim, num_heads, bias=bias, separate_projections=separate_projections, kdim=kdim, vdim=vdim,
            dropout=dropout, rng=rng, dtype=dtype, attention_fn=attention_fn,
        )
        self.batch_first = bool(batch_first)
        self.add_zero_attn = bool(add_zero_attn)

    def _init_extra_keys(self, rng, dtype) -> None:
        E = self.embed_dim
        if self._add_bias_kv:
            self.bias_k = Parameter(init.xavier_normal(rng, (1, 1, E), dtype))
            self.bias_v = Parameter(init.xavier_normal(rng, (1, 1, E), dtype))
        else:
            self.bias_k = self.bias_v = None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}"
        )

    def _to_batch_first(self, x, batched):
        if not batched:
            return x[None] if isinstance(x, np.ndarray) else namespace(x).expand_dims(x, axis=0)
        return x if self.batch_first else _permute(x, (1, 0, 2))

    def _from_batch_first(self, x, batched):
        if not batched:
            return x[0, ...]
        return x if self.batch_first else _permute(x, (1, 0, 2))

    @staticmethod
    def _pad_keys(mask):
        """Append one key that takes part to a mask (for bias_kv / zero_attn)."""
        if mask is None:
            return None
        return _concat([mask, _full((*mask.shape[:-1], 1), is_bool(mask), mask)], axis=-1)

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
        """Check a call's arguments (torch's conventions) and project the heads:
        everything the attention of the heads receives."""
        E, H = self.embed_dim, self.num_heads
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

        kpm = _check_mask(key_padding_mask, "key_padding_mask", [(N, S_all)] if batched else [(S_all,)], q)
        am = _check_mask(
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
        qh, kh, vh = self._heads(qp, kp, vp, None, cache, past, zero_attn=self.add_zero_attn)
        if self.add_zero_attn:
            am, kpm = self._pad_keys(am), self._pad_keys(kpm)
        mask = _merge_masks(am, kpm, self.dtype)
        return AttentionInputs(q, k, v, qh, kh, vh, mask, causal_flag, batched, cache is not None)

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
        if not need_weights and query is key and key is value and key_padding_mask is None and attn_mask is None:
            out = self._one_pool_call(query, bool(is_causal), cache, batch_first=self.batch_first)
            if out is not None:
                return self._from_batch_first(out, query.ndim == 3), None
        a = self.attention_inputs(query, key, value, key_padding_mask, attn_mask, is_causal, cache=cache)
        z, weights, rng_state, explicit = self._attend(a.qh, a.kh, a.vh, a.mask, a.causal, need_weights)
        out = self._finish(z, a, weights, rng_state, explicit)
        if not need_weights:
            weights = None
        elif average_attn_weights:
            weights = namespace(weights).mean(weights, axis=1)
        if weights is not None and not a.batched:
            weights = weights[0, ...]
        return self._from_batch_first(out, a.batched), weights

    def _extra_keys_backward(self, gkp, gvp):
        if self.bias_k is not None:
            self.bias_k.accumulate(gkp[:, -1].sum(axis=0)[None, None])
            self.bias_v.accumulate(gvp[:, -1].sum(axis=0)[None, None])
            gkp, gvp = gkp[:, :-1], gvp[:, :-1]
        return gkp, gvp

    def backward(self, grad_output: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(grad_query, grad_key, grad_value)`` in the inputs' layouts; parameter gradients
        accumulate in ``.grad``. For self-attention (one tensor as query, key and value) its
        gradient is the sum of the three."""
        (gq, gk, gv), a = self._backward_qkv(grad_output, batch_first=self.batch_first)
        b = a.batched
        return self._from_batch_first(gq, b), self._from_batch_first(gk, b), self._from_batch_first(gv, b)
