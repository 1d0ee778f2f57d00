"""The public attention functions: validate once, then pick a kernel.

:func:`scaled_dot_product_attention` and its backward run the naive kernel
(:mod:`attnlab.core.naive`), the rows kernel (:mod:`attnlab.core.rows`: float32 with numba,
up to a few thousand keys) or the blockwise one (:mod:`attnlab.core.blockwise`), whichever
is faster for the problem's size; all give the same numbers (to float32 rounding); soft-capped
scores (``softcap``) take the naive kernel. :func:`attention_weights` and
:func:`attention_scores` return the intermediate arrays that the layers, the trace and the
pictures show: they are the naive kernel's own, so what is shown is what is computed.
:func:`apply_attention_weights` is the last step, ``weights @ value`` (grouped-query heads
too); with :func:`attention_scores_backward` and
:func:`~attnlab.core.softmax.softmax_backward` it takes a gradient back through a layer that
holds its own weights (to hook or read them) the way
:func:`scaled_dot_product_attention_backward` takes it through the whole.
Axis legend: see :mod:`attnlab.core.spec`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attnlab._cpu import cpu_info
from attnlab._validation import as_float_array
from attnlab.core import blockwise, blockwise_xp, naive, rows
from attnlab.core._namespace import as_dtype, is_numpy, mT
from attnlab.core.spec import (
    AttentionSpec,
    check_attention_args,
    check_grad,
    check_grad_out,
    check_keys_args,
    check_weights_args,
    reduce_to,
)

__all__ = [
    "apply_attention_weights",
    "apply_attention_weights_backward",
    "attention_scores",
    "attention_scores_backward",
    "attention_weights",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "simple_attention",
]


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """Attention as ``torch.nn.functional.scaled_dot_product_attention`` computes it.

    Equivalent to::

        scores = query @ key.swapaxes(-1, -2) * scale     # (..., Hq, L, S)
        scores = softcap * tanh(scores / softcap)          # only if softcap is given
        scores[~attn_mask] = -inf  or  scores += attn_mask # bool or float mask
        weights = softmax(scores, axis=-1)                 # rows sum to 1
        weights = dropout(weights, dropout_p, rng)         # only if dropout_p > 0
        return weights @ value                             # (..., Hq, L, Ev)

    A query with nothing to attend to (a fully masked row, or ``S == 0``) outputs zeros,
    never NaN; a row masked everywhere with the same finite value (``-1e9``,
    ``finfo.min``) is a uniform average, as in torch. NaN or inf in the inputs propagate.
    float32 and float64 are kept; float16 is computed in float32 and returned as float16.

    Args:
        query: ``(..., Hq, L, E)`` (any leading dims; ``(L, E)`` works too).
        key: ``(..., H, S, E)``; ``H == Hq`` unless ``enable_gqa``.
        value: ``(..., H, S, Ev)``.
        attn_mask: bool (True = takes part) or float (added to the scores), broadcastable
            to ``(..., Hq, L, S)``. Not together with ``is_causal``.
        dropout_p: probability of dropping a weight; dropout happens only if ``> 0``.
        is_causal: apply a top-left aligned causal mask (query ``i`` sees keys ``j <= i``).
            For bottom-right alignment pass ``causal_mask(L, S, align="bottom-right")``.
        scale: factor on the scores; ``None`` means ``1 / sqrt(E)``.
        enable_gqa: grouped-query attention: each of the ``H`` key/value heads serves
            ``Hq // H`` consecutive query heads (``repeat_interleave``, as in torch).
        rng: the ``np.random.Generator`` that draws the dropout mask; ``None`` takes a
            fresh unseeded one.
        softcap: soft-capping of the scores (Gemma 2's attention-logit soft-cap; the name
            is flash-attn's): the scaled scores ``s`` become ``softcap * tanh(s / softcap)``,
            so ``|s| < softcap``, before the mask and the softmax, in the order
            ``transformers``' Gemma 2 computes them. ``None``: off. Not in torch's function.

    Returns:
        ``(..., Hq, L, Ev)``, the dtype of ``query``.

    Raises:
        TypeError: non-float or mixed dtypes, a mask that is neither bool nor float, a
            ``softcap`` that is not a number.
        ValueError: shapes that do not fit (the message names the argument and both
            shapes), both ``attn_mask`` and ``is_causal``, ``dropout_p`` outside ``[0, 1)``,
            ``softcap`` not positive and finite.

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 4, 8))  # each (H=2, L=S=4, E=8)
    >>> scaled_dot_product_attention(q, k, v, is_causal=True).shape
    (2, 4, 8)
    >>> capped = scaled_dot_product_attention(q, k, v, is_causal=True, softcap=0.5)
    >>> bool(np.allclose(capped, attention_weights(q, k, is_causal=True, softcap=0.5) @ v))
    True
    """
    spec = check_attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                softcap=softcap)
    if not is_numpy(query, key, value, attn_mask):  # another array library: the Array API kernels
        return _other_library(spec, "forward", rng=rng)
    work = widened(spec)
    kernel = kernel_for(work)
    if kernel == "rows":
        out = rows.forward(work)
    elif kernel == "blockwise":
        out = blockwise.forward_spec(work)
    else:
        out = naive.forward(work, rng=rng)
    return out.astype(spec.query.dtype, copy=False)


def kernel_for(spec: AttentionSpec, *, backward: bool = False, why: list | None = None) -> str:
    """The kernel the dispatcher runs for ``spec`` (NumPy arrays, widened to the compute
    dtype by :func:`widened`): ``"rows"`` (:mod:`attnlab.core.rows`), ``"blockwise"`` or
    ``"naive"`` (always for soft-capped scores). The one place the choice is made, so a
    benchmark can name it; ``why``: a list that gets the reasons, in words (:func:`explain`).

    >>> from attnlab.core.spec import check_attention_args
    >>> q = np.zeros((1, 2, 4, 8), dtype=np.float32)
    >>> kernel_for(check_attention_args(q, q, q))   # tiny problems keep the reference kernel
    'naive'
    """
    if spec.softcap is not None:
        if why is not None:
            why.append("soft-capped scores: the naive path (the rows and blockwise kernels have no soft-cap)")
        return "naive"
    if rows.planned(spec, backward=backward, why=why):
        return "rows"
    return "blockwise" if use_blockwise(spec, why=why) else "naive"


def explain(spec: AttentionSpec, *, backward: bool = False) -> list[str]:
    """Which kernel :func:`scaled_dot_product_attention` (``backward``: its backward) runs
    for ``spec`` on this machine, with which blocks and threads, and why: lines of text
    (``attnlab bench --explain-dispatch``). The CPU is :func:`attnlab._cpu.cpu_info`'s
    (``ATTNLAB_CPU`` or :func:`attnlab._cpu.pinned_cpu` describe another).

    >>> from attnlab.core.spec import check_attention_args
    >>> q = np.zeros((1, 2, 4, 8), dtype=np.float32)
    >>> explain(check_attention_args(q, q, q))[0]
    'kernel: naive'
    """
    from attnlab._tuning import thresholds

    work = widened(spec)
    why: list[str] = []
    kernel = kernel_for(work, backward=backward, why=why)
    lines = [f"kernel: {kernel}", *(f"  {w}" for w in why)]
    if kernel == "rows":
        lines.append("  " + rows.describe_blocks(work, backward=backward))
    elif kernel == "blockwise":
        plan = blockwise._plan(work, None, None, None, None)
        n = len(plan.heads) * plan.L * plan.S
        threads = 1 if n < plan.min_scores_per_thread else plan.threads
        tiles = f"{plan.bq} x {plan.bk}" if backward else f"{plan.bq} x {plan.bk_forward}"
        lines.append(f"  tiles of {tiles} (query rows x keys: {blockwise.tuning().source}); element-wise pass "
                     f"{'compiled' if plan.fused else 'NumPy'}; {threads} thread(s) ({n} scores "
                     f"{'>=' if n >= plan.min_scores_per_thread else '<'} {plan.min_scores_per_thread})")
    lines.append("  thresholds from: " + thresholds().profile.line())
    return lines


def widened(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with inputs narrower than float32 (float16) cast to float32, the dtype both
    kernels compute in; other specs unchanged. Callers cast results back."""
    dtype = blockwise.compute_dtype(spec.query.dtype)
    if dtype == spec.query.dtype:
        return spec
    mask = spec.attn_mask
    if mask is not None and mask.dtype != np.bool_:
        mask = mask.astype(dtype)
    return dataclasses.replace(
        spec, query=spec.query.astype(dtype), key=spec.key.astype(dtype),
        value=spec.value.astype(dtype), attn_mask=mask,
    )


# Where the blockwise kernel beats materialising the scores (forward, bool key-padding
# mask, E = 32, 12 heads, batches of about 4000 query rows; the naive path's softmax runs
# in place, block by block):
# - the scores of all heads together no longer fit in twice the per-core L2 cache (the
#   naive path's passes over them then stream from L3 or memory), and
# - each head has at least 256 x 256 scores (NumPy pass), or 192 x 192 when the compiled
#   pass runs, so that per-tile costs stay small.
# On a 2-core AVX2 EPYC (512 KiB L2), blockwise time / naive time, one thread, NumPy pass
# then compiled: T = 180: 1.47, 1.06; T = 192: 1.34, 0.97; T = 250: 1.20, 0.88; T = 384:
# 0.98, 0.71; T = 512: 0.90, 0.67. Two threads: T = 180: 1.55, 1.05; 192: 1.46, 0.98;
# 250: 1.04, 0.72; 384: 0.71, 0.47.
BLOCKWISE_MIN_SCORES_PER_HEAD = 256 * 256
BLOCKWISE_MIN_SCORES_PER_HEAD_FUSED = 192 * 192


def blockwise_min_score_bytes() -> int:
    """All heads' scores (in bytes) from which the blockwise kernel runs: twice this CPU's
    per-core L2 cache (:func:`attnlab._cpu.cpu_info`).

    >>> blockwise_min_score_bytes() >= 2 * 1024
    True
    """
    return 2 * cpu_info().l2


def use_blockwise(spec: AttentionSpec, *, why: list | None = None) -> bool:
    """The blockwise kernel is exact for everything but dropout; pick it where it is faster
    (see :data:`BLOCKWISE_MIN_SCORES_PER_HEAD` and :func:`blockwise_min_score_bytes`).
    ``why``: a list that gets the reason, in words."""
    dtype = spec.query.dtype
    if spec.dropout_p > 0 or dtype not in (np.float32, np.float64):
        return rows._because(why, False, "blockwise: no dropout, float32 or float64 only: the naive path")
    per_head = spec.L * spec.S
    heads = math.prod(spec.batch_shape)
    nbytes, least = per_head * heads * dtype.itemsize, blockwise_min_score_bytes()
    if nbytes < least:
        return rows._because(why, False, f"blockwise: all heads' scores, {nbytes // 1024} KiB, fit in twice the "
                             f"{least // 2048} KiB L2: the naive path")
    fused = blockwise.fused_planned(dtype, per_head * heads)
    need = BLOCKWISE_MIN_SCORES_PER_HEAD_FUSED if fused else BLOCKWISE_MIN_SCORES_PER_HEAD
    return rows._because(why, per_head >= need, f"blockwise: {nbytes // 1024} KiB of scores >= twice the "
                         f"{least // 2048} KiB L2, {per_head} scores a head {'>=' if per_head >= need else '<'} "
                         f"{need} ({'compiled' if fused else 'NumPy'} element-wise pass)")


def attention_scores(
    query: np.ndarray,
    key: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
) -> np.ndarray:
    """The masked, scaled scores ``query @ key^T * scale + mask``: ``(..., Hq, L, S)``.

    What :func:`attention_weights` feeds its softmax: a bool mask's False entries (and, with
    ``is_causal``, the future keys) are ``-inf``, a float mask is added; with ``softcap``
    the scaled scores are soft-capped first (``softcap * tanh(s / softcap)``). The same
    arguments as :func:`scaled_dot_product_attention` without value and dropout.

    >>> q = k = np.eye(2)
    >>> attention_scores(q, k, is_causal=True, scale=1.0)
    array([[ 1., -inf],
           [ 0.,  1.]])
    >>> attention_scores(q, k, scale=4.0, softcap=2.0).round(3)  # 2 tanh(4 / 2), 2 tanh(0)
    array([[1.928, 0.   ],
           [0.   , 1.928]])
    """
    spec = check_keys_args(query, key, attn_mask, 0.0, is_causal, scale, enable_gqa, softcap=softcap)
    if not is_numpy(query, key, attn_mask):  # another array library: computed in its namespace
        return _other_library(spec, "scores")
    return naive.scores(widened(spec)).astype(spec.query.dtype, copy=False)


def attention_weights(
    query: np.ndarray,
    key: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """The attention weights ``dropout(softmax(query @ key^T * scale + mask))``: ``(..., Hq, L, S)``.

    The same arguments and semantics as :func:`scaled_dot_product_attention` without
    ``value``; ``scaled_dot_product_attention(q, k, v, ...)`` equals
    ``attention_weights(q, k, ...) @ v`` (for the same ``rng`` state with dropout, since
    both draw the same mask). Each row sums to 1 (before dropout), or is all zeros when
    every key is masked. For teaching, inspection and pictures; the layers return these
    as their ``need_weights`` maps.

    >>> q = k = np.eye(3)
    >>> attention_weights(q, k, is_causal=True).round(2)
    array([[1.  , 0.  , 0.  ],
           [0.36, 0.64, 0.  ],
           [0.26, 0.26, 0.47]])
    """
    spec = check_keys_args(query, key, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap=softcap)
    if not is_numpy(query, key, attn_mask):  # another array library: computed in its namespace
        return _other_library(spec, "weights", rng=rng)
    return naive.weights(widened(spec), rng=rng).astype(spec.query.dtype, copy=False)


def scaled_dot_product_attention_backward(
    grad_out: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    rng: np.random.Generator | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of a loss through :func:`scaled_dot_product_attention`.

    Recomputes the forward pass's weights. With ``dropout_p > 0`` pass a Generator in the
    same state as the forward pass had (e.g. a fresh ``np.random.default_rng(seed)`` with
    the same seed): it draws the same dropout mask.

    Args:
        grad_out: dLoss/doutput, ``(..., Hq, L, Ev)``.
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rng, softcap:
            as given to the forward pass.

    Returns:
        ``(grad_query, grad_key, grad_value)`` with the shapes of ``query``, ``key`` and
        ``value`` (GQA and broadcast dims summed back).

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 4, 8))
    >>> dq, dk, dv = scaled_dot_product_attention_backward(np.ones((4, 8)), q, k, v)
    >>> dq.shape, dk.shape, dv.shape
    ((4, 8), (4, 8), (4, 8))
    """
    spec = check_attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                softcap=softcap)
    grad_out = check_grad_out(spec, grad_out)
    if not is_numpy(grad_out, query, key, value, attn_mask):  # another array library: the Array API kernels
        return _other_library(spec, "backward", grad_out=grad_out, rng=rng)
    work = widened(spec)
    grad_out = grad_out.astype(work.query.dtype, copy=False)
    kernel = kernel_for(work, backward=True)
    if kernel == "rows":
        grads = rows.backward(work, grad_out)
    elif kernel == "blockwise":
        grads = blockwise.backward_from_spec(work, grad_out)
    else:
        grads = naive.backward(work, grad_out, rng=rng)
    return tuple(g.astype(spec.query.dtype, copy=False) for g in grads)


def attention_scores_backward(
    grad_scores: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of a loss through :func:`attention_scores`.

    The scores' gradient goes back through the soft-cap (``1 - tanh^2``, recomputed) and
    the product ``query @ key^T * scale``. Entries that a bool mask or ``is_causal`` set to
    ``-inf`` are constants and take no gradient; a float mask passes it on.

    Args:
        grad_scores: dLoss/dscores, ``(..., Hq, L, S)``.
        query, key, attn_mask, is_causal, scale, enable_gqa, softcap: as given to
            :func:`attention_scores`.

    Returns:
        ``(grad_query, grad_key)`` with the shapes of ``query`` and ``key`` (grouped-query
        and broadcast dims summed back).

    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 3, 4))
    >>> dq, dk = attention_scores_backward(np.ones((3, 3)), q, k, scale=1.0)
    >>> bool(np.allclose(dq, np.ones((3, 3)) @ k)), bool(np.allclose(dk, np.ones((3, 3)).T @ q))
    (True, True)
    """
    spec = check_keys_args(query, key, attn_mask, 0.0, is_causal, scale, enable_gqa, softcap=softcap)
    grad_scores = check_grad_out(spec, grad_scores, name="grad_scores", scores=True)
    if not is_numpy(grad_scores, query, key, attn_mask):  # another array library: in its namespace
        return _other_library(spec, "scores_backward", grad_out=grad_scores)
    work = widened(spec)
    grads = naive.scores_backward(work, grad_scores.astype(work.query.dtype, copy=False))
    return tuple(g.astype(spec.query.dtype, copy=False) for g in grads)


def apply_attention_weights(weights: np.ndarray, value: np.ndarray, *, enable_gqa: bool = False) -> np.ndarray:
    """The last step of attention, ``weights @ value``: ``(..., Hq, L, Ev)``.

    With ``enable_gqa`` each of the ``H`` value heads serves ``Hq // H`` consecutive query
    heads (as in :func:`scaled_dot_product_attention`), without copying the values.
    ``scaled_dot_product_attention(q, k, v, ...)`` equals
    ``apply_attention_weights(attention_weights(q, k, ...), v)``.

    Args:
        weights: ``(..., Hq, L, S)``, e.g. from :func:`attention_weights`.
        value: ``(..., H, S, Ev)``; ``H == Hq`` unless ``enable_gqa``.
        enable_gqa: grouped-query heads.

    Returns:
        ``(..., Hq, L, Ev)``, the dtype of ``weights``.

    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 4, 5, 8))            # each (H=4, L=S=5, E=8)
    >>> w = attention_weights(q, k[:2], enable_gqa=True)      # two key/value heads
    >>> out = apply_attention_weights(w, v[:2], enable_gqa=True)
    >>> bool(np.allclose(out, scaled_dot_product_attention(q, k[:2], v[:2], enable_gqa=True)))
    True
    """
    w, v, groups, _, xp = check_weights_args(weights, value, enable_gqa)
    if xp is not np:
        return naive.grouped_matmul(w, v, groups)
    dtype = blockwise.compute_dtype(w.dtype)
    return naive.grouped_matmul(w.astype(dtype, copy=False), v.astype(dtype, copy=False), groups).astype(
        w.dtype, copy=False)


def apply_attention_weights_backward(
    grad_out: np.ndarray, weights: np.ndarray, value: np.ndarray, *, enable_gqa: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of a loss through :func:`apply_attention_weights`.

    Args:
        grad_out: dLoss/doutput, ``(..., Hq, L, Ev)``.
        weights, value, enable_gqa: as given to the forward pass.

    Returns:
        ``(grad_weights, grad_value)`` with the shapes of ``weights`` and ``value``
        (grouped-query and broadcast dims summed back).

    >>> w, v = np.full((2, 3), 0.5), np.ones((3, 4))
    >>> dw, dv = apply_attention_weights_backward(np.ones((2, 4)), w, v)
    >>> dw.tolist(), dv.shape
    ([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]], (3, 4))
    """
    w, v, groups, batch, xp = check_weights_args(weights, value, enable_gqa)
    g = check_grad(grad_out, "grad_out", (*batch, w.shape[-2], v.shape[-1]), "the output's shape", xp, weights=w)
    if xp is np:
        dtype = blockwise.compute_dtype(w.dtype)
        g, w, v = (a.astype(dtype, copy=False) for a in (g, w, v))
    grad_w = reduce_to(naive.grouped_matmul(g, mT(v), groups), tuple(weights.shape), 1)
    grad_v = reduce_to(mT(w) @ g, tuple(value.shape), groups)
    return as_dtype(grad_w, weights.dtype), as_dtype(grad_v, weights.dtype)


# ---- arrays of other libraries (torch, CuPy, JAX, ...) -------------------------------------------


def kernel_for_other_library(spec: AttentionSpec) -> str:
    """The kernel for arrays of another library: ``"blockwise"`` (:mod:`attnlab.core.blockwise_xp`,
    no ``(L, S)`` matrix) from :data:`attnlab.core.blockwise_xp.MIN_SCORES` scores without
    dropout, else ``"naive"``. Sizes alone decide: nothing here depends on the host.

    >>> import array_api_strict as xs
    >>> q = xs.zeros((1, 2, 8192, 8))
    >>> kernel_for_other_library(check_attention_args(q, q, q)), kernel_for_other_library(
    ...     check_attention_args(q[:, :, :64, :], q, q))
    ('blockwise', 'naive')
    """
    if spec.softcap is not None:  # the blockwise kernel has no soft-cap
        return "naive"
    return "blockwise" if blockwise_xp.use_blockwise(spec) else "naive"


def _other_library(spec: AttentionSpec, what: str, *, grad_out=None, rng=None):
    """``what`` (forward, backward, weights, scores, scores_backward) for another library's
    arrays: computed in
    float32 for narrower inputs (:func:`attnlab.core.blockwise_xp.widened`), JAX's matmuls at
    full precision (:func:`attnlab.core.blockwise_xp.matmul_precision`), results in the
    inputs' dtype."""
    work = blockwise_xp.widened(spec)
    dtype = spec.query.dtype
    with blockwise_xp.matmul_precision(spec.xp):
        if what == "scores":
            return as_dtype(naive.scores(work), dtype)
        if what == "weights":
            return as_dtype(naive.weights(work, rng=rng), dtype)
        if what == "scores_backward":
            grads = naive.scores_backward(work, as_dtype(grad_out, work.query.dtype))
            return tuple(as_dtype(g, dtype) for g in grads)
        blocks = kernel_for_other_library(work) == "blockwise"
        if what == "forward":
            out = blockwise_xp.forward(work) if blocks else naive.forward(work, rng=rng)
            return as_dtype(out, dtype)
        grad_out = as_dtype(grad_out, work.query.dtype)
        grads = blockwise_xp.backward(work, grad_out) if blocks else naive.backward(work, grad_out, rng=rng)
        return tuple(as_dtype(g, dtype) for g in grads)


def simple_attention(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weight-free self-attention: the inputs are their own queries, keys and values.

    ``scores = x @ x^T`` (no scaling), ``weights = softmax(scores)``, ``context = weights @ x``.

    Args:
        x: ``(..., T, D)`` token vectors.

    Returns:
        ``(context (..., T, D), weights (..., T, T))``.

    >>> x = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
    ...               [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
    >>> context, weights = simple_attention(x)   # "Your journey starts with one step"
    >>> weights[1].round(4)                       # how "journey" attends
    array([0.1385, 0.2379, 0.2333, 0.124 , 0.1082, 0.1581])
    >>> context[1].round(4)
    array([0.4419, 0.6515, 0.5683])
    """
    x = as_float_array(x, "x", min_ndim=2, layout="(..., T, D)")
    spec = widened(check_attention_args(x, x, x, scale=1.0))
    w = naive.weights(spec)
    return np.matmul(w, spec.full_value).astype(x.dtype, copy=False), w.astype(x.dtype, copy=False)
