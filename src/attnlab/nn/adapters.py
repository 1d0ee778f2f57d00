"""Low-rank adapters beside a layer's weight: :class:`LoRA` and the :class:`Adapters` slot.

A linear layer computes ``y = x W^T + b`` with ``W (out, in)``. A LoRA adapter (Hu et al.
2021, as PEFT's ``lora.Linear`` computes it) adds a trainable low-rank term to a block of
the output's columns::

    y[..., start:stop] += scaling * (dropout(x) @ A^T) @ B^T     A (r, in), B (stop - start, r)

``scaling = alpha / r`` (``alpha / sqrt(r)`` with rank-stabilised LoRA). ``B`` starts at
zero, so a new adapter changes nothing; ``A`` starts as torch's ``nn.Linear`` weight
(kaiming-uniform with ``a = sqrt(5)``: uniform in ``±1/sqrt(in)``). The dropout (training
mode only) acts on the adapter's input, not on the layer's.

The rows ``start:stop`` let one stacked weight carry adapters on its parts: attnlab keeps a
Llama attention's q, k and v in one ``in_proj_weight`` where transformers has three
``nn.Linear``\\ s, so PEFT's adapter on ``q_proj`` is an adapter on the query rows here;
GPT-2's fused ``c_attn`` takes one adapter over all rows, as PEFT gives it.

Every layer with a weight that adapters may wrap has an ``adapters`` slot (None, or an
:class:`Adapters` module holding named :class:`LoRA` children): :class:`~attnlab.nn.Linear`
and the in-projection of :class:`~attnlab.nn.Attention`. The layer calls
``adapters(x, y)`` after its own product and ``adapters.backward(grad_y)`` in its backward
pass. :mod:`attnlab.train.lora` adds adapters to a model by ``transformers``' module names
and reads and writes them in PEFT's format.

Shapes: ``x (..., in)``, ``y (..., out_total)``; ``N`` the rows of ``x`` flattened.
"""

from __future__ import annotations

import math

import numpy as np

from attnlab._threads import matmul
from attnlab._validation import float_dtype, generator, positive_int, probability
from attnlab.nn import init
from attnlab.nn.module import Module, Parameter

__all__ = ["Adapters", "LoRA"]


class LoRA(Module):
    """One low-rank adapter (see the module docstring): ``forward(x) -> delta (..., stop -
    start)``, the term added to the wrapped layer's output columns ``start:stop``.

    Args:
        in_features: the wrapped layer's input width.
        out_features: the width of the block of output columns it adds to.
        r: the rank (> 0).
        alpha: ``lora_alpha``; ``scaling = alpha / r`` (``alpha / sqrt(r)`` with
            ``use_rslora``).
        dropout: dropout on the adapter's input in training mode (``lora_dropout``).
        start: the first output column the adapter adds to.
        use_rslora: rank-stabilised scaling.
        rng: initialisation of ``A`` and the dropout's masks.
        dtype: float32 or float64 (the wrapped layer's).

    Parameters ``lora_A (r, in_features)`` and ``lora_B (out_features, r)`` (PEFT's
    ``lora_A.weight``/``lora_B.weight``). ``merged`` says the term is folded into the
    wrapped weight (:func:`attnlab.train.lora.merge`): the forward pass then adds nothing.

    >>> lora = LoRA(4, 3, r=2, alpha=4, rng=np.random.default_rng(0))
    >>> lora.lora_A.shape, lora.lora_B.shape, lora.scaling
    ((2, 4), (3, 2), 2.0)
    >>> bool(np.all(lora(np.ones((5, 4), np.float32)) == 0))      # B starts at zero
    True
    """

    def __init__(self, in_features: int, out_features: int, r: int, *, alpha: float, dropout: float = 0.0,
                 start: int = 0, use_rslora: bool = False, rng=None, dtype=np.float32):
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        self.r = positive_int(r, "r")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.integer | np.floating) \
                or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"alpha must be a positive number, got {alpha!r}")
        self.alpha = float(alpha)
        self.use_rslora = bool(use_rslora)
        self.scaling = self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)
        self.dropout = probability(dropout, "dropout")
        self.start = positive_int(start, "start", allow_zero=True)
        self.merged = False
        dtype = float_dtype(dtype)
        rng = generator(rng)
        object.__setattr__(self, "_rng", rng)
        self.lora_A = Parameter(init.uniform(rng, (self.r, self.in_features), 1.0 / math.sqrt(self.in_features),
                                             dtype))
        self.lora_B = Parameter(np.zeros((self.out_features, self.r), dtype))

    @property
    def stop(self) -> int:
        return self.start + self.out_features

    def delta_weight(self) -> np.ndarray:
        """``scaling * B @ A`` ``(out_features, in_features)``: what :func:`merge` adds to the
        wrapped weight's rows ``start:stop``."""
        return (self.lora_B.data @ self.lora_A.data) * self.lora_A.data.dtype.type(self.scaling)

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.in_features)
        keep = None
        if self.dropout > 0 and self.training:
            keep = (self._rng.random(x2.shape) >= self.dropout).astype(x2.dtype)
            keep *= x2.dtype.type(1.0 / (1.0 - self.dropout))
            x2 = x2 * keep
        u = matmul(x2, self.lora_A.data.T)  # (N, r)
        self._save(x=x2, u=u, keep=keep, shape=x.shape)
        delta = matmul(u, self.lora_B.data.T)  # (N, out)
        delta *= delta.dtype.type(self.scaling)
        return delta.reshape(*x.shape[:-1], self.out_features)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """The gradient of the input ``(..., in_features)`` from that of the delta ``(...,
        out_features)``; ``lora_A.grad`` and ``lora_B.grad`` accumulate (unless frozen)."""
        c = self._saved()
        g = grad_output.reshape(-1, self.out_features)
        s = g.dtype.type(self.scaling)
        B, A = self.lora_B, self.lora_A
        gu = matmul(g, B.data)  # (N, r)
        gu *= s
        if B.requires_grad:
            gB = matmul(g.T, c["u"], tokens=g.shape[0])
            gB *= s
            B.accumulate(gB, owned=True)
        if A.requires_grad:
            A.accumulate(matmul(gu.T, c["x"], tokens=g.shape[0]), owned=True)
        gx = matmul(gu, A.data)
        if c["keep"] is not None:
            gx *= c["keep"]
        return gx.reshape(c["shape"])

    def extra_repr(self) -> str:
        extra = ", use_rslora=True" if self.use_rslora else ""
        extra += f", dropout={self.dropout}" if self.dropout else ""
        extra += ", merged=True" if self.merged else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"alpha={self.alpha:g}, rows={self.start}:{self.stop}{extra}")


class Adapters(Module):
    """A layer's adapter slot: named :class:`LoRA` children (named after the
    ``transformers`` module each stands for: ``q_proj``, ``c_attn``...), each adding to its
    columns of the layer's output.

    ``forward(x, y)`` adds every unmerged adapter's term to ``y`` (the layer's own fresh
    output, changed in place) and returns it; ``backward(grad_y)`` returns the gradient of
    ``x`` that the adapters add (None if none ran).

    >>> slot = Adapters()
    >>> slot.q_proj = LoRA(4, 2, r=1, alpha=1, rng=np.random.default_rng(0))
    >>> slot(np.ones((3, 4)), np.zeros((3, 6))).shape
    (3, 6)
    """

    def loras(self) -> list[LoRA]:
        return [m for m in self._modules.values() if isinstance(m, LoRA)]

    def forward(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        ran = []
        for lora in self.loras():
            if lora.merged:
                if self.training:
                    raise RuntimeError("an adapter merged into its weight cannot train: call "
                                       "attnlab.train.lora.unmerge(model) before training")
                continue
            y[..., lora.start:lora.stop] += lora(x)
            ran.append(lora)
        self._save(ran=ran)
        return y

    def backward(self, grad_output: np.ndarray) -> np.ndarray | None:
        gx = None
        for lora in reversed(self._saved()["ran"]):
            g = lora.backward(grad_output[..., lora.start:lora.stop])
            gx = g if gx is None else gx + g
        return gx
