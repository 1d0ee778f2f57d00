"""Transformer building blocks shared by every model: ``FeedForward`` and ``TransformerBlock``
(attention + feed-forward + LayerNorms, pre- or post-norm, optional key/value cache).

A model is an arrangement of these blocks (embeddings, positions and heads are the
model's own): :class:`~attnlab.models.TinyTransformer` stacks pre-norm causal blocks,
:class:`~attnlab.models.BertEncoder` post-norm bidirectional ones. The attention inside is
always :class:`~attnlab.nn.Attention`, so its ``attention_fn``, its maps, its hook points,
:func:`attnlab.trace` and its backward pass come with every model.
"""

from __future__ import annotations

import threading

import numpy as np

from attnlab._validation import generator, probability, shape_error
from attnlab.nn import functional as F
from attnlab.nn._context import may_fuse
from attnlab.nn.attention import Attention, KVCache
from attnlab.nn.hooks import HookPoint
from attnlab.nn.layers import GELU, Dropout, LayerNorm, ReLU, Sequential
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module, structure_version
from attnlab.quant import _kernels, _set_threads, is_quantized

__all__ = ["ACTIVATIONS", "FeedForward", "KVCache", "TransformerBlock", "activation_layer"]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def activation_layer(name: str, *, inplace: bool = False) -> Module:
    """The activation layer called ``name``: ``"gelu"`` (exact erf), ``"gelu_tanh"`` or ``"relu"``.

    >>> activation_layer("gelu_tanh")
    GELU(approximate='tanh')
    """
    if name == "gelu":
        return GELU(inplace=inplace)
    if name == "gelu_tanh":
        return GELU("tanh", inplace=inplace)
    if name == "relu":
        return ReLU(inplace=inplace)
    raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {name!r}")


class FeedForward(Sequential):
    """The transformer MLP ``Linear(d_model, d_ff) -> activation -> Linear(d_ff, d_model)``
    (-> ``Dropout``): parameter names ``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``.

    Hook points: ``hook_pre`` (the first projection's output, before the activation) and
    ``hook_post`` (after the activation), TransformerLens's ``mlp.hook_pre``/``mlp.hook_post``.

    Args:
        d_model: input and output width.
        d_ff: hidden width.
        activation: ``"gelu"`` (exact), ``"gelu_tanh"`` or ``"relu"``.
        dropout: dropout after the second projection (training mode only).

    >>> ff = FeedForward(4, 8, rng=np.random.default_rng(0))
    >>> sorted(ff.state_dict()), ff.hook_names()
    (['0.bias', '0.weight', '2.bias', '2.weight'], ['hook_pre', 'hook_post'])
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
        rng=None,
        dtype=np.float32,
    ):
        rng = generator(rng)
        layers = [
            Linear(d_model, d_ff, bias, rng=rng, dtype=dtype),
            activation_layer(activation, inplace=True),  # on the first Linear's fresh output
            Linear(d_ff, d_model, bias, rng=rng, dtype=dtype),
        ]
        if probability(dropout, "dropout") > 0:
            layers.append(Dropout(dropout, rng=rng))
        super().__init__(*layers)
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x):
        layers = self._layers()
        h = self.hook_post(layers[1](self.hook_pre(layers[0](x))))
        for layer in layers[2:]:
            h = layer(h)
        return h

    def backward(self, grad_output):
        layers = self._layers()
        g = grad_output
        for layer in reversed(layers[2:]):
            g = layer.backward(g)
        g = self.hook_pre.backward(layers[1].backward(self.hook_post.backward(g)))
        return layers[0].backward(g)


class TransformerBlock(Module):
    """A residual transformer block: attention, then a feed-forward network.

    Pre-norm (``norm_first=True``, GPT-style): ``x + attn(ln_1(x))`` then
    ``x + mlp(ln_2(x))``. Post-norm (``norm_first=False``, BERT-style):
    ``ln_1(x + attn(x))`` then ``ln_2(x + mlp(x))``. The attention is an
    :class:`~attnlab.nn.Attention` (parameter names ``attn.in_proj_weight``,
    ``attn.out_proj.weight`` …); the feed-forward network is a :class:`FeedForward`
    (``mlp.0.weight``, ``mlp.2.weight`` …). A model family arranges its own parts by passing
    them in (``attn=``, ``mlp=``, ``ln_1=``, ``ln_2=``: an RMSNorm, a gated MLP, an
    attention with rotary positions); the block's residual wiring, hooks and backward pass
    stay the same. Sandwich norms (Gemma 2 and 3): ``post_attn_norm=`` and ``post_mlp_norm=``
    normalise the attention's and the feed-forward network's outputs before the residual
    adds them, ``x + post_attn_norm(attn(ln_1(x)))`` (kept as ``ln_1_post`` and
    ``ln_2_post``, TransformerLens's ``ln1_post``/``ln2_post``).

    Args:
        d_model: width; ``n_heads`` must divide it.
        n_heads: attention heads.
        d_ff: feed-forward hidden width.
        dropout: dropout in attention weights, after attention and in the MLP.
        activation: see :class:`FeedForward`.
        causal: each position attends only to itself and earlier positions.
        bias: biases in every projection.
        norm_first: pre-norm (True) or post-norm (False).
        layer_norm_eps: the LayerNorms' ``eps``.
        separate_projections: separate ``q/k/v_proj_weight`` instead of one fused
            ``in_proj_weight`` (see :class:`~attnlab.nn.Attention`).
        attention_fn: the attention's ``attention_fn`` (a faster kernel).
        attn, mlp, ln_1, ln_2: modules that replace the default-built parts.
        post_attn_norm, post_mlp_norm: norms of the attention's and the feed-forward
            network's outputs, applied before the residual adds (None: none).
        rng, dtype: initialisation and dtype of every parameter.

    Call with ``x`` ``(B, T, d_model)`` (or ``(T, d_model)``) and optionally
    ``key_padding_mask`` ``(B, S)`` (True = the key takes part), ``cache`` (a
    :class:`~attnlab.nn.KVCache`: ``x`` holds the new tokens, which attend to the cached
    ones too) and ``positions`` (for the attention's position slot); returns
    ``(B, T, d_model)``. :meth:`forward_with_weights` also returns the attention maps.

    Hook points (TransformerLens's names): ``hook_resid_pre``, ``ln1.hook_normalized``,
    ``attn.hook_*``, ``hook_attn_out``, ``hook_resid_mid``, ``ln2.hook_normalized``,
    ``mlp.hook_pre``, ``mlp.hook_post``, ``hook_mlp_out``, ``hook_resid_post``.
    Four more fire only when a hook names them (not for ``names_filter=None`` or a
    predicate), as TransformerLens's ``use_split_qkv_input`` and ``use_hook_mlp_in``:
    ``hook_q_input`` ``(B, T, H, d_model)``, ``hook_k_input`` and ``hook_v_input``
    ``(B, T, H_kv, d_model)``, each head's own copy of the attention's input (the
    residual, before ``ln_1``; batch axis kept for an unbatched call), which the block then
    normalises and projects head by head, so a hook can change one head's input alone; and
    ``hook_mlp_in`` ``(B, T, d_model)``, the MLP's own copy of the residual (pre-norm: before
    ``ln_2``; post-norm: after ``ln_1``). Post-norm,
    ``hook_resid_post`` is the sum before ``ln_2`` and the block's output, ``ln_2`` of it,
    is ``hook_normalized_resid_post`` (see :attr:`output_hook`). With sandwich norms,
    ``ln1_post.hook_normalized`` and ``ln2_post.hook_normalized`` too, and ``hook_attn_out``
    and ``hook_mlp_out`` are the normed outputs, what the residual receives (as
    TransformerLens's Gemma 2).

    >>> block = TransformerBlock(8, 2, 16, rng=np.random.default_rng(0))
    >>> block(np.zeros((1, 5, 8), dtype=np.float32)).shape
    (1, 5, 8)
    """

    _hook_alias = {"ln_1": "ln1", "ln_2": "ln2", "ln_1_post": "ln1_post", "ln_2_post": "ln2_post"}

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        causal: bool = True,
        bias: bool = True,
        norm_first: bool = True,
        layer_norm_eps: float = 1e-5,
        separate_projections: bool = False,
        attention_fn=None,
        attn: Module | None = None,
        mlp: Module | None = None,
        ln_1: Module | None = None,
        ln_2: Module | None = None,
        rng=None,
        dtype=np.float32,
        post_attn_norm: Module | None = None,
        post_mlp_norm: Module | None = None,
    ):
        super().__init__()
        rng = generator(rng)
        self.causal = bool(causal)
        self.norm_first = bool(norm_first)
        self.hook_resid_pre = HookPoint()
        # Each head's own copy of the attention's input and the MLP's, for patching one edge
        # into one head (TransformerLens's use_split_qkv_input and use_hook_mlp_in): attached
        # only when named, and only then does the block compute per-head inputs.
        self.hook_q_input = HookPoint(opt_in=True)
        self.hook_k_input = HookPoint(opt_in=True)
        self.hook_v_input = HookPoint(opt_in=True)
        ln_1 = ln_1 if ln_1 is not None else LayerNorm(d_model, layer_norm_eps, dtype=dtype)
        if self.norm_first:
            self.ln_1 = ln_1
        if attn is None:
            attn = Attention(
                d_model, n_heads, dropout=dropout, bias=bias, separate_projections=separate_projections,
                causal=causal, rng=rng, dtype=dtype, attention_fn=attention_fn,
            )
        elif not isinstance(attn, Attention):
            raise TypeError(f"attn must be an attnlab Attention, got {type(attn).__name__}")
        self.attn = attn
        self.ln_1_post = post_attn_norm  # None: no sandwich norm (registered only when given)
        self.drop_1 = Dropout(dropout, rng=rng)
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_in = HookPoint(opt_in=True)
        if not self.norm_first:
            self.ln_1 = ln_1
        self.ln_2 = ln_2 if ln_2 is not None else LayerNorm(d_model, layer_norm_eps, dtype=dtype)
        if mlp is None:
            mlp = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias, rng=rng, dtype=dtype)
        self.mlp = mlp
        self.ln_2_post = post_mlp_norm
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()
        if not self.norm_first:  # the block's output, ln_2 of the residual (TransformerLens's BERT)
            self.hook_normalized_resid_post = HookPoint()

    @property
    def output_hook(self) -> str:
        """The name (within the block) of the hook point that sees the block's output:
        ``hook_resid_post``, or ``hook_normalized_resid_post`` post-norm."""
        return "hook_resid_post" if self.norm_first else "hook_normalized_resid_post"

    def extra_repr(self) -> str:
        norm = "pre-norm" if self.norm_first else "post-norm"
        return f"{norm}, causal={self.causal}"

    def attention_input(self, x: np.ndarray) -> np.ndarray:
        """What the attention reads (its query, key and value): ``ln_1(x)`` pre-norm, else ``x``."""
        return self.ln_1(x) if self.norm_first else x

    def forward(
        self,
        x: np.ndarray,
        *,
        key_padding_mask: np.ndarray | None = None,
        cache: KVCache | None = None,
        positions: np.ndarray | None = None,
    ) -> np.ndarray:
        if cache is not None:  # one new token after cached ones: one compiled call where it applies
            out = self._decode_step(x, key_padding_mask, cache, positions)
            if out is not None:
                return out
        return self._run(x, key_padding_mask, cache, positions, need_weights=False)[0]

    def decode_record(self) -> tuple | None:
        """This block's slots for the compiled decoding step (:mod:`attnlab._decode_kernels`):
        ``(ln_1, attention, ln_1_post, ln_2, feed_forward, ln_2_post)``, each part's own
        record (``decode_record`` of :class:`~attnlab.nn.RMSNorm`,
        :class:`~attnlab.nn.Attention` and :class:`GatedFeedForward`; an absent sandwich
        norm is None), or None where the step cannot compute the block: post-norm, not
        causal, dropout after the attention, a part that gives no record, a part of another
        width, a subclass, or a parameter that no record reads (one the step would leave
        out)."""
        if type(self) is not TransformerBlock or not (self.norm_first and self.causal and self.drop_1.p == 0.0):
            return None
        E = self.attn.embed_dim
        parts = (self.ln_1, self.attn, self.ln_1_post, self.ln_2, self.mlp, self.ln_2_post)
        if any(getattr(m, "normalized_shape", E) != E for m in parts) or getattr(self.mlp, "d_model", None) != E:
            return None
        record = tuple(None if m is None else m.decode_record() if hasattr(m, "decode_record") else False
                       for m in parts)
        if any(r is False or r is None and m is not None for m, r in zip(parts, record, strict=True)):
            return None
        read = {id(a) for a in _leaves(record)}
        if any(id(p.data.codes if is_quantized(p.data) else p.data) not in read for p in self.parameters()):
            return None
        return record

    def _decode_step(self, x, key_padding_mask, cache, positions) -> np.ndarray | None:
        """The block on one new token per row, ``x (N, 1, D)`` after a non-empty ``cache``,
        in one compiled call (:func:`attnlab._decode_kernels.decode_layer`), or None where
        the module path runs. The choice goes by what the inputs are: float32 NumPy ``x``
        and cache, stored as float32, float16 or int8 (:meth:`~attnlab.nn.Attention.decode_rows`;
        float16 where the CPU converts it, :data:`attnlab._decode_kernels.HALF_CONVERSIONS`), the block's record
        (:meth:`decode_record`: quantized or float32 projections, the block's slots), numba there
        and not turned off, and a call that may take a fused kernel
        (:func:`attnlab.nn._context.may_fuse`: eval mode, no tape, no hook on the block's
        points). The result equals the module path's to float32 round-off; bad input
        goes to the module path, which raises."""
        if type(x) is not np.ndarray or x.ndim != 3 or x.shape[1] != 1 or x.dtype != np.float32 \
                or type(cache) is not KVCache or not cache.length:
            return None
        plan = self.__dict__.get("_decode_plan")
        if plan is None or not plan.current():
            plan = _DecodePlan(self)
            object.__setattr__(self, "_decode_plan", plan)
        N, _, D = x.shape
        kernels = None if plan.record is None or D != plan.widths[0] or not may_fuse(self.training, plan.points) \
            else _step_kernels()
        if kernels is None or (cache.dtype == np.float16 and not kernels.HALF_CONVERSIONS):
            return None
        rows = self.attn.decode_rows(N, key_padding_mask, cache, positions)
        if rows is None:
            return None
        h = x.reshape(N, D).copy()  # the residual, updated in place: x stays as it was
        key = (N, plan.widths)
        scratch = _SCRATCH.__dict__.get(key)  # this thread's, shared by the blocks of one width
        if scratch is None:
            scratch = tuple(np.empty((N, w), np.float32) for w in plan.widths)
            _SCRATCH.__dict__[key] = scratch
        threads = _set_threads()
        if kernels.decode_layer(h, plan.record, rows, scratch, threads):  # a value beyond a float16 cache's range
            cache.crop(-1)  # the token is not cached, as KVCache.append leaves it
            raise cache.range_error(np.float32)
        return h.reshape(N, 1, D)

    def forward_with_weights(
        self,
        x: np.ndarray,
        *,
        key_padding_mask: np.ndarray | None = None,
        cache: KVCache | None = None,
        positions: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(output, weights)``: the block's output and its attention's per-head weights,
        ``(B, H, T, S)`` (``(H, T, S)`` for unbatched ``x``), computed once by the attention
        (its output is ``weights @ V``)."""
        return self._run(x, key_padding_mask, cache, positions, need_weights=True)

    def _run(self, x, key_padding_mask, cache, positions, *, need_weights: bool):
        if np.ndim(x) not in (2, 3):
            d = self.attn.embed_dim
            raise shape_error("x", np.shape(x), f"(B, T, {d}) or (T, {d})")
        x = self.hook_resid_pre(x)
        per_head = self._per_head_inputs(x) if self._split() else None
        h = x if per_head is not None else self.attention_input(x)  # per head: x gives the shapes only
        a, w = self.attn._run(h, None, key_padding_mask, None, self.causal, cache, positions, need_weights,
                              per_head)
        if self.ln_1_post is not None:
            a = self.ln_1_post(a)
        s = self.hook_attn_out(self.drop_1(a))  # a fresh array: the residual is added in place
        s += x
        s = self.hook_resid_mid(s)
        if self.norm_first:
            m = self.mlp(self.ln_2(self._mlp_in(s)))
            m = self.hook_mlp_out(m if self.ln_2_post is None else self.ln_2_post(m))
            m += s
            return self.hook_resid_post(m), w
        s = self.ln_1(s)
        m = self.mlp(self._mlp_in(s))
        m = self.hook_mlp_out(m if self.ln_2_post is None else self.ln_2_post(m))
        m += s
        return self.hook_normalized_resid_post(self.ln_2(self.hook_resid_post(m))), w

    def _split(self) -> bool:
        """Whether this call gives each head its own input (a hook on hook_q/k/v_input)."""
        return self.hook_q_input.hooked or self.hook_k_input.hooked or self.hook_v_input.hooked

    def _per_head_inputs(self, x: np.ndarray) -> tuple:
        """``(x_q, x_k, x_v)``: each head's copy of the residual ``x`` through its hook point
        and the attention's input norm, ``(B, T, H | H_kv, d_model)`` (batched)."""
        xb = x if x.ndim == 3 else x[None]
        heads = (self.attn.num_heads, self.attn.num_kv_heads, self.attn.num_kv_heads)
        points = (self.hook_q_input, self.hook_k_input, self.hook_v_input)
        # np.repeat makes fresh copies: a hook may write into one head's input
        return tuple(self.attention_input(point(np.repeat(xb[:, :, None], n, axis=2)))
                     for point, n in zip(points, heads, strict=True))

    def _mlp_in(self, s: np.ndarray) -> np.ndarray:
        """The MLP's copy of the residual, through hook_mlp_in (a copy only when hooked: the
        residual goes on unchanged)."""
        return self.hook_mlp_in(s.copy() if self.hook_mlp_in.hooked else s)

    def _attn_input_backward(self, grad, batched: bool) -> np.ndarray:
        """The attention's backward pass to the gradient of the block's residual input:
        through ``ln_1`` (pre-norm), or, after a call with per-head inputs, through each
        head's norm and hook point, summed over the heads."""
        g = self.attn.backward(grad)
        if not isinstance(g, tuple):
            return self.ln_1.backward(g) if self.norm_first else g
        points = (self.hook_q_input, self.hook_k_input, self.hook_v_input)
        total = None
        for point, gh in reversed(list(zip(points, g, strict=True))):  # ln_1 ran on q, k, v in that order
            if self.norm_first:
                gh = self.ln_1.backward(gh)
            gh = point.backward(gh).sum(axis=2)
            total = gh if total is None else total + gh
        return total if batched else total[0]

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """The gradient of the block's input; the parameters' gradients accumulate. Through
        every hook point in reverse order (each one's backward hooks see the gradient of its
        activation)."""
        batched = np.ndim(grad_output) == 3
        if self.norm_first:
            g = self.hook_resid_post.backward(grad_output)
            g = g + self.hook_mlp_in.backward(self.ln_2.backward(self.mlp.backward(self._post_mlp_backward(g))))
            g = self.hook_resid_mid.backward(g)
            g = g + self._attn_input_backward(self._post_attn_backward(g), batched)
            return self.hook_resid_pre.backward(g)
        gm = self.hook_resid_post.backward(self.ln_2.backward(self.hook_normalized_resid_post.backward(grad_output)))
        gs = gm + self.hook_mlp_in.backward(self.mlp.backward(self._post_mlp_backward(gm)))
        gs = self.hook_resid_mid.backward(self.ln_1.backward(gs))
        return self.hook_resid_pre.backward(gs + self._attn_input_backward(self._post_attn_backward(gs), batched))

    def _post_attn_backward(self, g: np.ndarray) -> np.ndarray:
        """From the residual's gradient to the attention output's: ``hook_attn_out``, the
        dropout, the sandwich norm."""
        g = self.drop_1.backward(self.hook_attn_out.backward(g))
        return g if self.ln_1_post is None else self.ln_1_post.backward(g)

    def _post_mlp_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.hook_mlp_out.backward(g)
        return g if self.ln_2_post is None else self.ln_2_post.backward(g)


class _DecodePlan:
    """A block's record for the compiled decoding step, the hook points the step passes by,
    its scratch widths ``(D, qkv, z, D, F, F)`` and the structure version it was made at (a
    replaced weight, parameter or module anywhere makes a new plan:
    :func:`attnlab.nn.module.structure_version`)."""

    __slots__ = ("points", "record", "version", "widths")

    def __init__(self, block: TransformerBlock) -> None:
        self.version = structure_version()
        self.record = block.decode_record()
        self.points = tuple(m for _, m in block.named_modules() if isinstance(m, HookPoint))
        self.widths = (0,) * 6
        if self.record is not None:
            attn, mlp = self.record[1], self.record[4]
            D, F = block.attn.embed_dim, mlp[0][0].shape[0]
            self.widths = (D, attn[0][0].shape[0], attn[4] * attn[6], D, F, F)

    def current(self) -> bool:
        return self.version == structure_version()


_SCRATCH = threading.local()  # the compiled step's scratch arrays, per thread, by (rows, widths)


_DECODE_KERNELS: list = []  # attnlab._decode_kernels, once imported


def _step_kernels():
    """:mod:`attnlab._decode_kernels` (imported on first use: it imports numba), or None
    where the compiled kernels are not there or turned off (:func:`attnlab.quant._kernels`)."""
    if _kernels() is None:
        return None
    if not _DECODE_KERNELS:
        from attnlab import _decode_kernels

        _DECODE_KERNELS.append(_decode_kernels)
    return _DECODE_KERNELS[0]


def _leaves(record):
    """The arrays of a decoding-step record (nested tuples)."""
    for item in record:
        if type(item) is tuple:
            yield from _leaves(item)
        elif type(item) is np.ndarray:
            yield item


class GatedFeedForward(Module):
    """The gated feed-forward network of Llama-style decoders (SwiGLU with ``"silu"``):
    ``down_proj(act(gate_proj(x)) * up_proj(x))``, Hugging Face's ``LlamaMLP`` (parameter
    names ``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``).

    Args:
        d_model: input and output width.
        d_ff: hidden width (``intermediate_size``).
        activation: ``"silu"`` (Llama, Mistral, Qwen), ``"gelu_tanh"`` (Gemma), ``"gelu"``
            or ``"relu"``.
        bias: biases in the three projections (``mlp_bias``).
        rng, dtype: initialisation and dtype of the parameters.

    Call with ``x`` ``(..., d_model)``; returns ``(..., d_model)``. In the forward pass the
    gate projection's output is what TransformerLens calls ``mlp.hook_pre``, the up
    projection's ``mlp.hook_pre_linear``, and ``act(gate) * up`` ``mlp.hook_post``.

    >>> ff = GatedFeedForward(4, 8, rng=np.random.default_rng(0))
    >>> sorted(ff.state_dict()), ff.hook_names()
    (['down_proj.weight', 'gate_proj.weight', 'up_proj.weight'], ['hook_pre', 'hook_pre_linear', 'hook_post'])
    >>> ff(np.ones((2, 4), np.float32)).shape
    (2, 4)
    """

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu", bias: bool = False,
                 rng=None, dtype=np.float32):
        super().__init__()
        rng = generator(rng)
        self.gate_proj = Linear(d_model, d_ff, bias, rng=rng, dtype=dtype)
        self.up_proj = Linear(d_model, d_ff, bias, rng=rng, dtype=dtype)
        self.down_proj = Linear(d_ff, d_model, bias, rng=rng, dtype=dtype)
        self.activation = activation
        self.act_fn = SiLU() if activation == "silu" else _gated_activation(activation)
        self.hook_pre = HookPoint()  # the gate projection's output
        self.hook_pre_linear = HookPoint()  # the up projection's output
        self.hook_post = HookPoint()  # act(gate) * up

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

    @property
    def d_model(self) -> int:
        """The input and output width."""
        return self.gate_proj.in_features

    def decode_record(self) -> tuple | None:
        """This network's slots for the compiled decoding step
        (:mod:`attnlab._decode_kernels`): ``(gate, up, down, activation)``, the three
        projections' products (:meth:`~attnlab.nn.Linear.decode_record`: quantized or float32)
        and the activation's code (0 SiLU, 1 GELU tanh, 2 GELU erf, 3 ReLU), or None where
        the step cannot compute it (other weights, adapters, another activation module, a
        subclass)."""
        act = self.act_fn
        code = _DECODE_ACTIVATIONS.get((type(act), getattr(act, "approximate", None)))
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        if type(self) is not GatedFeedForward or code is None or not (
                type(g) is type(u) is type(d) is Linear and g.in_features == u.in_features == d.out_features
                and g.out_features == u.out_features == d.in_features):
            return None
        products = (g.decode_record(), u.decode_record(), d.decode_record())
        return None if None in products else (*products, code)

    def forward(self, x: np.ndarray) -> np.ndarray:
        gate = self._pre(self.gate_proj(x))
        up = self._pre_linear(self.up_proj(x))
        if not self._keeping() and not self.hook_pre.hooked and type(gate) is np.ndarray and up is not gate:
            # Inference, the gate's projection fresh and seen by no hook: the activation and
            # the product overwrite it (no temporaries).
            act = self._activation_in_place(gate)
            if act is not None:
                return self.down_proj(self._post(np.multiply(act, up, out=act)))
        act = self.act_fn(gate)
        h = self._post(act * up)
        self._save(act=act, up=up)
        return self.down_proj(h)

    def _activation_in_place(self, gate: np.ndarray) -> np.ndarray | None:
        """``act_fn(gate)`` written over ``gate``, or None for an activation module of
        another kind. SmolLM2's prompt of 512 tokens (512 x 1536 float32, 2 threads, a
        2-core AVX-512 EPYC): 0.60-0.77 ms for the SiLU module and the product into new
        arrays, 0.41-0.47 ms in place."""
        act = self.act_fn
        if type(act) is SiLU:
            return F.silu(gate, out=gate)
        if type(act) is GELU:
            return F.gelu(gate, approximate=act.approximate, out=gate)
        if type(act) is ReLU:
            return np.maximum(gate, 0, out=gate)
        return None

    # The hook points on the hidden activations (one attribute test each when unhooked).
    def _pre(self, gate: np.ndarray) -> np.ndarray:
        return self.hook_pre(gate)

    def _pre_linear(self, up: np.ndarray) -> np.ndarray:
        return self.hook_pre_linear(up)

    def _post(self, h: np.ndarray) -> np.ndarray:
        return self.hook_post(h)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        c = self._saved()
        gh = self.hook_post.backward(self.down_proj.backward(grad_output))
        g_gate = self.hook_pre.backward(self.act_fn.backward(gh * c["up"]))
        gx = self.gate_proj.backward(g_gate)
        gx += self.up_proj.backward(self.hook_pre_linear.backward(gh * c["act"]))
        return gx


def _gated_activation(name: str) -> Module:
    """The activation module of a gated feed-forward network (not in place: its input is kept)."""
    if name not in ("gelu", "gelu_tanh", "relu"):
        raise ValueError(f"activation must be one of 'silu', 'gelu', 'gelu_tanh', 'relu', got {name!r}")
    return activation_layer(name)


from attnlab.nn.layers import SiLU  # noqa: E402  (the gated network's default activation)

#: the activation codes of the compiled decoding step (attnlab._decode_kernels._activate)
_DECODE_ACTIVATIONS = {(SiLU, None): 0, (GELU, "tanh"): 1, (GELU, "none"): 2, (ReLU, None): 3}

__all__ += ["GatedFeedForward"]
