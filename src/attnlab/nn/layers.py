"""The layers a transformer needs besides attention: ``Embedding``, ``LayerNorm``,
``GELU``, ``ReLU``, ``Dropout`` and ``Sequential`` (PyTorch names and parameter names).
The blocks built from them are in :mod:`attnlab.nn.blocks`.

Every layer follows :mod:`attnlab.nn.module`'s mechanism: the forward pass in training mode
keeps a cache; ``backward(grad_output)`` returns the input gradient and adds parameter
gradients to ``.grad``. Composite layers only call their children's ``backward`` in reverse.
"""

from __future__ import annotations

import math

import numpy as np

from attnlab._threads import matmul
from attnlab._validation import float_dtype, generator, positive_int, probability
from attnlab.core._namespace import array_type, as_dtype, device, from_host, is_numpy, namespace, to_host
from attnlab.core._reduce import col_sum
from attnlab.nn import _context, init
from attnlab.nn import functional as F
from attnlab.nn.hooks import HookPoint
from attnlab.nn.linear import Linear, check_input  # noqa: F401  (Linear: the doctests)
from attnlab.nn.module import Module, Parameter
from attnlab.quant import is_quantized

__all__ = [
    "GELU",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "ReLU",
    "Sequential",
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
        self.weight = Parameter(init.normal(rng, shape, float_dtype(dtype)))

    def forward(self, ids: np.ndarray) -> np.ndarray:
        w = self.weight.data
        if not isinstance(w, np.ndarray) and not is_quantized(w):
            return self._lookup(w, ids)
        if not is_numpy(ids):
            raise TypeError(f"ids is {array_type(ids)}, but the layer's weights are NumPy arrays: pass NumPy "
                            "ids, or move the layer to that library once with layer.to(...)")
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(
                f"ids must lie in [0, {self.num_embeddings}), got values in "
                f"[{ids.min()}, {ids.max()}]"
            )
        self._save(ids=ids)
        return w.rows_of(ids) if is_quantized(w) else w[ids]  # quantized: only these rows dequantized

    def _lookup(self, w, ids):
        """The rows of ``w``, a table of another library (:meth:`Module.to`), for ``ids`` of
        that library or NumPy (moved to the table's device): ``xp.take``, no fancy indexing."""
        xp = namespace(w)
        host = is_numpy(ids)
        if host:  # checked here, then moved: reading the device's min and max waits for its queue
            ids = np.asarray(ids)
            if not np.issubdtype(ids.dtype, np.integer):
                raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
        elif namespace(ids, names=("ids",)) is not xp:
            raise TypeError(f"ids is {array_type(ids)}, but the layer's weights are {array_type(w)}")
        elif not xp.isdtype(ids.dtype, "integral"):
            raise TypeError(f"ids must be an integer array, got dtype {ids.dtype} ({array_type(ids)})")
        if math.prod(ids.shape):
            lo, hi = (int(ids.min()), int(ids.max())) if host else (int(xp.min(ids)), int(xp.max(ids)))
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(f"ids must lie in [0, {self.num_embeddings}), got values in [{lo}, {hi}]")
        if host:
            ids = xp.asarray(ids, device=device(w))
        self._save(ids=ids)
        rows = xp.take(w, xp.reshape(ids, (-1,)), axis=0)  # (N, D) -> (..., D)
        return xp.reshape(rows, (*ids.shape, self.embedding_dim))

    def backward(self, grad_output: np.ndarray) -> None:
        """Accumulates ``weight.grad``; ids have no gradient, so returns None. A gradient
        with more leading axes than the ids (rows looked up once and broadcast, as shared
        positions over a batch) is summed over them first."""
        ids = self._saved()["ids"]
        if not self.weight.requires_grad or _context.parameters_frozen():  # the ids have no gradient
            return None
        g = grad_output
        if g.ndim > ids.ndim + 1:
            g = g.reshape(-1, *ids.shape, self.embedding_dim).sum(axis=0)
        ids = ids.reshape(-1)
        g = g.reshape(-1, self.embedding_dim)
        V = self.num_embeddings
        if V * len(ids) <= 1 << 22:  # small table: one GEMM with the one-hot ids is fastest
            one_hot = ids[None, :] == np.arange(V)[:, None]  # (V, N)
            self.weight.accumulate(matmul(one_hot.astype(g.dtype), g, tokens=len(ids)), owned=True)
        else:  # a large table: the rows added into its gradient where they are
            self.weight.add_rows(ids, g)
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
        if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating | np.integer):
            raise TypeError(f"eps must be a float, got {type(eps).__name__}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a positive finite float, got {eps}")
        self.eps = float(eps)
        dtype = float_dtype(dtype)
        D = self.normalized_shape
        self.weight = Parameter(np.ones(D, dtype)) if elementwise_affine else None
        self.bias = Parameter(np.zeros(D, dtype)) if elementwise_affine and bias else None
        # An empty array of the layer's library, device and dtype: what inputs must match.
        object.__setattr__(self, "_like", np.empty(0, dtype))
        self.hook_normalized = HookPoint()  # x_hat, before the weight and bias

    def _apply(self, convert) -> None:
        super()._apply(convert)
        object.__setattr__(self, "_like", convert(self._like))

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = check_input(x, "x", self._like, self.normalized_shape)
        w = None if self.weight is None else self.weight.data
        b = None if self.bias is None else self.bias.data
        hooked = self.hook_normalized.hooked
        if not hooked and not self._keeping():  # x_hat wanted by neither
            return F.layer_norm(x, w, b, self.eps, keep_x_hat=False)[0]
        y, x_hat, rstd = F.layer_norm(x, w, b, self.eps)
        x_used = x_hat
        if hooked:  # a hook reads or replaces x_hat: y follows it
            x_used = self.hook_normalized(x_hat.copy() if self._keeping() else x_hat)
            y = x_used * w if w is not None else x_used
            y = y + b if b is not None else y
        self._save(x_hat=x_hat, x_used=x_used, rstd=rstd, hooked=hooked)
        return y

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        c = self._saved()
        w = None if self.weight is None else self.weight.data
        if not c["hooked"]:
            gx, gw, gb = F.layer_norm_backward(grad_output, c["x_hat"], c["rstd"], w)
        else:  # through hook_normalized: the gradient of x_hat first, seen by its backward hooks
            gw, gb, g_hat = _affine_backward(grad_output, c["x_used"], w, bias=self.bias is not None)
            gx = F.layer_norm_backward(self.hook_normalized.backward(g_hat), c["x_hat"], c["rstd"], None)[0]
        if self.weight is not None:
            self.weight.accumulate(gw)
        if self.bias is not None:
            self.bias.accumulate(gb)
        return gx

    def extra_repr(self) -> str:
        return f"({self.normalized_shape},), eps={self.eps}"


def _affine_backward(grad_y, x_used, scale, *, bias: bool):
    """``(grad_weight, grad_bias, grad_x_used)`` of ``y = x_used * scale (+ bias)`` over the
    last axis (batch dims summed; None for an absent weight or bias)."""
    D = x_used.shape[-1]
    g2 = grad_y.reshape(-1, D)
    gw = col_sum(g2 * x_used.reshape(-1, D)) if scale is not None else None
    gb = col_sum(g2) if bias else None
    return gw, gb, grad_y * scale if scale is not None else grad_y


class GELU(Module):
    """``x * Phi(x)`` with the exact erf (``approximate="none"``) or torch's ``"tanh"`` form.

    With ``inplace=True`` an eval-mode call overwrites its input (training mode keeps the
    input for the backward pass, so it never does).

    >>> GELU()(np.array([-1.0, 0.0, 1.0])).round(4)
    array([-0.1587,  0.    ,  0.8413])
    """

    def __init__(self, approximate: str = "none", *, inplace: bool = False):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.inplace = bool(inplace)

    def forward(self, x: np.ndarray) -> np.ndarray:
        if is_numpy(x):
            x = np.asarray(x)
        self._save(x=x)
        out = x if self.inplace and not self._keeping() else None
        return F.gelu(x, approximate=self.approximate, out=out)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return F.gelu_backward(grad_output, self._saved()["x"], approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}" + (", inplace=True" if self.inplace else "")


class ReLU(Module):
    """``max(x, 0)``; the gradient at 0 is 0, as in torch. ``inplace=True`` overwrites the input.

    >>> ReLU()(np.array([-1.0, 2.0]))
    array([0., 2.])
    """

    def __init__(self, *, inplace: bool = False):
        super().__init__()
        self.inplace = bool(inplace)

    def forward(self, x: np.ndarray) -> np.ndarray:
        if is_numpy(x):
            y = np.maximum(x, 0, out=x if self.inplace else None)
        else:  # another array library (2022.12 has no maximum); NaN stays NaN
            y = namespace(x).where(x < 0, namespace(x).zeros_like(x), x)
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
        host = is_numpy(x)
        if host:
            x = np.asarray(x)
        if not self.training or self.p == 0.0:
            self._save(keep=None)
            return x
        if not host:  # the mask is drawn on the host, as the core's dropout does, and moved once
            keep = from_host(self._rng.random(tuple(x.shape)) >= self.p, x)
            keep = as_dtype(keep, x.dtype) * (1.0 / (1.0 - self.p))
            self._save(keep=keep)
            return x * keep
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

    def _layers(self) -> list[Module]:
        """The children that compute (hook points are markers, not layers)."""
        return [m for m in self._modules.values() if not isinstance(m, HookPoint)]

    def __len__(self) -> int:
        return len(self._layers())

    def __getitem__(self, i: int) -> Module:
        return self._layers()[i]

    def forward(self, x):
        for layer in self._layers():
            x = layer(x)
        return x

    def backward(self, grad_output):
        for layer in reversed(self._layers()):
            grad_output = layer.backward(grad_output)
        return grad_output


# ---- the pieces of Llama-style decoders: RMSNorm, SiLU, rotary positions --------------
from attnlab._validation import shape_error  # noqa: E402
from attnlab.core.rotary import RopeConfig, apply_rotary, apply_rotary_backward, rope_cos_sin, rope_inv_freq  # noqa: E402

__all__ += ["RMSNorm", "RotaryEmbedding", "SiLU"]


class RMSNorm(Module):
    """Root-mean-square normalisation over the last axis, as Hugging Face's ``LlamaRMSNorm``
    computes it: ``x_hat = x / sqrt(mean(x^2) + eps)`` (float16 in float32), then
    ``x_hat * weight`` (``x_hat * (1 + weight)`` with ``add_unit_offset=True``, Gemma's
    norms, whose weight starts at 0). No mean is subtracted and there is no bias.

    The forward pass normalises, then scales: ``x_hat`` (before the weight) is what
    TransformerLens calls ``hook_normalized``.

    >>> norm = RMSNorm(2, eps=0.0)
    >>> norm(np.array([[3.0, 4.0]], dtype=np.float32))
    array([[0.84852815, 1.1313709 ]], dtype=float32)
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-6, *, elementwise_affine: bool = True,
                 add_unit_offset: bool = False, dtype=np.float32):
        super().__init__()
        self.normalized_shape = positive_int(normalized_shape, "normalized_shape")
        if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating | np.integer):
            raise TypeError(f"eps must be a float, got {type(eps).__name__}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a non-negative finite float, got {eps}")
        self.eps = float(eps)
        self.add_unit_offset = bool(add_unit_offset)
        dtype = float_dtype(dtype)
        D = self.normalized_shape
        start = np.zeros(D, dtype) if self.add_unit_offset else np.ones(D, dtype)
        self.weight = Parameter(start) if elementwise_affine else None
        object.__setattr__(self, "_like", np.empty(0, dtype))
        self.hook_normalized = HookPoint()  # x_hat, before the weight

    def _apply(self, convert) -> None:
        super()._apply(convert)
        object.__setattr__(self, "_like", convert(self._like))

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = check_input(x, "x", self._like, self.normalized_shape)
        w = None if self.weight is None else self.weight.data
        hooked = self.hook_normalized.hooked
        keeping = self._keeping()
        scaled_only = not keeping and w is not None and not hooked  # x_hat wanted by no one
        if scaled_only:
            scale = (1.0 + w) if self.add_unit_offset else w
            fused = F._rms_normalize_fused(x, self.eps, scale)  # x_hat * scale in the same pass
            if fused is not None:
                return fused[0]
        x_hat, rstd = F.rms_normalize(x, self.eps)
        if scaled_only and type(x_hat) is np.ndarray and x_hat.dtype == w.dtype:  # x_hat is fresh: scaled in place
            return np.multiply(x_hat, scale, out=x_hat)
        x_used = x_hat
        if hooked:  # the normalised input before the weight, through hook_normalized
            x_used = self.hook_normalized(x_hat.copy() if keeping else x_hat)
        self._save(x_hat=x_hat, x_used=x_used, rstd=rstd, hooked=hooked)
        return F.rms_scale(x_used, w, add_unit_offset=self.add_unit_offset)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        c = self._saved()
        w = None if self.weight is None else self.weight.data
        if not c["hooked"]:
            gx, gw = F.rms_norm_backward(grad_output, c["x_hat"], c["rstd"], w, add_unit_offset=self.add_unit_offset,
                                         weight_grad=w is not None and self.weight.requires_grad)
        else:  # through hook_normalized: the gradient of x_hat first, seen by its backward hooks
            scale = None if w is None else ((1.0 + w) if self.add_unit_offset else w)
            gw, _, g_hat = _affine_backward(grad_output, c["x_used"], scale, bias=False)
            gx = F.rms_norm_backward(self.hook_normalized.backward(g_hat), c["x_hat"], c["rstd"], None)[0]
        if gw is not None:
            self.weight.accumulate(gw)
        return gx

    def decode_record(self) -> tuple | None:
        """This norm's slots for the compiled decoding step (:mod:`attnlab._decode_kernels`):
        ``(weight, eps, offset)``, the step scaling by ``weight + offset`` (``offset`` 1 with
        ``add_unit_offset``), or None where the step cannot compute it (no weight, one that
        is not a C-contiguous float32 NumPy vector, a subclass). The weight is the parameter's own
        array: a change in place is seen.

        >>> RMSNorm(4, eps=1e-5, add_unit_offset=True).decode_record()[1:]
        (np.float32(1e-05), np.float32(1.0))
        """
        w = None if self.weight is None else self.weight.data
        if type(self) is not RMSNorm or type(w) is not np.ndarray or w.dtype != np.float32 \
                or w.shape != (self.normalized_shape,) or not w.flags.c_contiguous:
            return None
        return (w, np.float32(self.eps), np.float32(1.0 if self.add_unit_offset else 0.0))

    def extra_repr(self) -> str:
        offset = ", add_unit_offset=True" if self.add_unit_offset else ""
        return f"({self.normalized_shape},), eps={self.eps}{offset}"


class SiLU(Module):
    """``x * sigmoid(x)`` (torch's ``nn.SiLU``, also called swish).

    >>> SiLU()(np.array([0.0, 1.0])).round(4)
    array([0.    , 0.7311])
    """

    def forward(self, x: np.ndarray) -> np.ndarray:
        if is_numpy(x):
            x = np.asarray(x)
        self._save(x=x)
        return F.silu(x)

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        return F.silu_backward(grad_output, self._saved()["x"])


_LAST_DECODE_ROWS: list = [None]  # RotaryEmbedding.decode_rows's last (key, config, (cos, sin))
_LAST_DEVICE_ROWS: list = [None]  # RotaryEmbedding._on_device's last (key, config, (cos, sin))


class RotaryEmbedding(Module):
    """Rotary position embedding for an attention layer's position slot (Hugging Face's
    split-halves convention; see :mod:`attnlab.core.rotary` for the math and the scalings).

    ``forward(q, k, positions)`` rotates queries ``(N, H, L, D)`` and keys ``(N, Hkv, L, D)``
    (or unbatched ``(H, L, D)``) by integer ``positions`` ``(L,)`` or ``(N, L)``;
    ``backward(grad_q, grad_k)`` returns the gradients of the unrotated q and k. It has no
    parameters. cos/sin are kept in a table that grows with the largest position seen
    (``dynamic`` scaling recomputes them per call instead: its frequencies depend on the
    largest position of the call).

    Args:
        config: a :class:`~attnlab.core.rotary.RopeConfig`, or the head dim ``D`` (then
            ``theta`` sets the base and there is no scaling).
        theta: the base for an int ``config``.

    >>> rope = RotaryEmbedding(4)
    >>> q = np.ones((1, 2, 3, 4), np.float32)
    >>> rq, rk = rope(q, q[:, :1], np.arange(3))
    >>> rq.shape, rk.shape, bool(np.allclose(rq[0, 0, 0], 1.0))
    ((1, 2, 3, 4), (1, 1, 3, 4), True)
    """

    def __init__(self, config, *, theta: float | None = None):
        super().__init__()
        if isinstance(config, RopeConfig):
            if theta is not None:
                raise TypeError("pass theta inside the RopeConfig, not beside it")
        else:
            config = RopeConfig(positive_int(config, "head_dim"), theta=10000.0 if theta is None else float(theta))
        self.config = config
        self.inv_freq, self.attention_factor = rope_inv_freq(config)
        object.__setattr__(self, "_table", None)

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.config.rotary_dim

    def cos_sin(self, positions: np.ndarray, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)`` ``(..., L, R)`` (NumPy) for integer ``positions`` ``(L,)`` or ``(N, L)``."""
        positions = to_host(positions)
        if not np.issubdtype(positions.dtype, np.integer):
            raise TypeError(f"positions must be an integer array, got dtype {positions.dtype}")
        if positions.ndim not in (1, 2):
            raise shape_error("positions", positions.shape, "(L,) or (N, L)")
        if positions.size == 0:
            shape = (*positions.shape, self.rotary_dim)
            return np.zeros(shape, dtype), np.zeros(shape, dtype)
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0:
            raise ValueError(f"positions must be >= 0, got a minimum of {lo}")
        if self.config.rope_type == "dynamic":
            inv, att = rope_inv_freq(self.config, seq_len=hi + 1)
            return rope_cos_sin(inv, positions, attention_factor=att, dtype=dtype)
        table = self._table
        if table is None or table[0].shape[0] <= hi or table[0].dtype != dtype:
            n = max(64, 1 << int(hi).bit_length())
            table = rope_cos_sin(self.inv_freq, np.arange(n), attention_factor=self.attention_factor, dtype=dtype)
            object.__setattr__(self, "_table", table)
        return table[0][positions], table[1][positions]

    def decode_rows(self, positions: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The rotation of one new token in each of ``n`` rows for the compiled decoding
        step (:mod:`attnlab._decode_kernels`): C-contiguous float32 ``(cos, sin)``, each
        ``(n, R)``, for integer ``positions`` ``(1,)`` (every row's) or ``(n, 1)``; None
        for other positions (the module path checks them) or a subclass (its own rotation).

        >>> cos, sin = RotaryEmbedding(8).decode_rows(np.array([[0], [3]]), 2)
        >>> cos.shape, float(cos[0, 0]), float(sin[0, 0])
        ((2, 8), 1.0, 0.0)
        """
        if type(self) is not RotaryEmbedding or type(positions) is not np.ndarray \
                or positions.shape not in ((1,), (n, 1)) or positions.dtype.kind not in "iu":
            return None
        # Every block of a step asks for the same rotation: the last one is kept (read only
        # by the step), for the rotary parameters and positions it was computed from.
        key = (positions.tobytes(), positions.dtype.char, n)
        last = _LAST_DECODE_ROWS[0]
        if last is not None and last[0] == key and (last[1] is self.config or last[1] == self.config):
            return last[2]
        cos, sin = self.cos_sin(positions.reshape(-1))
        if cos.shape[0] != n:
            cos, sin = np.repeat(cos, n, axis=0), np.repeat(sin, n, axis=0)
        rows = np.ascontiguousarray(cos), np.ascontiguousarray(sin)
        _LAST_DECODE_ROWS[0] = (key, self.config, rows)
        return rows

    def forward(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        for name, x in (("q", q), ("k", k)):
            if np.ndim(x) not in (3, 4) or np.shape(x)[-1] != self.head_dim:
                raise shape_error(name, np.shape(x), f"(N, heads, L, {self.head_dim}) or (heads, L, {self.head_dim})")
        L = q.shape[-2]
        positions = to_host(positions)  # the angles are computed on the host (transformers' float32 products)
        if positions.shape[-1:] != (L,) or positions.ndim not in (1, 2) or (
                positions.ndim == 2 and (q.ndim != 4 or positions.shape[0] not in (1, q.shape[0]))):
            need = f"({L},)" if q.ndim == 3 else f"({L},) or ({q.shape[0]}, {L})"
            raise shape_error("positions", positions.shape, need)
        if isinstance(q, np.ndarray):
            cos, sin = self._host_rows(positions, q.dtype)
        else:  # another library's heads: the rows they need, moved to their device and dtype
            cos, sin = self._on_device(positions, q)
        self._save(cos=cos, sin=sin)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _host_rows(self, positions: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)`` for ``positions`` in ``dtype``, each ``(L, R)`` or, for positions
        ``(N, L)``, ``(N, 1, L, R)``: one rotation for every head."""
        cos, sin = self.cos_sin(positions, dtype)
        if cos.ndim == 3:
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin

    def _on_device(self, positions: np.ndarray, like):
        """:meth:`_host_rows` moved to ``like``'s library, device and dtype (computed on the
        host in float32, or float64 for float64 heads). Every block of a forward pass asks for
        the same rows: the last move is kept (read only), for the rotary parameters,
        positions and target it was made for. On a GPU each move from the host waits for the
        device to finish its queue, so 2 moves a block stalled every block (a 30-block
        decoder: 60 waits a token)."""
        key = (positions.tobytes(), positions.shape, str(like.dtype), str(device(like)), array_type(like))
        last = _LAST_DEVICE_ROWS[0]
        if last is not None and last[0] == key and (last[1] is self.config or last[1] == self.config):
            return last[2]
        host = np.float64 if like.dtype == namespace(like).float64 else np.float32
        cos, sin = self._host_rows(positions, host)
        rows = as_dtype(from_host(cos, like), like.dtype), as_dtype(from_host(sin, like), like.dtype)
        _LAST_DEVICE_ROWS[0] = (key, self.config, rows)
        return rows

    def backward(self, grad_q: np.ndarray, grad_k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = self._saved()
        return apply_rotary_backward(grad_q, c["cos"], c["sin"]), apply_rotary_backward(grad_k, c["cos"], c["sin"])

    def extra_repr(self) -> str:
        c = self.config
        scaling = "" if c.rope_type == "default" else f", rope_type={c.rope_type!r}"
        return f"head_dim={c.head_dim}, theta={c.theta}{scaling}"
