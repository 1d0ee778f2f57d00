"""Which array library a call computes in, and the few operations that differ between them.

NumPy arrays (and anything NumPy converts: lists, Python numbers) take attnlab's NumPy code,
with its NumPy-only speed tricks (in-place updates, ``np.copyto``, BLAS reductions). An array
of another library (torch, CuPy, JAX, ``array_api_strict``, ...) stays in that library and on
its device: its namespace comes from ``array_api_compat`` (the optional extra
``attnlab[arrayapi]``), and the same math runs written against the Array API standard
(2022.12). The helpers here are the places where the two differ; everything else in the core
is written once, against ``xp``.

>>> import numpy as np
>>> namespace(np.ones((2, 3)), None) is np
True
"""

from __future__ import annotations

import math

import numpy as np

from attnlab._validation import as_float_array, shape_error

# Libraries whose arrays NumPy must not silently convert (many lack __array_namespace__).
_ARRAY_LIBRARIES = {"torch", "cupy", "jax", "jaxlib", "dask", "sparse", "ndonnx", "mlx", "tensorflow", "paddle"}
_NUMPY_LIKE = (np.ndarray, np.generic, list, tuple, int, float, complex)

# What the namespace path calls: checked once per namespace, so that a library lacking one
# of them fails up front with its array type named, not deep inside the math.
REQUIRED = (
    "arange", "asarray", "astype", "broadcast_to", "empty", "exp", "expand_dims", "isdtype",
    "matmul", "matrix_transpose", "max", "min", "reshape", "sum", "where", "zeros_like",
)
_CHECKED: set[int] = set()
# The namespace of each array type seen (a forward pass asks hundreds of times per token).
_BY_TYPE: dict[type, object] = {np.ndarray: np}


def array_type(x: object) -> str:
    """``torch.Tensor``, ``numpy.ndarray``, ``array_api_strict.Array``: the name users know."""
    return f"{type(x).__module__.partition('.')[0]}.{type(x).__name__}"


def _foreign(x: object) -> bool:
    """An array of a library other than NumPy."""
    if x is None or isinstance(x, _NUMPY_LIKE):
        return False
    return hasattr(x, "__array_namespace__") or type(x).__module__.partition(".")[0] in _ARRAY_LIBRARIES


def is_numpy(*arrays: object) -> bool:
    """True when every argument is None or something NumPy computes on (not another library's array)."""
    for a in arrays:  # a plain loop: this runs on every NumPy call
        if a is not None and type(a) is not np.ndarray and _foreign(a):
            return False
    return True


def namespace(*arrays: object, names: tuple[str, ...] | None = None):
    """The namespace to compute in: the ``numpy`` module for NumPy inputs, else the one Array
    API namespace of all the arrays (``None`` entries are skipped). ``names`` name the
    arrays in errors.

    Raises:
        ImportError: another library's array without ``array_api_compat`` installed.
        TypeError: arrays of different libraries (or a list beside a tensor), or a
            namespace that lacks an operation attnlab needs; both name the array types.
    """
    kind = None  # one array type throughout: its namespace, once found, is kept
    for a in arrays:
        if a is not None:
            if kind is None:
                kind = type(a)
            elif type(a) is not kind:
                kind = None
                break
    xp = _BY_TYPE.get(kind)
    if xp is not None:  # the common call, hundreds of times a forward pass
        return xp
    for a in arrays:  # is_numpy, inlined: NumPy-like inputs of mixed types (lists, scalars)
        if a is not None and type(a) is not np.ndarray and _foreign(a):
            break
    else:
        return np
    names = names or tuple(f"argument {i}" for i in range(1, len(arrays) + 1))
    given = {name: a for name, a in zip(names, arrays, strict=True) if a is not None}
    first = next(a for a in given.values() if _foreign(a))
    try:
        import array_api_compat
    except ImportError as exc:
        raise ImportError(
            f"attnlab computes on {array_type(first)} arrays through array-api-compat: "
            "pip install 'attnlab[arrayapi]'"
        ) from exc
    try:
        xp = array_api_compat.array_namespace(*given.values())
    except TypeError:
        kinds = ", ".join(f"{name} is {array_type(a)}" for name, a in given.items())
        raise TypeError(
            f"pass arrays of one library ({kinds}); attnlab computes in their namespace "
            "(build a mask there, e.g. causal_mask(L, S, like=query))"
        ) from None
    if id(xp) not in _CHECKED:
        missing = [name for name in REQUIRED if not hasattr(xp, name)]
        if missing:
            raise TypeError(
                f"attnlab cannot compute on {array_type(first)} arrays: their namespace "
                f"{getattr(xp, '__name__', xp)!r} lacks {', '.join(missing)} (Array API standard 2022.12)"
            )
        _CHECKED.add(id(xp))
    if kind is not None:
        _BY_TYPE[kind] = xp
    return xp


def device(x: object):
    """The device ``x`` lives on (``None`` for NumPy)."""
    if isinstance(x, np.ndarray):
        return None
    if type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        return x.device  # what array_api_compat answers for torch, without its dozen type checks
    import array_api_compat

    return array_api_compat.device(x)


def on_accelerator(x: object) -> bool:
    """Whether ``x`` lives on an accelerator (a GPU, ...) rather than the host: torch tensors
    on a device other than ``cpu`` or ``meta``, CuPy arrays, JAX arrays on a non-CPU
    platform. NumPy, ``array_api_strict`` and anything else count as the host.

    >>> on_accelerator(np.ones(3))
    False
    """
    if isinstance(x, np.ndarray):
        return False
    top = type(x).__module__.partition(".")[0]
    if top == "cupy":
        return True
    if top == "torch":
        return getattr(getattr(x, "device", None), "type", "cpu") not in ("cpu", "meta")
    if top in ("jax", "jaxlib"):
        try:
            devices = x.devices()
        except Exception:  # a tracer inside jax.jit has no devices: JAX's default backend then
            import jax

            return jax.default_backend() != "cpu"
        return any(getattr(d, "platform", "cpu") != "cpu" for d in devices)
    return False


def float_array(x: object, name: str, xp, *, min_ndim: int = 0, layout: str | None = None):
    """:func:`attnlab._validation.as_float_array` for any namespace: ``x`` unchanged, or an
    error naming ``name``, its dtype and its array type."""
    if xp is np:
        return as_float_array(x, name, min_ndim=min_ndim, layout=layout)
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype} ({array_type(x)})")
    if x.ndim < min_ndim:
        raise shape_error(name, tuple(x.shape), layout or f"at least {min_ndim}-D")
    return x


def writeable(x) -> bool:
    """Whether ``x`` may be written in place (``x[i] = v``): not JAX's immutable arrays."""
    if isinstance(x, np.ndarray):
        return x.flags.writeable
    import array_api_compat

    return bool(array_api_compat.is_writeable_array(x))


def is_bool(x) -> bool:
    """``x`` has a boolean dtype."""
    if isinstance(x, np.ndarray):
        return x.dtype == np.bool_
    return namespace(x).isdtype(x.dtype, "bool")


def is_floating(x) -> bool:
    """``x`` has a real floating-point dtype."""
    if isinstance(x, np.ndarray):
        return bool(np.issubdtype(x.dtype, np.floating))
    return namespace(x).isdtype(x.dtype, "real floating")


def as_dtype(x, dtype):
    """``x`` cast to ``dtype`` (no copy when it already has it)."""
    if x.dtype == dtype:
        return x
    return x.astype(dtype) if isinstance(x, np.ndarray) else namespace(x).astype(x, dtype)


def mT(x):
    """Swap the last two axes: ``(..., M, N) -> (..., N, M)``."""
    if isinstance(x, np.ndarray):
        return np.swapaxes(x, -1, -2)
    return namespace(x).matrix_transpose(x)


def where_scalar(cond, value: float, x):
    """``x`` with ``value`` where ``cond`` is True (a new array)."""
    if isinstance(x, np.ndarray):
        return np.where(cond, value, x).astype(x.dtype, copy=False)
    return namespace(x).where(cond, full_scalar(value, x), x)


def full_scalar(value: float, like):
    """A 0-D array holding ``value`` in ``like``'s dtype, namespace and device (filled there:
    on a GPU a copy from the host would wait for the device's queue)."""
    if isinstance(like, np.ndarray):
        return like.dtype.type(value)
    return namespace(like).full((), value, dtype=like.dtype, device=device(like))


def fill_forbidden(s, allowed):
    """``s`` with ``-inf`` where the boolean ``allowed`` is False (in place for NumPy)."""
    if isinstance(s, np.ndarray):
        np.copyto(s, -np.inf, where=~allowed)
        return s
    return namespace(s).where(allowed, s, full_scalar(-math.inf, s))


def add_(a, b):
    """``a + b``, in place in ``a`` for NumPy (``b`` broadcasts to ``a``)."""
    if isinstance(a, np.ndarray):
        a += b
        return a
    return a + b


def mul_(a, b):
    """``a * b``, in place in ``a`` for NumPy (``b`` broadcasts to ``a``)."""
    if isinstance(a, np.ndarray):
        a *= b
        return a
    return a * b


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array: itself if it is one, else a copy on the host, from any library
    and device (never ``np.asarray`` of another library's array, which fails on a GPU).

    >>> to_host(np.arange(3))
    array([0, 1, 2])
    """
    if isinstance(x, np.ndarray):
        return x
    if is_numpy(x):
        return np.asarray(x)
    if array_type(x) == "array_api_strict.Array":  # its host device is called CPU_DEVICE
        return np.asarray(x.to_device(type(x.device)("CPU_DEVICE")))
    import array_api_compat

    if array_api_compat.is_jax_array(x):  # JAX copies to the host from any device; it has no "cpu" device name
        return np.asarray(x)
    return np.asarray(array_api_compat.to_device(x, "cpu"))


def from_host(a: np.ndarray, like):
    """The NumPy array ``a`` in ``like``'s namespace and on its device (NumPy: ``a`` itself)."""
    if isinstance(like, np.ndarray):
        return a
    return namespace(like).asarray(a, device=device(like))


def repeat_heads(x, groups: int):
    """Repeat each head ``groups`` times, consecutively: ``(..., H, N, D) -> (..., H * groups, N, D)``."""
    if isinstance(x, np.ndarray):
        return np.repeat(x, groups, axis=-3)
    xp = namespace(x)
    *lead, h, n, d = x.shape
    wide = xp.broadcast_to(xp.expand_dims(x, axis=-3), (*lead, h, groups, n, d))
    return xp.reshape(wide, (*lead, h * groups, n, d))
