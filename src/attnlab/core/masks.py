"""Attention masks.

attnlab's one convention: a **boolean mask is True where a query may attend to a key**
(the entry "takes part"), as in ``torch.nn.functional.scaled_dot_product_attention``. A float
mask is added to the scores (use ``-inf`` to forbid). ``torch.nn.MultiheadAttention`` uses the
opposite boolean convention (True = ignore); :func:`convert_mha_mask` translates.

Every function here also takes (or, with ``like=``, builds) arrays of another Array API
library, such as torch tensors, and returns that library's arrays on the same device.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import positive_int, shape_error
from attnlab.core._namespace import array_type, device, is_bool, is_floating, namespace

ALIGNMENTS = ("top-left", "bottom-right")


def causal_mask(L: int, S: int | None = None, *, align: str = "top-left", like=None) -> np.ndarray:
    """Boolean ``(L, S)`` mask, True where query ``i`` may attend to key ``j``.

    ``align="top-left"`` (PyTorch's ``is_causal``): ``j <= i``. ``align="bottom-right"``:
    the last query lines up with the last key, ``j <= i + (S - L)``; this is what decoding
    with a KV cache needs (L new queries after S - L cached keys).

    Args:
        L: number of queries.
        S: number of keys (defaults to ``L``).
        align: ``"top-left"`` or ``"bottom-right"``.
        like: an array whose library and device the mask is built in (e.g. the query, a
            torch tensor); ``None`` builds a NumPy array.

    >>> causal_mask(2, 3).astype(int)
    array([[1, 0, 0],
           [1, 1, 0]])
    >>> causal_mask(2, 3, align="bottom-right").astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    L = positive_int(L, "L", allow_zero=True)
    S = L if S is None else positive_int(S, "S", allow_zero=True)
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    offset = 0 if align == "top-left" else S - L
    xp = namespace(like)
    if xp is np:
        return np.arange(S)[None, :] <= np.arange(L)[:, None] + offset
    rows = xp.reshape(xp.arange(L, device=device(like)), (L, 1))
    cols = xp.reshape(xp.arange(S, device=device(like)), (1, S))
    return cols <= rows + offset


def padding_mask(lengths, S: int) -> np.ndarray:
    """Boolean ``(B, S)`` key mask, True for the first ``lengths[b]`` keys of sequence ``b``.

    ``lengths`` may be another Array API library's integer array; the mask is then built
    in that library, on its device.

    For :func:`~attnlab.scaled_dot_product_attention` on ``(B, H, L, S)`` scores, index it as
    ``padding_mask(lengths, S)[:, None, None, :]``; :class:`~attnlab.MultiheadAttention`
    takes it directly as ``key_padding_mask``.

    >>> padding_mask([1, 3], 3).astype(int)
    array([[1, 0, 0],
           [1, 1, 1]])
    """
    S = positive_int(S, "S", allow_zero=True)
    xp = namespace(lengths)
    arr = np.asarray(lengths) if xp is np else lengths
    if arr.ndim != 1:
        raise shape_error("lengths", tuple(arr.shape), "(B,)")
    if not (np.issubdtype(arr.dtype, np.integer) if xp is np else xp.isdtype(arr.dtype, "integral")):
        raise TypeError(f"lengths must hold integers, got dtype {arr.dtype} ({array_type(arr)})")
    if arr.shape[0]:
        lo, hi = int(xp.min(arr)), int(xp.max(arr))
        if lo < 0 or hi > S:
            raise ValueError(f"lengths must lie in [0, S={S}], got values in [{lo}, {hi}]")
    if xp is np:
        return np.arange(S)[None, :] < arr[:, None]
    cols = xp.reshape(xp.arange(S, dtype=arr.dtype, device=device(arr)), (1, S))
    return cols < xp.reshape(arr, (arr.shape[0], 1))


def convert_mha_mask(mask: np.ndarray | None) -> np.ndarray | None:
    """Translate a ``torch.nn.MultiheadAttention`` mask to attnlab's convention.

    PyTorch's MultiheadAttention takes boolean masks that are True where a key is *ignored*;
    attnlab (like ``scaled_dot_product_attention``) takes True where it *takes part*. A
    boolean mask is therefore inverted; a float (additive) mask means the same in both and
    is returned unchanged; ``None`` stays ``None``.

    >>> convert_mha_mask(np.array([False, True]))
    array([ True, False])
    """
    if mask is None:
        return None
    if namespace(mask) is np:
        mask = np.asarray(mask)
    if is_bool(mask):
        return ~mask
    if not is_floating(mask):
        raise TypeError(f"mask must be boolean or floating-point, got dtype {mask.dtype} ({array_type(mask)})")
    return mask


def mask_to_bias(mask: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Boolean mask (True = takes part) to an additive bias: 0 where True, ``-inf`` elsewhere.

    For another library's mask, ``dtype`` may be that library's dtype (``torch.float64``) or
    a NumPy one, which names the same float type there (``np.float64`` -> ``torch.float64``).

    >>> mask_to_bias(np.array([True, False]))
    array([  0., -inf], dtype=float32)
    """
    xp = namespace(mask)
    if xp is np:
        mask = np.asarray(mask)
    if not is_bool(mask):
        raise TypeError(f"mask must be boolean, got dtype {mask.dtype} ({array_type(mask)})")
    if xp is np:
        return np.where(mask, 0.0, -np.inf).astype(dtype)
    dtype = _dtype_in(xp, dtype, mask)
    zero = xp.full((), 0.0, dtype=dtype, device=device(mask))  # filled there: no copy from the host
    return xp.where(mask, zero, xp.full((), -np.inf, dtype=dtype, device=device(mask)))


def _dtype_in(xp, dtype, like):
    """``dtype`` as a floating dtype of namespace ``xp`` (it may name a NumPy dtype)."""
    if isinstance(dtype, type | np.dtype | str):
        name = np.dtype(dtype).name
        if not hasattr(xp, name):
            raise TypeError(f"{array_type(like)} arrays have no dtype {name}")
        dtype = getattr(xp, name)
    if not xp.isdtype(dtype, "real floating"):
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    return dtype


def sliding_window_mask(
    L: int, S: int | None = None, *, window: int, align: str = "top-left", like=None
) -> np.ndarray:
    """Boolean ``(L, S)`` causal mask limited to the last ``window`` keys, True where query
    ``i`` may attend to key ``j``: ``i - window < j <= i`` (transformers' sliding-window
    semantics, Mistral's and Gemma's local layers: a query sees itself and the
    ``window - 1`` keys before it).

    ``align="bottom-right"`` numbers the queries as the last ``L`` of ``S`` positions (query
    ``i`` is at position ``i + S - L``): L new tokens after ``S - L`` cached ones, where the
    window then reaches back into the cache and, past ``window``, drops its oldest keys.

    Args:
        L: number of queries.
        S: number of keys (defaults to ``L``).
        window: how many keys (the query's own included) each query may see.
        align: ``"top-left"`` or ``"bottom-right"``.
        like: an array whose library and device the mask is built in.

    >>> sliding_window_mask(4, window=2).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    >>> sliding_window_mask(1, 5, window=3, align="bottom-right").astype(int)
    array([[0, 0, 1, 1, 1]])
    """
    window = positive_int(window, "window")
    causal = causal_mask(L, S, align=align, like=like)
    L, S = causal.shape
    offset = 0 if align == "top-left" else S - L
    xp = namespace(like)
    if xp is np:
        return causal & (np.arange(S)[None, :] > np.arange(L)[:, None] + offset - window)
    rows = xp.reshape(xp.arange(L, device=device(like)), (L, 1))
    cols = xp.reshape(xp.arange(S, device=device(like)), (1, S))
    return causal & (cols > rows + (offset - window))
