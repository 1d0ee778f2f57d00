"""Metrics on a model's output, each with its gradient: what the gradient methods
(:func:`~attnlab.inspect.attribution_patching`, :func:`~attnlab.inspect.edge_attribution`,
:func:`~attnlab.inspect.input_attribution`) differentiate, and what
:func:`~attnlab.inspect.activation_patching` records.

A metric is called on a decoder's logits ``(B, T, V)`` (or ``(T, V)`` for one unbatched
sequence) and returns one number, the mean over the batch; ``metric.grad(logits)`` is the
gradient of that number with respect to the logits, an array of the logits' shape and
dtype. Any object with ``__call__(logits) -> number`` and ``grad(logits) -> array`` works
where a metric is asked for; :class:`Metric` is the base class of the four here.

- :func:`logit_diff` ``(good, bad, position=-1)``: ``logits[b, p, good] - logits[b, p, bad]``;
- :func:`log_prob` ``(token, position=-1)``: ``log softmax(logits[b, p])[token]``;
- :func:`probability` ``(token, position=-1)``: ``softmax(logits[b, p])[token]``;
- :func:`cross_entropy` ``(targets)``: the mean of ``-log softmax(logits[b, t])[targets[b, t]]``
  over the positions whose target is not ``ignore_index`` (torch's ``cross_entropy``).

A token may be one id for every sequence or one per sequence ``(B,)``; a position one index
(negative from the end) or one per sequence ``(B,)`` (the last real token of each row of a
padded batch). Values are computed in float64.
"""

from __future__ import annotations

import numpy as np

from attnlab._validation import shape_error

__all__ = ["Metric", "cross_entropy", "log_prob", "logit_diff", "probability"]


class Metric:
    """A number computed from a model's output, with its gradient (see the module
    docstring). Subclasses define :meth:`value` and :meth:`grad`."""

    def __call__(self, logits) -> float:
        return self.value(logits)

    def value(self, logits) -> float:
        raise NotImplementedError

    def grad(self, logits) -> np.ndarray:
        """The gradient of the metric with respect to ``logits``, of their shape and dtype."""
        raise NotImplementedError


def _ids(value: object, name: str, *, allow_negative: bool = False) -> np.ndarray:
    """One integer or a 1-D sequence of integers, as an int64 array ``()`` or ``(B,)``."""
    a = np.asarray(value)
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer) or a.ndim > 1:
        raise TypeError(f"{name} must be an int or a sequence of ints (one per sequence), got {value!r}")
    if not allow_negative and a.size and a.min() < 0:
        raise ValueError(f"{name} must be token ids >= 0, got {value!r}")
    return a.astype(np.int64)


def _logits(logits: object) -> np.ndarray:
    a = np.asarray(logits)
    if a.ndim not in (2, 3) or not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"a metric takes float logits (B, T, V) or (T, V), got {type(logits).__name__}"
                        + (f" of shape {a.shape} and dtype {a.dtype}" if hasattr(logits, "shape") else ""))
    return a


def _rows(logits: np.ndarray, position: np.ndarray, *tokens: tuple[str, np.ndarray]):
    """``(batch index (B,), position (B,), token ids (B,)...)`` of the scored entries, checked
    against the logits' shape (a 2-D ``logits`` is one sequence, B = 1)."""
    B = logits.shape[0] if logits.ndim == 3 else 1
    T, V = logits.shape[-2:]
    out = []
    for name, ids in (("position", position), *tokens):
        if ids.ndim == 1 and ids.shape[0] != B:
            raise shape_error(name, ids.shape, f"() or ({B},): one per sequence of the logits {logits.shape}")
        out.append(np.broadcast_to(ids, (B,)))
    pos = out[0]
    if pos.min() < -T or pos.max() >= T:
        raise ValueError(f"position {position.tolist()} is out of range for {T} positions ({-T}..{T - 1})")
    for (name, _), ids in zip(tokens, out[1:], strict=True):
        if ids.max() >= V:
            raise ValueError(f"{name} {ids.max()} is outside the vocabulary of the logits (0..{V - 1})")
    return np.arange(B), pos % T, *out[1:]


def _at(logits: np.ndarray, b, p) -> np.ndarray:
    """The logits rows ``(B, V)`` at ``(b, p)``, float64."""
    rows = logits[b, p] if logits.ndim == 3 else logits[p]
    return rows.astype(np.float64)


def _scatter(logits: np.ndarray, b, p, rows: np.ndarray) -> np.ndarray:
    """An array of zeros like ``logits`` with ``rows (B, V)`` at ``(b, p)``."""
    g = np.zeros(logits.shape, dtype=logits.dtype)
    if logits.ndim == 3:
        np.add.at(g, (b, p), rows.astype(logits.dtype))
    else:
        np.add.at(g, p, rows.astype(logits.dtype))
    return g


def _softmax(rows: np.ndarray) -> np.ndarray:
    e = np.exp(rows - rows.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class _TokenMetric(Metric):
    """A metric of one position's logits per sequence, averaged over the batch."""

    def __init__(self, position, **tokens) -> None:
        self.position = _ids(position, "position", allow_negative=True)
        self.tokens = {name: _ids(v, name) for name, v in tokens.items()}

    def _where(self, logits):
        logits = _logits(logits)
        b, p, *ids = _rows(logits, self.position, *self.tokens.items())
        return logits, b, p, ids

    def __repr__(self) -> str:
        args = [f"{k}={v.tolist()}" for k, v in self.tokens.items()] + [f"position={self.position.tolist()}"]
        return f"{type(self).__name__.lstrip('_')}({', '.join(args)})"


class _LogitDiff(_TokenMetric):
    def value(self, logits) -> float:
        logits, b, p, (good, bad) = self._where(logits)
        rows = _at(logits, b, p)
        return float(np.mean(rows[b, good] - rows[b, bad]))

    def grad(self, logits) -> np.ndarray:
        logits, b, p, (good, bad) = self._where(logits)
        rows = np.zeros((len(b), logits.shape[-1]))
        np.add.at(rows, (b, good), 1.0 / len(b))
        np.add.at(rows, (b, bad), -1.0 / len(b))
        return _scatter(logits, b, p, rows)


class _LogProb(_TokenMetric):
    def value(self, logits) -> float:
        logits, b, p, (token,) = self._where(logits)
        rows = _at(logits, b, p)
        m = rows.max(axis=-1)
        lse = m + np.log(np.exp(rows - m[:, None]).sum(axis=-1))
        return float(np.mean(rows[b, token] - lse))

    def grad(self, logits) -> np.ndarray:
        logits, b, p, (token,) = self._where(logits)
        rows = -_softmax(_at(logits, b, p))
        rows[b, token] += 1.0
        return _scatter(logits, b, p, rows / len(b))


class _Probability(_TokenMetric):
    def value(self, logits) -> float:
        logits, b, p, (token,) = self._where(logits)
        return float(np.mean(_softmax(_at(logits, b, p))[b, token]))

    def grad(self, logits) -> np.ndarray:
        logits, b, p, (token,) = self._where(logits)
        probs = _softmax(_at(logits, b, p))
        pt = probs[b, token]
        rows = -probs * pt[:, None]
        rows[b, token] += pt
        return _scatter(logits, b, p, rows / len(b))


def logit_diff(good, bad, position=-1) -> Metric:
    """``logits[b, position, good] - logits[b, position, bad]``, averaged over the batch
    (the indirect-object task's metric).

    Args:
        good, bad: token ids, one for every sequence or one per sequence ``(B,)``.
        position: the position scored, negative from the end, or one per sequence ``(B,)``.

    >>> logits = np.zeros((1, 3, 5), np.float32)
    >>> logits[0, -1, 2], logits[0, -1, 4] = 3.0, 1.0
    >>> metric = logit_diff(2, 4)
    >>> metric(logits), metric.grad(logits)[0, -1]
    (2.0, array([ 0.,  0.,  1.,  0., -1.], dtype=float32))
    """
    return _LogitDiff(position, good=good, bad=bad)


def log_prob(token, position=-1) -> Metric:
    """``log softmax(logits[b, position])[token]``, averaged over the batch.

    >>> metric = log_prob(1)
    >>> round(metric(np.zeros((2, 4), np.float32)), 4)   # one sequence of 2 positions, V = 4
    -1.3863
    """
    return _LogProb(position, token=token)


def probability(token, position=-1) -> Metric:
    """``softmax(logits[b, position])[token]``, averaged over the batch.

    >>> probability(0)(np.zeros((1, 2, 4)))
    0.25
    """
    return _Probability(position, token=token)


class _CrossEntropy(Metric):
    def __init__(self, targets, ignore_index: int) -> None:
        t = np.asarray(targets)
        if t.dtype == bool or not np.issubdtype(t.dtype, np.integer) or t.ndim not in (1, 2):
            raise TypeError(f"targets must be integer token ids (B, T) or (T,), got {type(targets).__name__}"
                            + (f" of dtype {t.dtype} and shape {t.shape}" if hasattr(targets, "shape") else ""))
        self.targets, self.ignore_index = t.astype(np.int64), int(ignore_index)

    def _check(self, logits):
        logits = _logits(logits)
        if self.targets.shape != logits.shape[:-1]:
            raise shape_error("targets", self.targets.shape, f"{logits.shape[:-1]}, the logits' shape without V")
        keep = self.targets != self.ignore_index
        if not keep.any():
            raise ValueError(f"every target is ignore_index={self.ignore_index}: nothing to average")
        V = logits.shape[-1]
        t = self.targets[keep]
        if t.min() < 0 or t.max() >= V:
            raise ValueError(f"targets hold {t.min() if t.min() < 0 else t.max()}, outside the vocabulary of the "
                             f"logits (0..{V - 1}) and not ignore_index={self.ignore_index}")
        return logits, keep, t

    def value(self, logits) -> float:
        logits, keep, t = self._check(logits)
        rows = logits[keep].astype(np.float64)
        m = rows.max(axis=-1)
        lse = m + np.log(np.exp(rows - m[:, None]).sum(axis=-1))
        return float(np.mean(lse - rows[np.arange(len(t)), t]))

    def grad(self, logits) -> np.ndarray:
        logits, keep, t = self._check(logits)
        rows = _softmax(logits[keep].astype(np.float64))
        rows[np.arange(len(t)), t] -= 1.0
        g = np.zeros(logits.shape, dtype=logits.dtype)
        g[keep] = rows / len(t)
        return g

    def __repr__(self) -> str:
        return f"cross_entropy(targets of shape {self.targets.shape}, ignore_index={self.ignore_index})"


def cross_entropy(targets, *, ignore_index: int = -100) -> Metric:
    """The mean of ``-log softmax(logits[b, t])[targets[b, t]]`` over the positions whose
    target is not ``ignore_index`` (torch's ``F.cross_entropy(logits.flatten(0, -2),
    targets.flatten())``).

    ``targets`` has the logits' shape without ``V``: position ``t`` scores the token at ``t``.
    For next-token prediction on ``ids``, shift: ``targets = ids[:, 1:]`` against the
    logits of ``ids[:, :-1]``, or keep every position and set the last target to
    ``ignore_index``.

    >>> ids = np.array([[3, 1, 2]])
    >>> targets = np.concatenate([ids[:, 1:], [[-100]]], axis=1)   # the next token; none after the last
    >>> round(cross_entropy(targets)(np.zeros((1, 3, 4))), 4)      # uniform over V = 4: log 4
    1.3863
    """
    return _CrossEntropy(targets, ignore_index)


def check_metric(metric: object, what: str) -> None:
    """A ``TypeError`` unless ``metric`` is a callable with ``.grad`` (what ``what`` needs)."""
    if not callable(metric) or not callable(getattr(metric, "grad", None)):
        raise TypeError(
            f"{what} needs a metric with a gradient: an object with __call__(logits) -> number and "
            f".grad(logits) -> array, such as attnlab.inspect.logit_diff(good, bad), log_prob(token), "
            f"probability(token) or cross_entropy(targets); got {type(metric).__name__}"
            + (" without .grad" if callable(metric) else ""))
