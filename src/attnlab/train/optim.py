"""Optimizers with ``torch.optim``'s update rules and defaults, and gradient clipping.

Each optimizer takes an iterable of :class:`~attnlab.Parameter` (e.g. ``model.parameters()``)
and updates ``param.data`` in place from ``param.grad`` on ``step()``; parameters whose
``grad`` is None are skipped, as in torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from attnlab.nn.module import Parameter

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm_", "warmup_cosine"]


def _nonneg(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not value >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


class Optimizer:
    """Base class: holds the parameters, per-parameter ``state`` and ``zero_grad``."""

    def __init__(self, params: Iterable[Parameter]):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        for i, p in enumerate(self.params):
            if not isinstance(p, Parameter):
                raise TypeError(f"params[{i}] must be a Parameter, got {type(p).__name__}")
        self.state: list[dict] = [{} for _ in self.params]

    def zero_grad(self) -> None:
        """Set every parameter's ``grad`` to None (torch's default ``set_to_none=True``)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p, state in zip(self.params, self.state, strict=True):
            if p.grad is not None:
                self._update(p, p.grad, state)

    def _update(self, p: Parameter, grad: np.ndarray, state: dict) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """Stochastic gradient descent with torch's momentum, dampening, Nesterov and weight
    decay (L2 added to the gradient)::

        g = grad + weight_decay * p
        buf = g (first step)  or  momentum * buf + (1 - dampening) * g
        g = g + momentum * buf (nesterov)  or  buf
        p -= lr * g

    >>> p = Parameter(np.array([1.0])); p.grad = np.array([0.5])
    >>> SGD([p], lr=0.1).step(); p.data
    array([0.95])
    """

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ):
        super().__init__(params)
        self.lr = _nonneg(lr, "lr")
        self.momentum = _nonneg(momentum, "momentum")
        self.dampening = float(dampening)
        self.weight_decay = _nonneg(weight_decay, "weight_decay")
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening = 0")

    def _update(self, p, grad, state):
        dt = p.data.dtype.type
        g = grad + dt(self.weight_decay) * p.data if self.weight_decay else grad
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = np.array(g, dtype=p.data.dtype, copy=True)
            else:
                buf *= dt(self.momentum)
                buf += dt(1.0 - self.dampening) * g
            g = g + dt(self.momentum) * buf if self.nesterov else buf
        p.data -= dt(self.lr) * g


class Adam(Optimizer):
    """Adam (Kingma & Ba) with torch's defaults and update; ``weight_decay`` is L2 added to
    the gradient (use :class:`AdamW` for decoupled decay)::

        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    >>> p = Parameter(np.array([1.0])); p.grad = np.array([0.5])
    >>> Adam([p], lr=0.1).step(); p.data.round(6)
    array([0.9])
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
    ):
        super().__init__(params)
        self.lr = _nonneg(lr, "lr")
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = _nonneg(eps, "eps")
        self.weight_decay = _nonneg(weight_decay, "weight_decay")
        self.amsgrad = bool(amsgrad)

    def _update(self, p, grad, state):
        dt = p.data.dtype.type
        beta1, beta2 = self.betas
        if not state:
            state["step"] = 0
            state["exp_avg"] = np.zeros_like(p.data)
            state["exp_avg_sq"] = np.zeros_like(p.data)
            if self.amsgrad:
                state["max_exp_avg_sq"] = np.zeros_like(p.data)
        state["step"] += 1
        t = state["step"]
        if self.weight_decay:
            if self._decoupled:
                p.data *= dt(1.0 - self.lr * self.weight_decay)
            else:
                grad = grad + dt(self.weight_decay) * p.data
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += (grad - m) * dt(1.0 - beta1)  # torch: exp_avg.lerp_(grad, 1 - beta1)
        v *= dt(beta2)
        v += dt(1.0 - beta2) * grad * grad
        if self.amsgrad:
            np.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
            v = state["max_exp_avg_sq"]
        step_size = self.lr / (1.0 - beta1**t)
        denom = np.sqrt(v) / dt(math.sqrt(1.0 - beta2**t))
        denom += dt(self.eps)
        p.data -= dt(step_size) * m / denom


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p *= 1 - lr * weight_decay``
    before the Adam step; torch's default ``weight_decay=0.01``.

    >>> p = Parameter(np.array([1.0])); p.grad = np.array([0.5])
    >>> AdamW([p], lr=0.1).step(); p.data.round(6)
    array([0.899])
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


def warmup_cosine(step: int, *, lr: float, steps: int, warmup: int = 0, min_lr_ratio: float = 0.0) -> float:
    """The learning rate of (1-based) ``step`` of ``steps``: linear warm-up over the first
    ``warmup`` steps (``lr * step / warmup``), then cosine decay from ``lr`` to
    ``min_lr_ratio * lr``, reached at the last step.

    >>> [round(warmup_cosine(s, lr=1.0, steps=5, warmup=2, min_lr_ratio=0.1), 3) for s in range(1, 6)]
    [0.5, 1.0, 0.775, 0.325, 0.1]
    """
    if warmup and step <= warmup:
        return lr * step / warmup
    span = max(steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def clip_grad_norm_(
    params: Iterable[Parameter], max_norm: float, norm_type: float = 2.0
) -> float:
    """Scale all gradients together so their global norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: the norm is taken over all gradients as one
    vector, the factor is ``min(1, max_norm / (total_norm + 1e-6))``, and the total norm
    *before* clipping is returned. ``norm_type`` may be ``inf``.

    >>> p = Parameter(np.zeros(2)); p.grad = np.array([3.0, 4.0])
    >>> clip_grad_norm_([p], 1.0)
    5.0
    >>> p.grad.round(4)
    array([0.6, 0.8])
    """
    grads = [p.grad for p in params if p.grad is not None]
    max_norm = _nonneg(max_norm, "max_norm")
    norm_type = float(norm_type)
    if not grads:
        return 0.0
    if math.isinf(norm_type):
        total = max(float(np.max(np.abs(g))) if g.size else 0.0 for g in grads)
    elif norm_type == 2.0:  # each gradient's squared norm as one dot product (no temporary)
        total = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads))
    else:
        total = float(
            sum(float(np.sum(np.abs(g.astype(np.float64)) ** norm_type)) for g in grads)
            ** (1.0 / norm_type)
        )
    coef = min(max_norm / (total + 1e-6), 1.0)
    if coef < 1.0:
        for g in grads:
            g *= g.dtype.type(coef)
    return total
