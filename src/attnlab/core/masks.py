"""Attention masks.

attnlab's one convention: a **boolean mask is True where a query may attend to a key**
(the entry "takes part"), as in ``torch.nn.functional.scaled_dot_product_attention``. A float
mask is added to the scores (use ``-inf`` to forbid). ``torch.nn.MultiheadAttention`` uses the
opposite boolean convention (True = ignore); :func:`convert_mha_mask` translates.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import positive_int, shape_error

ALIGNMENTS = ("top-left", "bottom-right")


def causal_mask(L: int, S: int | None = None, *, align: str = "top-left") -> np.ndarray:
    """Boolean ``(L, S)`` mask, True where query ``i`` may attend to key ``j``.

    ``align="top-left"`` (PyTorch's ``is_causal``): ``j <= i``. ``align="bottom-right"``:
    the last query lines up with the last key, ``j <= i + (S - L)``; this is what decoding
    with a KV cache needs (L new queries after S - L cached keys).

    Args:
        L: number of queries.
        S: number of keys (defaults to ``L``).
        align: ``"top-left"`` or ``"bottom-right"``.

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
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + offset


def padding_mask(lengths, S: int) -> np.ndarray:
    """Boolean ``(B, S)`` key mask, True for the first ``lengths[b]`` keys of sequence ``b``.

    For :func:`~attnlab.scaled_dot_product_attention` on ``(B, H, L, S)`` scores, index it as
    ``padding_mask(lengths, S)[:, None, None, :]``; :class:`~attnlab.MultiheadAttention`
    takes it directly as ``key_padding_mask``.

    >>> padding_mask([1, 3], 3).astype(int)
    array([[1, 0, 0],
           [1, 1, 1]])
    """
    S = positive_int(S, "S", allow_zero=True)
    arr = np.asarray(lengths)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        if arr.ndim != 1:
            raise shape_error("lengths", arr.shape, "(B,)")
        raise TypeError(f"lengths must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > S):
        raise ValueError(f"lengths must lie in [0, S={S}], got {arr.tolist()}")
    return np.arange(S)[None, :] < arr[:, None]


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
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return ~mask
    if not np.issubdtype(mask.dtype, np.floating):
        raise TypeError(f"mask must be boolean or floating-point, got dtype {mask.dtype}")
    return mask


def mask_to_bias(mask: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Boolean mask (True = takes part) to an additive bias: 0 where True, ``-inf`` elsewhere.

    >>> mask_to_bias(np.array([True, False]))
    array([  0., -inf], dtype=float32)
    """
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must be boolean, got dtype {mask.dtype}")
    return np.where(mask, 0.0, -np.inf).astype(dtype)
