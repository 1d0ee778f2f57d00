"""Block-quantized weights kept quantized: :class:`QuantizedTensor` (GGUF's ``Q8_0``,
``Q4_0`` and ``Q4_1``) and its product :func:`quantized_linear`.

A weight ``W (R, K)`` (torch's ``(out_features, in_features)``) is stored as llama.cpp
stores it: each row is ``K / 32`` blocks of 32 values, a block being a scale (and for
``Q4_1`` a min) and 32 integer codes:

======  ==========================  =====================  ====================
type    value                       codes                  bytes read / block
======  ==========================  =====================  ====================
Q8_0    ``scale * q``, q in -128..127   int8, one a value      32 + 4 (scale)
Q4_0    ``scale * (q - 8)``, q < 16  4 bits, two a byte     16 + 4
Q4_1    ``scale * q + min``, q < 16  4 bits, two a byte     16 + 8 (scale, min)
======  ==========================  =====================  ====================

Scales and mins are kept as float32 arrays ``(R, K / 32)`` (the file's float16 converted
once at load: the kernels read them without conversion), the codes as one C-contiguous
array ``(R, K)`` int8 or ``(R, K / 2)`` uint8 (llama.cpp's nibble order: byte ``j`` of a
block holds value ``j`` in its low four bits and value ``j + 16`` in its high ones).

Products ``x @ W.T`` (:func:`quantized_linear`, which :func:`attnlab.nn.functional.linear`
calls for such a weight): with numba (the ``fast`` extra) and at most
:data:`MATVEC_MAX_ROWS` rows of ``x`` (decode), a compiled kernel that reads each block once,
parallel over output rows; otherwise the weight is dequantized :data:`CHUNK_ROWS` rows at a
time into a scratch buffer and multiplied with BLAS (prefill, and the NumPy fallback
without numba, ``ATTNLAB_NO_NUMBA=1`` or ``tuned(fused=False)``). Every path equals
``x @ W.dequantize().T`` to float32 round-off. Quantized weights are for inference: a
backward pass through one raises.

A weight may instead multiply its input rounded to int8 (``W.activations == "int8"``, set
for a whole model by :func:`quantize_activations`): llama.cpp's arithmetic for 4-bit
weights, which rounds each block of 32 input values to int8 codes and a float scale
(:func:`round_activations`), so that a block's product is an integer dot product of codes
with codes (AVX512-VNNI or AVX2 instructions, chosen by what numba compiles for). Every path
then equals ``round_activations(x) @ W.dequantize().T`` to float32 round-off. On a 2-core
Zen 4 EPYC, SmolLM2's 150 block products a token took 0.70 of the float-activation time
(2.7 against 3.9 ms, 2 threads, paired in one process); its next-token distributions moved
by a KL divergence of about 0.006 a token, about as far as llama.cpp's own from the exact
products (0.004-0.006).

>>> rng = np.random.default_rng(0)
>>> w = QuantizedTensor.quantize(rng.standard_normal((4, 64)).astype(np.float32), "Q8_0")
>>> w.shape, w.kind, w.nbytes
((4, 64), 'Q8_0', 288)
>>> x = rng.standard_normal((2, 64)).astype(np.float32)
>>> bool(np.allclose(quantized_linear(x, w), x @ w.dequantize().T, atol=1e-4))
True
"""

from __future__ import annotations

import threading

import numpy as np

from attnlab._threads import get_num_threads, run_units

__all__ = [
    "ACTIVATIONS", "BLOCK", "CHUNK_ROWS", "KINDS", "MATVEC_MAX_ROWS", "QuantizedFallbackWarning", "QuantizedTensor",
    "float32_matvec", "is_quantized", "keeps_quantized", "product_record", "quantize_activations", "quantized_linear",
    "round_activations", "stack_rows",
]

#: values per block (every supported type)
BLOCK = 32
#: bytes per block in a GGUF file, by type (float16 scale [and min], then the codes)
KINDS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
#: rows of ``x`` up to which the matrix-vector kernel runs (more: dequantize + BLAS)
MATVEC_MAX_ROWS = 8
#: weight rows dequantized at a time for the BLAS path (a 1536-wide chunk is 1.5 MiB)
CHUNK_ROWS = 256
#: what a quantized weight's products multiply: ``x`` as it is, or rounded to int8
ACTIVATIONS = ("float32", "int8")

_scratch = threading.local()


class QuantizedTensor:
    """A 2-D weight ``(R, K)`` in blocks of 32 (see the module docstring).

    Build it from a GGUF tensor's bytes (:meth:`from_bytes`) or from float32 values
    (:meth:`quantize`). ``dtype`` is float32: the dtype of its products.

    Attributes:
        kind: ``"Q8_0"``, ``"Q4_0"`` or ``"Q4_1"``.
        shape: ``(R, K)``, the logical shape.
        codes: ``(R, K)`` int8 (Q8_0) or ``(R, K / 2)`` uint8 (the 4-bit types).
        scales: ``(R, K / 32)`` float32.
        mins: ``(R, K / 32)`` float32 (Q4_1), else ``None``.
        activations: ``"float32"`` (the default: products with ``x`` as it is) or
            ``"int8"`` (products with ``x`` rounded to int8 block by block,
            :func:`round_activations`; see :func:`quantize_activations`).
    """

    __slots__ = ("kind", "shape", "codes", "scales", "mins", "name", "_activations")
    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, kind: str, shape: tuple[int, int], codes: np.ndarray, scales: np.ndarray,
                 mins: np.ndarray | None = None, *, name: str = "weight", activations: str = "float32"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"{name}: activations must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                             f"got {activations!r}")
        if kind not in KINDS:
            raise ValueError(f"{name}: quantization type {kind!r} is not supported; supported: {', '.join(KINDS)}")
        R, K = (int(d) for d in shape)
        if R <= 0 or K <= 0 or K % BLOCK:
            raise ValueError(f"tensor {name} ({kind}, shape {(R, K)}): the row length {K} is not a positive "
                             f"multiple of the block size {BLOCK}")
        nb = K // BLOCK
        need_codes = (R, K) if kind == "Q8_0" else (R, K // 2)
        code_dtype = np.int8 if kind == "Q8_0" else np.uint8
        parts = [("codes", codes, need_codes, code_dtype), ("scales", scales, (R, nb), np.float32)]
        if kind == "Q4_1":
            parts.append(("mins", mins, (R, nb), np.float32))
        elif mins is not None:
            raise ValueError(f"tensor {name} ({kind}): this type has no mins")
        for label, a, need, dt in parts:
            if not isinstance(a, np.ndarray) or a.shape != need or a.dtype != dt or not a.flags.c_contiguous:
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"tensor {name} ({kind}, shape {(R, K)}): {label} must be C-contiguous "
                                 f"{np.dtype(dt).name} {need}, got {got}")
        self.kind, self.shape, self.name = kind, (R, K), name
        self.codes, self.scales, self.mins = codes, scales, mins
        self._activations = activations

    @property
    def activations(self) -> str:
        """``"float32"`` or ``"int8"``: read-only (a compiled decoding step keeps the records
        it built; :meth:`with_activations` makes a new weight, and
        :func:`quantize_activations` puts it in the model's parameter)."""
        return self._activations

    # ---- construction ------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data, kind: str, shape: tuple[int, int], *, name: str = "weight") -> QuantizedTensor:
        """From llama.cpp's packed blocks: ``R * K / 32`` blocks of :data:`KINDS` bytes each
        (a float16 scale, for Q4_1 a float16 min, then the codes), row after row.

        Raises:
            ValueError: naming the tensor, its type, its shape and the byte counts, for an
                unsupported type, a shape that is not 2-D, a row length that is not a
                multiple of 32, or a buffer of the wrong size (a truncated one included).
        """
        if kind not in KINDS:
            raise ValueError(f"tensor {name}: quantization type {kind!r} cannot be kept quantized; "
                             f"supported: {', '.join(KINDS)}")
        shape = tuple(int(d) for d in shape)
        raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.asarray(data).view(np.uint8).reshape(-1) if np.asarray(data).dtype != np.uint8 \
            else np.asarray(data).reshape(-1)
        if len(shape) != 2 or min(shape) <= 0:
            raise ValueError(f"tensor {name} ({kind}, shape {shape}, {raw.size} bytes): a quantized weight "
                             "must be 2-D (rows, columns)")
        R, K = shape
        if K % BLOCK:
            raise ValueError(f"tensor {name} ({kind}, shape {shape}, {raw.size} bytes): the row length {K} "
                             f"is not a multiple of the block size {BLOCK}")
        nb, bb = K // BLOCK, KINDS[kind]
        if raw.size != R * nb * bb:
            raise ValueError(f"tensor {name} ({kind}, shape {shape}): needs {R} rows x {nb} blocks x {bb} "
                             f"bytes = {R * nb * bb} bytes, got {raw.size}")
        blocks = raw.reshape(R, nb, bb)
        scales = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        if kind == "Q4_1":
            mins = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
            codes = np.ascontiguousarray(blocks[:, :, 4:]).reshape(R, K // 2)
        elif kind == "Q4_0":
            mins = None
            codes = np.ascontiguousarray(blocks[:, :, 2:]).reshape(R, K // 2)
        else:
            mins = None
            codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(R, K)
        return cls(kind, (R, K), codes, scales, mins, name=name)

    @classmethod
    def quantize(cls, w: np.ndarray, kind: str, *, name: str = "weight") -> QuantizedTensor:
        """Round a float weight ``(R, K)`` to ``kind`` blocks (llama.cpp's reference rounding:
        Q8_0 and Q4_0 scale by the block's largest magnitude, Q4_1 spans min..max). For tests
        and examples; models load theirs with :meth:`from_bytes`."""
        w = np.asarray(w, dtype=np.float32)
        if w.ndim != 2 or w.shape[1] % BLOCK:
            raise ValueError(f"{name}: quantize needs (R, K) with K a multiple of {BLOCK}, got {w.shape}")
        if kind not in KINDS:
            raise ValueError(f"{name}: quantization type {kind!r} is not supported; supported: {', '.join(KINDS)}")
        R, K = w.shape
        b = w.reshape(R, K // BLOCK, BLOCK)
        if kind == "Q4_1":
            lo, hi = b.min(axis=2), b.max(axis=2)
            d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
            m = lo.astype(np.float16).astype(np.float32)
            inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
            q = np.clip(np.rint((b - m[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
            return cls(kind, (R, K), _pack4(q), d, m, name=name)
        # signed: the value of largest magnitude maps to -128 (Q8_0: +-127) or -8
        idx = np.abs(b).argmax(axis=2)
        amax = np.take_along_axis(b, idx[..., None], axis=2)[..., 0]
        if kind == "Q8_0":
            d = (np.abs(amax) / 127).astype(np.float16).astype(np.float32)
            inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
            q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8)
            return cls(kind, (R, K), q.reshape(R, K), d, name=name)
        d = (amax / -8).astype(np.float16).astype(np.float32)
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.rint(b * inv[..., None]) + 8, 0, 15).astype(np.uint8)
        return cls(kind, (R, K), _pack4(q), d, name=name)

    # ---- views -------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes, scales and mins."""
        return self.codes.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        rounded = "" if self.activations == "float32" else f", activations={self.activations!r}"
        return f"QuantizedTensor({self.kind}, shape={self.shape}, nbytes={self.nbytes}{rounded})"

    def with_activations(self, activations: str) -> QuantizedTensor:
        """The same weight (its arrays shared, not copied) multiplying ``x`` as it is
        (``"float32"``) or rounded to int8 (``"int8"``, :func:`round_activations`)."""
        return QuantizedTensor(self.kind, self.shape, self.codes, self.scales, self.mins, name=self.name,
                               activations=activations)

    def copy(self) -> QuantizedTensor:
        """The same weight with arrays of its own (NumPy's ``copy``: writable, C-contiguous).

        >>> w = QuantizedTensor.quantize(np.ones((2, 32), dtype=np.float32), "Q4_1")
        >>> c = w.copy(); c.codes is w.codes, np.array_equal(c.dequantize(), w.dequantize())
        (False, True)
        """
        return QuantizedTensor(self.kind, self.shape, self.codes.copy(), self.scales.copy(),
                               None if self.mins is None else self.mins.copy(), name=self.name,
                               activations=self.activations)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(f"{self!r} ({self.name}) is not an array: call .dequantize() for its float32 values "
                        "(quantized weights are multiplied through attnlab.nn.functional.linear)")

    def take_rows(self, rows) -> QuantizedTensor:
        """The rows ``rows`` (an index array or slice) as a new quantized weight (copies)."""
        mins = None if self.mins is None else np.ascontiguousarray(self.mins[rows])
        codes, scales = np.ascontiguousarray(self.codes[rows]), np.ascontiguousarray(self.scales[rows])
        return QuantizedTensor(self.kind, (scales.shape[0], self.shape[1]), codes, scales, mins, name=self.name,
                               activations=self.activations)

    @staticmethod
    def concat_rows(parts, *, name: str = "weight") -> QuantizedTensor:
        """Quantized weights of one type and row length stacked along the rows (as
        ``np.concatenate(..., axis=0)``): e.g. q, k and v into one in-projection."""
        kinds = {(p.kind, p.shape[1], p.activations) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"{name}: cannot stack quantized weights of different types, widths or activations: "
                             f"{', '.join(f'{p.kind} {p.shape} {p.activations}' for p in parts)}")
        mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
        codes, scales = np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts])
        return QuantizedTensor(parts[0].kind, (scales.shape[0], parts[0].shape[1]), codes, scales, mins, name=name,
                               activations=parts[0].activations)

    def dequantize(self, rows=None, *, out: np.ndarray | None = None) -> np.ndarray:
        """The float32 values ``(R, K)`` (or of ``rows``, a slice or index array), as
        llama.cpp computes them (``scale * q``, ``scale * (q - 8)``, ``scale * q + min``)."""
        codes, scales = self.codes, self.scales
        mins = self.mins
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            mins = None if mins is None else mins[rows]
        n, nb = scales.shape
        if out is None:
            out = np.empty((n, self.shape[1]), dtype=np.float32)
        kern = _kernels()
        if kern is not None and n * self.shape[1] >= 4096:
            codes, scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
            if self.kind == "Q8_0":
                kern.q8_0_dequantize(codes, scales, out)
            else:
                m = scales if mins is None else np.ascontiguousarray(mins)
                kern.q4_dequantize(codes, scales, m, out, mins is not None)
            return out
        o = out.reshape(n, nb, BLOCK)
        if self.kind == "Q8_0":
            np.multiply(codes.reshape(n, nb, BLOCK), scales[..., None], out=o, dtype=np.float32)
            return out
        c = codes.reshape(n, nb, BLOCK // 2)
        o[..., :16] = c & 15
        o[..., 16:] = c >> 4
        if mins is None:
            o -= 8
            o *= scales[..., None]
        else:
            o *= scales[..., None]
            o += mins[..., None]
        return out

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """An embedding lookup: the dequantized rows ``ids (...)`` -> ``(..., K)`` (only the
        rows asked for are dequantized)."""
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
        return self.dequantize(flat).reshape(*ids.shape, self.shape[1])


def is_quantized(w) -> bool:
    """True for a :class:`QuantizedTensor`.

    >>> is_quantized(np.zeros((2, 32)))
    False
    """
    return type(w) is QuantizedTensor


_KIND_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
_FLOAT32_KIND = 3  # a float32 weight in a product record
_INT8_ACTIVATIONS = 4  # added to a kind's code: its products round x to int8
_NO_SCALES = np.empty((0, 0), np.float32)


def product_record(weight, bias=None) -> tuple | None:
    """The record of ``x @ weight.T + bias`` that the compiled decoding step multiplies by
    (:mod:`attnlab._decode_kernels`): ``(codes, scales, mins, kind, bias)``, or None where
    that step cannot (``weight`` neither a :class:`QuantizedTensor` nor a C-contiguous
    float32 NumPy matrix, ``bias`` not a C-contiguous float32 NumPy vector of its rows).
    ``kind`` is 0 ``Q8_0``, 1 ``Q4_0``, 2 ``Q4_1``, 3 float32 (``codes`` the weight itself,
    read where it is: a change in place is seen; ``scales``/``mins`` empty), and 4, 5, 6 the
    three quantized types with int8 activations (:func:`quantize_activations`); ``mins`` is
    ``scales`` where there are none; ``bias`` None is none.

    >>> w = QuantizedTensor.quantize(np.ones((2, 32), dtype=np.float32), "Q4_1")
    >>> codes, scales, mins, kind, bias = product_record(w)
    >>> codes.shape, kind, bias
    ((2, 16), 2, None)
    >>> product_record(np.ones((2, 32), dtype=np.float32))[3], product_record(np.ones((2, 32)))
    (3, None)
    """
    rows = weight.shape[0] if type(weight) in (QuantizedTensor, np.ndarray) and len(weight.shape) == 2 else None
    if rows is None or bias is not None and (type(bias) is not np.ndarray or bias.dtype != np.float32
                                             or bias.shape != (rows,) or not bias.flags.c_contiguous):
        return None
    if type(weight) is np.ndarray:
        if weight.dtype != np.float32 or not weight.flags.c_contiguous:
            return None
        return (weight, _NO_SCALES, _NO_SCALES, _FLOAT32_KIND, bias)
    mins = weight.scales if weight.mins is None else weight.mins
    kind = _KIND_CODES[weight.kind] + (_INT8_ACTIVATIONS if weight.activations == "int8" else 0)
    return (weight.codes, weight.scales, mins, kind, bias)


def stack_rows(parts, *, name: str = "weight"):
    """Weights stacked along the rows (q, k and v into one in-projection): one
    :class:`QuantizedTensor` when all are quantized alike, else a float32 array (the
    quantized parts dequantized).

    >>> w = QuantizedTensor.quantize(np.ones((2, 32), dtype=np.float32), "Q8_0")
    >>> stack_rows([w, w]).shape, type(stack_rows([w, np.ones((1, 32), dtype=np.float32)])).__name__
    ((4, 32), 'ndarray')
    """
    parts = list(parts)
    if all(is_quantized(p) for p in parts) and len({(p.kind, p.shape[1], p.activations) for p in parts}) == 1:
        return parts[0] if len(parts) == 1 else QuantizedTensor.concat_rows(parts, name=name)
    return np.concatenate([p.dequantize() if is_quantized(p) else np.asarray(p, dtype=np.float32) for p in parts])


def _pack4(q: np.ndarray) -> np.ndarray:
    """4-bit codes ``(R, nb, 32)`` -> llama.cpp's bytes ``(R, nb * 16)``."""
    R, nb, _ = q.shape
    return np.ascontiguousarray(q[..., :16] | (q[..., 16:] << 4)).reshape(R, nb * 16)


_KERNELS: list = []  # [the compiled module or None], resolved on first use
_tuning = None  # attnlab.core.blockwise.tuning, imported on first use


def _kernels():
    """The compiled kernels module, or None (no numba, or turned off: ``ATTNLAB_NO_NUMBA=1``
    or ``attnlab.core.blockwise.tuned(fused=False)``)."""
    global _tuning
    if _tuning is None:
        from attnlab.core.blockwise import tuning as _tuning
    if _tuning().fused is False:
        return None
    if not _KERNELS:
        try:
            from attnlab import _quant_kernels
        except ImportError:
            _quant_kernels = None
        _KERNELS.append(_quant_kernels)
    return _KERNELS[0]


class QuantizedFallbackWarning(UserWarning):
    """Weights asked to stay quantized are dequantized to float32: the compiled kernels
    that make quantized decoding fast are not there."""


_FALLBACK_WARNED: list = []


def keeps_quantized() -> bool:
    """Whether weights asked to stay quantized (``from_pretrained(..., quantized=True)``)
    should: True where the compiled matrix-vector kernels run (numba, the ``fast`` extra,
    not turned off by ``ATTNLAB_NO_NUMBA=1`` or ``tuned(fused=False)``). Without them a
    quantized decoding step dequantizes every weight it reads, several times slower than
    float32 (SmolLM2 on a 2-core EPYC: about 6 tokens/s against 35), so the loaders
    dequantize instead: the same numbers as a float32 load, as fast, with a float32
    model's memory. Says so once per process (:class:`QuantizedFallbackWarning`).

    >>> isinstance(keeps_quantized(), bool)
    True
    """
    if _kernels() is not None:
        return True
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED.append(True)
        import warnings

        warnings.warn("quantized weights are dequantized to float32 (as fast as float32, with its memory): numba, "
                      "which runs quantized decoding, is not installed or is turned off; install it with "
                      "pip install 'attnlab[fast]'", QuantizedFallbackWarning, stacklevel=3)
    return False


def _buffer(name: str, shape: tuple[int, ...]) -> np.ndarray:
    size = shape[0] * shape[1]
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.float32)
        setattr(_scratch, name, buf)
    return buf[:size].reshape(shape)


def float32_matvec(x: np.ndarray, weight: np.ndarray) -> np.ndarray | None:
    """``x @ weight.T`` by the compiled matrix-vector kernel (``_quant_kernels.f32_matvec``)
    for float32 NumPy ``x (..., K)`` of at most :data:`MATVEC_MAX_ROWS` rows and a
    C-contiguous float32 NumPy ``weight (R, K)`` (a decoding step's products, a float32
    model's output layer among them), or None where that does not apply (more rows, other
    dtypes or layouts, numba missing or turned off): then BLAS does it.

    Why not BLAS: OpenBLAS's threads spin for a tenth of a second after a multi-threaded
    call, and the compiled decoding step that follows (:mod:`attnlab._decode_kernels`)
    then runs its threads beside them (float32 SmolLM2 on a 2-core Zen 4 EPYC: 40 ms a token
    with the output layer on BLAS, 18 ms with it here); the kernel also streams the weight
    faster (35 GB/s against 21-30).

    >>> w = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> y = float32_matvec(np.ones((1, 2), np.float32), w)
    >>> y is None or y.tolist() == [[1.0, 5.0, 9.0]]
    True
    """
    if type(x) is not np.ndarray or type(weight) is not np.ndarray or x.dtype != np.float32 \
            or weight.dtype != np.float32 or weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1] \
            or not weight.flags.c_contiguous or x.size > MATVEC_MAX_ROWS * max(1, weight.shape[1]):
        return None
    kern = _kernels()
    if kern is None:
        return None
    x2 = np.ascontiguousarray(x.reshape(-1, weight.shape[1]))
    y = np.empty((x2.shape[0], weight.shape[0]), dtype=np.float32)
    _set_threads()
    kern.f32_matvec(weight, x2, y)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def round_activations(x: np.ndarray) -> np.ndarray:
    """``x (..., K)`` float32 rounded to int8 block by block, as a weight with int8
    activations multiplies it (llama.cpp's rounding of a 4-bit product's inputs, its
    ``Q8_1`` blocks, with ``d`` kept in float32): each run of 32 values along the last
    axis becomes ``d * q``, ``d = max|x| / 127`` in float32 (0 where that is below float32's
    normal range), ``q = rint(x / d)`` (``x * (1 / d)``, ties to even) in ``-127..127``. A
    row (the last axis) holding a NaN or an infinity is kept as it is. Float32 out.

    >>> x = np.array([[0.5, -1.0] + [0.25] * 30], dtype=np.float32)
    >>> r = round_activations(x)
    >>> float(r[0, 1]), bool(abs(r[0, 0] - 0.5) <= 1 / 254)
    (-1.0, True)
    """
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"x has dtype {x.dtype}, but activations are rounded from float32")
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        from attnlab._validation import shape_error

        raise shape_error("x", tuple(x.shape), f"(..., K) with K a multiple of {BLOCK}")
    f32 = np.float32
    b = x.reshape(-1, x.shape[-1] // BLOCK, BLOCK)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(b).max(axis=-1) / f32(127)
        d[~(d >= f32(np.finfo(f32).tiny))] = 0
        inv = np.divide(f32(1), d, out=np.zeros_like(d), where=d > 0)
        out = d[..., None] * np.rint(b * inv[..., None])
    out = out.reshape(x.shape)
    bad = ~np.isfinite(x).all(axis=-1)
    out[bad] = x[bad]
    return out


def quantize_activations(model, dtype: str = "int8"):
    """Make every quantized weight of ``model`` (a :class:`attnlab.nn.Module`) multiply its
    inputs rounded to int8 (``dtype="int8"``: :func:`round_activations`, llama.cpp's
    arithmetic for 4-bit weights, whose products become integer dot products: about 2x
    faster on a CPU with AVX2 or AVX512-VNNI) or as they are (``"float32"``, the default
    of a loaded model); returns ``model``. Like torch's dynamic quantization, the rounding
    happens on the fly, a product at a time. The weights' arrays are shared, not copied.

    Raises:
        ValueError: ``dtype`` is not one of :data:`ACTIVATIONS`, or ``model`` holds no
            quantized weight (load it with ``quantized=True``).
    """
    if dtype not in ACTIVATIONS:
        raise ValueError(f"dtype must be one of {', '.join(map(repr, ACTIVATIONS))}, got {dtype!r}")
    params = [p for _, p in model.named_parameters() if is_quantized(p.data)]
    if not params:
        raise ValueError(f"{type(model).__name__} has no quantized weights to round the activations of: "
                         "load it with quantized=True (from a .gguf file)")
    for p in params:
        if p.data.activations != dtype:
            p.data = p.data.with_activations(dtype)
    return model


def quantized_linear(x: np.ndarray, w: QuantizedTensor, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ w.dequantize().T + bias`` (with int8 activations, ``round_activations(x) @
    w.dequantize().T + bias``): ``x (..., K)`` float32 -> ``(..., R)`` float32, without
    dequantizing the whole weight (see the module docstring for the paths).

    Raises:
        ValueError: ``x``'s last dim is not ``K``.
        TypeError: ``x`` is not float32.
    """
    R, K = w.shape
    if x.shape[-1] != K:
        from attnlab._validation import shape_error

        raise shape_error("x", tuple(x.shape), f"(..., {K})")
    if x.dtype != np.float32:
        raise TypeError(f"x has dtype {x.dtype}, but a quantized weight multiplies float32 inputs")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if not x2.flags.c_contiguous:
        x2 = np.ascontiguousarray(x2)
    N = x2.shape[0]
    y = np.empty((N, R), dtype=np.float32)
    kern = _kernels() if N <= MATVEC_MAX_ROWS else None
    rounded = w.activations == "int8"
    if kern is not None:
        _set_threads()
        has_min = w.mins is not None
        if w.kind == "Q8_0":
            (kern.q8_0_matvec_q8 if rounded else kern.q8_0_matvec)(w.codes, w.scales, x2, y)
        else:
            (kern.q4_matvec_q8 if rounded else kern.q4_matvec)(w.codes, w.scales, w.mins if has_min else w.scales,
                                                               x2, y, has_min)
    else:
        if rounded:
            x2 = round_activations(x2)
        # Chunks of weight rows, each dequantized and multiplied on one thread of
        # attnlab's pool (BLAS on one thread meanwhile): the dequantizing runs on every
        # thread, and no BLAS thread is left spinning for the decoding steps that follow a
        # prompt (numba's threads then lost a core for a tenth of a second: SmolLM2
        # quantized, 32-token prompt, 8 new tokens at 15 ms each against 6 ms steady).
        step = max(1, min(R, CHUNK_ROWS))

        def chunk_product(r0: int, _scratch: dict) -> None:
            r1 = min(R, r0 + step)
            chunk = w.dequantize(slice(r0, r1), out=_buffer("dequant", (step, K))[: r1 - r0])
            np.matmul(x2, chunk.T, out=y[:, r0:r1])

        starts = range(0, R, step)
        run_units(starts, chunk_product, min(get_num_threads(), len(starts)))
    if bias is not None:
        y += bias
    return y.reshape(*lead, R)


_numba_threads = threading.local()  # numba's thread count is per calling thread


def _set_threads() -> int:
    """numba's pool to attnlab's thread count (set only when it changes); returns the
    count numba runs on (no more than its pool's threads)."""
    n = get_num_threads()
    if getattr(_numba_threads, "n", None) != n:
        import numba

        _numba_threads.count = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(_numba_threads.count)
        _numba_threads.n = n
    return _numba_threads.count
