"""Solutions of the exercises (:mod:`attnlab.exercises.tasks`), written as a learner would:
plain NumPy, one idea at a time. :func:`attnlab.exercises.solution` returns them and
:func:`attnlab.exercises.check` passes each (the test suite makes sure).

Axis legend: ``...`` batch dims, ``H`` heads, ``L`` queries, ``S`` keys, ``E`` width, ``D``
one head's width. Boolean masks are True where a query may attend to a key.
"""

from __future__ import annotations

import numpy as np

from attnlab.exercises.tasks import __all__  # noqa: F401  (one solution per task, by its name)


def softmax(x, axis=-1):
    shifted = x - x.max(axis=axis, keepdims=True)    # the largest becomes 0: exp cannot overflow
    e = np.exp(shifted)                              # -inf (a masked score) becomes 0
    return e / e.sum(axis=axis, keepdims=True)


def scaled_dot_product_attention(q, k, v, mask=None):
    E = q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(E).astype(q.dtype)   # (..., L, S)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)     # True = takes part
    return softmax(scores, axis=-1) @ v              # (..., L, S) @ (..., S, Ev)


def causal_mask(L, S):
    i = np.arange(L)[:, None]                        # query i sits at position S - L + i
    j = np.arange(S)[None, :]
    return j <= i + (S - L)


def split_heads(x, num_heads):
    *batch, L, HD = x.shape
    x = x.reshape(*batch, L, num_heads, HD // num_heads)   # (..., L, H, D)
    return np.swapaxes(x, -2, -3)                          # (..., H, L, D)


def merge_heads(x):
    *batch, H, L, D = x.shape
    x = np.swapaxes(x, -2, -3)                       # (..., L, H, D)
    return x.reshape(*batch, L, H * D)


def multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, mask=None):
    q = split_heads(x @ w_q.T, num_heads)            # (..., H, L, D)
    k = split_heads(x @ w_k.T, num_heads)
    v = split_heads(x @ w_v.T, num_heads)
    if mask is not None:
        mask = np.expand_dims(mask, -3)              # the same mask for every head
    z = scaled_dot_product_attention(q, k, v, mask)  # (..., H, L, D)
    return merge_heads(z) @ w_o.T                    # (..., L, E_out)


def cross_attention(x, context, w_q, w_k, w_v, w_o, num_heads, mask=None):
    q = split_heads(x @ w_q.T, num_heads)            # (..., H, L, D): queries from x
    k = split_heads(context @ w_k.T, num_heads)      # (..., H, S, D): keys and values
    v = split_heads(context @ w_v.T, num_heads)      #                from the context
    if mask is not None:
        mask = np.expand_dims(mask, -3)
    z = scaled_dot_product_attention(q, k, v, mask)
    return merge_heads(z) @ w_o.T


def apply_rotary(x, positions, theta=10000.0):
    D = x.shape[-1]
    F = D // 2
    freq = theta ** (-2 * np.arange(F) / D)                 # (F,)
    angle = np.asarray(positions)[:, None] * freq           # (L, F)
    cos, sin = np.cos(angle).astype(x.dtype), np.sin(angle).astype(x.dtype)
    x1, x2 = x[..., :F], x[..., F:]                          # the two halves
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def grouped_query_attention(q, k, v, mask=None):
    group = q.shape[-3] // k.shape[-3]                 # query heads per key/value head
    k = np.repeat(k, group, axis=-3)                   # head h uses key/value head h // group
    v = np.repeat(v, group, axis=-3)
    return scaled_dot_product_attention(q, k, v, mask)


def cached_attention(q, k, v, k_cache, v_cache):
    k_cache = np.concatenate([k_cache, k], axis=-2)     # (..., P + L, E), oldest first
    v_cache = np.concatenate([v_cache, v], axis=-2)
    mask = causal_mask(q.shape[-2], k_cache.shape[-2])  # new query i is at position P + i
    return scaled_dot_product_attention(q, k_cache, v_cache, mask), k_cache, v_cache


def online_softmax_attention(q, k, v, block_size, mask=None):
    L, S = q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1])
    if mask is not None:
        mask = np.broadcast_to(mask, (*np.broadcast_shapes(q.shape[:-2], k.shape[:-2]), L, S))
    m = np.full(q.shape[:-1] + (1,), -np.inf)          # the largest score so far, per query
    total = np.zeros(q.shape[:-1] + (1,))              # the sum of exponentials
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],))      # the weighted sum of values
    for start in range(0, S, block_size):
        stop = min(start + block_size, S)
        s = q @ np.swapaxes(k[..., start:stop, :], -1, -2) * scale   # this block's scores only
        if mask is not None:
            s = np.where(mask[..., start:stop], s, -np.inf)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        # A query that has seen only masked keys so far has m_new = -inf: nothing to add.
        safe = np.where(np.isfinite(m_new), m_new, 0.0)
        correction = np.exp(m - safe)                  # rescale what was summed so far
        p = np.exp(s - safe)
        total = total * correction + p.sum(axis=-1, keepdims=True)
        acc = acc * correction + p @ v[..., start:stop, :]
        m = m_new
    return (acc / total).astype(q.dtype)
