"""One forward and one backward pass of a metric, with the activations and gradients of some
hook points recorded: what every gradient method reads. The backward pass runs with the
parameters frozen (:func:`attnlab.nn._context.frozen_parameters`): no weight gradient is
computed, and the parameters' ``.grad`` are left as they were."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnlab.inspect.interventions import _number
from attnlab.nn._context import frozen_parameters
from attnlab.nn.hooks import hooks
from attnlab.quant import is_quantized


def check_differentiable(model, what: str) -> None:
    """A ``TypeError`` before any pass when ``model`` has no backward pass: quantized weights
    (load dequantized) or weights on another array library."""
    for name, p in model.named_parameters():
        if is_quantized(p.data):
            raise TypeError(f"{what} needs gradients, and {type(model).__name__}'s {name} is kept quantized "
                            f"({p.data.kind}), which has no backward pass: load the model dequantized "
                            "(load_smollm2() or from_pretrained(path) without quantized=True)")
        if type(p.data) is not np.ndarray:
            raise TypeError(f"{what} needs gradients, which attnlab computes on NumPy arrays, but "
                            f"{type(model).__name__}'s {name} is {type(p.data).__module__}.{type(p.data).__name__}: "
                            "call model.to(np) first")


def _recorder(store: dict):
    def record(x, name):
        store[name] = np.array(x, copy=True)  # the pass may update the array in place later

    record.reads_only = True
    return record


def run_with_grads(model, ids: np.ndarray, metric, names: Sequence[str], *, fwd_hooks=(), bwd_hooks=(),
                   grad_names: Sequence[str] | None = None, select=None, **forward_kwargs):
    """``(metric value, output, activations, gradients)``: ``model(ids)`` with ``fwd_hooks``
    (run before the recording), ``metric(output)``, then ``model.backward(metric.grad(output))``
    with ``bwd_hooks`` (run before the recording). ``activations[name]`` for ``names``,
    ``gradients[name]`` (the metric's gradient with respect to that activation) for
    ``grad_names`` (None: ``names``); copies. ``select(output)``: the array that the metric's
    gradient is taken of and that ``backward`` takes the gradient of (an encoder's
    ``last_hidden_state``; None: the output itself)."""
    acts: dict[str, np.ndarray] = {}
    grads: dict[str, np.ndarray] = {}
    grad_names = names if grad_names is None else grad_names
    fwd = [*fwd_hooks, *((n, _recorder(acts)) for n in names)]
    bwd = [*bwd_hooks, *((n, _recorder(grads)) for n in grad_names)]
    with hooks(model, fwd, bwd, keep=True), frozen_parameters():
        out = model(ids, **forward_kwargs)
        value = _number(metric(out))
        g = np.asarray(metric.grad(out))
        ref = np.asarray(out if select is None else select(out))
        if g.shape != ref.shape:
            raise ValueError(f"metric.grad returned an array of shape {g.shape}, but the output is {ref.shape}")
        model.backward(g.astype(ref.dtype, copy=False))
    return value, out, acts, grads
