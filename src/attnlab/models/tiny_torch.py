"""The PyTorch twin of :class:`~attnlab.models.TinyTransformer`, for tests and benchmarks.

Same architecture (GPT-style or Llama-style, as the config says) and the same
``state_dict`` keys, so weights move across with
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
        "silu": lambda: nn.SiLU(),
    }[c.activation]
    rotary = c.position == "rotary"
    plain_attention = not rotary and c.kv_heads == c.n_heads  # torch's own MultiheadAttention
    H, Hkv, Dh = c.n_heads, c.kv_heads, c.d_model // c.n_heads

    def norm():
        if c.norm == "rmsnorm":
            return nn.RMSNorm(c.d_model, eps=c.norm_eps)
        return nn.LayerNorm(c.d_model, eps=c.norm_eps)

    def rotate(x, cos, sin):  # Hugging Face's split halves: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Attention(nn.Module):
        """Grouped-query causal attention with a fused in-projection (q heads, then k, v)."""

        def __init__(self):
            super().__init__()
            self.in_proj_weight = nn.Parameter(torch.empty((H + 2 * Hkv) * Dh, c.d_model))
            nn.init.xavier_uniform_(self.in_proj_weight)
            self.in_proj_bias = nn.Parameter(torch.zeros((H + 2 * Hkv) * Dh)) if c.bias else None
            self.out_proj = nn.Linear(H * Dh, c.d_model, bias=c.bias)

        def forward(self, x, mask, cos_sin):
            B, T, _ = x.shape
            qkv = nn.functional.linear(x, self.in_proj_weight, self.in_proj_bias)
            q, k, v = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
            q = q.view(B, T, H, Dh).transpose(1, 2)
            k = k.view(B, T, Hkv, Dh).transpose(1, 2)
            v = v.view(B, T, Hkv, Dh).transpose(1, 2)
            if cos_sin is not None:
                q, k = rotate(q, *cos_sin), rotate(k, *cos_sin)
            z = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=c.dropout if self.training else 0.0, enable_gqa=Hkv != H)
            return self.out_proj(z.transpose(1, 2).reshape(B, T, H * Dh))

    class GatedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(c.d_model, c.d_ff, c.bias)
            self.up_proj = nn.Linear(c.d_model, c.d_ff, c.bias)
            self.down_proj = nn.Linear(c.d_ff, c.d_model, c.bias)
            self.act = act()

        def forward(self, x):
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = norm()
            if plain_attention:
                self.attn = nn.MultiheadAttention(
                    c.d_model, c.n_heads, dropout=c.dropout, bias=c.bias, batch_first=True
                )
            else:
                self.attn = Attention()
            self.drop_1 = nn.Dropout(c.dropout)
            self.ln_2 = norm()
            if c.mlp == "gated":
                self.mlp = GatedMLP()
            else:
                layers = [nn.Linear(c.d_model, c.d_ff, c.bias), act(), nn.Linear(c.d_ff, c.d_model, c.bias)]
                if c.dropout > 0:
                    layers.append(nn.Dropout(c.dropout))
                self.mlp = nn.Sequential(*layers)

        def forward(self, x, mask, cos_sin=None):
            h = self.ln_1(x)
            if plain_attention:
                a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
            else:
                a = self.attn(h, mask, cos_sin)
            x = x + self.drop_1(a)
            return x + self.mlp(self.ln_2(x))

    class TorchTiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.attnlab_config = c  # what attnlab.interop.from_torch rebuilds the model from
            self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
            if not rotary:
                self.pos_emb = nn.Embedding(c.context_length, c.d_model)
            self.blocks = nn.ModuleList([Block() for _ in range(c.n_layers)])
            self.ln_f = norm()
            self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)

        def forward(self, ids):
            T = ids.shape[-1]
            dt = self.head.weight.dtype
            mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=dt)
            cos_sin = None
            if rotary:  # transformers' float32 frequencies and angles; cos/sin in float64, rounded
                # once to float32 for a float32 model (attnlab.core.rotary.rope_cos_sin)
                inv = 1.0 / (float(c.rope_theta) ** (torch.arange(0, Dh, 2, dtype=torch.int64).float() / Dh))
                angles = torch.arange(T).float()[:, None] * inv[None, :]
                angles = torch.cat((angles, angles), dim=-1).double()
                cos_sin = tuple(a if dt == torch.float64 else a.float().to(dt) for a in (angles.cos(), angles.sin()))
                x = self.tok_emb(ids)
            else:
                x = self.tok_emb(ids) + self.pos_emb(torch.arange(T))
            for block in self.blocks:
                x = block(x, mask, cos_sin)
            return self.head(self.ln_f(x))

    return TorchTiny().to(dtype)


def copy_to_torch(model: TinyTransformer, twin) -> None:
    """Load ``model``'s weights into its torch twin (keys must match exactly)."""
    import torch

    twin.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.state_dict().items()})
