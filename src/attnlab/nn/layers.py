"""The layers a small transformer needs besides attention: ``Embedding``, ``LayerNorm``,
``GELU``, ``ReLU``, ``Dropout``, ``Sequential``, ``FeedForward`` and the pre-norm
``TransformerBlock`` (PyTorch names and parameter names).

Every layer follows :mod:`attnlab.nn.module`'s mechanism: the forward pass in training mode
keeps a cache; ``backward(grad_output)`` returns the input gradient and adds parameter
gradients to ``.grad``. Composite layers only call their children's ``backward`` in reverse.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import float_dtype, generator, positive_int, probability, shape_error
from attnlab.nn import functional as F
from attnlab.nn.attention import MultiheadAttention
from attnlab.nn.linear import Linear, check_input
from attnlab.nn.module import Module, Parameter

__all__ = [
    "GELU",
    "Dropout",
    "Embedding",
    "FeedForward",
    "LayerNorm",
    "ReLU",
    "Sequential",
    "TransformerBlock",
]


class Embedding(Module):
    """A lookup table: integer ids ``(...)`` -> rows of ``weight`` ``(..., embedding_dim)``.

    Initialised ``N(0, 1)`` as torch's ``nn.Embedding``. The weight gradient adds up the
    gradients of every position that looked a row up.

    >>> emb = Embedding(10, 4, rng=np.random.default_rng(0))
    >>> emb(np.array([[1, 2, 1]])).shape
    (1, 3, 4)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, rng=None, dtype=np.float32):
        super().__init__()
        self.num_embeddings = positive_int(num_embeddings, "num_embeddings")
        self.embedding_dim = positive_int(embedding_dim, "embedding_dim")
        rng = generator(rng)
        shape = (self.num_embeddings, self.embedding_dim)
        self.weight = Parameter(rng.standard_normal(shape).astype(float_dtype(dtype)))

    def forward(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(
                f"ids must lie in [0, {self.num_embeddings}), got values in "
                f"[{ids.min()}, {ids.max()}]"
            )
        self._save(ids=ids)
        return self.weight.data[ids]

    def backward(self, grad_output: np.ndarray) -> None:
        """Accumulates ``weight.grad``; ids have no gradient, so returns None."""
        ids = self._saved()["ids"].reshape(-1)
        g = grad_output.reshape(-1, self.embedding_dim)
        V = self.num_embeddings
        if V * len(ids) <= 1 << 22:  # small table: one GEMM with the one-hot ids is fastest
            one_hot = ids[None, :] == np.arange(V)[:, None]  # (V, N)
            grad = one_hot.astype(g.dtype) @ g
        else:
            grad = np.zeros_like(self.weight.data)
            np.add.at(grad, ids, g)
        self.weight.accumulate(grad)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LayerNorm(Module):
    """Layer normalisation over the last axis (torch's ``nn.LayerNorm(normalized_shape)``
    for an int shape): ``(x - mean) / sqrt(var + eps) * weight + bias``, biased variance.

    >>> ln = LayerNorm(4)
    >>> y = ln(np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32))
    >>> y.round(3)
    array([[-1.342, -0.447,  0.447,  1.342]], dtype=float32)
    """

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype=np.float32,
    ):
        super().__init__()
        self.normalized_shape = positive_int(normalized_shape, "normalized_shape")
        self.eps = float(eps)
        dtype = float_dtype(dtype)
        D = self.normalized_shape
        self.weight = Parameter(np.ones(D, dtype)) if elementwise_affine else None
        self.bias = Parameter(np.zeros(D, dtype)) if elementwise_affine and bias else None
        object.__setattr__(self, "_dtype", dtype)

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = check_input(x, "x", self._dtype, self.normalized_shape)
        w = None if self.weight is None else self.weight.data
        b = None if self.bias is None else self.bias.data
        y, x_hat, rstd = F.layer_norm(x, w, b, self.eps)
        self._save(x_hat=x_hat, rstd=rstd)
        return y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        c = self._saved()
        w = None if self.weight is None else self.weight.data
        gx, gw, gb = F.layer_norm_backward(grad_output, c["x_hat"], c["rstd"], w)
        if self.weight is not None:
            self.weight.accumulate(gw)
        if self.bias is not None:
            self.bias.accumulate(gb)
        return gx

    def extra_repr(self) -> str:
        return f"({self.normalized_shape},), eps={self.eps}"


class GELU(Module):
    """``x * Phi(x)`` with the exact erf (``approximate="none"``) or torch's ``"tanh"`` form.

    >>> GELU()(np.array([-1.0, 0.0, 1.0])).round(4)
    array([-0.1587,  0.    ,  0.8413])
    """

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        self._save(x=x)
        return F.gelu(x, approximate=self.approximate)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return F.gelu_backward(grad_output, self._saved()["x"], approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(Module):
    """``max(x, 0)``; the gradient at 0 is 0, as in torch.

    >>> ReLU()(np.array([-1.0, 2.0]))
    array([0., 2.])
    """

    def forward(self, x: np.ndarray) -> np.ndarray:
        y = np.maximum(x, 0)
        self._save(pos=y > 0)
        return y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return grad_output * self._saved()["pos"]


class Dropout(Module):
    """Zeroes each element with probability ``p`` in training mode and scales the rest by
    ``1 / (1 - p)``; the identity in eval mode. The mask is drawn from ``rng``.

    >>> Dropout(0.5, rng=np.random.default_rng(0)).eval()(np.ones(3))
    array([1., 1., 1.])
    """

    def __init__(self, p: float = 0.5, *, rng=None):
        super().__init__()
        self.p = probability(p, "p")
        object.__setattr__(self, "_rng", generator(rng))

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if not self.training or self.p == 0.0:
            self._save(keep=None)
            return x
        keep = (self._rng.random(x.shape) >= self.p).astype(x.dtype)
        keep *= x.dtype.type(1.0 / (1.0 - self.p))
        self._save(keep=keep)
        return x * keep

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        keep = self._saved()["keep"]
        return grad_output if keep is None else grad_output * keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Sequential(Module):
    """Children called in order; ``backward`` calls their ``backward`` in reverse.
    Parameter names are ``"0.weight"``, ``"1.bias"`` … as in torch.

    >>> net = Sequential(Linear(3, 4, rng=np.random.default_rng(0)), ReLU())
    >>> net(np.ones((2, 3), dtype=np.float32)).shape
    (2, 4)
    """

    def __init__(self, *layers: Module):
        super().__init__()
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential takes Modules, got {type(layer).__name__} at {i}")
            setattr(self, str(i), layer)

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def forward(self, x):
        for layer in self._modules.values():
            x = layer(x)
        return x

    def backward(self, grad_output):
        for layer in reversed(self._modules.values()):
            grad_output = layer.backward(grad_output)
        return grad_output


def _activation(name: str) -> Module:
    if name == "gelu":
        return GELU()
    if name == "gelu_tanh":
        return GELU("tanh")
    if name == "relu":
        return ReLU()
    raise ValueError(f"activation must be 'gelu', 'gelu_tanh' or 'relu', got {name!r}")


class FeedForward(Sequential):
    """The transformer MLP ``Linear(d_model, d_ff) -> activation -> Linear(d_ff, d_model)``
    (-> ``Dropout``): parameter names ``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``.

    Args:
        d_model: input and output width.
        d_ff: hidden width.
        activation: ``"gelu"`` (exact), ``"gelu_tanh"`` or ``"relu"``.
        dropout: dropout after the second projection (training mode only).

    >>> ff = FeedForward(4, 8, rng=np.random.default_rng(0))
    >>> sorted(ff.state_dict())
    ['0.bias', '0.weight', '2.bias', '2.weight']
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
            _activation(activation),
            Linear(d_ff, d_model, bias, rng=rng, dtype=dtype),
        ]
        if probability(dropout, "dropout") > 0:
            layers.append(Dropout(dropout, rng=rng))
        super().__init__(*layers)


class TransformerBlock(Module):
    """A pre-norm residual block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    The attention is :class:`~attnlab.MultiheadAttention` (``batch_first``), causal when
    ``causal=True``; it is called with ``need_weights=False`` so its ``attention_fn`` (a
    faster kernel) does the work, unless :attr:`keep_weights` asks for the maps.

    Args:
        d_model: width; ``n_heads`` must divide it.
        n_heads: attention heads.
        d_ff: feed-forward hidden width.
        dropout: dropout in attention weights, after attention and in the MLP.
        activation: see :class:`FeedForward`.
        causal: each position attends only to itself and earlier positions.
        rng, dtype: initialisation and dtype of every parameter.

    Input and output ``(B, T, d_model)`` (or ``(T, d_model)``).

    >>> block = TransformerBlock(8, 2, 16, rng=np.random.default_rng(0))
    >>> block(np.zeros((1, 5, 8), dtype=np.float32)).shape
    (1, 5, 8)
    """

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
        attention_fn=None,
        rng=None,
        dtype=np.float32,
    ):
        super().__init__()
        rng = generator(rng)
        self.causal = bool(causal)
        self.ln_1 = LayerNorm(d_model, dtype=dtype)
        self.attn = MultiheadAttention(
            d_model, n_heads, dropout=dropout, bias=bias, batch_first=True, rng=rng,
            dtype=dtype, attention_fn=attention_fn,
        )
        self.drop_1 = Dropout(dropout, rng=rng)
        self.ln_2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = FeedForward(
            d_model, d_ff, activation=activation, dropout=dropout, bias=bias, rng=rng, dtype=dtype
        )
        object.__setattr__(self, "keep_weights", False)
        object.__setattr__(self, "last_weights", None)

    def forward(self, x: np.ndarray) -> np.ndarray:
        if np.ndim(x) not in (2, 3):
            d = self.attn.embed_dim
            raise shape_error("x", np.shape(x), f"(B, T, {d}) or (T, {d})")
        h = self.ln_1(x)
        a, w = self.attn(
            h, h, h, need_weights=self.keep_weights, average_attn_weights=False,
            is_causal=self.causal,
        )
        object.__setattr__(self, "last_weights", w)
        x = x + self.drop_1(a)
        return x + self.mlp(self.ln_2(x))

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        g = grad_output + self.ln_2.backward(self.mlp.backward(grad_output))
        gq, gk, gv = self.attn.backward(self.drop_1.backward(g))
        return g + self.ln_1.backward(gq + gk + gv)
