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
from attnlab.nn import _context, init
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

    def _keep(self, rows: int, dtype) -> np.ndarray | None:
        """The dropout's scaled keep mask ``(rows, in_features)`` (None: no dropout now)."""
        if not (self.dropout > 0 and self.training):
            return None
        keep = (self._rng.random((rows, self.in_features)) >= self.dropout).astype(dtype)
        keep *= dtype.type(1.0 / (1.0 - self.dropout))
        return keep

    def forward(self, x: np.ndarray) -> np.ndarray:
        x2 = x.reshape(-1, self.in_features)
        keep = self._keep(x2.shape[0], x2.dtype)
        if keep is not None:
            x2 = x2 * keep
        u = matmul(x2, self.lora_A.data.T)  # (N, r)
        self._save(x=x2, u=u, keep=keep, shape=x.shape)
        delta = matmul(u, self.lora_B.data.T)  # (N, out)
        delta *= delta.dtype.type(self.scaling)
        return delta.reshape(*x.shape[:-1], self.out_features)

    def _training_params(self) -> tuple[bool, bool]:
        """Whether ``lora_A`` and ``lora_B`` take a gradient in this backward pass."""
        frozen = _context.parameters_frozen()
        return self.lora_A.requires_grad and not frozen, self.lora_B.requires_grad and not frozen

    def backward(self, grad_output: np.ndarray, parts: list[tuple[int, int]] | None = None):
        """The gradient of the input ``(..., in_features)`` from that of the delta ``(...,
        out_features)``; ``lora_A.grad`` and ``lora_B.grad`` accumulate (unless frozen).

        ``parts``: column ranges ``(a, b)`` of the wrapped layer's output that together cover
        this adapter's (a stacked q/k/v projection's parts, with ``grad_output`` the whole
        output's gradient ``(..., out_total)``): a list of the input's gradient through each
        part's columns (None where the adapter has none), whose sum is the input's gradient."""
        c = self._saved()
        full = grad_output if parts is None else grad_output[..., self.start:self.stop]
        g = full.reshape(-1, self.out_features)
        s = g.dtype.type(self.scaling)
        B, A = self.lora_B, self.lora_A
        train_a, train_b = self._training_params()
        if train_b:
            gB = matmul(g.T, c["u"], tokens=g.shape[0])
            gB *= s
            B.accumulate(gB, owned=True)
        if parts is None:
            gus = [matmul(g, B.data)]  # (N, r)
        else:
            spans = [(max(a, self.start) - self.start, min(b, self.stop) - self.start) for a, b in parts]
            gus = [matmul(g[:, lo:hi], B.data[lo:hi]) if lo < hi else None for lo, hi in spans]
        grads = []
        for gu in gus:
            if gu is None:
                grads.append(None)
                continue
            gu *= s
            gx = matmul(gu, A.data)
            if c["keep"] is not None:
                gx *= c["keep"]
            grads.append(gx.reshape(c["shape"]))
        if train_a:
            gu = sum(gu for gu in gus if gu is not None)
            A.accumulate(matmul(gu.T, c["x"], tokens=g.shape[0]), owned=True)
        return grads[0] if parts is None else grads

    def _part_B(self, a: int, b: int, head_dim: int) -> np.ndarray | None:
        """``B``'s rows for the output columns ``a:b`` (``n`` heads of ``head_dim``) as ``(n,
        head_dim, r)``, zero where the adapter has no rows (None: none at all)."""
        lo, hi = max(a, self.start), min(b, self.stop)
        if lo >= hi:
            return None
        B = self.lora_B.data
        if (lo, hi) == (a, b):
            part = B[lo - self.start:hi - self.start]
        else:
            part = np.zeros((b - a, self.r), B.dtype)
            part[lo - a:hi - a] = B[lo - self.start:hi - self.start]
        return part.reshape((b - a) // head_dim, head_dim, self.r)

    def forward_heads(self, xs, cuts, head_dim: int) -> list[np.ndarray | None]:
        """The adapter on per-head inputs: ``xs[p] (N, L, n_p, in_features)``, each head's own
        input to part ``p`` of the wrapped layer's output, whose columns ``cuts[p] = (a, b)``
        are ``n_p`` heads of ``head_dim`` (a stacked q/k/v projection); head ``h``'s columns
        get ``scaling * (x_p[:, :, h] @ A^T) @ B_h^T``. Returns each part's term ``(N, L,
        n_p head_dim)`` (None where the adapter has no columns). One dropout mask ``(N, L,
        in_features)`` serves every head, so equal inputs give :meth:`forward`'s terms."""
        N, L = xs[0].shape[:2]
        keep = self._keep(N * L, xs[0].dtype)
        keep = None if keep is None else keep.reshape(N, L, 1, self.in_features)
        s = xs[0].dtype.type(self.scaling)
        out, kept = [], []
        for x, (a, b) in zip(xs, cuts, strict=True):
            Bp = self._part_B(a, b, head_dim)
            if Bp is None:
                out.append(None)
                kept.append(None)
                continue
            xd = x if keep is None else x * keep
            u = np.einsum("nlhe,re->nlhr", xd, self.lora_A.data)
            delta = np.einsum("nlhr,hdr->nlhd", u, Bp)
            delta *= s
            out.append(delta.reshape(*delta.shape[:2], -1))
            kept.append((xd, u, a, b))
        self._save(heads=kept, keep=keep, head_dim=head_dim)
        return out

    def backward_heads(self, grads) -> list[np.ndarray | None]:
        """:meth:`forward_heads`'s backward pass: ``grads[p] (N, L, n_p head_dim)``, the
        gradients of the parts' outputs -> the gradients of each part's per-head inputs
        ``(N, L, n_p, in_features)`` (None where the adapter has no columns); ``lora_A.grad``
        and ``lora_B.grad`` accumulate (unless frozen)."""
        c = self._saved()
        D, A, B = c["head_dim"], self.lora_A, self.lora_B
        train_a, train_b = self._training_params()
        gA = np.zeros(A.shape, A.data.dtype) if train_a else None
        gB = np.zeros(B.shape, B.data.dtype) if train_b else None
        out = []
        for g, kept in zip(grads, c["heads"], strict=True):
            if kept is None:
                out.append(None)
                continue
            xd, u, a, b = kept
            s = g.dtype.type(self.scaling)
            g4 = g.reshape(*g.shape[:2], -1, D)
            gu = np.einsum("nlhd,hdr->nlhr", g4, self._part_B(a, b, D))
            gu *= s
            if gB is not None:
                lo, hi = max(a, self.start), min(b, self.stop)
                gB[lo - self.start:hi - self.start] += \
                    (np.einsum("nlhd,nlhr->hdr", g4, u).reshape(b - a, self.r) * s)[lo - a:hi - a]
            if gA is not None:
                gA += np.einsum("nlhr,nlhe->re", gu, xd)
            gx = np.einsum("nlhr,re->nlhe", gu, A.data)
            if c["keep"] is not None:
                gx *= c["keep"]
            out.append(gx)
        A.accumulate(gA, owned=True)
        B.accumulate(gB, owned=True)
        return out

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

    def _running(self) -> list[LoRA]:
        """The adapters that add their terms in this call (the unmerged ones)."""
        ran = []
        for lora in self.loras():
            if lora.merged:
                if self.training:
                    raise RuntimeError("an adapter merged into its weight cannot train: call "
                                       "attnlab.train.lora.unmerge(model) before training")
                continue
            ran.append(lora)
        return ran

    def forward(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        ran = self._running()
        for lora in ran:
            y[..., lora.start:lora.stop] += lora(x)
        self._save(ran=ran)
        return y

    def backward(self, grad_output: np.ndarray, parts: list[tuple[int, int]] | None = None):
        """The input's gradient that the adapters add (None if none ran); with ``parts``
        (column ranges covering the output), a list of it through each part's columns."""
        total = None if parts is None else [None] * len(parts)
        for lora in reversed(self._saved()["ran"]):
            g = lora.backward(grad_output, parts) if parts is not None \
                else lora.backward(grad_output[..., lora.start:lora.stop])
            total = _add(total, g) if parts is None else [_add(t, gp) for t, gp in zip(total, g, strict=True)]
        return total

    def forward_heads(self, xs, ys, cuts, head_dim: int) -> None:
        """Per-head inputs (:meth:`LoRA.forward_heads`): each adapter's terms added in place
        to the parts' outputs ``ys[p] (N, L, n_p head_dim)``."""
        ran = self._running()
        for lora in ran:
            for y, delta in zip(ys, lora.forward_heads(xs, cuts, head_dim), strict=True):
                if delta is not None:
                    y += delta
        self._save(ran=ran)

    def backward_heads(self, grads) -> list[np.ndarray | None]:
        """The per-head inputs' gradients the adapters add, one per part (None: none)."""
        total = [None] * len(grads)
        for lora in reversed(self._saved()["ran"]):
            total = [_add(t, g) for t, g in zip(total, lora.backward_heads(grads), strict=True)]
        return total


def _add(total: np.ndarray | None, g: np.ndarray | None) -> np.ndarray | None:
    if g is None:
        return total
    return g if total is None else total + g
