"""Input attribution: which prompt tokens made the model produce this output (saliency,
input x gradient, integrated gradients), from the gradient at the token embeddings
(``hook_embed``), in NumPy.

What is attributed (one scalar per row of the result):

- a decoder's next token (``target`` an id): its log-probability at the last position
  (``output="log_prob"``, the default), its logit (``"logit"``) or its probability
  (``"prob"``); or any metric with ``.grad`` (``target=logit_diff(...)``);
- a generated sequence (``target`` a sequence of ids after a 1-D prompt): one row per
  generated token ``k``, the same quantity of token ``k`` after the prompt and the tokens
  generated before it (teacher forcing), attributed to all of those;
- a BERT encoder's pooled sentence vector: its cosine similarity with ``target`` (a vector
  ``(D,)`` or a text, whose vector is taken), through the model's pooling.

Methods, for the embedding ``x`` of each token (``E`` dimensions) and ``f`` the scalar:

- ``"saliency"``: ``df/dx``; a token's score is the L2 norm over its dimensions (>= 0);
- ``"input_x_gradient"``: ``x * df/dx``; a token's score is the sum over its dimensions;
- ``"integrated_gradients"``: ``(x - x') * sum_i w_i df/dx(x' + alpha_i (x - x'))`` from a
  baseline ``x'``; a token's score is the sum over its dimensions, so the scores add up to
  ``f(x) - f(x')`` up to the quadrature's error, the completeness gap reported.

The rules are Captum's (``rule=``): ``"gausslegendre"`` (its default; ``steps`` Gauss-Legendre
nodes on [0, 1]), ``"riemann_right"``, ``"riemann_left"``, ``"riemann_middle"`` and
``"riemann_trapezoid"`` (``alpha = linspace(0, 1, steps)``, weights ``1/steps`` with the end
points halved, as Captum: they add up to ``1 - 1/steps``, a gap of ``1/steps`` of the
change by construction). Every rule's point runs as one row of a batch.

Baselines: ``"zeros"`` (zero token embeddings), ``"pad"`` (every token replaced by the pad
token; the end-of-sequence token where the model has no pad token) or an array (``(E,)``,
``(T, E)`` or the inputs' ``(B, T, E)``). On a model without position embeddings (Llama,
Mistral, Qwen, Gemma: rotary positions) a zero baseline makes the residual stream exactly 0,
where an RMSNorm is singular (its gradient is ``1/sqrt(eps)``): the default there
(``baseline=None``) is the pad token's embedding, or the end-of-sequence token's where the
pad token's is zero (transformers initialises an ``nn.Embedding``'s ``padding_idx`` row to
zeros); GPT-2 and BERT, whose position embeddings keep the residual away from 0, default to
``"zeros"``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from attnlab._validation import shape_error
from attnlab.inspect._grad import check_differentiable, run_with_grads
from attnlab.inspect._model import token_ids
from attnlab.inspect.interventions import _choice
from attnlab.inspect.metrics import Metric, check_metric

__all__ = ["INPUT_METHODS", "INTEGRATION_RULES", "InputAttribution", "input_attribution"]

INPUT_METHODS = ("saliency", "input_x_gradient", "integrated_gradients")
"""``input_attribution``'s methods."""
INTEGRATION_RULES = ("gausslegendre", "riemann_right", "riemann_left", "riemann_middle", "riemann_trapezoid")
"""Integrated gradients' rules, Captum's names (Gauss-Legendre is Captum's default)."""
OUTPUTS = ("log_prob", "logit", "prob")


@dataclass(frozen=True)
class InputAttribution:
    """The result of :func:`input_attribution`.

    Attributes:
        scores: one score per input token: ``(T,)`` for one sequence, ``(B, T)`` for a batch,
            ``(G, L)`` for a generated sequence of ``G`` tokens (``L = T + G - 1``; row ``k``
            is 0 after the input it saw), ``(B, G, L)`` for a batch of them.
        per_dim: ``scores``' shape with the embedding dimensions ``E`` last (with
            ``per_dim=True``; else None): the gradient (saliency), ``x * gradient`` or the
            integrated gradient.
        value: the attributed scalar at the input, one per row (``scores.shape[:-1]``).
        baseline_value: the scalar at the baseline (integrated gradients; else None).
        gap: the completeness gap, ``scores.sum(-1) - (value - baseline_value)``.
        tokens: the input tokens when a text was given (else None).
        method, rule, steps, output: how it was computed.
    """

    scores: np.ndarray
    per_dim: np.ndarray | None
    value: np.ndarray
    baseline_value: np.ndarray | None
    gap: np.ndarray | None
    tokens: list[str] | None
    method: str
    rule: str | None
    steps: int
    output: str

    @property
    def relative_gap(self) -> np.ndarray | None:
        """``|gap| / |value - baseline_value|``: the share of the change the scores miss."""
        if self.gap is None:
            return None
        change = np.abs(self.value - self.baseline_value)
        return np.abs(self.gap) / np.where(change > 0, change, np.nan)


def integration_points(rule: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``(alphas, weights)`` of Captum's rule ``rule`` with ``steps`` points.

    >>> integration_points("riemann_right", 4)
    (array([0.25, 0.5 , 0.75, 1.  ]), array([0.25, 0.25, 0.25, 0.25]))
    """
    n = steps
    if rule == "gausslegendre":
        x, w = np.polynomial.legendre.leggauss(n)
        return 0.5 * (x + 1.0), 0.5 * w
    weights = np.full(n, 1.0 / n)
    if rule == "riemann_trapezoid":
        if n < 2:
            raise ValueError("the trapezoid rule needs steps >= 2")
        weights[[0, -1]] /= 2
        return np.linspace(0.0, 1.0, n), weights
    start = {"riemann_right": 1.0 / n, "riemann_left": 0.0, "riemann_middle": 0.5 / n}[rule]
    return start + np.arange(n) / n, weights


class _RowScalar(Metric):
    """Per-row scalars of a decoder's logits, summed (so one backward pass gives each row's
    gradient in its own row): ``output`` of ``tokens[r]`` at ``positions[r]``."""

    def __init__(self, positions: np.ndarray, tokens: np.ndarray, output: str) -> None:
        self.positions, self.tokens, self.output = positions, tokens, output

    def rows(self, logits: np.ndarray) -> np.ndarray:
        r = np.arange(len(self.tokens))
        z = logits[r, self.positions].astype(np.float64)  # (R, V)
        if self.output == "logit":
            return z[r, self.tokens]
        m = z.max(axis=-1)
        logp = z[r, self.tokens] - m - np.log(np.exp(z - m[:, None]).sum(axis=-1))
        return logp if self.output == "log_prob" else np.exp(logp)

    def value(self, logits) -> float:
        return float(self.rows(logits).sum())

    def subset(self, rows: np.ndarray) -> _RowScalar:
        return _RowScalar(self.positions[rows], self.tokens[rows], self.output)

    def grad(self, logits) -> np.ndarray:
        r = np.arange(len(self.tokens))
        z = logits[r, self.positions].astype(np.float64)
        rows = np.zeros_like(z)
        if self.output == "logit":
            rows[r, self.tokens] = 1.0
        else:
            p = np.exp(z - z.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            rows = -p
            rows[r, self.tokens] += 1.0
            if self.output == "prob":
                rows *= p[r, self.tokens][:, None]
        g = np.zeros(logits.shape, dtype=logits.dtype)
        g[r, self.positions] = rows
        return g


class _Cosine(Metric):
    """Per-row cosine similarity of an encoder's pooled sentence vector with ``target``,
    summed; the pooling is the model's (``"mean"``, ``"cls"``, ``"max"``) over each row's
    first ``lengths[r]`` tokens."""

    def __init__(self, target: np.ndarray, lengths: np.ndarray, pooling: str) -> None:
        self.t = target / np.linalg.norm(target)  # unit: the rows' cosines with it
        self.lengths, self.pooling = lengths, pooling

    def _pool(self, h: np.ndarray):
        h = np.asarray(h, np.float64)
        R, T, _ = h.shape
        real = np.arange(T)[None, :] < self.lengths[:, None]  # (R, T)
        if self.pooling == "cls":
            w = np.zeros((R, T))
            w[:, 0] = 1.0
        elif self.pooling == "max":
            masked = np.where(real[..., None], h, -np.inf)
            w = None
            return masked.max(axis=1), masked.argmax(axis=1)
        else:
            w = real / self.lengths[:, None]
        return np.einsum("rtd,rt->rd", h, w), w

    def rows(self, out) -> np.ndarray:
        p, _ = self._pool(out.last_hidden_state if hasattr(out, "last_hidden_state") else out)
        return p @ self.t / np.linalg.norm(p, axis=-1)

    def value(self, out) -> float:
        return float(self.rows(out).sum())

    def subset(self, rows: np.ndarray) -> _Cosine:
        return _Cosine(self.t, self.lengths[rows], self.pooling)

    def grad(self, out) -> np.ndarray:
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
        p, w = self._pool(h)
        n = np.linalg.norm(p, axis=-1, keepdims=True)
        gp = (self.t - (p @ self.t)[:, None] * p / n**2) / n  # d cos / d pooled, (R, D)
        if self.pooling == "max":
            g = np.zeros(np.shape(h))
            R, _, D = g.shape
            g[np.arange(R)[:, None], w, np.arange(D)[None, :]] = gp
        else:
            g = w[..., None] * gp[:, None, :]
        return g.astype(np.asarray(h).dtype)


def input_attribution(
    model,
    ids,
    target,
    *,
    method: str = "integrated_gradients",
    steps: int = 50,
    baseline: str | np.ndarray | None = None,
    rule: str = "gausslegendre",
    output: str = "log_prob",
    per_dim: bool = False,
    attention_mask: np.ndarray | None = None,
    batch_size: int | None = None,
) -> InputAttribution:
    """Attribute a model's output to its input tokens (see :mod:`attnlab.inspect.inputs` for
    the scalars, the methods and the baselines).

    Args:
        model: a decoder (GPT-2, Llama, Mistral, Qwen, Gemma) or a BERT encoder, float
            weights.
        ids: token ids ``(T,)`` or ``(B, T)``, or a text (tokenized by the model).
        target: a decoder's next token (an id, or ``(B,)`` ids), a generated sequence (ids
            ``(G,)`` after a 1-D prompt, ``(B, G)`` after a batch), or a metric with
            ``.grad`` on the logits; for an encoder a vector ``(D,)`` or a text.
        method: ``"saliency"``, ``"input_x_gradient"`` or ``"integrated_gradients"``.
        steps: integrated gradients' points (>= 1; >= 2 for the trapezoid).
        baseline: ``"zeros"``, ``"pad"``, an array, or None (the model's default: see above).
        rule: the integration rule (Captum's names; Gauss-Legendre first).
        output: ``"log_prob"``, ``"logit"`` or ``"prob"`` of a decoder's target token.
        per_dim: also return the per-dimension attributions.
        attention_mask: ``(B, T)``, 1 for real tokens (a left-padded batch).
        batch_size: rows (points x sequences) per forward pass (None: about 4096 tokens).

    Returns:
        An :class:`InputAttribution`.

    Raises:
        ValueError: ``steps < 1``; a target token outside the vocabulary; an unknown
            method, rule, output or baseline; a baseline of the wrong shape; ``"pad"`` for a
            model with neither a pad nor an end-of-sequence token.
        TypeError: quantized weights (load the model dequantized); a target of the wrong
            kind.

    >>> from attnlab.models import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2),
    ...              rng=np.random.default_rng(0), dtype=np.float64)
    >>> result = input_attribution(model, np.array([1, 2, 3, 4]), target=7)
    >>> result.scores.shape, bool(abs(result.gap) < 1e-3 * abs(result.value - result.baseline_value))
    ((4,), True)
    >>> input_attribution(model, np.array([1, 2, 3]), target=[7, 8], method="saliency").scores.shape
    (2, 4)
    """
    method = _choice(method, "method", INPUT_METHODS)
    rule = _choice(rule, "rule", INTEGRATION_RULES)
    output = _choice(output, "output", OUTPUTS)
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if per_dim not in (True, False):
        raise TypeError(f"per_dim must be a bool, got {per_dim!r}")
    check_differentiable(model, "input_attribution")
    encoder = _is_encoder(model)
    tokens = None
    types = None
    if isinstance(ids, str):
        ids, tokens, types = _encode(model, ids, encoder)
    ids = token_ids(ids, "ids")
    single = ids.ndim == 1
    batch = ids[None] if single else ids
    mask = None if attention_mask is None else np.asarray(attention_mask)
    if mask is not None:
        mask = mask[None] if mask.ndim == 1 else mask
        if mask.shape != batch.shape:
            raise shape_error("attention_mask", np.shape(attention_mask), f"{ids.shape}, the shape of ids")
    embed_hook = next((n for n in model.hook_names() if n.split(".")[-1] == "hook_embed"), None)
    if embed_hook is None:
        raise TypeError(f"{type(model).__name__} has no hook_embed (the token embeddings) to attribute to")
    vocab = int(model.config.vocab_size)
    if batch.min() < 0 or batch.max() >= vocab:
        raise ValueError(f"ids must be token ids in 0..{vocab - 1}, got {int(batch.min())}..{int(batch.max())}")
    if method != "integrated_gradients":
        alphas, weights = np.ones(1), np.ones(1)
        rule_used = None
    else:
        alphas, weights = integration_points(rule, int(steps))
        rule_used = rule
    # A callable target is a metric: one without .grad is named as such (check_metric below).
    kind = "cosine" if encoder else ("metric" if isinstance(target, Metric) or callable(target) else output)
    # The rows: (ids (R, L), mask (R, L) or None, types or None, the scalar, result shape)
    rows_types = types  # an encoder's segment ids (a text's), else None
    if encoder:
        rows_ids, rows_mask, scalar, shape = _encoder_rows(model, batch, mask, target, single)
    elif kind == "metric":
        check_metric(target, "input_attribution")
        rows_ids, rows_mask, scalar, shape = batch, mask, target, (() if single else (len(batch),))
    else:
        rows_ids, rows_mask, scalar, shape = _decoder_rows(batch, mask, target, output, vocab, single)
    R, L = rows_ids.shape
    x = _embeddings(model, embed_hook, rows_ids, rows_mask, rows_types)  # (R, L, E)
    if method == "integrated_gradients":
        x_base = _baseline(model, embed_hook, baseline, x, rows_ids, rows_mask, rows_types, R, L)
    else:
        x_base = np.zeros_like(x)
    avg = np.zeros(x.shape, np.float64)
    per_pass = max(1, (4096 // L) if batch_size is None else int(batch_size))
    if kind == "metric":  # the metric is the whole batch's: one pass per point
        per_pass = 1
    items = [(a, w) for a, w in zip(alphas, weights, strict=True)]
    if kind == "metric":
        for a, w in items:
            emb = (x_base + a * (x - x_base)).astype(x.dtype)
            _, _, _, grads = _pass(model, embed_hook, rows_ids, rows_mask, rows_types, emb, scalar, encoder)
            avg += w * grads
    else:
        pairs = [(r, i) for i in range(len(items)) for r in range(R)]
        for start in range(0, len(pairs), per_pass):
            chunk = pairs[start:start + per_pass]
            rr = np.array([r for r, _ in chunk])
            al = np.array([items[i][0] for _, i in chunk])[:, None, None]
            emb = (x_base[rr] + al * (x[rr] - x_base[rr])).astype(x.dtype)
            sub = scalar.subset(rr)
            _, _, _, grads = _pass(model, embed_hook, rows_ids[rr], None if rows_mask is None else rows_mask[rr],
                                   None if rows_types is None else rows_types[rr], emb, sub, encoder)
            for k, (r, i) in enumerate(chunk):
                avg[r] += items[i][1] * grads[k]
    xd = x.astype(np.float64)
    if method == "saliency":
        dims = avg
        scores = np.sqrt((avg * avg).sum(axis=-1))
    else:
        dims = (xd - x_base.astype(np.float64)) * avg if method == "integrated_gradients" else xd * avg
        scores = dims.sum(axis=-1)
    value = _values(model, scalar, kind, rows_ids, rows_mask, rows_types, x, embed_hook)
    base_value = gap = None
    if method == "integrated_gradients":
        base_value = _values(model, scalar, kind, rows_ids, rows_mask, rows_types, x_base, embed_hook)
        total = scores.sum() if kind == "metric" else scores.sum(axis=-1)
        gap = total - (value - base_value)
    # Rows back to the inputs' layout: a metric's value is one number for its whole batch.
    value_shape = () if kind == "metric" else shape

    scores, dims = scores.reshape(*shape, L), dims.reshape(*shape, L, -1)
    value = np.asarray(value).reshape(value_shape)
    if base_value is not None:
        base_value = np.asarray(base_value).reshape(value_shape)
        gap = np.asarray(gap).reshape(value_shape)
    return InputAttribution(scores=scores, per_dim=dims if per_dim else None, value=value,
                            baseline_value=base_value, gap=gap, tokens=tokens, method=method, rule=rule_used,
                            steps=int(steps) if method == "integrated_gradients" else 1,
                            output="cosine" if encoder else ("metric" if kind == "metric" else output))


def _is_encoder(model) -> bool:
    from attnlab.models.bert import BertEncoder

    return isinstance(model, BertEncoder)


def _encode(model, text: str, encoder: bool):
    if encoder:
        enc, ids, types = model._one_text(text)
        return ids, list(enc.tokens), types
    ids, tokens = model.encode(text)
    return ids, tokens, None


def _token(value, vocab: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a token id (int), got {value!r}")
    if not 0 <= int(value) < vocab:
        raise ValueError(f"{name} {int(value)} is outside the vocabulary (0..{vocab - 1})")
    return int(value)


def _decoder_rows(batch, mask, target, output, vocab: int, single: bool):
    """The rows of a decoder's next token or generated sequence."""
    B, T = batch.shape
    t = np.asarray(target)
    if t.dtype == bool or not np.issubdtype(t.dtype, np.integer) or t.ndim > 2:
        raise TypeError(f"target must be a token id, ids (B,) or a generated sequence, or a metric with .grad; "
                        f"got {target!r}")
    if t.size and (t.min() < 0 or t.max() >= vocab):
        bad = int(t.min() if t.min() < 0 else t.max())
        raise ValueError(f"target {bad} is outside the vocabulary (0..{vocab - 1})")
    generated = (single and t.ndim == 1) or t.ndim == 2
    if not generated:  # the next token of each sequence
        t = np.broadcast_to(t, (B,)) if t.ndim == 0 or t.shape == (B,) else None
        if t is None:
            raise shape_error("target", np.shape(target), f"() or ({B},): one next token per sequence")
        return batch, mask, _RowScalar(np.full(B, T - 1), t.astype(np.int64), output), (() if single else (B,))
    t = t[None] if t.ndim == 1 else t
    if t.shape[0] != B or t.shape[1] < 1:
        raise shape_error("target", np.shape(target), f"(G,) or ({B}, G): the generated tokens")
    G = t.shape[1]
    full = np.concatenate([batch, t[:, :-1]], axis=1)  # (B, L = T + G - 1): the generated tokens fed back
    rows = np.repeat(full, G, axis=0)
    positions = np.tile(T - 1 + np.arange(G), B)
    rows_mask = None
    if mask is not None:
        rows_mask = np.repeat(np.concatenate([mask, np.ones((B, G - 1), mask.dtype)], axis=1), G, axis=0)
    shape = (G,) if single else (B, G)
    return rows, rows_mask, _RowScalar(positions, t.reshape(-1).astype(np.int64), output), shape


def _encoder_rows(model, batch, mask, target, single: bool):
    if isinstance(target, str):
        target = model.encode(target, normalize=False)
    t = np.asarray(target)
    D = model.config.hidden_size
    if not np.issubdtype(t.dtype, np.floating) or t.shape != (D,):
        raise TypeError(f"an encoder's target is its sentence vector's direction: a float vector ({D},) or a "
                        f"text, got {type(target).__name__}" + (f" of shape {t.shape}" if hasattr(t, "shape") else ""))
    if not np.any(t):
        raise ValueError("target is the zero vector: the cosine similarity with it is undefined")
    lengths = np.full(len(batch), batch.shape[1]) if mask is None else mask.sum(axis=1).astype(np.int64)
    return batch, mask, _Cosine(t.astype(np.float64), lengths, model.pooling), (() if single else (len(batch),))


def _run_kwargs(mask, types) -> dict:
    """The forward pass's keyword arguments: the mask, an encoder's segment ids."""
    kw = {}
    if mask is not None:
        kw["attention_mask"] = mask
    if types is not None:
        kw["token_type_ids"] = types
    return kw


def _embeddings(model, hook: str, ids, mask, types) -> np.ndarray:
    _, cache = model.run_with_cache(ids, names_filter=[hook], **_run_kwargs(mask, types))
    return np.asarray(cache[hook])


def _baseline(model, hook, baseline, x, ids, mask, types, R, L) -> np.ndarray:
    positions = any(n.endswith("hook_pos_embed") for n in model.hook_names())  # else rotary: RMSNorm at 0
    if baseline is None:
        baseline = "zeros" if positions else "token"
    if isinstance(baseline, str):
        if baseline != "token":
            baseline = _choice(baseline, "baseline", ("zeros", "pad"))
        if baseline == "zeros":
            if not positions:
                warnings.warn("a zero baseline on a model without position embeddings makes the residual stream 0, "
                              "where an RMSNorm's gradient is 1/sqrt(eps): the integral is badly approximated "
                              "(the default here is the pad token's embedding)", RuntimeWarning, stacklevel=3)
            return np.zeros_like(x)
        c = model.config
        eos = getattr(c, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, tuple | list) else eos
        candidates = [t for t in (getattr(c, "pad_token_id", None), eos) if t is not None]
        if not candidates:
            raise ValueError(f"baseline='pad': {type(model).__name__} has neither a pad nor an end-of-sequence "
                             "token; pass baseline='zeros' or an array")
        for token in candidates if baseline == "token" else candidates[:1]:
            emb = _embeddings(model, hook, np.full_like(ids, int(token)), mask, types)
            if np.any(emb) or positions:
                return emb
            if baseline == "pad":
                warnings.warn(f"the pad token's embedding (id {token}) is zero on a model without position embeddings, "
                              "a singular baseline (see baseline='zeros'); the default takes the end-of-sequence "
                              "token's", RuntimeWarning, stacklevel=3)
                return emb
        raise ValueError(f"the pad and end-of-sequence tokens' embeddings of {type(model).__name__} are zero, a "
                         "singular baseline on a model without position embeddings: pass baseline= an array of "
                         "small, non-zero token embeddings")
    b = np.asarray(baseline)
    E = x.shape[-1]
    if not np.issubdtype(b.dtype, np.floating) or b.shape not in ((E,), (L, E), x.shape):
        raise shape_error("baseline", b.shape, f"({E},), ({L}, {E}) or {x.shape}: token embeddings")
    return np.broadcast_to(b, x.shape).astype(x.dtype)


def _pass(model, hook, ids, mask, types, emb, scalar, encoder: bool):
    def replace(a, name):
        return emb if a.shape == emb.shape else emb.reshape(a.shape)

    select = (lambda out: out.last_hidden_state) if encoder else None
    value, out, acts, grads = run_with_grads(model, ids, scalar, [], grad_names=[hook],
                                             fwd_hooks=[(hook, replace)], select=select,
                                             **_run_kwargs(mask, types))
    return value, out, acts, np.asarray(grads[hook], np.float64).reshape(emb.shape)


def _values(model, scalar, kind, ids, mask, types, emb, hook) -> np.ndarray:
    """The scalar of each row at the embeddings ``emb``."""
    def replace(a, name):
        return emb.reshape(a.shape)

    out = model.run_with_hooks(ids, fwd_hooks=[(hook, replace)], **_run_kwargs(mask, types))
    if kind == "metric":
        return np.asarray(float(scalar(out)))
    return scalar.rows(out)

