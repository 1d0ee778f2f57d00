"""The compiled decoding step of a Llama-family model whose block weights are kept quantized.

:meth:`attnlab.models.llama.Llama.forward` with a cache and one new token per row runs here
instead of through the modules when nothing would tell the two apart: every block's
projections are :class:`~attnlab.quant.QuantizedTensor` weights (``from_pretrained(...,
quantized=True)``), numba is there (the ``fast`` extra; not turned off by
``ATTNLAB_NO_NUMBA=1`` or ``tuned(fused=False)``), the call may take a fused inference kernel
(:func:`attnlab.nn._context.may_fuse`: eval mode, no backward hooks, no hook function attached
anywhere in the model), and the blocks have the plain Llama shape (RMSNorm without unit offset, SiLU-gated
feed-forward, rotary positions, no soft-capping, the default attention function, no
dropout). QK-norm (Qwen3), biases (Qwen2), sliding windows (Mistral), grouped-query heads
and a left-padded batch (``attention_mask``) are handled. Anything else, and every call
that is not a single new token after a non-empty cache, takes the module path, which
also raises every error about bad input.

Each block is one call of :func:`attnlab._decode_kernels.decode_layer`; the embedding, the
final norm and the unembedding stay the modules' (the unembedding is one quantized product).
The result equals the module path's to float32 round-off (a test holds the two within 1e-4
over a whole generation).
"""

from __future__ import annotations

import numpy as np

from attnlab.models.generate import check_attention_mask, check_token_ids
from attnlab.nn._context import may_fuse
from attnlab.nn.attention import Attention, KVCache
from attnlab.nn.blocks import GatedFeedForward
from attnlab.nn.hooks import HookPoint
from attnlab.nn.layers import RMSNorm, RotaryEmbedding
from attnlab.nn.module import structure_version
from attnlab.quant import _kernels, _set_threads, is_quantized

#: kernel code of each quantized type (:func:`attnlab._decode_kernels._product`)
_KIND = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
_NONE = np.empty(0, dtype=np.float32)  # "no bias", "no norm"
_NO_MASK = np.ones((0, 0), dtype=np.bool_)


def decode_step(model, input_ids, attention_mask, cache) -> np.ndarray | None:
    """The logits ``(N, 1, V)`` of one new token per row of ``input_ids (N, 1)`` after the
    cached ones, through the compiled step; None where the step does not apply (the caller
    then runs the modules)."""
    if cache is None or not may_fuse(model.training) or type(input_ids) is not np.ndarray or input_ids.ndim != 2 \
            or input_ids.shape[1] != 1 or input_ids.dtype.kind not in "iu":
        return None
    plan = model.__dict__.get("_decode_plan")
    if plan is None or not plan.current(model):
        plan = _Plan.build(model)
        object.__setattr__(model, "_decode_plan", plan)
    if not plan.eligible or _kernels() is None or not may_fuse(model.training, plan.hooks):
        return None
    return plan.step(model, input_ids, attention_mask, cache)


def _weight(linear_weight, bias) -> tuple:
    w = linear_weight
    b = _NONE if bias is None else bias
    return (w.codes, w.scales, w.scales if w.mins is None else w.mins, _KIND[w.kind], b)


class _Plan:
    """What the step needs of a model, gathered once, and what it was gathered from (so a
    replaced weight or module rebuilds it)."""

    def __init__(self, eligible: bool, parts: tuple = (), datas: tuple = (), hooks: tuple = (), layers=(),
                 rotary=None, shape=(0, 0, 0), scale: float = 0.0, windows: tuple = (), n_positions: int = 0):
        self.version = structure_version()
        self.eligible, self.parts, self.datas, self.hooks = eligible, parts, datas, hooks
        self.layers, self.rotary, self.shape, self.scale = layers, rotary, shape, scale
        self.windows, self.n_positions = windows, n_positions

    def current(self, model) -> bool:
        """Whether the model still has the modules and weights this plan was built from."""
        if self.version != structure_version():  # a module somewhere gained or lost a part
            return False
        blocks = model.layers
        if len(blocks) * 4 != len(self.parts):
            return False
        parts = self.parts
        for i, b in enumerate(blocks):
            j = 4 * i
            if b.attn is not parts[j] or b.mlp is not parts[j + 1] or b.ln_1 is not parts[j + 2] \
                    or b.ln_2 is not parts[j + 3]:
                return False
        return all(p.data is d for p, d in self.datas)

    @classmethod
    def build(cls, model) -> _Plan:
        from attnlab.core import scaled_dot_product_attention
        from attnlab.models.llama import Llama

        blocks = model.layers
        parts = tuple(m for b in blocks for m in (b.attn, b.mlp, b.ln_1, b.ln_2))
        params = [p for b in blocks for _, p in b.named_parameters()]
        no = cls(False, parts, tuple((p, p.data) for p in params))
        if type(model)._embed is not Llama._embed or model.dtype != np.float32 or not blocks:
            return no
        rope = None
        layers = []
        for b in blocks:
            a, mlp = b.attn, b.mlp
            norms = [b.ln_1, b.ln_2] + ([a.q_norm, a.k_norm] if a.q_norm is not None else [])
            if not (b.norm_first and b.ln_1_post is None and b.ln_2_post is None and b.drop_1.p == 0.0
                    and type(a) is Attention and a._qkv_same_embed_dim and a.softcap is None and a.dropout == 0.0
                    and a.attention_fn is scaled_dot_product_attention and a.causal and b.causal
                    and type(a.rotary) is RotaryEmbedding
                    and type(mlp) is GatedFeedForward and mlp.activation == "silu"
                    and all(type(n) is RMSNorm and n.weight is not None and not n.add_unit_offset for n in norms)):
                return no
            rope = rope or a.rotary
            if a.rotary.config != rope.config:
                return no
            ws = (a.in_proj_weight, a.out_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                  mlp.down_proj.weight)
            if not all(is_quantized(w.data) for w in ws):
                return no
            biases = (a.in_proj_bias, a.out_proj.bias, mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias)
            read = {id(p) for p in (*ws, *biases, *(n.weight for n in norms)) if p is not None}
            if any(id(p) not in read for p in b.parameters()):  # a part the step would not compute (adapters)
                return no
            args = [b.ln_1.weight.data, np.float32(b.ln_1.eps), b.ln_2.weight.data, np.float32(b.ln_2.eps)]
            for w, bias in zip(ws, biases, strict=True):
                args.extend(_weight(w.data, None if bias is None else bias.data))
            qk = (a.q_norm.weight.data, np.float32(a.q_norm.eps), a.k_norm.weight.data, np.float32(a.k_norm.eps)) \
                if a.q_norm is not None else (_NONE, np.float32(0), _NONE, np.float32(0))
            layers.append((tuple(args), qk))
        floats = [arr for args, qk in layers for arr in (args[0], args[2], *args[8::5], qk[0], qk[2])]
        if any(type(arr) is not np.ndarray or arr.dtype != np.float32 or arr.ndim != 1 or not arr.flags.c_contiguous
               for arr in floats):  # norm weights and biases (the quantized weights are checked on creation)
            return no
        a0 = blocks[0].attn
        hooks = tuple(m for _, m in model.named_modules() if isinstance(m, HookPoint))
        scale = 1.0 / np.sqrt(a0.head_dim) if a0.scale is None else a0.scale
        return cls(True, parts, no.datas, hooks, layers, rope, (a0.num_heads, a0.num_kv_heads, a0.head_dim),
                   np.float32(scale), tuple(b.attn.sliding_window for b in blocks), model.max_positions)

    def step(self, model, ids, attention_mask, cache) -> np.ndarray | None:
        from attnlab._decode_kernels import decode_layer

        N = ids.shape[0]
        H, Hkv, Dh = self.shape
        if not isinstance(cache, list | tuple) or len(cache) != len(self.layers):
            return None
        past = cache[0].length if type(cache[0]) is KVCache else 0
        if past == 0 or past + 1 > self.n_positions:
            return None
        for c in cache:
            k = c._key if type(c) is KVCache else None
            if k is None or c.length != past or type(k) is not np.ndarray or k.dtype != np.float32 \
                    or k.shape[0] != N or k.shape[1] != Hkv or k.shape[3] != Dh or not k.flags.c_contiguous:
                return None
        check_token_ids(ids, model.config.vocab_size)
        mask = check_attention_mask(attention_mask, (N, past + 1))
        if mask is None:
            positions = np.full((N, 1), past)
            key_mask = _NO_MASK
        else:
            if not mask[:, -1].all():  # a new token that takes no part: the modules decide
                return None
            positions = mask.sum(axis=1, keepdims=True) - 1
            key_mask = np.ascontiguousarray(mask)
        cos, sin = self.rotary.cos_sin(positions)
        cos, sin = np.ascontiguousarray(cos.reshape(N, -1)), np.ascontiguousarray(sin.reshape(N, -1))
        h = np.array(model._embed(ids, positions).reshape(N, -1), dtype=np.float32, order="C")
        D, F = h.shape[1], self.layers[0][0][14].shape[0]  # the width and the gate's rows
        xn, o = np.empty((N, D), np.float32), np.empty((N, D), np.float32)
        qkv = np.empty((N, (H + 2 * Hkv) * Dh), np.float32)
        z = np.empty((N, H * Dh), np.float32)
        gate, up = np.empty((N, F), np.float32), np.empty((N, F), np.float32)
        _set_threads()
        for (args, qk), c, window in zip(self.layers, cache, self.windows, strict=True):
            c._reserve(1, c._key, c._value)
            slot = c.length
            c.length += 1
            start = 0 if window is None else max(0, slot + 1 - window)
            decode_layer(h, *args, *qk, cos, sin, c._key, c._value, slot, start, key_mask, H, Hkv, Dh, self.scale,
                         xn, qkv, z, o, gate, up)
        return model._logits(h[:, None, :])
