"""Move layers and models between attnlab and PyTorch (torch is imported here, only when called).

A model exported with :func:`to_torch` is an ordinary ``torch.nn.Module`` with attnlab's
``state_dict`` names: it trains with torch's optimizers and, across processes or machines,
with ``torch.nn.parallel.DistributedDataParallel``; :func:`from_torch` brings the trained
weights back.

>>> import numpy as np, attnlab
>>> layer = attnlab.MultiheadAttention(8, 2, rng=np.random.default_rng(0))
>>> torch_mha = to_torch(layer)                 # a torch.nn.MultiheadAttention
>>> back = from_torch(torch_mha)
>>> all(np.array_equal(a, b) for a, b in zip(layer.state_dict().values(), back.state_dict().values()))
True
"""

from __future__ import annotations

import numpy as np

from attnlab.models.tiny import TinyTransformer, TinyTransformerConfig
from attnlab.models.tiny_torch import torch_tiny_transformer
from attnlab.nn.attention import MultiheadAttention, SelfAttention
from attnlab.nn.linear import Linear
from attnlab.nn.module import Module

_TORCH_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}


def _torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("attnlab.interop needs PyTorch: pip install torch==2.13.0") from exc
    return torch


def _torch_self_attention_class():
    """A torch module equal to :class:`attnlab.SelfAttention` (seed 004's class)."""
    torch = _torch()

    class TorchSelfAttention(torch.nn.Module):
        def __init__(self, d_in, d_out, qkv_bias=False):
            super().__init__()
            self.d_in, self.d_out = d_in, d_out
            self.W_q = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_k = torch.nn.Linear(d_in, d_out, bias=qkv_bias)
            self.W_v = torch.nn.Linear(d_in, d_out, bias=qkv_bias)

        def forward(self, x):
            q, k, v = self.W_q(x), self.W_k(x), self.W_v(x)
            weights = torch.softmax(q @ k.transpose(-2, -1) / self.d_out**0.5, dim=-1)
            return weights @ v, weights

    return TorchSelfAttention


def _mha_config(mha) -> dict:
    """Constructor arguments of a MultiheadAttention, attnlab's or torch's (same attributes)."""
    return dict(
        embed_dim=mha.embed_dim,
        num_heads=mha.num_heads,
        dropout=mha.dropout,
        bias=mha.in_proj_bias is not None,
        add_bias_kv=mha.bias_k is not None,
        add_zero_attn=mha.add_zero_attn,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=mha.batch_first,
    )


def to_torch(layer: Module):
    """A ``torch.nn`` module with ``layer``'s configuration and weights (same dtype).

    Supports :class:`~attnlab.MultiheadAttention` (-> ``torch.nn.MultiheadAttention``),
    :class:`~attnlab.Linear` (-> ``torch.nn.Linear``), :class:`~attnlab.SelfAttention`
    (-> an equivalent torch module) and :class:`~attnlab.models.TinyTransformer` (-> a torch
    module with the same ``state_dict`` names that maps ``ids (B, T)`` to the same logits).
    Training/eval mode is copied.

    >>> import numpy as np, torch
    >>> from attnlab.models import TinyTransformer, TinyTransformerConfig
    >>> cfg = TinyTransformerConfig(vocab_size=10, context_length=8, d_model=16, d_ff=32, dtype="float64")
    >>> model = TinyTransformer(cfg, rng=np.random.default_rng(0))
    >>> ids = np.array([[1, 2, 3, 4]])
    >>> bool(np.allclose(to_torch(model)(torch.from_numpy(ids)).detach().numpy(), model(ids)))
    True
    """
    torch = _torch()
    dtype = getattr(torch, _TORCH_DTYPES[np.dtype(next(layer.parameters()).dtype)])
    if isinstance(layer, MultiheadAttention):
        module = torch.nn.MultiheadAttention(**_mha_config(layer), dtype=dtype)
    elif isinstance(layer, Linear):
        module = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=dtype)
    elif isinstance(layer, SelfAttention):
        cls = _torch_self_attention_class()
        module = cls(layer.d_in, layer.d_out, qkv_bias=layer.W_q.bias is not None).to(dtype)
    elif isinstance(layer, TinyTransformer):
        module = torch_tiny_transformer(layer.config)
    else:
        raise TypeError(
            f"to_torch supports MultiheadAttention, SelfAttention, Linear and TinyTransformer, "
            f"got {type(layer).__name__}"
        )
    module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in layer.state_dict().items()})
    module.train(layer.training)
    return module


def from_torch(module, *, rng: np.random.Generator | None = None) -> Module:
    """An attnlab layer with ``module``'s configuration and weights (same dtype).

    Accepts ``torch.nn.MultiheadAttention``, ``torch.nn.Linear`` and the modules returned by
    :func:`to_torch` for a ``SelfAttention`` or a ``TinyTransformer`` (also after training in
    torch), and any of these wrapped in ``DistributedDataParallel`` or ``DataParallel``.
    ``rng`` drives the new layer's dropout.
    """
    torch = _torch()
    if isinstance(module, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
        module = module.module  # the wrapped model, with its own state_dict names
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    if isinstance(module, torch.nn.MultiheadAttention):
        layer = MultiheadAttention(**_mha_config(module), rng=rng, dtype=dtype)
    elif isinstance(module, torch.nn.Linear):
        layer = Linear(module.in_features, module.out_features, bias=module.bias is not None, rng=rng, dtype=dtype)
    elif type(module).__name__ == "TorchSelfAttention":
        layer = SelfAttention(module.d_in, module.d_out, qkv_bias=module.W_q.bias is not None, rng=rng, dtype=dtype)
    elif isinstance(getattr(module, "attnlab_config", None), TinyTransformerConfig):
        layer = TinyTransformer(module.attnlab_config, rng=rng)
    else:
        raise TypeError(
            f"from_torch supports nn.MultiheadAttention, nn.Linear, to_torch(SelfAttention) and "
            f"to_torch(TinyTransformer), got {type(module).__name__}"
        )
    layer.load_state_dict(state)
    layer.train(module.training)
    return layer
