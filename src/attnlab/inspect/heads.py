"""What the attention heads do, from their maps (``blocks.{i}.attn.hook_pattern``): head
detectors and attention rollout.

Shapes: ``N`` blocks, ``H`` query heads, ``B`` sequences, ``T`` tokens. Blocks count from
0, as the hook names do (block ``i`` is attnlab's layer ``i + 1``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from attnlab.inspect._model import PATTERN, blocks, cached, check_cache, token_ids
from attnlab.nn.module import Module

__all__ = ["HEAD_KINDS", "attention_rollout", "detect_heads", "detection_pattern"]

HEAD_KINDS = ("previous_token", "duplicate_token", "induction")
"""The kinds of head ``detect_heads`` scores: attending to the previous token, to earlier
copies of the same token, and to the token after an earlier copy (induction)."""


def detection_pattern(ids: np.ndarray, kind: str) -> np.ndarray:
    """The attention map a head of ``kind`` would have on one sequence: 0/1, lower
    triangular ``(T, T)`` (query, key), float64.

    - ``"previous_token"``: each query attends to the token just before it.
    - ``"duplicate_token"``: each query attends to the earlier copies of its own token.
    - ``"induction"``: each query attends to the tokens that followed the earlier copies of
      its own token (key ``j`` where ``ids[j - 1] == ids[i]``, ``j - 1 < i``).

    These are TransformerLens's detection patterns (``transformer_lens.head_detector``).

    Args:
        ids: ``(T,)`` token ids.
        kind: ``"previous_token"``, ``"duplicate_token"`` or ``"induction"``.

    >>> detection_pattern(np.array([5, 6, 5, 6]), "induction").astype(int)
    array([[0, 0, 0, 0],
           [0, 0, 0, 0],
           [0, 1, 0, 0],
           [0, 0, 1, 0]])
    """
    if not isinstance(kind, str) or kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, HEAD_KINDS))}, got {kind!r}")
    ids = token_ids(ids, "ids")
    if ids.ndim != 1:
        raise ValueError(f"ids has shape {ids.shape}, but should be (T,): one sequence")
    T = len(ids)
    if kind == "previous_token":
        return np.eye(T, k=-1)
    same = np.tril(ids[:, None] == ids[None, :], k=-1)  # (query i, key j): an earlier copy, j < i
    if kind == "duplicate_token":
        return same.astype(np.float64)
    pattern = np.zeros((T, T))
    pattern[:, 1:] = same[:, :-1]  # key j + 1 after an earlier copy at j (j + 1 <= i)
    return pattern


def detect_heads(
    model: Module,
    inputs: np.ndarray,
    kind: str = "induction",
    *,
    exclude_bos: bool = False,
    exclude_current_token: bool = False,
    **forward_kwargs,
) -> np.ndarray:
    """How much each head attends as a head of ``kind`` would: one score per head.

    For every sequence and head, with ``A`` the head's map ``(T, T)`` and ``P``
    :func:`detection_pattern` of the sequence, the score is ``sum(A * P) / sum(A)``: the
    share of the head's attention that lands where ``kind`` says (1 for a perfect head,
    when every query has such a key). ``exclude_bos`` drops the attention to position 0
    from both sums, ``exclude_current_token`` the attention to the query's own position.
    Scores are averaged over the sequences of the batch. This is TransformerLens's
    ``detect_head`` with its ``"mul"`` error measure (for a list of prompts, the mean of
    the per-prompt scores).

    Args:
        model: any attnlab model with hook points (the maps are
            ``blocks.{i}.attn.hook_pattern``).
        inputs: token ids ``(B, T)`` or ``(T,)``; every position counts (no padding).
        kind: ``"previous_token"``, ``"duplicate_token"`` or ``"induction"``.
        exclude_bos: leave out the attention to the first token.
        exclude_current_token: leave out the attention of each token to itself.
        **forward_kwargs: passed to the forward pass.

    Returns:
        float64 ``(N, H)``: ``scores[i, h]`` for head ``h`` of block ``i``.

    Raises:
        ValueError: an unknown ``kind``.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> scores = detect_heads(model, np.array([[1, 2, 3, 1, 2, 3]]), "induction")
    >>> scores.shape, bool(((scores >= 0) & (scores <= 1)).all())
    ((2, 2), True)
    """
    if not isinstance(kind, str) or kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, HEAD_KINDS))}, got {kind!r}")
    ids = token_ids(inputs, "inputs")
    N = len(blocks(model))
    names = [PATTERN.format(i=i) for i in range(N)]
    _, cache = model.run_with_cache(ids, names_filter=names, **forward_kwargs)
    batch = ids.reshape(-1, ids.shape[-1])
    want = np.stack([detection_pattern(row, kind) for row in batch])  # (B, T, T)
    keep = np.ones(want.shape[-2:])
    if exclude_bos:
        keep[:, 0] = 0
    if exclude_current_token:
        np.fill_diagonal(keep, 0)
    per_block = []
    for name in names:
        A = np.asarray(cache[name], dtype=np.float64).reshape(batch.shape[0], -1, *keep.shape) * keep
        with np.errstate(invalid="ignore", divide="ignore"):
            per_block.append(np.einsum("bhqk,bqk->bh", A, want) / A.sum(axis=(-2, -1)))  # (B, H)
    scores = np.stack(per_block)  # (N, B, H)
    return scores.mean(axis=1)


def attention_rollout(model: Module, cache: Mapping[str, np.ndarray]) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema, 2020): how much each token's output draws on each
    input token, through every block.

    Each block's maps are averaged over heads, the identity is added for the residual
    connection and the rows are renormalised, ``Â_i = (mean_h A_i + I) / rowsum``; the
    rollout after block ``i`` is ``R_i = Â_i @ R_{i-1}`` with ``R_0 = Â_0``. Meant for
    encoders (BERT); on a causal model it stays causal.

    Args:
        model: an attnlab model with hook points.
        cache: from ``model.run_with_cache(...)``; it needs every
            ``blocks.{i}.attn.hook_pattern`` ``(B, H, T, T)``.

    Returns:
        float64 ``(N, B, T, T)`` (``B`` as the cached maps have it): entry ``i`` is the
        rollout through blocks ``0..i``, so ``[-1]`` is the whole model's. Each row sums
        to 1.

    Raises:
        KeyError: a map is not in the cache.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> _, cache = model.run_with_cache(np.array([[1, 2, 3]]))
    >>> rollout = attention_rollout(model, cache)
    >>> rollout.shape, bool(np.allclose(rollout.sum(-1), 1))
    ((2, 1, 3, 3), True)
    >>> rollout[0, 0, 0]
    array([1., 0., 0.])
    """
    layers = blocks(model)
    check_cache(cache)
    out = []
    rollout = None
    for i in range(len(layers)):
        A = cached(cache, PATTERN.format(i=i), "attention_rollout").astype(np.float64).mean(axis=-3)
        A = A + np.eye(A.shape[-1])
        A /= A.sum(axis=-1, keepdims=True)
        rollout = A if rollout is None else A @ rollout
        out.append(rollout)
    return np.stack(out)
