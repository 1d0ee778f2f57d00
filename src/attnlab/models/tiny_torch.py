"""The PyTorch twin of :class:`~attnlab.models.TinyTransformer`, for tests and benchmarks.

Same architecture and the same ``state_dict`` keys, so weights move across with
``twin.load_state_dict({k: torch.from_numpy(v) ...})``. torch is imported inside
:func:`torch_tiny_transformer` only: it is a test oracle, never a dependency of attnlab.
"""

from __future__ import annotations

from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig

__all__ = ["copy_to_torch", "torch_tiny_transformer"]


def torch_tiny_transformer(config: TinyTransformerConfig):
    """A ``torch.nn.Module`` equivalent to ``TinyTransformer(config)`` (random weights).

    The module keeps ``config`` as ``attnlab_config``; :func:`attnlab.interop.from_torch`
    turns it back into a :class:`~attnlab.models.TinyTransformer`.
    """
    import torch
    from torch import nn

    dtype = {"float32": torch.float32, "float64": torch.float64}[str(config.dtype)]
    c = config
    act = {
        "gelu": lambda: nn.GELU(),
        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
        "relu": lambda: nn.ReLU(),
    }[c.activation]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(c.d_model)
            self.attn = nn.MultiheadAttention(
                c.d_model, c.n_heads, dropout=c.dropout, bias=c.bias, batch_first=True
            )
            self.drop_1 = nn.Dropout(c.dropout)
            self.ln_2 = nn.LayerNorm(c.d_model)
            layers = [nn.Linear(c.d_model, c.d_ff, c.bias), act(), nn.Linear(c.d_ff, c.d_model, c.bias)]
            if c.dropout > 0:
                layers.append(nn.Dropout(c.dropout))
            self.mlp = nn.Sequential(*layers)

        def forward(self, x, mask):
            h = self.ln_1(x)
            a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
            x = x + self.drop_1(a)
            return x + self.mlp(self.ln_2(x))

    class TorchTiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.attnlab_config = c  # what attnlab.interop.from_torch rebuilds the model from
            self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
            self.pos_emb = nn.Embedding(c.context_length, c.d_model)
            self.blocks = nn.ModuleList([Block() for _ in range(c.n_layers)])
            self.ln_f = nn.LayerNorm(c.d_model)
            self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

        def forward(self, ids):
            T = ids.shape[-1]
            mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=self.head.weight.dtype)
            x = self.tok_emb(ids) + self.pos_emb(torch.arange(T))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.ln_f(x))

    return TorchTiny().to(dtype)


def copy_to_torch(model: TinyTransformer, twin) -> None:
    """Load ``model``'s weights into its torch twin (keys must match exactly)."""
    import torch

    twin.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.state_dict().items()})
