"""Reading the residual stream in the vocabulary: the logit lens and the direct logit
attribution of a decoder, both from a cache of ``model.run_with_cache``.

Shapes: ``N`` blocks, ``H`` query heads, ``B`` sequences, ``T`` tokens, ``E`` model width,
``V`` vocabulary. Blocks count from 0, as the hook names do (block ``i`` is attnlab's
layer ``i + 1``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from attnlab._validation import shape_error
from attnlab.inspect._model import (
    MLP_OUT,
    RESID_POST,
    RESID_PRE,
    Z,
    blocks,
    cached,
    check_cache,
    decoder_head,
    norm_linearisation,
    num_heads,
    output_projection,
    unembedding,
)
from attnlab.nn.module import Module

__all__ = ["LogitAttribution", "direct_logit_attribution", "logit_lens", "logit_lens_top"]


def logit_lens(model: Module, cache: Mapping[str, np.ndarray]) -> np.ndarray:
    """The logits the residual stream would give after each block: the logit lens.

    Entry 0 reads the embeddings (``blocks.0.hook_resid_pre``), entry ``i + 1`` the
    residual after block ``i`` (``blocks.{i}.hook_resid_post``); each goes through the
    model's final norm (its own statistics, recomputed for every entry) and the
    unembedding, so the last entry is the model's logits. This is TransformerLens's
    ``cache.accumulated_resid(apply_ln=True)`` followed by ``model.unembed``.

    Args:
        model: a decoder with hook points, ``ln_final`` and ``unembed`` (GPT-2,
            TinyTransformer, ...).
        cache: from ``model.run_with_cache(ids)``; it needs ``blocks.0.hook_resid_pre``
            and every ``blocks.{i}.hook_resid_post``.

    Returns:
        ``(N + 1, B, T, V)`` logits in the model's dtype (``(N + 1, T, V)`` for an
        unbatched run). Mind the size: ``N + 1`` times the logits.

    Raises:
        KeyError: a residual the lens needs is not in the cache.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> logits, cache = model.run_with_cache(np.array([[1, 2, 3, 4]]))
    >>> lens = logit_lens(model, cache)
    >>> lens.shape, bool(np.allclose(lens[-1], logits, atol=1e-5))
    ((3, 1, 4, 50), True)
    """
    layers = blocks(model)
    norm, unembed = decoder_head(model, "logit lens")
    check_cache(cache)
    what = "logit_lens"
    resid = [cached(cache, RESID_PRE.format(i=0), what)]
    resid += [cached(cache, RESID_POST.format(i=i), what) for i in range(len(layers))]
    stack = np.stack(resid)  # (N + 1, ..., T, E)
    flat = stack.reshape(-1, *stack.shape[-2:])  # (N + 1, B, T, E) -> ((N + 1) B, T, E)
    logits = np.asarray(unembed(norm(flat)))
    return logits.reshape(*stack.shape[:-1], logits.shape[-1])


def logit_lens_top(model: Module, cache: Mapping[str, np.ndarray], k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` likeliest tokens of the logit lens and their probabilities, one layer's
    logits at a time: what the explain views show, in the memory of one ``(B, T, V)``
    array rather than :func:`logit_lens`'s ``N + 1`` of them.

    Returns:
        ``(ids, probs)``, each ``(N + 1, B, T, k)`` (no ``B`` for an unbatched run):
        entry 0 reads the embeddings, entry ``i + 1`` the residual after block ``i``;
        ``probs`` are the softmax of that entry's logits (float64), likeliest first.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> logits, cache = model.run_with_cache(np.array([[1, 2, 3, 4]]))
    >>> ids, probs = logit_lens_top(model, cache, k=2)
    >>> ids.shape, bool((ids[-1, ..., 0] == logits.argmax(-1)).all())
    ((3, 1, 4, 2), True)
    """
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    layers = blocks(model)
    norm, unembed = decoder_head(model, "logit lens")
    check_cache(cache)
    names = [RESID_PRE.format(i=0)] + [RESID_POST.format(i=i) for i in range(len(layers))]
    ids, probs = [], []
    for name in names:
        logits = np.asarray(unembed(norm(cached(cache, name, "logit_lens_top")))).astype(np.float64)
        k_eff = min(int(k), logits.shape[-1])
        top = np.argpartition(-logits, k_eff - 1, axis=-1)[..., :k_eff]
        top_logits = np.take_along_axis(logits, top, axis=-1)
        order = np.argsort(-top_logits, axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)
        m = logits.max(axis=-1, keepdims=True)
        log_total = np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)) + m
        ids.append(top)
        probs.append(np.exp(np.take_along_axis(logits, top, axis=-1) - log_total))
    return np.stack(ids), np.stack(probs)


@dataclass(frozen=True)
class LogitAttribution:
    """Each part of the residual stream's direct effect on one token's logit.

    The final norm is linearised at the real final residual ``x``: for a LayerNorm,
    ``norm(x) = w * (x - mean(x)) / s + b`` with ``s = sqrt(var(x) + eps)`` fixed at the
    real ``x``, so a part ``c`` of ``x`` contributes ``(w * (c - mean(c)) / s) @ W_U[:, t]``
    (TransformerLens's ``apply_ln_to_stack``, then the token's unembedding direction scaled
    by the norm's weight). An RMSNorm neither centres nor has a bias. The parts add up to
    the logit exactly, :attr:`bias` included.

    Attributes (float64; ``(B, T)`` is one value per position, ``(T,)`` for an unbatched
    run):
        heads: ``(N, H, B, T)``: head ``h`` of block ``i``, ``z[..., h, :] @ W_O[h]``.
        attn_bias: ``(N, B, T)``: each attention's output bias ``b_O``.
        mlp: ``(N, B, T)``: each block's MLP output (``hook_mlp_out``).
        embed: ``(B, T)``: the token embedding (``hook_embed``).
        pos_embed: ``(B, T)``: the learned position embedding (``hook_pos_embed``); zeros
            for a model without one.
        bias: ``(B, T)``: what the final norm's bias and the unembedding's bias add,
            ``b @ W_U[:, t] + b_U[t]``: the part of the logit no component writes.
        tokens: ``(B, T)``: the token each position's logit is for.
    """

    heads: np.ndarray
    attn_bias: np.ndarray
    mlp: np.ndarray
    embed: np.ndarray
    pos_embed: np.ndarray
    bias: np.ndarray
    tokens: np.ndarray

    def total(self) -> np.ndarray:
        """The sum of every part: the logit of :attr:`tokens`, ``(B, T)``."""
        return (self.heads.sum(axis=(0, 1)) + self.attn_bias.sum(axis=0) + self.mlp.sum(axis=0)
                + self.embed + self.pos_embed + self.bias)

    def stack(self) -> tuple[np.ndarray, list[str]]:
        """Every part as one array ``(N * H + 2 N + 3, B, T)`` and its labels, in
        TransformerLens's style: ``embed``, ``pos_embed``, ``L{i}H{h}`` (block-major),
        ``{i}_attn_bias``, ``{i}_mlp_out``, ``bias``."""
        N, H = self.heads.shape[:2]
        parts = [self.embed[None], self.pos_embed[None], self.heads.reshape(N * H, *self.heads.shape[2:]),
                 self.attn_bias, self.mlp, self.bias[None]]
        labels = (["embed", "pos_embed"] + [f"L{i}H{h}" for i in range(N) for h in range(H)]
                  + [f"{i}_attn_bias" for i in range(N)] + [f"{i}_mlp_out" for i in range(N)] + ["bias"])
        return np.concatenate(parts), labels


def direct_logit_attribution(
    model: Module, cache: Mapping[str, np.ndarray], token: int | np.ndarray
) -> LogitAttribution:
    """How much each head, each MLP and the embeddings write directly to ``token``'s logit.

    Args:
        model: a decoder with hook points, a LayerNorm or RMSNorm ``ln_final`` and an
            unembedding (GPT-2, TinyTransformer, ...).
        cache: from ``model.run_with_cache(ids)``; it needs ``hook_embed``,
            ``hook_pos_embed`` (learned positions only), every ``blocks.{i}.attn.hook_z``
            and ``blocks.{i}.hook_mlp_out``, and the last ``blocks.{i}.hook_resid_post``.
        token: the token whose logit is split: an int (at every position), ``(B,)`` (one
            per sequence) or ``(B, T)`` (one per position); ``(T,)`` for an unbatched run.

    Returns:
        :class:`LogitAttribution`; its :meth:`~LogitAttribution.total` is the logit of
        ``token`` at every position.

    Raises:
        KeyError: an activation it needs is not in the cache.
        ValueError: a token id outside the vocabulary, or ``token`` of a shape that is not
            one of the above.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0))
    >>> logits, cache = model.run_with_cache(np.array([[1, 2, 3, 4]]))
    >>> dla = direct_logit_attribution(model, cache, 7)
    >>> dla.heads.shape, dla.mlp.shape, dla.embed.shape
    ((2, 2, 1, 4), (2, 1, 4), (1, 4))
    >>> bool(np.allclose(dla.total(), logits[..., 7], atol=1e-5))
    True
    """
    layers = blocks(model)
    norm, _ = decoder_head(model, "direct logit attribution")
    check_cache(cache)
    what = "direct_logit_attribution"
    N = len(layers)
    x = cached(cache, RESID_POST.format(i=N - 1), what)
    batched = x.ndim == 3
    if not batched:
        x = x[None]
    B, T, E = x.shape

    def part(name: str, ndim: int = 3) -> np.ndarray:  # with a batch axis, whether or not it was cached with one
        a = cached(cache, name, what)
        return a[None] if a.ndim == ndim - 1 else a

    W_U, b_U = unembedding(model, E, x.dtype)
    V = W_U.shape[1]
    tokens = _tokens(token, B, T, V, batched)
    centre, scale, w, b = norm_linearisation(norm, x)
    u = np.moveaxis(W_U[:, tokens].astype(np.float64), 0, -1)  # (E, B, T) -> (B, T, E)
    d = u if w is None else u * w
    if centre:  # (c - mean(c)) @ d == c @ (d - mean(d))
        d = d - d.mean(axis=-1, keepdims=True)
    d = d / scale  # the direction each part is read along, (B, T, E)

    def along(a: np.ndarray) -> np.ndarray:
        return np.einsum("bte,bte->bt", a.astype(np.float64), d)

    names = model.hook_names()
    embed = along(part("hook_embed"))
    pos_embed = along(part("hook_pos_embed")) if "hook_pos_embed" in names else np.zeros((B, T))
    heads = np.empty((N, num_heads(model), B, T))
    attn_bias, mlp = np.zeros((N, B, T)), np.empty((N, B, T))
    for i, block in enumerate(layers):
        W_O, b_O = output_projection(block.attn)
        z = part(Z.format(i=i), 4).astype(np.float64)  # (B, T, H, D)
        read = np.einsum("hde,bte->bthd", W_O.astype(np.float64), d)
        heads[i] = np.einsum("bthd,bthd->hbt", z, read)
        if b_O is not None:
            attn_bias[i] = d @ b_O.astype(np.float64)
        mlp[i] = along(part(MLP_OUT.format(i=i)))
    bias = np.zeros((B, T))
    if b is not None:
        bias += u @ b
    if b_U is not None:
        bias += b_U.astype(np.float64)[tokens]
    result = LogitAttribution(heads, attn_bias, mlp, embed, pos_embed, bias, tokens)
    if batched:
        return result
    return LogitAttribution(heads[:, :, 0], attn_bias[:, 0], mlp[:, 0], embed[0], pos_embed[0], bias[0],
                            tokens[0])


def _tokens(token: object, B: int, T: int, V: int, batched: bool) -> np.ndarray:
    """``token`` as ``(B, T)`` ids in ``0..V-1``."""
    t = np.asarray(token)
    if t.dtype == bool or not np.issubdtype(t.dtype, np.integer):
        raise TypeError(f"token must be an int or integer token ids, got {token!r}" if t.ndim == 0
                        else f"token must be integer token ids, got dtype {t.dtype}")
    if t.ndim == 0:
        t = np.full((B, T), int(t))
    elif batched and t.shape == (B,):
        t = np.repeat(t[:, None], T, axis=1)
    elif batched and t.shape == (B, T):
        pass
    elif not batched and t.shape == (T,):
        t = t[None]
    else:
        need = f"() (one id), ({B},) or ({B}, {T})" if batched else f"() (one id) or ({T},)"
        raise shape_error("token", t.shape, need)
    bad = (t < 0) | (t >= V)
    if bad.any():
        raise ValueError(f"token must lie in [0, {V}), got {int(t[bad][0])}")
    return t.astype(np.int64)
