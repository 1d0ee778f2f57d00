"""Changing activations during a forward pass: head ablation and activation patching, both
through ``model.run_with_hooks`` (a hook returns the replacement array).

Shapes: ``N`` blocks, ``H`` query heads, ``B`` sequences, ``T`` tokens, ``D`` head width.
Blocks count from 0, as the hook names do (block ``i`` is attnlab's layer ``i + 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from attnlab.inspect._model import ATTN_OUT, MLP_OUT, PATTERN, RESID_PRE, Z, blocks, num_heads, token_ids
from attnlab.nn.module import Module

__all__ = ["ABLATIONS", "PATCH_HOOKS", "ablate_heads", "activation_patching"]

ABLATIONS = ("zero", "mean")
"""What ``ablate_heads`` can replace a head's output (``hook_z``) with: zeros, or its mean
over the batch and positions."""
PATCH_HOOKS = {"resid_pre": RESID_PRE, "attn_out": ATTN_OUT, "mlp_out": MLP_OUT, "z": Z, "pattern": PATTERN,
               "q": "blocks.{i}.attn.hook_q", "k": "blocks.{i}.attn.hook_k", "v": "blocks.{i}.attn.hook_v",
               "rot_q": "blocks.{i}.attn.hook_rot_q", "rot_k": "blocks.{i}.attn.hook_rot_k"}
"""The activations ``activation_patching`` and ``attribution_patching`` patch, by short name:
the hook point (in each block, counted from 0) that each names. ``resid_pre``, ``attn_out``
and ``mlp_out`` ``(B, T, E)`` have a cell per position; the others one per head: ``z``,
``q``, ``rot_q`` ``(B, T, H, D)``, ``k``, ``v``, ``rot_k`` ``(B, T, H_kv, D)`` (per key/value
head under grouped-query attention) and ``pattern`` ``(B, H, T, S)``; ``rot_q`` and
``rot_k`` (the rotated queries and keys) only in models with rotary positions."""


class Cells:
    """How an activation of one hook kind splits into cells: the axes (counted from the
    end, as an unbatched call drops the batch axis of the residual stream only) of the
    position and of the head (None: no head axis). ``pattern``'s position is the query's."""

    def __init__(self, kind: str, model, by_position: bool) -> None:
        self.kind = _choice(kind, "hook", tuple(PATCH_HOOKS))
        self.template = PATCH_HOOKS[kind]
        N = len(blocks(model))
        self.names = [self.template.format(i=i) for i in range(N)]
        known = set(model.hook_names())
        missing = [n for n in self.names if n not in known]
        if missing:
            why = " (its attention has no rotary positions)" if kind.startswith("rot_") else ""
            raise ValueError(f"hook {kind!r}: {type(model).__name__} has no hook point {missing[0]}{why}")
        self.pos_axis, self.head_axis = {"pattern": (-2, -3)}.get(
            kind, (-2, None) if kind in ("resid_pre", "attn_out", "mlp_out") else (-3, -2))
        if by_position not in (True, False):
            raise TypeError(f"by_position must be a bool, got {by_position!r}")
        if by_position and self.head_axis is None:
            raise ValueError(f"by_position=True splits a per-head kind by position too; hook={kind!r} already "
                             "has one cell per position")
        self.by_position = by_position

    def count(self, a: np.ndarray) -> tuple[int, ...]:
        """The cells of one block's activation ``a``: ``(T,)``, ``(H,)`` or ``(T, H)``."""
        if self.head_axis is None:
            return (a.shape[self.pos_axis],)
        if self.by_position:
            return a.shape[self.pos_axis], a.shape[self.head_axis]
        return (a.shape[self.head_axis],)

    def index(self, a: np.ndarray, cell: tuple[int, ...]) -> tuple:
        """The index of one cell in ``a``."""
        sl = [slice(None)] * a.ndim
        if self.head_axis is None:
            sl[self.pos_axis] = cell[0]
        elif self.by_position:
            sl[self.pos_axis], sl[self.head_axis] = cell
        else:
            sl[self.head_axis] = cell[0]
        return tuple(sl)

    def reduce(self, a: np.ndarray) -> np.ndarray:
        """``a`` (an activation-shaped array) summed over everything but the cell axes,
        float64, cells in the order of :meth:`count`."""
        keep = [self.pos_axis] if self.head_axis is None else \
            ([self.pos_axis, self.head_axis] if self.by_position else [self.head_axis])
        keep = [k % a.ndim for k in keep]
        out = a.astype(np.float64, copy=False).sum(axis=tuple(i for i in range(a.ndim) if i not in keep))
        return out.T if len(keep) == 2 and keep[0] > keep[1] else out


def _choice(value: object, name: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _heads(heads: object, N: int, H: int) -> dict[int, list[int]]:
    """``heads``, a list of ``(block, head)``, as block -> heads; errors name the pair."""
    if isinstance(heads, str) or not isinstance(heads, Sequence):
        raise TypeError(f"heads must be a list of (block, head) pairs, got {type(heads).__name__}")
    chosen: dict[int, list[int]] = {}
    for n, pair in enumerate(heads):
        ok = (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
              and all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in pair))
        if not ok:
            raise TypeError(f"heads[{n}] must be a (block, head) pair of ints, got {pair!r}")
        i, h = int(pair[0]), int(pair[1])
        if not 0 <= i < N:
            raise ValueError(f"heads[{n}] = {tuple(pair)}: block {i} is out of range for a model with {N} "
                             f"blocks (0..{N - 1})")
        if not 0 <= h < H:
            raise ValueError(f"heads[{n}] = {tuple(pair)}: head {h} is out of range for blocks with {H} "
                             f"heads (0..{H - 1})")
        chosen.setdefault(i, [])
        if h not in chosen[i]:
            chosen[i].append(h)
    return chosen


def ablate_heads(
    model: Module,
    inputs: np.ndarray,
    heads: Sequence[tuple[int, int]],
    how: str = "zero",
    **forward_kwargs,
):
    """The model's output with some attention heads knocked out.

    A head is ablated at ``blocks.{i}.attn.hook_z`` ``(B, T, H, D)``, its output before
    the output projection: ``"zero"`` sets it to 0; ``"mean"`` sets it to its mean over
    the batch and the positions of a clean run of the same ``inputs`` (every position
    counts, padded ones too). Other heads, and the output bias, are untouched.

    Args:
        model: any attnlab model with hook points.
        inputs: what the model's forward takes first (token ids ``(B, T)``).
        heads: ``(block, head)`` pairs, blocks from 0; an empty list ablates nothing.
        how: ``"zero"`` or ``"mean"``.
        **forward_kwargs: passed to the forward pass (e.g. ``attention_mask``).

    Returns:
        What the forward pass returns (a decoder's logits ``(B, T, V)``).

    Raises:
        ValueError: an unknown ``how``, a block or head index out of range.
        TypeError: ``heads`` that are not ``(block, head)`` pairs of ints.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> ids = np.array([[1, 2, 3, 4]])
    >>> ablate_heads(model, ids, [(1, 0), (0, 1)]).shape
    (1, 4, 50)
    >>> ablate_heads(model, ids, [(2, 0)])
    Traceback (most recent call last):
    ...
    ValueError: heads[0] = (2, 0): block 2 is out of range for a model with 2 blocks (0..1)
    """
    how = _choice(how, "how", ABLATIONS)
    N, H = len(blocks(model)), num_heads(model)
    chosen = _heads(heads, N, H)
    fills: dict[int, np.ndarray | None] = dict.fromkeys(chosen)
    if how == "mean" and chosen:
        _, clean = model.run_with_cache(inputs, names_filter=[Z.format(i=i) for i in chosen], **forward_kwargs)
        for i in chosen:
            z = np.asarray(clean[Z.format(i=i)])
            fills[i] = z.reshape(-1, *z.shape[-2:]).mean(axis=0)  # (H, D)

    def ablation(i: int) -> Callable:
        hs, fill = chosen[i], fills[i]

        def hook(z: np.ndarray, name: str) -> np.ndarray:
            z = z.copy()
            for h in hs:
                z[..., h, :] = 0 if fill is None else fill[h]
            return z

        return hook

    return model.run_with_hooks(inputs, fwd_hooks=[(Z.format(i=i), ablation(i)) for i in chosen], **forward_kwargs)


def activation_patching(
    model: Module,
    clean: np.ndarray,
    corrupted: np.ndarray,
    metric: Callable[[object], float],
    hook: str = "resid_pre",
    *,
    by_position: bool = False,
    cells_per_pass: int = 1,
    **forward_kwargs,
) -> np.ndarray:
    """The metric after patching one activation at a time from the clean run into the
    corrupted one.

    ``clean`` runs once and its activations are cached. Then for every block ``i`` and
    every cell, ``corrupted`` runs with that one slice replaced by the clean run's, at
    every sequence of the batch, and ``metric(output)`` is recorded. The cells
    (:data:`PATCH_HOOKS` names the hook points):

    - ``"resid_pre"``: ``blocks.{i}.hook_resid_pre[:, p]``, the residual entering block ``i``,
      at each position ``p``; ``"attn_out"`` and ``"mlp_out"`` the same of the attention's
      and the MLP's output;
    - ``"z"``: ``blocks.{i}.attn.hook_z[:, :, h]``, head ``h``'s output at every position;
      ``"q"``, ``"k"``, ``"v"`` (``"rot_q"``, ``"rot_k"``) its queries, keys (per key/value
      head under grouped-query attention), values (the rotated ones); ``"pattern"``:
      ``hook_pattern[:, h]``, its attention weights;
    - with ``by_position=True`` a per-head kind has a cell per (position, head):
      ``hook_z[:, p, h]``, ``hook_pattern[:, h, p]`` (query position ``p``).

    Args:
        model: any attnlab model with hook points.
        clean, corrupted: token ids of the same shape, ``(B, T)`` or ``(T,)``.
        metric: output of the forward pass (a decoder's logits) -> a number, e.g. a logit
            difference (:func:`~attnlab.inspect.logit_diff`).
        hook: a key of :data:`PATCH_HOOKS`.
        by_position: one cell per (position, head) for the per-head kinds.
        cells_per_pass: patch this many cells of one block in one forward pass, the
            corrupted batch repeated once per cell (the metric then sees each copy's output
            alone); the same numbers up to float rounding, fewer passes over the weights.
            Array keyword arguments (``attention_mask``) are repeated with the batch.
        **forward_kwargs: passed to every forward pass (e.g. ``attention_mask``).

    Returns:
        float64 ``(N, T)`` for the residual kinds; ``(N, H)`` per head (``H_kv`` for
        ``k``, ``v``, ``rot_k``), ``(N, T, H)`` with ``by_position``.

    Raises:
        ValueError: ``clean`` and ``corrupted`` of different shapes (lengths), an unknown
            ``hook`` or one the model does not have (``rot_k`` without rotary positions),
            ``by_position`` with a residual kind.
        TypeError: ``metric`` not callable, or returning something that is not one number.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> clean, corrupted = np.array([[1, 2, 3, 4]]), np.array([[1, 5, 3, 4]])
    >>> metric = lambda logits: logits[0, -1, 7]
    >>> effect = activation_patching(model, clean, corrupted, metric)
    >>> effect.shape, bool(np.isclose(effect[0, 1], metric(model(clean)), atol=1e-5))
    ((2, 4), True)
    >>> activation_patching(model, clean, corrupted, metric, hook="z").shape
    (2, 2)
    """
    cells = Cells(hook, model, by_position)
    if not callable(metric):
        raise TypeError(f"metric must be a callable (output -> number), got {type(metric).__name__}")
    clean_ids, corrupted_ids = same_shape_ids(clean, corrupted)
    if isinstance(cells_per_pass, bool) or not isinstance(cells_per_pass, int | np.integer) or cells_per_pass < 1:
        raise ValueError(f"cells_per_pass must be an int >= 1, got {cells_per_pass!r}")
    names = cells.names
    if cells_per_pass > 1:
        return _patch_in_batches(model, cells, clean_ids, corrupted_ids, metric, int(cells_per_pass), forward_kwargs)
    _, cache = model.run_with_cache(clean_ids, names_filter=names, **forward_kwargs)
    out = None
    for i, name in enumerate(names):
        source = np.asarray(cache[name])
        count = cells.count(source)
        if out is None:
            out = np.empty((len(names), *count))
        for cell in np.ndindex(*count):
            sl = cells.index(source, cell)

            def patch(a: np.ndarray, _name: str, sl=sl, source=source) -> np.ndarray:
                a = a.copy()
                a[sl] = source[sl]
                return a

            value = metric(model.run_with_hooks(corrupted_ids, fwd_hooks=[(name, patch)], **forward_kwargs))
            out[(i, *cell)] = _number(value)
    return out


def _patch_in_batches(model, cells: Cells, clean_ids, corrupted_ids, metric, k: int, forward_kwargs) -> np.ndarray:
    """activation_patching with ``k`` cells of a block per forward pass: the corrupted batch
    repeated ``k`` times, copy ``j`` with cell ``j`` patched."""
    single = corrupted_ids.ndim == 1
    base, clean_b = (corrupted_ids[None], clean_ids[None]) if single else (corrupted_ids, clean_ids)
    B = base.shape[0]

    kwargs = {key: v[None] if single and isinstance(v, np.ndarray) else v for key, v in forward_kwargs.items()}
    _, cache = model.run_with_cache(clean_b, names_filter=cells.names, **kwargs)
    out = None
    for i, name in enumerate(cells.names):
        source = np.asarray(cache[name])  # (B, ...)
        count = cells.count(source)
        if out is None:
            out = np.empty((len(cells.names), *count))
        todo = list(np.ndindex(*count))
        for start in range(0, len(todo), k):
            chunk = todo[start:start + k]
            n = len(chunk)

            def patch(a: np.ndarray, _name: str, chunk=chunk, source=source, n=n) -> np.ndarray:
                a = a.copy()
                copies = a.reshape(n, B, *a.shape[1:])  # a view: the copies of the batch
                for j, cell in enumerate(chunk):
                    sl = cells.index(source, cell)
                    copies[j][sl] = source[sl]
                return a

            reps = {key: np.concatenate([v] * n) if isinstance(v, np.ndarray) and v.ndim and v.shape[0] == B else v
                    for key, v in kwargs.items()}
            result = model.run_with_hooks(np.concatenate([base] * n), fwd_hooks=[(name, patch)], **reps)
            if not isinstance(result, np.ndarray) or result.shape[0] != n * B:
                raise TypeError("cells_per_pass > 1 needs a model whose output is an array with the batch first "
                                f"(got {type(result).__name__})")
            for j, cell in enumerate(chunk):
                part = result[j * B:(j + 1) * B]
                out[(i, *cell)] = _number(metric(part[0] if single else part))
    return out


def same_shape_ids(clean: object, corrupted: object) -> tuple[np.ndarray, np.ndarray]:
    """The two runs' token ids, checked to have one shape (cells are compared position by
    position: there is no alignment of texts of different lengths)."""
    clean_ids, corrupted_ids = token_ids(clean, "clean"), token_ids(corrupted, "corrupted")
    if clean_ids.shape != corrupted_ids.shape:
        raise ValueError(f"clean and corrupted must have the same shape (the same batch and length: the runs "
                         f"are compared position by position), got clean {clean_ids.shape} and corrupted "
                         f"{corrupted_ids.shape}")
    return clean_ids, corrupted_ids


def _number(value: object) -> float:
    a = np.asarray(value)
    if a.size != 1 or not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise TypeError(f"metric must return one number, got {type(value).__name__}"
                        + (f" of shape {a.shape}" if a.ndim else ""))
    return float(a.reshape(()))
