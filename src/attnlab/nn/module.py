"""``Module`` and ``Parameter``: parameters, modes, state dicts and gradients.

The backward mechanism: a module called in training mode keeps what its backward pass
needs (its cache); ``module.backward(grad_output)`` returns the gradients of its inputs and
**adds** each parameter's gradient to ``param.grad``. Composite modules call their
children's ``backward`` in reverse order, so each piece of math is written once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from attnlab._validation import fmt_shape


class Parameter:
    """A trainable array: ``data`` (updated in place by optimizers) and its ``grad``.

    ``np.asarray(param)`` gives ``param.data``.
    """

    __slots__ = ("data", "grad")

    def __init__(self, data: np.ndarray):
        self.data = np.asarray(data)
        self.grad: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    def accumulate(self, grad: np.ndarray) -> None:
        """Add ``grad`` to ``self.grad`` (creating it on first use)."""
        if self.grad is None:
            self.grad = np.array(grad, dtype=self.data.dtype, copy=True)
        else:
            self.grad += grad

    def __array__(self, dtype=None, copy=None):
        return self.data if dtype is None else self.data.astype(dtype)

    def __repr__(self) -> str:
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


class Module:
    """Base class of attnlab's layers (PyTorch's ``nn.Module`` names and semantics).

    Subclasses assign ``Parameter``s and child ``Module``s as attributes (registered in
    assignment order), implement ``forward`` and, to be trainable, ``backward``.
    Modules start in training mode, as in PyTorch.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_cache", None)

    def __setattr__(self, name: str, value) -> None:
        params, modules = self.__dict__.get("_parameters"), self.__dict__.get("_modules")
        if params is None:
            raise RuntimeError(f"call Module.__init__() in {type(self).__name__}.__init__ first")
        params.pop(name, None)
        modules.pop(name, None)
        if isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def backward(self, grad_output):
        raise NotImplementedError(f"{type(self).__name__} has no backward pass")

    # ---- parameters and state -------------------------------------------------------
    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """``(name, Parameter)`` pairs, with the names ``state_dict()`` uses."""
        for name, p in self._parameters.items():
            if p is not None:
                yield prefix + name, p
        for name, m in self._modules.items():
            yield from m.named_parameters(prefix + name + ".")

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix.rstrip("."), self
        for name, m in self._modules.items():
            yield from m.named_modules(prefix + name + ".")

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every parameter, keyed by torch-style dotted names."""
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True) -> None:
        """Copy arrays into the parameters (cast to each parameter's dtype).

        Raises:
            KeyError: a missing or unexpected key (only missing ones if ``strict=False``
                ignores extras), listing all of them.
            ValueError: an array whose shape differs; names the tensor and both shapes.
            TypeError: a non-float array.
        """
        own = dict(self.named_parameters())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if missing or (strict and unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if strict and unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise KeyError(f"{type(self).__name__}.load_state_dict: " + "; ".join(parts))
        staged = {}
        for name, p in own.items():
            arr = state_dict[name]
            arr = np.asarray(arr.detach().cpu().numpy() if hasattr(arr, "detach") else arr)
            if not np.issubdtype(arr.dtype, np.floating):
                raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, but should be floating-point")
            if arr.shape != p.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {fmt_shape(arr.shape)} in the state dict, "
                    f"but the model needs {fmt_shape(p.shape)}"
                )
            staged[name] = arr
        for name, arr in staged.items():  # all checked first: nothing is half-loaded
            own[name].data[...] = arr

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # ---- modes ------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        for _, m in self.named_modules():
            object.__setattr__(m, "training", bool(mode))
            if not mode:
                object.__setattr__(m, "_cache", None)
        return self

    def eval(self) -> Module:
        return self.train(False)

    # ---- the cache that backward reads ------------------------------------------------
    def _save(self, **cache) -> None:
        if self.training:
            object.__setattr__(self, "_cache", cache)

    def _saved(self) -> dict:
        if self._cache is None:
            raise RuntimeError(
                f"{type(self).__name__}.backward() needs a forward call in training mode "
                "first (call .train() before the forward pass)"
            )
        cache = self._cache
        object.__setattr__(self, "_cache", None)
        return cache

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            lines.append(f"  ({name}): " + repr(m).replace("\n", "\n  "))
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"
