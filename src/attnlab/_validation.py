"""One place for argument checks.

Every public function validates its inputs here, so errors read the same everywhere: they
name the argument, the shape (or dtype) it got and the shape it needs. Checks raise
``TypeError`` for a wrong kind of thing and ``ValueError`` for a wrong shape or value; never
``assert`` (``python -O`` strips it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def fmt_shape(shape: Sequence[int | str]) -> str:
    """``(2, 3)`` -> ``"(2, 3)"``; a 1-tuple keeps its comma; strings are symbolic dims."""
    items = [str(s) for s in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def shape_error(name: str, got: Sequence[int], need: str, why: str | None = None) -> ValueError:
    """A ``ValueError`` that reads "<name> has shape <got>, but should be <need>[: why]"."""
    msg = f"{name} has shape {fmt_shape(got)}, but should be {need}"
    if why:
        msg += f": {why}"
    return ValueError(msg)


def as_float_array(x: object, name: str, *, min_ndim: int = 0, layout: str | None = None) -> np.ndarray:
    """Return ``x`` as a floating-point ndarray (no copy, no cast) or raise.

    Integer, boolean, complex and object arrays are rejected with a ``TypeError``; arrays with
    fewer than ``min_ndim`` dimensions with a ``ValueError`` that shows ``layout``.
    """
    arr = np.asarray(x)
    if arr.dtype.type not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point array (float32 or float64), got dtype {arr.dtype}"
        )
    if arr.ndim < min_ndim:
        raise shape_error(name, arr.shape, layout or f"at least {min_ndim}-D")
    return arr


def same_dtype(**arrays: np.ndarray) -> np.dtype:
    """Return the common dtype of the named arrays, or raise ``TypeError`` naming them all."""
    dtypes = {name: a.dtype for name, a in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"expected {', '.join(dtypes)} to have the same dtype, got {listing}")
    return next(iter(dtypes.values()))


def positive_int(value: object, name: str, *, allow_zero: bool = False) -> int:
    """``value`` as an ``int`` that is > 0 (or >= 0), else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative int" if allow_zero else "a positive int"
        raise ValueError(f"{name} must be {need}, got {value}")
    return value


def probability(value: object, name: str) -> float:
    """``value`` as a float in ``[0, 1)``, else ``TypeError``/``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def positive_float(value: object, name: str) -> float | None:
    """``value`` as a positive finite float, or None for None; else ``TypeError`` (not a
    number) or ``ValueError`` (zero, negative, inf or NaN)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{name} must be a positive finite float or None, got {type(value).__name__}")
    value = float(value)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite float or None, got {value!r}")
    return value


def generator(rng: object, name: str = "rng") -> np.random.Generator:
    """``rng`` if it is a ``np.random.Generator``; ``None`` gives a fresh, unseeded one."""
    if rng is None:
        return np.random.default_rng()
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"{name} must be a numpy.random.Generator (e.g. np.random.default_rng(0)), "
            f"got {type(rng).__name__}"
        )
    return rng


def float_dtype(dtype: object, name: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy float32/float64 dtype, else ``TypeError``."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{name} must be float32 or float64, got {dtype!r}") from exc
    if dt.type not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got {dt}")
    return dt


def layer_number(layer: object, n_layers: int, *, name: str = "layer", embeddings: bool = True) -> int:
    """``layer`` as a number in ``0..n_layers`` (or ``1..n_layers``), negatives from the end.

    attnlab's one layer numbering, in Python, the CLI, JSON, the report and plot titles:
    layer 0 is the embeddings (static vectors; it has no attention), layer ``k`` is the
    output of the ``k``-th transformer block, ``k = 1..n_layers``; ``-1`` is the last
    block. With ``embeddings=False`` (something only blocks have, such as attention maps)
    layer 0 is refused with a message that says why.

    >>> layer_number(-1, 6), layer_number(0, 6), layer_number(6, 6)
    (6, 0, 6)
    >>> layer_number(0, 6, embeddings=False)
    Traceback (most recent call last):
    ...
    ValueError: layer 0 is the embeddings, which have no attention; pick a layer in 1..6 (or -6..-1)
    """
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(layer).__name__}")
    layer = int(layer)
    lo = 0 if embeddings else 1
    if layer == 0 and not embeddings:
        raise ValueError(
            f"{name} 0 is the embeddings, which have no attention; pick a {name} in "
            f"1..{n_layers} (or -{n_layers}..-1)"
        )
    k = layer + n_layers + 1 if layer < 0 else layer
    if not lo <= k <= n_layers:
        raise ValueError(
            f"{name} must be in {lo}..{n_layers} (or -{n_layers}..-1) for a model with "
            f"{n_layers} layers, got {layer}"
        )
    return k
