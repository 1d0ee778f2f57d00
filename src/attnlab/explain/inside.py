"""What ``explain`` shows from inside a decoder: the logit lens, the head detector scores
and, given a corrupted text, activation patching.

:func:`decoder_inside` computes all three for any decoder with hook points, ``ln_final``
and ``unembed`` (GPT-2, TinyTransformer, the decoder families to come), through
:mod:`attnlab.inspect` (:func:`~attnlab.inspect.logit_lens_top`,
:func:`~attnlab.inspect.detect_heads`, :func:`~attnlab.inspect.activation_patching`), so
the numbers are those functions' numbers. A backend calls it with its model, the text's
token ids, the token strings and, for patching, its own tokenizer.

Two numberings, as everywhere in attnlab (see :mod:`attnlab.inspect`):

- **layers** count from 0, the embeddings: layer ``k`` (``1..n``) is the output of the
  ``k``-th block. The lens has one row per layer, ``0..n``.
- **blocks** count from 0, as the hook names do (``blocks.{i}.hook_resid_pre``): block
  ``i`` makes layer ``i + 1``. The head scores and the patching result have one row per
  block, ``0..n-1``. Block ``i``'s ``resid_pre`` (what patching replaces) is the residual
  that enters block ``i``: layer ``i``'s output.

Shapes: ``N`` blocks, ``H`` heads, ``T`` tokens, ``k`` tokens kept per lens cell.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["LENS_TOP", "PATCH_METRIC", "Lens", "Patching", "decoder_inside", "patch_metric", "top_heads"]

#: Tokens kept per lens cell (the likeliest first).
LENS_TOP = 3
#: Positions read through the unembedding at once (bounds the lens's memory: a
#: ``(chunk, V)`` float64 array per layer).
LENS_CHUNK = 128
#: What the patching numbers are, in words (the CLI, the JSON and the report say it).
PATCH_METRIC = (
    "logit(clean prediction) - logit(corrupted prediction) at the last position, where the clean "
    "prediction is the clean run's likeliest next token and the corrupted prediction is the "
    "corrupted run's likeliest next token other than it"
)


@dataclass
class Lens:
    """The logit lens as the views show it: the ``k`` likeliest next tokens at every
    position, read from the residual stream after each layer.

    Attributes:
        ids: ``(n + 1, T, k)`` int64 token ids, likeliest first; row 0 reads the
            embeddings (``blocks.0.hook_resid_pre``), row ``k`` the output of block
            ``k - 1`` (``blocks.{k-1}.hook_resid_post``), through the final norm and the
            unembedding. The last row is the model's own prediction.
        probs: ``(n + 1, T, k)`` float64 softmax probabilities of those tokens.
        strings: token id -> its string, for every id in :attr:`ids`.
    """

    ids: np.ndarray
    probs: np.ndarray
    strings: dict[int, str] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(np.shape(self.ids)[-1])

    def tokens(self, rank: int = 0) -> list[list[str]]:
        """``(n + 1, T)`` strings of the ``rank``-th likeliest token (0: the top one)."""
        return [[self.strings[int(i)] for i in row] for row in np.asarray(self.ids)[..., rank]]


@dataclass
class Patching:
    """Activation patching of ``resid_pre`` from the clean text into a corrupted one.

    ``values[i, p]`` is the metric (:data:`PATCH_METRIC`) when the corrupted text runs
    with the residual entering block ``i`` (``blocks.{i}.hook_resid_pre``; layer ``i``'s
    output) at position ``p`` replaced by the clean run's: near :attr:`clean_value`, that
    one vector carries what makes the clean prediction; near :attr:`corrupted_value`, it
    does not (:attr:`restored` scales this to 1 and 0).

    Attributes:
        values: ``(N, T)`` float64 metric after each patch.
        corrupted_text: the corrupted text.
        corrupted_tokens: its ``T`` tokens.
        clean_id, clean_token: the clean run's prediction (its likeliest next token).
        corrupted_id, corrupted_token: the corrupted run's likeliest next token other than
            the clean prediction.
        clean_value, corrupted_value: the metric on the clean and on the corrupted run.
        hook: which activation was patched (``"resid_pre"``).
        metric: the metric, in words.
    """

    values: np.ndarray
    corrupted_text: str
    corrupted_tokens: list[str]
    clean_id: int
    clean_token: str
    corrupted_id: int
    corrupted_token: str
    clean_value: float
    corrupted_value: float
    hook: str = "resid_pre"
    metric: str = PATCH_METRIC

    def restored(self) -> np.ndarray:
        """``(values - corrupted_value) / (clean_value - corrupted_value)``: 0 where a patch
        leaves the corrupted run's metric, 1 where it gives the clean run's (NaN when the
        two runs' metrics are equal)."""
        span = self.clean_value - self.corrupted_value
        with np.errstate(invalid="ignore", divide="ignore"):
            return (np.asarray(self.values, np.float64) - self.corrupted_value) / (span if span else np.nan)


def patch_metric(clean_logits: np.ndarray, corrupted_logits: np.ndarray) -> tuple[int, int]:
    """``(a, b)``: the clean prediction ``a`` (the argmax of the clean run's last-position
    logits) and ``b``, the corrupted run's likeliest last-position token other than ``a``.
    The metric is then ``logits[..., -1, a] - logits[..., -1, b]``.

    >>> clean = np.array([[0.0, 3.0, 1.0]]); corrupted = np.array([[2.0, 1.0, 0.0]])
    >>> patch_metric(clean, corrupted)
    (1, 0)
    >>> patch_metric(clean, clean)  # the same prediction: b is the runner-up
    (1, 2)
    """
    last_clean = np.asarray(clean_logits, np.float64).reshape(-1, np.shape(clean_logits)[-1])[-1]
    last_corrupted = np.asarray(corrupted_logits, np.float64).reshape(-1, np.shape(corrupted_logits)[-1])[-1].copy()
    a = int(last_clean.argmax())
    last_corrupted[a] = -np.inf
    return a, int(last_corrupted.argmax())


def top_heads(scores: np.ndarray, n: int = 3) -> list[tuple[int, int, float]]:
    """The ``n`` highest-scoring heads of ``scores (N, H)`` as ``(block, head, score)``,
    best first (NaN scores last; ties in block, head order).

    >>> top_heads(np.array([[0.1, 0.9], [0.5, 0.2]]), 2)
    [(0, 1, 0.9), (1, 0, 0.5)]
    """
    s = np.asarray(scores, np.float64)
    flat = np.where(np.isfinite(s), s, -np.inf).ravel()
    order = np.argsort(-flat, kind="stable")[: max(0, int(n))]
    H = s.shape[1]
    return [(int(k // H), int(k % H), float(s.flat[k])) for k in order]


def _lens_top(model, cache: Mapping[str, np.ndarray], k: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`attnlab.inspect.logit_lens_top` over ``chunk`` positions at a time (each
    position's lens depends only on its own residual)."""
    from attnlab.inspect import logit_lens_top

    T = next(iter(cache.values())).shape[-2]
    ids, probs = [], []
    for lo in range(0, T, chunk):
        part = {name: a[..., lo : lo + chunk, :] for name, a in cache.items()}
        i, p = logit_lens_top(model, part, k=k)
        ids.append(i)
        probs.append(p)
    return np.concatenate(ids, axis=-2), np.concatenate(probs, axis=-2)


def _head_scores(cache: Mapping[str, np.ndarray], n_blocks: int, ids: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`attnlab.inspect.detect_heads` of one sequence ``ids (T,)`` for every kind, from
    maps already cached (``blocks.{i}.attn.hook_pattern``), so the kinds share one forward
    pass: ``sum(A * P) / sum(A)`` per head, ``P`` the kind's detection pattern."""
    from attnlab.inspect import HEAD_KINDS, detection_pattern

    want = {kind: detection_pattern(ids, kind)[None] for kind in HEAD_KINDS}  # (1, T, T)
    scores: dict[str, list] = {kind: [] for kind in HEAD_KINDS}
    for i in range(n_blocks):
        A = np.asarray(cache[f"blocks.{i}.attn.hook_pattern"], dtype=np.float64).reshape(1, -1, len(ids), len(ids))
        total = A.sum(axis=(-2, -1))
        for kind in HEAD_KINDS:
            with np.errstate(invalid="ignore", divide="ignore"):
                scores[kind].append(np.einsum("bhqk,bqk->bh", A, want[kind]) / total)
    return {kind: np.stack(v).mean(axis=1) for kind, v in scores.items()}  # (N, H) each


def decoder_inside(
    model,
    ids: np.ndarray,
    vocab: Sequence[str] | Callable[[int], str],
    *,
    corrupt: str | None = None,
    encode: Callable[[str], tuple[np.ndarray, list[str]]] | None = None,
    k: int = LENS_TOP,
    heads: bool = True,
    chunk: int = LENS_CHUNK,
) -> tuple[Lens, dict[str, np.ndarray] | None, Patching | None]:
    """The logit lens, the head detector scores and (with ``corrupt``) activation patching
    of one text through a decoder.

    Args:
        model: a decoder with hook points, ``ln_final`` and ``unembed``.
        ids: ``(T,)`` the text's token ids.
        vocab: token id -> string, a sequence or a callable.
        corrupt: a corrupted text of the same number of tokens (None: no patching).
        encode: text -> ``(ids (T,), tokens)``, the backend's own tokenizer (needed with
            ``corrupt``).
        k: tokens kept per lens cell.
        heads: compute the head detector scores (from the same forward pass as the lens).
        chunk: positions read through the unembedding at once.

    Returns:
        ``(lens, head_scores, patching)``: a :class:`Lens` (``(n + 1, T, k)``); a dict
        ``kind -> (N, H)``, the numbers of :func:`attnlab.inspect.detect_heads` on ``ids``
        for each kind of :data:`attnlab.inspect.HEAD_KINDS`, read from one forward pass
        (None with ``heads=False``); a :class:`Patching` (``(N, T)``) or None.

    Raises:
        ValueError: a corrupted text with a different number of tokens (the message gives
            both counts).

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> vocab = [f"t{i}" for i in range(50)]
    >>> encode = lambda s: (np.array([int(w) for w in s.split()]), s.split())
    >>> lens, scores, patch = decoder_inside(model, np.array([1, 2, 3, 1, 2]), vocab,
    ...                                      corrupt="1 2 4 1 2", encode=encode)
    >>> lens.ids.shape, sorted(scores), scores["induction"].shape, patch.values.shape
    ((3, 5, 3), ['duplicate_token', 'induction', 'previous_token'], (2, 2), (2, 5))
    """
    from attnlab.inspect import activation_patching

    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids has shape {ids.shape}, but should be (T,): one sequence")
    name_of = vocab if callable(vocab) else (lambda i: vocab[i])
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        patch_ids = patch_tokens = None
        if corrupt is not None:  # refuse a bad corrupted text before any long computation
            if encode is None:
                raise ValueError("activation patching needs the model's tokenizer (encode=)")
            try:
                patch_ids, patch_tokens = encode(corrupt)
            except ValueError as exc:
                raise ValueError(f"the corrupted text: {exc}") from None
            patch_ids = np.asarray(patch_ids)
            if patch_ids.shape != ids.shape:
                raise ValueError(
                    f"the corrupted text has {patch_ids.shape[-1]} token{'s' * (patch_ids.shape[-1] != 1)} "
                    f"but the text has {len(ids)}: activation patching compares the two position by "
                    "position, so both need the same number of tokens")
        n_blocks = len(model.layers)
        names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(n_blocks)]
        maps = [f"blocks.{i}.attn.hook_pattern" for i in range(n_blocks)] if heads else []
        logits, cache = model.run_with_cache(ids[None], names_filter=names + maps)
        top, probs = _lens_top(model, {n: np.asarray(cache[n]) for n in names}, k, chunk)
        top, probs = top[:, 0], probs[:, 0]  # (n + 1, T, k)
        lens = Lens(top.astype(np.int64), probs.astype(np.float64),
                    {int(i): str(name_of(int(i))) for i in np.unique(top)})
        scores = None
        if heads:
            scores = _head_scores(cache, n_blocks, ids)
        del cache
        patching = None
        if patch_ids is not None:
            corrupted_logits = model(patch_ids[None])
            a, b = patch_metric(logits, corrupted_logits)

            def metric(out: np.ndarray) -> float:
                last = np.asarray(out)[0, -1]
                return float(last[a]) - float(last[b])

            values = activation_patching(model, ids[None], patch_ids[None], metric, hook="resid_pre")
            patching = Patching(
                values=values, corrupted_text=corrupt, corrupted_tokens=list(patch_tokens),
                clean_id=a, clean_token=str(name_of(a)), corrupted_id=b, corrupted_token=str(name_of(b)),
                clean_value=metric(logits), corrupted_value=metric(corrupted_logits))
        return lens, scores, patching
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
