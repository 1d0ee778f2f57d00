"""Attribution patching: every cell of :func:`~attnlab.inspect.activation_patching` estimated
at once from one gradient, ``(a_clean - a_corrupted) . d metric / d a``, in two forward passes
and one backward pass (Nanda 2022); AtP* (Kramar et al. 2024) recomputes the attention
softmax for queries and keys and drops the gradient of one layer at a time (GradDrop).

Shapes: ``N`` blocks, ``H`` query heads, ``H_kv`` key/value heads, ``B`` sequences, ``T``
tokens. Blocks count from 0, as the hook names do.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from attnlab.inspect._grad import check_differentiable, run_with_grads
from attnlab.inspect._model import PATTERN
from attnlab.inspect.interventions import Cells, _choice, same_shape_ids
from attnlab.inspect.metrics import check_metric

__all__ = ["ATTRIBUTION_METHODS", "attribution_patching"]

ATTRIBUTION_METHODS = ("atp", "atp*")
"""``attribution_patching``'s methods: the linear estimate, and AtP*."""

SCORES = "blocks.{i}.attn.hook_attn_scores"
_QK = {"q": ("q", "k"), "k": ("q", "k"), "rot_q": ("rot_q", "rot_k"), "rot_k": ("rot_q", "rot_k")}
_DROP = ("blocks.{i}.hook_attn_out", "blocks.{i}.hook_mlp_out")


def attribution_patching(
    model,
    clean: np.ndarray,
    corrupted: np.ndarray,
    metric: Callable,
    *,
    hook: str = "resid_pre",
    method: str = "atp",
    gradient_at: str = "clean",
    by_position: bool = False,
    graddrop: bool = True,
    **forward_kwargs,
) -> np.ndarray:
    """Estimate the effect of every cell of :func:`~attnlab.inspect.activation_patching` from
    one gradient of ``metric``: ``(a_clean - a_corrupted) . d metric / d a``, summed over the
    cell's elements and the batch.

    Which difference each estimates (``m`` the metric; ``m(x; a <- a')`` the run on ``x``
    with the cell's activation replaced by that of the other run):

    - ``gradient_at="clean"`` (Nanda's attribution patching, the default): the gradient at
      the clean run; estimates ``m(clean) - m(clean; a <- a_corrupted)``, what the clean
      run loses when the cell is corrupted (noising);
    - ``gradient_at="corrupted"``: the gradient at the corrupted run; estimates
      ``m(corrupted; a <- a_clean) - m(corrupted)``, the first-order expansion of exactly
      what ``activation_patching`` runs: plot it beside ``activation_patching(...) -
      metric(model(corrupted))`` (denoising).

    Both are signed so that a positive cell carries the clean run's behaviour. Two forward
    passes and one backward pass give every cell of every block.

    ``method="atp*"`` (Kramar et al. 2024, arXiv 2403.00745) fixes AtP's two failures:

    - saturated attention: for ``q``, ``k`` (``rot_q``, ``rot_k``) the attention weights of
      the patched query or key are recomputed exactly (the softmax of the scores with the
      other run's query or key; one more forward pass) and only the step from the weights
      to the metric is linear. A key's cell changes one column of every query's scores;
      ``by_position=False`` patches every position of the head at once;
    - cancellation (``graddrop=True``): ``N`` more backward passes, the ``l``-th with no
      gradient through block ``l``'s attention and MLP outputs; the cell is
      ``sum_l |estimate_l| / (N - 1)``, a magnitude (>= 0, the sign is lost, as in the
      paper; ``graddrop=False`` keeps the sign). A one-block model has no GradDrop.

    Args:
        model: an attnlab model with hook points and a backward pass (float weights).
        clean, corrupted: token ids of the same shape, ``(B, T)`` or ``(T,)``.
        metric: a metric with ``.grad`` (:func:`~attnlab.inspect.logit_diff`, ...).
        hook: a key of :data:`~attnlab.inspect.PATCH_HOOKS` (``resid_pre``, ``attn_out``,
            ``mlp_out``, ``z``, ``pattern``, ``q``, ``k``, ``v``, ``rot_q``, ``rot_k``).
        method: ``"atp"`` or ``"atp*"``.
        gradient_at: ``"clean"`` or ``"corrupted"``.
        by_position: one cell per (position, head) for the per-head kinds.
        graddrop: with ``"atp*"``, the GradDrop passes.
        **forward_kwargs: passed to every forward pass (e.g. ``attention_mask``).

    Returns:
        float64, :func:`~attnlab.inspect.activation_patching`'s shape: ``(N, T)`` for
        ``resid_pre``, ``attn_out``, ``mlp_out``; ``(N, H)`` per head (``H_kv`` for ``k``,
        ``v``, ``rot_k``: per key/value head under grouped-query attention); ``(N, T, H)``
        with ``by_position=True``.

    Raises:
        ValueError: clean and corrupted of different shapes (no alignment is done); an
            unknown ``hook``, ``method`` or ``gradient_at``, or a hook the model lacks.
        TypeError: a metric without ``.grad``; quantized weights (load the model
            dequantized).

    >>> from attnlab.models import GPT2, GPT2Config
    >>> from attnlab.inspect import logit_diff
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> clean, corrupted = np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]])
    >>> metric = logit_diff(7, 8)
    >>> atp = attribution_patching(model, clean, corrupted, metric)
    >>> atp.shape, bool(np.all(atp[:, 0] == 0))      # position 0 is the same in both runs
    ((2, 4), True)
    >>> attribution_patching(model, clean, corrupted, metric, hook="z", by_position=True).shape
    (2, 4, 2)
    """
    cells = Cells(hook, model, by_position)
    method = _choice(method, "method", ATTRIBUTION_METHODS)
    gradient_at = _choice(gradient_at, "gradient_at", ("clean", "corrupted"))
    check_metric(metric, "attribution_patching")
    check_differentiable(model, "attribution_patching")
    clean_ids, corrupted_ids = same_shape_ids(clean, corrupted)
    base, other = (clean_ids, corrupted_ids) if gradient_at == "clean" else (corrupted_ids, clean_ids)
    sign = 1.0 if gradient_at == "clean" else -1.0  # a_clean - a_corrupted = sign * (a_base - a_other)
    N = len(cells.names)
    qk = method == "atp*" and cells.kind in _QK
    if not qk:
        _, other_cache = model.run_with_cache(other, names_filter=cells.names, **forward_kwargs)
        _, _, base_acts, grads = run_with_grads(model, base, metric, cells.names, **forward_kwargs)
        diffs = [sign * (base_acts[n] - np.asarray(other_cache[n])) for n in cells.names]

        def estimate(grads: dict) -> np.ndarray:
            return np.stack([cells.reduce(d * grads[n]) for d, n in zip(diffs, cells.names, strict=True)])

        grad_names = cells.names
    else:
        estimate, grads, grad_names = _qk_fix(model, cells, base, other, metric, sign, forward_kwargs)
    out = estimate(grads)
    if method == "atp" or not graddrop or N == 1:
        return out if method == "atp" or not graddrop else np.abs(out)
    total = np.zeros_like(out)
    for layer in range(N):
        def drop(g, name):
            return np.zeros_like(g)

        _, _, _, dropped = run_with_grads(model, base, metric, [], grad_names=grad_names,
                                          bwd_hooks=[(t.format(i=layer), drop) for t in _DROP], **forward_kwargs)
        total += np.abs(estimate(dropped))
    return total / (N - 1)


def _qk_fix(model, cells: Cells, base, other, metric, sign: float, forward_kwargs):
    """AtP*'s estimate for queries and keys: ``(estimate(grads), grads, grad names)``, where
    ``estimate`` maps the gradients at the attention weights to the cells.

    The attention scores of the patched query (key) come from one forward pass in which
    every block's queries and keys are set: the other run's queries (keys) against the base
    run's keys (queries); the pattern is then recomputed exactly."""
    q_kind, k_kind = _QK[cells.kind]
    N = len(cells.names)
    qn = [f"blocks.{i}.attn.hook_{q_kind}" for i in range(N)]
    kn = [f"blocks.{i}.attn.hook_{k_kind}" for i in range(N)]
    pn, sn = [PATTERN.format(i=i) for i in range(N)], [SCORES.format(i=i) for i in range(N)]
    _, other_cache = model.run_with_cache(other, names_filter=qn + kn, **forward_kwargs)
    _, _, base_acts, grads = run_with_grads(model, base, metric, qn + kn + pn + sn, grad_names=pn,
                                            **forward_kwargs)
    on_query = cells.kind == q_kind
    forced = {}
    for names, from_other in ((qn, on_query), (kn, not on_query)):
        for n in names:
            forced[n] = np.asarray(other_cache[n]) if from_other else base_acts[n]
    mixed: dict[str, np.ndarray] = {}

    def force(a, name):
        return forced[name]

    def keep(a, name):
        mixed[name] = np.array(a, dtype=np.float64)

    keep.reads_only = True
    model.run_with_hooks(base, fwd_hooks=[(n, force) for n in qn + kn] + [(n, keep) for n in sn], **forward_kwargs)
    H = base_acts[pn[0]].shape[1]
    groups = H // base_acts[kn[0]].shape[-2]  # query heads per key/value head

    def estimate(grads: dict) -> np.ndarray:
        out = []
        for i in range(N):
            A = base_acts[pn[i]].astype(np.float64)  # (B, H, T, S)
            G = grads[pn[i]].astype(np.float64)
            S, S2 = base_acts[sn[i]].astype(np.float64), mixed[sn[i]]
            if on_query or not cells.by_position:  # whole rows of scores change: recompute them
                effect = ((_softmax(S2) - A) * G).sum(axis=-1)  # (B, H, T): per query row
                cell = effect.sum(axis=0)  # (H, T)
                if not on_query:
                    cell = cell.sum(axis=-1)  # every query row of the head: (H,)
            else:  # key s alone: one column of every row
                cell = _key_column_effect(A, G, S, S2).sum(axis=(0, 2))  # (H, S)
            if not on_query:  # per key/value head: the sum over the query heads that share it
                cell = cell.reshape(H // groups, groups, *cell.shape[1:]).sum(axis=1)
            if on_query and not cells.by_position:
                cell = cell.sum(axis=-1)
            out.append(cell.T if cell.ndim == 2 else cell)  # (T, heads) or (heads,)
        # effect = m(base; patched) - m(base): the estimate of m(clean) - m(clean; corrupted) is
        # -effect at the clean run, +effect at the corrupted run.
        return -sign * np.stack(out)

    return estimate, grads, pn


def _softmax(scores: np.ndarray) -> np.ndarray:
    """The softmax over the last axis of masked scores (-inf); a fully masked row gives 0."""
    m = scores.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(scores - m)
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def _key_column_effect(A: np.ndarray, G: np.ndarray, S: np.ndarray, S2: np.ndarray) -> np.ndarray:
    """``(B, H, T, S)``: for each query ``t`` and key ``s``, ``sum_j (A'_j - A_j) G_j`` where
    ``A'`` is row ``t``'s softmax with score ``s`` set to ``S2[t, s]`` (the rest as ``S``).

    With ``d = S2 - S`` and the row's other weights' mass ``m_s = sum_{j != s} A_j``:
    ``A'_j = A_j / Z`` (``j != s``), ``A'_s = A_s e^d / Z``, ``Z = m_s + A_s e^d``, so the
    effect is ``A_s expm1(d) / Z * (G_s m_s - sum_{j != s} A_j G_j)``. The sums without
    ``s`` are taken as prefix plus suffix sums (no ``1 - A_s``: exact for a saturated row)."""
    ok = np.isfinite(S) & np.isfinite(S2)  # a masked key (-inf in both) changes nothing
    d = np.zeros_like(S)
    d[ok] = np.minimum(S2[ok] - S[ok], 700.0)  # e^d stays finite

    def without_self(x):  # sum_{j < s} + sum_{j > s}, no subtraction
        out = np.zeros_like(x)
        out[..., 1:] = np.cumsum(x, axis=-1)[..., :-1]
        out[..., :-1] += np.flip(np.cumsum(np.flip(x, -1), axis=-1), -1)[..., 1:]
        return out

    AG = A * G
    m = without_self(A)
    r = without_self(AG)
    Z = m + A * np.exp(d)
    frac = np.divide(A * np.expm1(d), Z, out=np.zeros_like(A), where=Z > 0)
    return frac * (G * m - r)
