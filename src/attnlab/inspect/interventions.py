"""Changing activations during a forward pass: head ablation and activation patching, both
through ``model.run_with_hooks`` (a hook returns the replacement array).

Shapes: ``N`` blocks, ``H`` query heads, ``B`` sequences, ``T`` tokens, ``D`` head width.
Blocks count from 0, as the hook names do (block ``i`` is attnlab's layer ``i + 1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from attnlab.inspect._model import ATTN_OUT, MLP_OUT, RESID_PRE, Z, blocks, num_heads, token_ids
from attnlab.nn.module import Module

__all__ = ["ABLATIONS", "PATCH_HOOKS", "ablate_heads", "activation_patching"]

ABLATIONS = ("zero", "mean")
"""What ``ablate_heads`` can replace a head's output (``hook_z``) with: zeros, or its mean
over the batch and positions."""
PATCH_HOOKS = {"resid_pre": RESID_PRE, "attn_out": ATTN_OUT, "mlp_out": MLP_OUT, "z": Z}
"""The activations ``activation_patching`` can patch, by short name: the hook point (in each
block, counted from 0) that each names."""


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
    **forward_kwargs,
) -> np.ndarray:
    """The metric after patching one activation at a time from the clean run into the
    corrupted one.

    ``clean`` runs once and its activations are cached. Then for every block ``i`` and
    every position ``p`` (every head ``h`` for ``hook="z"``), ``corrupted`` runs with that
    one slice replaced by the clean run's, at every sequence of the batch, and
    ``metric(output)`` is recorded:

    - ``"resid_pre"``: ``blocks.{i}.hook_resid_pre[:, p]``, the residual entering block ``i``;
    - ``"attn_out"``: ``blocks.{i}.hook_attn_out[:, p]``, the attention's output;
    - ``"mlp_out"``: ``blocks.{i}.hook_mlp_out[:, p]``, the MLP's output;
    - ``"z"``: ``blocks.{i}.attn.hook_z[:, :, h]``, head ``h``'s output at every position.

    Args:
        model: any attnlab model with hook points.
        clean, corrupted: token ids of the same shape, ``(B, T)`` or ``(T,)``.
        metric: output of the forward pass (a decoder's logits) -> a number, e.g. a logit
            difference.
        hook: ``"resid_pre"``, ``"attn_out"``, ``"mlp_out"`` or ``"z"``.
        **forward_kwargs: passed to every forward pass (e.g. ``attention_mask``).

    Returns:
        float64 ``(N, T)``, or ``(N, H)`` for ``"z"``.

    Raises:
        ValueError: ``clean`` and ``corrupted`` of different shapes (lengths), an unknown
            ``hook``.
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
    hook = _choice(hook, "hook", tuple(PATCH_HOOKS))
    if not callable(metric):
        raise TypeError(f"metric must be a callable (output -> number), got {type(metric).__name__}")
    clean_ids, corrupted_ids = token_ids(clean, "clean"), token_ids(corrupted, "corrupted")
    if clean_ids.shape != corrupted_ids.shape:
        raise ValueError(f"clean and corrupted must have the same shape (the same batch and length), got "
                         f"clean {clean_ids.shape} and corrupted {corrupted_ids.shape}")
    N = len(blocks(model))
    names = [PATCH_HOOKS[hook].format(i=i) for i in range(N)]
    _, cache = model.run_with_cache(clean_ids, names_filter=names, **forward_kwargs)
    # The slice to patch: position p of (..., T, E), or head h of z (..., T, H, D).
    count = num_heads(model) if hook == "z" else clean_ids.shape[-1]
    out = np.empty((N, count))
    for i, name in enumerate(names):
        source = np.asarray(cache[name])
        for k in range(count):
            sl = (..., k, slice(None))

            def patch(a: np.ndarray, _name: str, sl=sl, source=source) -> np.ndarray:
                a = a.copy()
                a[sl] = source[sl]
                return a

            value = metric(model.run_with_hooks(corrupted_ids, fwd_hooks=[(name, patch)], **forward_kwargs))
            out[i, k] = _number(value)
    return out


def _number(value: object) -> float:
    a = np.asarray(value)
    if a.size != 1 or not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise TypeError(f"metric must return one number, got {type(value).__name__}"
                        + (f" of shape {a.shape}" if a.ndim else ""))
    return float(a.reshape(()))
