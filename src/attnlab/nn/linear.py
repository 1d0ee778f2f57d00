"""``Linear``: ``y = x @ W.T + b`` (torch's ``nn.Linear``)."""

from __future__ import annotations

import numpy as np

from attnlab._validation import as_float_array, float_dtype, generator, positive_int, shape_error
from attnlab.core._namespace import array_type, device, float_array, is_numpy, namespace
from attnlab.nn import functional as F
from attnlab.nn import init
from attnlab.nn.module import Module, Parameter
from attnlab.quant import QuantizedTensor, product_record


def check_input(x, name: str, like, last_dim: int, layout: str = "(..., {d})") -> np.ndarray:
    """A layer's input: float, at least 1-D, last dim ``last_dim``, and of the library, device
    and dtype of ``like`` (the layer's weight)."""
    if type(x) is np.ndarray and x.ndim and x.shape[-1] == last_dim and x.dtype == like.dtype and (
            type(like) is np.ndarray or type(like) is QuantizedTensor):
        return x  # the common case (a float array of the weights' dtype and width), checked cheaply
    need = layout.format(d=last_dim)
    if isinstance(like, np.ndarray) or type(like) is QuantizedTensor:
        if type(x) is not np.ndarray and not is_numpy(x):
            raise TypeError(
                f"{name} is {array_type(x)}, but the layer's weights are NumPy arrays: pass a NumPy "
                f"array, or move the layer to that library once with layer.to(...)"
            )
        x = as_float_array(x, name, min_ndim=1, layout=need)
    else:  # weights of another library (Module.to): the input must be there too
        xp = namespace(like)
        if namespace(x, names=(name,)) is not xp or device(x) != device(like):
            where = "" if is_numpy(x) else f" on {device(x)}"
            raise TypeError(
                f"{name} is {array_type(x)}{where}, but the layer's weights are {array_type(like)} on "
                f"{device(like)}: pass such an array, or move the layer with layer.to(...)"
            )
        x = float_array(x, name, xp, min_ndim=1, layout=need)
    if x.shape[-1] != last_dim:
        raise shape_error(name, tuple(x.shape), need)
    if x.dtype != like.dtype:
        build = f"dtype=np.{x.dtype}" if isinstance(like, np.ndarray) else "that dtype before .to()"
        raise TypeError(
            f"{name} has dtype {x.dtype}, but the layer's parameters are {like.dtype} "
            f"(cast the input or build the layer with {build})"
        )
    return x


class Linear(Module):
    """``(..., in_features) -> (..., out_features)``; weight ``(out, in)``, bias ``(out,)``.

    Initialised as torch does (uniform in ``±1/sqrt(in_features)``) from ``rng``.

    ``adapters``: the slot for low-rank adapters (None, or an
    :class:`~attnlab.nn.adapters.Adapters` whose terms are added to the output; see
    :mod:`attnlab.train.lora`). A frozen weight (``requires_grad=False``) gets no gradient,
    and the forward pass keeps its input only where the weight's gradient or an adapter
    needs it.

    >>> layer = Linear(3, 2, rng=np.random.default_rng(0))
    >>> layer(np.ones((4, 3), dtype=np.float32)).shape
    (4, 2)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rng=None, dtype=np.float32):
        super().__init__()
        self.in_features = positive_int(in_features, "in_features")
        self.out_features = positive_int(out_features, "out_features")
        dtype = float_dtype(dtype)
        w, b = init.linear_default(generator(rng), self.out_features, self.in_features, dtype)
        self.weight = Parameter(w)
        self.bias = Parameter(b) if bias else None

    adapters = None  # the adapter slot (attnlab.nn.adapters): None, or an Adapters module

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = check_input(x, "x", self.weight.data, self.in_features)
        self._save(x=x if self.weight.requires_grad else None)
        y = F.linear(x, self.weight.data, None if self.bias is None else self.bias.data)
        return y if self.adapters is None else self.adapters(x, y)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        x = self._saved()["x"]
        w, b = self.weight, self.bias
        gx, gw, gb = F.linear_backward(grad_output, x, w.data, has_bias=b is not None and b.requires_grad,
                                       weight_grad=w.requires_grad)
        if gw is not None:
            w.accumulate(gw, owned=True)
        if gb is not None:
            b.accumulate(gb, owned=True)
        if self.adapters is not None:
            ga = self.adapters.backward(grad_output)
            if ga is not None:
                gx += ga
        return gx

    def decode_record(self) -> tuple | None:
        """This layer's product for the compiled decoding step
        (:func:`attnlab.quant.product_record`: a quantized or a C-contiguous float32 weight),
        or None where the step cannot compute it (another weight, adapters in the slot, a
        subclass)."""
        if type(self) is not Linear or self.adapters is not None \
                or self.weight.data.shape != (self.out_features, self.in_features):
            return None
        return product_record(self.weight.data, None if self.bias is None else self.bias.data)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
