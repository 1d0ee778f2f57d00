"""A tiny decoder-only transformer (pre-norm) built from attnlab's own layers.

GPT-style by default: ``ids (B, T) -> token + learned position embeddings -> n_layers x
TransformerBlock (causal) -> LayerNorm -> Linear head -> logits (B, T, vocab_size)``.
Llama-style with :meth:`TinyTransformerConfig.llama` (or the fields one at a time): rotary
positions in every attention instead of learned ones, RMSNorm instead of LayerNorm, a gated
feed-forward network (SwiGLU) instead of the GELU MLP, and grouped-query heads
(``n_kv_heads`` key/value heads shared by the ``n_heads`` query heads).

It trains with attnlab's backward passes: ``forward`` in training mode, then
``backward(grad_logits)`` fills every parameter's ``.grad``. With a key/value cache
(:meth:`TinyTransformer.new_cache`) it decodes incrementally: each call feeds only the new
tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from attnlab._validation import float_dtype, generator, layer_number, positive_int, probability, shape_error
from attnlab.core._namespace import to_host
from attnlab.models.decoder import CausalLM
from attnlab.models.generate import embed_tokens, embed_tokens_backward
from attnlab.nn.attention import Attention, KVCache
from attnlab.nn.blocks import GatedFeedForward, TransformerBlock
from attnlab.nn.hooks import HookPoint, record_layers
from attnlab.nn.layers import Embedding, LayerNorm, RMSNorm, RotaryEmbedding
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module
from attnlab.trace import Trace, trace_model

__all__ = ["TinyTransformer", "TinyTransformerConfig"]

POSITIONS = ("learned", "rotary")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("standard", "gated")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


@dataclass(frozen=True)
class TinyTransformerConfig:
    """The shape of a :class:`TinyTransformer`.

    Attributes:
        vocab_size: number of token ids.
        context_length: the longest sequence (number of position embeddings).
        d_model: width of the residual stream.
        n_heads: attention heads per layer (must divide ``d_model``).
        n_layers: number of transformer blocks.
        d_ff: hidden width of each feed-forward network.
        dropout: dropout probability (attention weights, residual branches, MLP).
        activation: ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``; with ``mlp="gated"`` also
            ``"silu"`` (SwiGLU).
        bias: biases in the linear layers (the LM head has none).
        dtype: ``"float32"`` or ``"float64"``.
        position: ``"learned"`` (position embeddings added to the tokens) or ``"rotary"``
            (queries and keys rotated in every attention, Hugging Face's split-halves
            convention; no position embeddings).
        rope_theta: the rotary embedding's base.
        norm: ``"layernorm"`` or ``"rmsnorm"`` (the blocks' norms and the final one).
        norm_eps: the norms' ``eps``.
        mlp: ``"standard"`` (``Linear -> activation -> Linear``) or ``"gated"``
            (``down(act(gate(x)) * up(x))``, :class:`~attnlab.nn.GatedFeedForward`; no
            dropout inside).
        n_kv_heads: key/value heads (divides ``n_heads``; 1 is multi-query attention;
            None: ``n_heads``).

    The defaults are the GPT-style model (and read every checkpoint written before the
    other arrangements existed). :meth:`llama` gives the Llama-style one:

    >>> c = TinyTransformerConfig.llama(n_heads=4)
    >>> c.position, c.norm, c.mlp, c.activation, c.kv_heads, c.bias
    ('rotary', 'rmsnorm', 'gated', 'silu', 2, False)
    """

    vocab_size: int = 32
    context_length: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    dropout: float = 0.0
    activation: str = "relu"
    bias: bool = True
    dtype: str = "float32"
    position: str = "learned"
    rope_theta: float = 10000.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "standard"
    n_kv_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "d_ff"):
            positive_int(getattr(self, name), name)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        probability(self.dropout, "dropout")
        float_dtype(self.dtype)
        for name, allowed in (("position", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        acts = GATED_ACTIVATIONS if self.mlp == "gated" else ACTIVATIONS
        if self.activation not in acts:
            raise ValueError(f"activation must be one of {', '.join(map(repr, acts))} with mlp={self.mlp!r}, "
                             f"got {self.activation!r}")
        if self.n_kv_heads is not None:
            positive_int(self.n_kv_heads, "n_kv_heads")
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if self.position == "rotary":
            head_dim = self.d_model // self.n_heads
            if head_dim % 2:
                raise ValueError(f"rotary positions need an even head size, got d_model / n_heads = "
                                 f"{self.d_model} / {self.n_heads} = {head_dim}")
            if self.rope_theta <= 1:
                raise ValueError(f"rope_theta must be > 1, got {self.rope_theta!r}")

    @classmethod
    def llama(cls, **overrides) -> TinyTransformerConfig:
        """The Llama-style arrangement: rotary positions, RMSNorm (``eps`` 1e-6), a SwiGLU
        feed-forward network, no biases and grouped-query heads (``n_kv_heads`` half of
        ``n_heads`` when that is even, else ``n_heads``); ``overrides`` set any field.

        >>> TinyTransformerConfig.llama(n_heads=3, d_model=48).kv_heads
        3
        """
        H = overrides.get("n_heads", cls.n_heads)
        preset = dict(position="rotary", norm="rmsnorm", norm_eps=1e-6, mlp="gated", activation="silu",
                      bias=False, n_kv_heads=H // 2 if isinstance(H, int) and H % 2 == 0 else None)
        return cls(**{**preset, **overrides})

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads (``n_kv_heads``, or ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def arrangement(self) -> str:
        """``"gpt"`` for the default arrangement, ``"llama"`` for :meth:`llama`'s, else
        ``"custom"``."""
        if (self.position, self.norm, self.mlp, self.n_kv_heads) == ("learned", "layernorm", "standard", None):
            return "gpt"
        if (self.position, self.norm, self.mlp, self.activation, self.bias) == \
                ("rotary", "rmsnorm", "gated", "silu", False):
            return "llama"
        return "custom"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TinyTransformerConfig:
        """Build from a dict (e.g. a checkpoint's), rejecting unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TinyTransformerConfig fields {unknown}")
        return cls(**d)


class TinyTransformer(CausalLM):
    """A small causal language model: the shared decoder (:class:`~attnlab.models.decoder.CausalLM`:
    forward, backward, cache, generation, hooks) in the arrangement its config gives.
    Parameter names follow the attribute layout
    (``tok_emb.weight``, ``pos_emb.weight``, ``blocks.0.attn.in_proj_weight``, …,
    ``ln_f.weight``, ``head.weight``). Llama-style (rotary positions) it has no
    ``pos_emb``, its fused ``in_proj_weight`` holds ``n_heads`` query heads then
    ``n_kv_heads`` key and value heads, and its gated MLP ``mlp.gate_proj.weight``,
    ``mlp.up_proj.weight``, ``mlp.down_proj.weight``; its attention hook points include
    ``hook_rot_q`` and ``hook_rot_k``.

    Args:
        config: the :class:`TinyTransformerConfig`.
        rng: Generator for the initial weights (and dropout).
        attention_fn: passed to every :class:`~attnlab.MultiheadAttention` (a faster
            kernel with :func:`attnlab.scaled_dot_product_attention`'s signature).

    >>> cfg = TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32)
    >>> model = TinyTransformer(cfg, rng=np.random.default_rng(0))
    >>> model(np.zeros((2, 8), dtype=np.int64)).shape
    (2, 8, 10)
    >>> llama = TinyTransformer(TinyTransformerConfig.llama(vocab_size=10, context_length=8, d_model=16, d_ff=32))
    >>> llama.layers[0].attn.num_kv_heads, llama(np.zeros((2, 8), dtype=np.int64)).shape
    (2, (2, 8, 10))
    """

    def __init__(self, config: TinyTransformerConfig, *, rng=None, attention_fn=None):
        super().__init__()
        if not isinstance(config, TinyTransformerConfig):
            raise TypeError(f"config must be a TinyTransformerConfig, got {type(config).__name__}")
        rng = generator(rng)
        c = config
        dtype = float_dtype(c.dtype)
        object.__setattr__(self, "config", c)
        self.tok_emb = Embedding(c.vocab_size, c.d_model, rng=rng, dtype=dtype)
        if c.position == "learned":
            self.pos_emb = Embedding(c.context_length, c.d_model, rng=rng, dtype=dtype)
        self.hook_embed = HookPoint()
        if c.position == "learned":
            self.hook_pos_embed = HookPoint()
        # torch's N(0, 1) embeddings: on recall they train far faster than GPT-2's N(0, 0.02)
        # (distinct positions from the start help the previous-token head form).
        self.blocks = Module()
        for i in range(c.n_layers):
            parts = self._parts(rng, dtype, attention_fn)  # None: the block's default part
            block = TransformerBlock(
                c.d_model, c.n_heads, c.d_ff, dropout=c.dropout, activation=c.activation,
                causal=True, bias=c.bias, norm_first=True, layer_norm_eps=c.norm_eps,
                attention_fn=attention_fn, rng=rng, dtype=dtype, **parts,
            )
            setattr(self.blocks, str(i), block)
        self.ln_f = self._norm(dtype) or LayerNorm(c.d_model, c.norm_eps, dtype=dtype)
        self.head = Linear(c.d_model, c.vocab_size, bias=False, rng=rng, dtype=dtype)

    def _norm(self, dtype) -> RMSNorm | None:
        c = self.config
        return RMSNorm(c.d_model, c.norm_eps, dtype=dtype) if c.norm == "rmsnorm" else None

    def _parts(self, rng, dtype, attention_fn) -> dict[str, Module | None]:
        """A block's parts that differ from TransformerBlock's defaults (in the order the
        block would build them, so the default arrangement draws the same weights)."""
        c = self.config
        attn = None
        if c.position == "rotary" or c.kv_heads != c.n_heads:
            rotary = RotaryEmbedding(c.d_model // c.n_heads, theta=float(c.rope_theta)) \
                if c.position == "rotary" else None
            attn = Attention(
                c.d_model, c.n_heads, num_kv_heads=c.kv_heads, dropout=c.dropout, bias=c.bias,
                rotary=rotary, causal=True, rng=rng, dtype=dtype, attention_fn=attention_fn,
            )
        mlp = GatedFeedForward(c.d_model, c.d_ff, activation=c.activation, bias=c.bias, rng=rng, dtype=dtype) \
            if c.mlp == "gated" else None
        return {"attn": attn, "mlp": mlp, "ln_1": self._norm(dtype), "ln_2": self._norm(dtype)}

    tokenizer = None
    _ids_name = "ids"

    @property
    def max_positions(self) -> int:
        """The longest sequence the model takes (``context_length``)."""
        return self.config.context_length

    @property
    def W_U(self) -> np.ndarray:
        """The unembedding ``(d_model, vocab_size)``: ``logits = h @ W_U``."""
        return self.head.weight.data.T

    @property
    def _out_param(self):
        return self.head.weight

    def _check_ids(self, ids, past: int = 0) -> np.ndarray:
        ids = to_host(ids)  # another library's ids (on any device): a host copy
        if ids.ndim not in (1, 2):
            raise shape_error("ids", ids.shape, "(B, T) or (T,)")
        T, n = ids.shape[-1], self.config.context_length
        if not 1 <= past + T <= n or T < 1:
            need = f"(B, T) with 1 <= T <= context_length={n}"
            if past:
                need += f" - {past} cached tokens"
            raise shape_error("ids", ids.shape, need)
        return ids

    def _embed(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # positions (T,) are shared by the batch, (B, T) are per sequence (a padded batch)
        if self.config.position == "rotary":  # positions enter in every attention
            return self.hook_embed(self.tok_emb(ids))
        return embed_tokens(self.tok_emb, self.pos_emb, self.hook_embed, self.hook_pos_embed, ids, positions)

    def forward(
        self,
        ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        *,
        cache: list[KVCache] | None = None,
        logits_to_keep: int | None = None,
    ) -> np.ndarray:
        """``ids (B, T)`` or ``(T,)`` integer tokens -> ``logits (B, T, vocab_size)``.

        With ``cache`` (from :meth:`new_cache`) ``ids`` are the tokens after those already
        cached: their positions continue from there, their keys and values are appended,
        and the logits equal those of the whole sequence run at once. No backward pass
        through a cached call. ``attention_mask`` ``(B, P + T)`` (1 = real token, the
        ``P`` cached ones included) leaves padding out and numbers positions over the real
        tokens; ``logits_to_keep`` keeps only the last positions' logits (see
        :func:`attnlab.models.generate.decoder_forward`).

        >>> cfg = TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32)
        >>> model = TinyTransformer(cfg, rng=np.random.default_rng(0)).eval()
        >>> ids = np.array([[1, 2, 3, 4]])
        >>> cache = model.new_cache()
        >>> step = [model(ids[:, :3], cache=cache), model(ids[:, 3:], cache=cache)]
        >>> bool(np.abs(np.concatenate(step, axis=1) - model(ids)).max() < 1e-5)
        True
        """
        return self._run(ids, attention_mask, cache, logits_to_keep)

    def _embed_backward(self, g: np.ndarray) -> None:
        if self.config.position == "rotary":
            self.tok_emb.backward(self.hook_embed.backward(g))
        else:
            embed_tokens_backward(self.tok_emb, self.pos_emb, self.hook_embed, self.hook_pos_embed, g)

    def _one_sequence(self, ids) -> np.ndarray:
        ids = self._check_ids(ids)
        if ids.ndim != 1:
            raise shape_error("ids", ids.shape, "(T,)")
        return ids

    def inspect(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Everything the explain views show for one sequence ``ids (T,)`` (eval mode; the
        training mode is restored after): ``attentions (n_layers, n_heads, T, T)`` (the
        blocks' attention maps), ``static (T, d_model)`` (token + position embeddings),
        ``contextual (T, d_model)`` (after the final LayerNorm) and
        ``logits (T, vocab_size)``."""
        ids = self._one_sequence(ids)
        was_training = self.training
        self.eval()
        try:
            logits, hidden, maps = record_layers(self, lambda: self(ids))
            return {
                "attentions": maps,
                "static": hidden[0],
                "contextual": self.ln_f(hidden[-1]),  # what the output layer read
                "logits": logits,
            }
        finally:
            self.train(was_training)

    def attention_maps(self, ids: np.ndarray) -> np.ndarray:
        """Per-head attention weights of one sequence: ``ids (T,)`` -> ``(n_layers, n_heads,
        T, T)``, rows summing to 1 (see :meth:`inspect`)."""
        return self.inspect(ids)["attentions"]

    def trace(
        self, ids: np.ndarray, *, layer: int = -1, head: int | None = None, tokens=None
    ) -> Trace:
        """The step-by-step :class:`~attnlab.Trace` of block ``layer``'s attention on one
        sequence ``ids (T,)``.

        Args:
            ids: ``(T,)`` token ids.
            layer: ``1..n_layers`` (the block whose attention is traced), negatives from
                the end; 0 (the embeddings) has no attention.
            head: keep only this head's per-head steps (``None``: every head).
            tokens: ``T`` labels (default: the ids as text).

        >>> cfg = TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32)
        >>> model = TinyTransformer(cfg, rng=np.random.default_rng(0))
        >>> t = model.trace(np.array([1, 2, 3]), layer=1, head=0)
        >>> t.layer, t.head, t.get("weights", 0).shape
        (1, 0, (3, 3))
        """
        ids = self._one_sequence(ids)
        k = layer_number(layer, self.config.n_layers, embeddings=False)
        tokens = [str(int(i)) for i in ids] if tokens is None else tokens
        was_training = self.training
        self.eval()
        try:
            return trace_model(self, k, lambda: self(ids), tokens=tokens, head=head)
        finally:
            self.train(was_training)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"vocab_size={c.vocab_size}, context_length={c.context_length}, d_model={c.d_model}, "
            f"n_heads={c.n_heads}, n_layers={c.n_layers}, d_ff={c.d_ff}"
            + ("" if c.arrangement == "gpt" else
               f", n_kv_heads={c.kv_heads}, position={c.position!r}, norm={c.norm!r}, mlp={c.mlp!r}")
        )
