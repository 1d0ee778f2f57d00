"""A tiny decoder-only transformer (GPT-style, pre-norm) built from attnlab's own layers.

``ids (B, T) -> token + position embeddings -> n_layers x TransformerBlock (causal)
-> LayerNorm -> Linear head -> logits (B, T, vocab_size)``.

It trains with attnlab's backward passes: ``forward`` in training mode, then
``backward(grad_logits)`` fills every parameter's ``.grad``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from attnlab._validation import float_dtype, generator, positive_int, probability, shape_error
from attnlab.nn.layers import Embedding, LayerNorm, TransformerBlock
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module

__all__ = ["TinyTransformer", "TinyTransformerConfig"]


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
        activation: ``"gelu"``, ``"gelu_tanh"`` or ``"relu"``.
        bias: biases in the linear layers (the LM head has none).
        dtype: ``"float32"`` or ``"float64"``.
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "d_ff"):
            positive_int(getattr(self, name), name)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        probability(self.dropout, "dropout")
        float_dtype(self.dtype)

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


class TinyTransformer(Module):
    """A small causal language model; parameter names follow the attribute layout
    (``tok_emb.weight``, ``pos_emb.weight``, ``blocks.0.attn.in_proj_weight``, …,
    ``ln_f.weight``, ``head.weight``).

    Args:
        config: the :class:`TinyTransformerConfig`.
        rng: Generator for the initial weights (and dropout).
        attention_fn: passed to every :class:`~attnlab.MultiheadAttention` (a faster
            kernel with :func:`attnlab.scaled_dot_product_attention`'s signature).

    >>> cfg = TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32)
    >>> model = TinyTransformer(cfg, rng=np.random.default_rng(0))
    >>> model(np.zeros((2, 8), dtype=np.int64)).shape
    (2, 8, 10)
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
        self.pos_emb = Embedding(c.context_length, c.d_model, rng=rng, dtype=dtype)
        # torch's N(0, 1) embeddings: on recall they train far faster than GPT-2's N(0, 0.02)
        # (distinct positions from the start help the previous-token head form).
        self.blocks = Module()
        for i in range(c.n_layers):
            block = TransformerBlock(
                c.d_model, c.n_heads, c.d_ff, dropout=c.dropout, activation=c.activation,
                causal=True, bias=c.bias, attention_fn=attention_fn, rng=rng, dtype=dtype,
            )
            setattr(self.blocks, str(i), block)
        self.ln_f = LayerNorm(c.d_model, dtype=dtype)
        self.head = Linear(c.d_model, c.vocab_size, bias=False, rng=rng, dtype=dtype)

    @property
    def layers(self) -> list[TransformerBlock]:
        return list(self.blocks._modules.values())

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """``ids (B, T)`` or ``(T,)`` integer tokens -> ``logits (B, T, vocab_size)``."""
        ids = np.asarray(ids)
        if ids.ndim not in (1, 2):
            raise shape_error("ids", ids.shape, "(B, T) or (T,)")
        T = ids.shape[-1]
        if not 1 <= T <= self.config.context_length:
            raise shape_error(
                "ids", ids.shape, f"(B, T) with 1 <= T <= context_length={self.config.context_length}"
            )
        x = self.tok_emb(ids) + self.pos_emb(np.arange(T))
        for block in self.layers:
            x = block(x)
        return self.head(self.ln_f(x))

    def backward(self, grad_logits: np.ndarray) -> None:
        """Fill ``.grad`` of every parameter from ``dLoss/dlogits`` (ids have no gradient)."""
        g = self.ln_f.backward(self.head.backward(grad_logits))
        for block in reversed(self.layers):
            g = block.backward(g)
        self.tok_emb.backward(g)
        # Positions are the same for every sequence: sum over the batch axis first.
        self.pos_emb.backward(g.reshape(-1, *g.shape[-2:]).sum(axis=0))

    def inspect(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Everything the explain views show for one sequence ``ids (T,)`` (eval mode; the
        training mode is restored after): ``attentions (n_layers, n_heads, T, T)``,
        ``static (T, d_model)`` (token + position embeddings), ``contextual (T, d_model)``
        (after the final LayerNorm) and ``logits (T, vocab_size)``."""
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise shape_error("ids", ids.shape, "(T,)")
        was_training = self.training
        self.eval()
        blocks = self.layers
        try:
            for b in blocks:
                object.__setattr__(b, "keep_weights", True)
            x = static = self.tok_emb(ids) + self.pos_emb(np.arange(len(ids)))
            for block in blocks:
                x = block(x)
            contextual = self.ln_f(x)
            return {
                "attentions": np.stack([b.last_weights for b in blocks]),
                "static": static,
                "contextual": contextual,
                "logits": self.head(contextual),
            }
        finally:
            for b in blocks:
                object.__setattr__(b, "keep_weights", False)
                object.__setattr__(b, "last_weights", None)
            self.train(was_training)

    def attention_maps(self, ids: np.ndarray) -> np.ndarray:
        """Per-head attention weights of one sequence: ``ids (T,)`` -> ``(n_layers, n_heads,
        T, T)``, rows summing to 1 (see :meth:`inspect`)."""
        return self.inspect(ids)["attentions"]

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"vocab_size={c.vocab_size}, context_length={c.context_length}, d_model={c.d_model}, "
            f"n_heads={c.n_heads}, n_layers={c.n_layers}, d_ff={c.d_ff}"
        )
