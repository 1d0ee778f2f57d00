"""The exercises, one function each: its signature, the shapes, the weight layout, the mask
convention and what to return. Write the function yourself (same name, same arguments),
then :func:`attnlab.exercises.check` it; each stub here only says what to write.

Axis legend (attnlab's, as in every docstring): ``...`` batch dims, ``H`` heads (``Hq``
query heads, ``H`` key/value heads where they differ), ``L`` queries, ``S`` keys,
``E`` query/key width, ``Ev`` value width, ``D`` one head's width. **Boolean masks are True
where a query may attend to a key** (the opposite of ``torch.nn.MultiheadAttention``'s
``attn_mask``); no row of a mask given to your function is all False. Weights are laid out
as ``torch.nn.Linear``'s: ``(out, in)``, so a projection is ``x @ W.T``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "apply_rotary",
    "cached_attention",
    "causal_mask",
    "cross_attention",
    "grouped_query_attention",
    "merge_heads",
    "multi_head_attention",
    "online_softmax_attention",
    "scaled_dot_product_attention",
    "softmax",
    "split_heads",
]


def _yours(name: str):
    raise NotImplementedError(f"{name} is an exercise: write it yourself, then "
                              f"attnlab.exercises.check({name!r}, your_function)")


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Exercise (the softmax): turn scores into weights that sum to 1 along ``axis``.

    ``softmax(x)[i] = exp(x[i]) / sum_j exp(x[j])`` over ``axis``. Subtract the largest
    score along ``axis`` first: the result is the same and ``exp`` cannot overflow (the
    checks give scores of 1000).

    Args:
        x: scores of any shape, float32 or float64; may hold ``-inf`` (a masked score,
            weight 0), never a slice of only ``-inf``.
        axis: the axis to normalize over (negative counts from the end).

    Returns:
        Weights of ``x``'s shape and dtype: each slice along ``axis`` sums to 1.

    Checked against :func:`attnlab.softmax`; in SmolLM2 it turns every head's scores into
    weights.
    """
    _yours("softmax")


def scaled_dot_product_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                 mask: np.ndarray | None = None) -> np.ndarray:
    """Exercise (scaled dot-product attention): ``softmax(q kᵀ / sqrt(E)) v``.

    Score every query against every key, scale by ``1 / sqrt(E)``, leave out the keys the
    mask hides (a score of ``-inf``), softmax over the keys, and take the weighted sum of
    the values.

    Args:
        q: queries ``(..., L, E)``.
        k: keys ``(..., S, E)``.
        v: values ``(..., S, Ev)``.
        mask: None, or bool broadcastable to ``(..., L, S)``: True where query ``i`` may
            attend to key ``j``.

    Returns:
        ``(..., L, Ev)``, ``q``'s dtype.

    Checked against :func:`attnlab.scaled_dot_product_attention`; in SmolLM2 it attends
    for every head (its 3 key/value heads repeated for the 9 query heads), with the causal
    mask.
    """
    _yours("scaled_dot_product_attention")


def causal_mask(L: int, S: int) -> np.ndarray:
    """Exercise (the causal mask): which keys each query may see in a decoder.

    The ``L`` queries are the *last* ``L`` of the ``S`` positions (``S > L`` when ``S - L``
    keys are cached): query ``i`` sits at position ``S - L + i`` and may attend to every
    key up to its own position, itself included.

    Args:
        L: number of queries.
        S: number of keys, ``S >= L``.

    Returns:
        Bool ``(L, S)``: True where query ``i`` may attend to key ``j`` (attnlab's
        convention: True = takes part).

    Checked against :func:`attnlab.causal_mask` (``align="bottom-right"``); in SmolLM2
    it masks every attention call, the prompt's and each decoding step's.
    """
    _yours("causal_mask")


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Exercise (splitting heads): one ``H * D``-wide vector per token into ``H`` heads.

    Head ``h`` takes the columns ``h * D .. (h + 1) * D - 1``, as ``torch.nn.MultiheadAttention``
    and every attnlab layer cut them.

    Args:
        x: ``(..., L, H * D)``.
        num_heads: ``H`` (divides the last axis).

    Returns:
        ``(..., H, L, D)``, ``x``'s dtype: ``out[..., h, i, :] = x[..., i, h * D:(h + 1) * D]``.

    In SmolLM2 it splits the queries, keys and values into their heads.
    """
    _yours("split_heads")


def merge_heads(x: np.ndarray) -> np.ndarray:
    """Exercise (merging heads): the heads' outputs side by side again.

    The inverse of :func:`split_heads`: head ``h``'s ``D`` values for token ``i`` go to the
    columns ``h * D .. (h + 1) * D - 1`` of row ``i``.

    Args:
        x: ``(..., H, L, D)``.

    Returns:
        ``(..., L, H * D)``, ``x``'s dtype: ``out[..., i, h * D:(h + 1) * D] = x[..., h, i, :]``.

    In SmolLM2 it merges the 9 heads' outputs before the output projection.
    """
    _yours("merge_heads")


def multi_head_attention(x: np.ndarray, w_q: np.ndarray, w_k: np.ndarray, w_v: np.ndarray,
                         w_o: np.ndarray, num_heads: int, mask: np.ndarray | None = None) -> np.ndarray:
    """Exercise (multi-head self-attention): project, split into heads, attend, merge,
    project out.

    ``Q = x @ w_q.T``, ``K = x @ w_k.T``, ``V = x @ w_v.T``, each split into ``H`` heads of
    ``D = w_q.shape[0] // H`` columns (head ``h`` takes columns ``h * D .. (h + 1) * D - 1``);
    each head is scaled dot-product attention with scale ``1 / sqrt(D)``; the heads'
    outputs are merged side by side and projected: ``out = merged @ w_o.T``. No biases.

    Args:
        x: ``(..., L, E)``.
        w_q, w_k, w_v: ``(H * D, E)`` each: ``torch.nn.Linear``'s layout ``(out, in)``.
        w_o: ``(E_out, H * D)`` (``E_out = E`` in a model).
        num_heads: ``H``.
        mask: None, or bool broadcastable to ``(..., L, L)``: True where query ``i`` may
            attend to key ``j``.

    Returns:
        ``(..., L, E_out)``, ``x``'s dtype.

    Checked against :class:`attnlab.nn.Attention` with these weights; in SmolLM2 it runs
    every layer's attention (its rotated queries and keys passed in as ``x``, with weights
    that pick them out).
    """
    _yours("multi_head_attention")


def cross_attention(x: np.ndarray, context: np.ndarray, w_q: np.ndarray, w_k: np.ndarray, w_v: np.ndarray,
                    w_o: np.ndarray, num_heads: int, mask: np.ndarray | None = None) -> np.ndarray:
    """Exercise (cross-attention): queries from ``x``, keys and values from ``context``.

    As :func:`multi_head_attention`, but ``K = context @ w_k.T`` and ``V = context @ w_v.T``:
    ``L`` queries attend to ``S`` keys of another sequence (``L != S`` in general).

    Args:
        x: the queries' sequence ``(..., L, E)``.
        context: the keys' and values' sequence ``(..., S, E_c)``.
        w_q: ``(H * D, E)``; w_k, w_v: ``(H * D, E_c)``; w_o: ``(E_out, H * D)``
            (``torch.nn.Linear``'s layout ``(out, in)``).
        num_heads: ``H``; each head has ``D = w_q.shape[0] // H`` columns, scale
            ``1 / sqrt(D)``.
        mask: None, or bool broadcastable to ``(..., L, S)``: True where query ``i`` may
            attend to key ``j``.

    Returns:
        ``(..., L, E_out)``, ``x``'s dtype: one row per query.

    Checked against :class:`attnlab.nn.Attention` (``key_value=context``); in SmolLM2 it
    runs every layer's attention (queries as ``x``, the keys and values side by side as
    ``context``).
    """
    _yours("cross_attention")


def apply_rotary(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """Exercise (rotary positions): rotate each query or key by angles that grow with its
    position.

    Hugging Face's convention (attnlab's and SmolLM2's): the ``D`` dims split into two
    **halves**, ``x1 = x[..., :D/2]`` and ``x2 = x[..., D/2:]``; frequency ``f`` (``0 <= f <
    D/2``) is ``theta ** (-2 f / D)``; token ``t`` at position ``p = positions[t]`` turns the
    pair ``(x1[f], x2[f])`` by the angle ``p * theta ** (-2 f / D)``::

        out1 = x1 cos - x2 sin
        out2 = x2 cos + x1 sin

    (Meta's original Llama code rotates interleaved pairs ``(x[2f], x[2f + 1])`` instead.)

    Args:
        x: queries or keys ``(..., L, D)``, ``D`` even.
        positions: ``(L,)`` integer positions (not always ``0..L-1``: after a cache they
            continue from it).
        theta: the base wavelength (SmolLM2's is 100000).

    Returns:
        ``x``'s shape and dtype.

    Checked against :func:`attnlab.core.rotary.apply_rotary`; in SmolLM2 it replaces every
    layer's rotary embedding (the position slot).
    """
    _yours("apply_rotary")


def grouped_query_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                            mask: np.ndarray | None = None) -> np.ndarray:
    """Exercise (grouped-query heads): fewer key/value heads than query heads.

    ``Hq`` query heads share ``H`` key/value heads (``H`` divides ``Hq``) in consecutive
    groups of ``G = Hq / H``: query head ``h`` uses key/value head ``h // G`` (SmolLM2: 9
    query heads over 3, heads 0-2 share key/value head 0). Each head is scaled dot-product
    attention with scale ``1 / sqrt(E)``.

    Args:
        q: ``(..., Hq, L, E)``.
        k: ``(..., H, S, E)``.
        v: ``(..., H, S, Ev)``.
        mask: None, or bool broadcastable to ``(..., Hq, L, S)``: True where query ``i``
            may attend to key ``j``.

    Returns:
        ``(..., Hq, L, Ev)``, ``q``'s dtype.

    Checked against :func:`attnlab.scaled_dot_product_attention` (``enable_gqa=True``); in
    SmolLM2 it gets the 3 key/value heads as they are.
    """
    _yours("grouped_query_attention")


def cached_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray,
                     v_cache: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exercise (the key/value cache): one decoding step that reuses the keys and values of
    the tokens before.

    Append the new tokens' keys and values after the ``P`` cached ones (oldest first), then
    attend: new query ``i`` sits at position ``P + i`` and sees every key up to its own
    position (causal), the cached ones included. Scale ``1 / sqrt(E)``.

    Args:
        q: the new tokens' queries ``(..., L, E)`` (``L = 1`` in a decoding step, more for a
            prompt).
        k, v: the new tokens' keys ``(..., L, E)`` and values ``(..., L, Ev)``.
        k_cache, v_cache: the cached keys ``(..., P, E)`` and values ``(..., P, Ev)``
            (``P = 0`` before the first call).

    Returns:
        ``(out, k_cache, v_cache)``: the output ``(..., L, Ev)`` and the grown cache
        ``(..., P + L, E)``, ``(..., P + L, Ev)``, all of ``q``'s dtype.

    Checked against :func:`attnlab.scaled_dot_product_attention` on the whole sequence;
    in SmolLM2 every layer keeps its cache in your hands: what your function returns is
    what it gets back at the next token.
    """
    _yours("cached_attention")


def online_softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, block_size: int,
                             mask: np.ndarray | None = None) -> np.ndarray:
    """Exercise (the online softmax): attention that reads the keys ``block_size`` at a
    time and never holds a whole ``(L, S)`` row of weights.

    Keep, per query, the largest score so far ``m``, the sum of exponentials ``l`` and the
    weighted sum of values ``acc``; when a block brings a larger maximum, rescale ``l`` and
    ``acc`` by ``exp(m_old - m_new)``; at the end, ``out = acc / l``. Scale ``1 / sqrt(E)``.
    A block may be entirely masked for some query (all its scores ``-inf``): that must
    not give NaN.

    Args:
        q: ``(..., L, E)``; k: ``(..., S, E)``; v: ``(..., S, Ev)``.
        block_size: keys per block (the last block may be shorter).
        mask: None, or bool broadcastable to ``(..., L, S)``: True where query ``i`` may
            attend to key ``j``.

    Returns:
        ``(..., L, Ev)``, ``q``'s dtype: equal to scaled dot-product attention.

    Checked against :func:`attnlab.scaled_dot_product_attention`; in SmolLM2 it attends for
    every head in blocks of 8 keys.
    """
    _yours("online_softmax_attention")
