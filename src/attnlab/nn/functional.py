"""Stateless layer math shared by modules: each forward has its backward beside it."""

from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight.T + bias``: ``(..., in) -> (..., out)``, weight ``(out, in)`` as in torch."""
    y = np.matmul(x, weight.T)
    if bias is not None:
        y += bias
    return y


def linear_backward(
    grad_y: np.ndarray, x: np.ndarray, weight: np.ndarray, *, has_bias: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(grad_x, grad_weight, grad_bias)`` for :func:`linear`; batch dims are summed."""
    g2 = grad_y.reshape(-1, grad_y.shape[-1])
    grad_w = g2.T @ x.reshape(-1, x.shape[-1])
    grad_b = g2.sum(axis=0) if has_bias else None
    return np.matmul(grad_y, weight), grad_w, grad_b
