"""What a sweep runs on each batch: the methods, and the one registry that names them.

A method turns a :class:`Batch` (token ids, left-padded, with the dataset items they came
from) into results: a dict ``{name: array with a leading batch axis B}`` or ``{name: list of
B arrays}`` (one per item, when their shapes differ, e.g. one row per token). The built-in
methods wrap attnlab's public functions (``run_with_cache``, :mod:`attnlab.inspect`,
``generate``); any function ``(model, batch) -> dict`` is a method too
(:class:`FunctionMethod`). A new method adds one entry to :data:`METHODS`
(:func:`register_method`): a name and a factory that takes the method's options.

Shapes: ``B`` items in a batch, ``T`` the batch's padded length, ``T_i`` item ``i``'s own
length, ``N`` blocks, ``H`` heads, ``k`` top tokens. Position axes keep only an item's own
tokens (the left padding is cut off), so item ``i``'s results equal those of a run of that
item alone (to float rounding: the batch's shape changes the order of some sums).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "METHODS",
    "ActivationPatching",
    "Batch",
    "Cache",
    "DetectHeads",
    "FunctionMethod",
    "Generate",
    "LogitLensTop",
    "Method",
    "make_method",
    "register_method",
]

Item = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a sweep: items of similar length, their ids padded to one length: on the
    left for a decoder (its last token last, as ``generate`` wants), on the right for an
    encoder (positions from 0).

    Attributes:
        input_ids: ``(B, T)`` int64 token ids, each row padded with id 0 (masked out).
        attention_mask: ``(B, T)`` int64, 1 for an item's tokens, 0 for its padding.
        lengths: ``(B,)`` each item's own length ``T_i`` (its last ``T_i`` columns, or its
            first ``T_i`` with ``left=False``).
        indices: ``(B,)`` the items' 0-based places in the dataset.
        items: the dataset items (JSON objects) themselves.
        extra: per item, what the method's :meth:`Method.encode` returned besides
            ``input_ids`` (e.g. the corrupted prompt's ids).
        seed: a number fixed by the batch's place in the dataset (for methods that draw).
        left: the padding is on the left (decoders) rather than the right (encoders).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    lengths: np.ndarray
    indices: np.ndarray
    items: tuple[Item, ...]
    extra: tuple[Mapping[str, np.ndarray], ...]
    seed: int = 0
    left: bool = True

    def __len__(self) -> int:
        return len(self.indices)

    def _span(self, b: int) -> slice:
        n, T = int(self.lengths[b]), self.input_ids.shape[1]
        return slice(T - n, T) if self.left else slice(0, n)

    def ids(self, b: int) -> np.ndarray:
        """Item ``b``'s own token ids, ``(1, T_i)``: a batch of one, no padding."""
        return self.input_ids[b:b + 1, self._span(b)]

    def one(self, b: int) -> Batch:
        """Item ``b`` alone, as a batch of one without padding."""
        span = self._span(b)
        return Batch(self.input_ids[b:b + 1, span], self.attention_mask[b:b + 1, span], self.lengths[b:b + 1],
                     self.indices[b:b + 1], self.items[b:b + 1], self.extra[b:b + 1], self.seed, self.left)

    def own(self, a: np.ndarray, b: int, axes: tuple[int, ...] = (1,)) -> np.ndarray:
        """Item ``b``'s own positions of a batched array ``a`` (axis 0 the batch; ``axes``
        its position axes, each of length ``T``): the padding cut off.

        >>> batch = Batch(np.array([[0, 5, 6]]), np.array([[0, 1, 1]]), np.array([2]), np.array([0]), ({},), ({},))
        >>> batch.own(np.arange(3)[None], 0)
        array([1, 2])
        """
        index = [slice(None)] * (a.ndim - 1)
        for axis in axes:
            index[axis - 1] = self._span(b)
        return a[b][tuple(index)]


class Method:
    """The base of every method (see the module docstring).

    Subclasses set :attr:`name`, take their options as keyword arguments (checked there,
    with clear errors), and define :meth:`__call__`; :meth:`encode` reads one item.
    """

    #: the registry name
    name = "method"
    #: True: each batch holds one item (a method that runs the model many times per item)
    one_per_batch = False

    def __init__(self, *, field: str = "text"):
        if not isinstance(field, str) or not field:
            raise TypeError(f"field must be a non-empty str, got {field!r}")
        self.field = field

    def settings(self) -> dict:
        """The options, as JSON: a sweep's folder records them, and refuses to resume with others."""
        return {"field": self.field}

    def check(self, model) -> None:
        """Raise a ``ValueError`` when the options do not fit ``model`` (before any work)."""

    def encode(self, item: Item, model) -> dict[str, np.ndarray]:
        """``{"input_ids": (T,) ids, ...}`` of one item: its :attr:`field`, a text (through the
        model's tokenizer) or a list of token ids. Raises ``ValueError`` naming what is wrong."""
        return {"input_ids": sequence(item, self.field, model)}

    def __call__(self, model, batch: Batch) -> dict[str, np.ndarray | list]:
        raise NotImplementedError


def sequence(item: Item, field: str, model) -> np.ndarray:
    """The token ids ``(T,)`` of ``item[field]``: a text (the model's tokenizer) or a list of ids."""
    if field not in item:
        have = ", ".join(map(repr, list(item)[:8])) or "none"
        raise ValueError(f"the item has no field {field!r} (its fields: {have})")
    value = item[field]
    if isinstance(value, str):
        if not hasattr(model, "encode"):
            raise ValueError(f"field {field!r} is a text, but {type(model).__name__} has no tokenizer: "
                             "give token ids (a list of ints)")
        return np.asarray(model.encode(value)[0], dtype=np.int64)
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = np.asarray(value, dtype=np.int64)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"field {field!r} holds token ids outside [0, {vocab})")
        return ids
    raise ValueError(f"field {field!r} must be a text or a non-empty list of token ids, got {_kind(value)}")


def _kind(value: object) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _position(position: object) -> int | str | None:
    if position is None or position == "mean":
        return position
    if isinstance(position, bool) or not isinstance(position, int | np.integer):
        raise TypeError(f"position must be an int (a token, -1 the last), 'mean' or None, got {position!r}")
    return int(position)


def _reduce(a: np.ndarray, position: int | str | None, axis: int = 0) -> np.ndarray:
    """One item's array reduced along its position ``axis``: one position, the mean, or all."""
    if position is None:
        return a
    if position == "mean":
        return a.mean(axis=axis, dtype=np.float64).astype(a.dtype, copy=False)
    n = a.shape[axis]
    if not -n <= position < n:
        raise ValueError(f"position {position} is outside this item's {n} tokens")
    return np.take(a, position, axis=axis)


# Hook names whose arrays are (B, H, L, S): the first position axis is 2 (the query), the
# key axis 3 follows it. Every other hook point has its positions on axis 1.
_MAP_HOOKS = ("hook_pattern", "hook_attn_scores")


class Cache(Method):
    """The chosen hook points' activations, per item (``run_with_cache``).

    Options:
        hooks: hook names (``blocks.3.hook_resid_post``, ``blocks.0.attn.hook_pattern``, ...).
        position: ``None`` (every token of the item, the default), an int (that token of
            each item, ``-1`` the last) or ``"mean"`` (the mean over the item's tokens).
            An attention map ``(H, T_i, T_i)`` is reduced along its query axis.

    Results: one per hook, named as the hook; ``(T_i, ...)`` per item, or without the
    position axis when reduced.
    """

    name = "cache"

    def __init__(self, *, hooks: Sequence[str], position: int | str | None = None, field: str = "text"):
        super().__init__(field=field)
        if isinstance(hooks, str):
            hooks = [hooks]
        if not isinstance(hooks, Sequence) or not hooks or not all(isinstance(h, str) for h in hooks):
            raise TypeError(f"hooks must be a non-empty list of hook names, got {hooks!r}")
        self.hooks = list(dict.fromkeys(hooks))
        self.position = _position(position)

    def settings(self) -> dict:
        return {**super().settings(), "hooks": self.hooks, "position": self.position}

    def check(self, model) -> None:
        known = set(model.hook_names())
        for h in self.hooks:
            if h not in known:
                import difflib

                close = difflib.get_close_matches(h, sorted(known), n=3, cutoff=0.5)
                raise ValueError(f"the model has no hook point {h!r}" + (f"; closest: {', '.join(close)}" if close
                                                                            else ""))

    def __call__(self, model, batch: Batch) -> dict[str, list]:
        _, cache = model.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask,
                                        names_filter=self.hooks)
        out = {}
        for name in self.hooks:
            a = np.asarray(cache[name])
            maps = name.endswith(_MAP_HOOKS)
            per_item = []
            for b in range(len(batch)):
                x = batch.own(a, b, (2, 3) if maps else (1,))  # maps: (H, T_i, T_i), else (T_i, ...)
                per_item.append(np.asarray(_reduce(x, self.position, axis=1 if maps else 0), order="C"))
            out[name] = per_item
        return out


class LogitLensTop(Method):
    """The ``k`` likeliest tokens of the logit lens at every block, per item
    (:func:`attnlab.inspect.logit_lens_top` on each item's own positions).

    Options:
        k: how many tokens (default 5).
        position: ``None`` (every token, the default) or an int (that token, ``-1`` the last).

    Results: ``ids`` (int64) and ``probs`` (float64), each ``(N + 1, T_i, k)`` per item (or
    ``(N + 1, k)`` at one position); entry 0 reads the embeddings.
    """

    name = "logit_lens_top"

    def __init__(self, *, k: int = 5, position: int | None = None, field: str = "text"):
        super().__init__(field=field)
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.k = int(k)
        self.position = _position(position)
        if self.position == "mean":
            raise ValueError("position='mean' has no meaning for token ids: give an int or None")

    def settings(self) -> dict:
        return {**super().settings(), "k": self.k, "position": self.position}

    def check(self, model) -> None:
        from attnlab.inspect._model import decoder_head

        decoder_head(model, "logit lens")

    def __call__(self, model, batch: Batch) -> dict[str, list]:
        from attnlab.inspect import logit_lens_top

        n = len(model.layers)
        names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(n)]
        _, cache = model.run_with_cache(batch.input_ids, attention_mask=batch.attention_mask, names_filter=names)
        if self.position is not None:  # every item's one position together: (B, 1, D) per entry
            own = {name: np.stack([_reduce(batch.own(np.asarray(cache[name]), b), self.position)
                                   for b in range(len(batch))])[:, None] for name in names}
            top, p = logit_lens_top(model, own, k=self.k)  # (N + 1, B, 1, k)
            return {"ids": np.moveaxis(top[:, :, 0], 1, 0).astype(np.int64), "probs": np.moveaxis(p[:, :, 0], 1, 0)}
        ids, probs = [], []
        for b in range(len(batch)):
            # One item at a time, its own positions only: one entry's (T_i, V) logits at a time.
            own = {name: batch.own(np.asarray(cache[name]), b)[None] for name in names}  # (1, T_i, D)
            top, p = logit_lens_top(model, own, k=self.k)  # (N + 1, 1, T_i, k)
            ids.append(top[:, 0].astype(np.int64))
            probs.append(p[:, 0])
        return {"ids": ids, "probs": probs}


class DetectHeads(Method):
    """How much each head attends as a head of ``kind`` would, per item
    (:func:`attnlab.inspect.detect_heads` on each item alone: it takes no padding).

    Options: ``kind`` (``"induction"``, ``"previous_token"``, ``"duplicate_token"``),
    ``exclude_bos``, ``exclude_current_token``.

    Results: ``scores`` ``(N, H)`` float64 per item.
    """

    name = "detect_heads"
    one_per_batch = True

    def __init__(self, *, kind: str = "induction", exclude_bos: bool = False, exclude_current_token: bool = False,
                 field: str = "text"):
        from attnlab.inspect import HEAD_KINDS

        super().__init__(field=field)
        if kind not in HEAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, HEAD_KINDS))}, got {kind!r}")
        self.kind, self.exclude_bos, self.exclude_current_token = kind, bool(exclude_bos), bool(exclude_current_token)

    def settings(self) -> dict:
        return {**super().settings(), "kind": self.kind, "exclude_bos": self.exclude_bos,
                "exclude_current_token": self.exclude_current_token}

    def __call__(self, model, batch: Batch) -> dict[str, np.ndarray]:
        from attnlab.inspect import detect_heads

        scores = [detect_heads(model, batch.ids(b), self.kind,
                               exclude_bos=self.exclude_bos, exclude_current_token=self.exclude_current_token)
                  for b in range(len(batch))]
        return {"scores": np.stack(scores)}


class ActivationPatching(Method):
    """Activation patching of each item's clean prompt into its corrupted one
    (:func:`attnlab.inspect.activation_patching`), measured by the logit difference
    ``logits[-1, answer] - logits[-1, wrong]`` at the last position.

    An item holds ``clean`` and ``corrupted`` (texts or token ids of one length) and
    ``answer`` and ``wrong`` (one token each: an id, or a text that is one token).

    Options: ``hook`` (``"resid_pre"``, ``"attn_out"``, ``"mlp_out"``, ``"z"``).

    Results: ``effect`` ``(N, T_i)`` (``(N, H)`` for ``"z"``) and ``clean``/``corrupted``,
    the metric of the unpatched runs (scalars), float64 per item.
    """

    name = "activation_patching"
    one_per_batch = True
    fields = ("clean", "corrupted", "answer", "wrong")

    def __init__(self, *, hook: str = "resid_pre"):
        from attnlab.inspect import PATCH_HOOKS

        super().__init__(field="clean")
        if hook not in PATCH_HOOKS:
            raise ValueError(f"hook must be one of {', '.join(map(repr, PATCH_HOOKS))}, got {hook!r}")
        self.hook = hook

    def settings(self) -> dict:
        return {"hook": self.hook}

    def encode(self, item: Item, model) -> dict[str, np.ndarray]:
        clean, corrupted = sequence(item, "clean", model), sequence(item, "corrupted", model)
        if clean.shape != corrupted.shape:
            raise ValueError(f"clean has {len(clean)} tokens and corrupted {len(corrupted)}: they must have "
                             "the same length")
        return {"input_ids": clean, "corrupted": corrupted, "answer": _one_token(item, "answer", model),
                "wrong": _one_token(item, "wrong", model)}

    def __call__(self, model, batch: Batch) -> dict[str, np.ndarray]:
        from attnlab.inspect import activation_patching

        effects, clean, corrupted = [], [], []
        for b in range(len(batch)):
            ex = batch.extra[b]
            answer, wrong = int(ex["answer"]), int(ex["wrong"])

            def metric(logits, answer=answer, wrong=wrong):
                return logits[0, -1, answer] - logits[0, -1, wrong]

            ids = batch.ids(b)
            bad = ex["corrupted"][None]
            effects.append(activation_patching(model, ids, bad, metric, hook=self.hook))
            clean.append(float(metric(model(ids))))
            corrupted.append(float(metric(model(bad))))
        return {"effect": effects, "clean": np.array(clean), "corrupted": np.array(corrupted)}


def _one_token(item: Item, field: str, model) -> np.ndarray:
    if isinstance(item.get(field), int) and not isinstance(item.get(field), bool):
        ids = sequence({field: [item[field]]}, field, model)
    else:
        ids = sequence(item, field, model)
    if len(ids) != 1:
        raise ValueError(f"field {field!r} must be one token, got {len(ids)}")
    return ids[0]


class Generate(Method):
    """Each item's prompt continued by the model (``model.generate``, one batch at a time,
    left-padded).

    Options: ``max_new_tokens`` (default 16), ``temperature`` (0: greedy, the default),
    ``top_k``, ``seed`` (sampling: each batch draws from a Generator seeded by
    ``seed`` and the batch's first item), ``eos_token_id`` (generation of an item stops
    there; its tokens end with it).

    Results: ``tokens`` ``(n_i,)`` int64 per item (the new tokens), and ``text`` (their
    decoding) when the model has a tokenizer.
    """

    name = "generate"

    def __init__(self, *, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0, eos_token_id: int | None = None, field: str = "text"):
        super().__init__(field=field)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, float(temperature), top_k
        self.seed, self.eos_token_id = int(seed), eos_token_id

    def settings(self) -> dict:
        return {**super().settings(), "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_k": self.top_k, "seed": self.seed, "eos_token_id": self.eos_token_id}

    def __call__(self, model, batch: Batch) -> dict[str, list]:
        rng = np.random.default_rng([self.seed, batch.seed])
        out = model.generate(batch.input_ids, self.max_new_tokens, attention_mask=batch.attention_mask,
                             temperature=self.temperature, top_k=self.top_k, rng=rng,
                             eos_token_id=self.eos_token_id)
        new = np.asarray(out)[:, batch.input_ids.shape[1]:]
        tokens = []
        for row in new:
            if self.eos_token_id is not None and (row == self.eos_token_id).any():
                row = row[: int(np.argmax(row == self.eos_token_id)) + 1]
            tokens.append(row.astype(np.int64))
        result: dict[str, list] = {"tokens": tokens}
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is not None:
            result["text"] = [tokenizer.decode([int(t) for t in row]) for row in tokens]
        return result


class FunctionMethod(Method):
    """Any function ``fn(model, batch) -> {name: array (B, ...) or list of B arrays}`` as a
    method. For the ``processes`` engine ``fn`` must be importable (a module-level function);
    Ray takes any function.

    Options: ``fn``, ``name`` (recorded in the sweep's folder: default the function's
    qualified name), ``one_per_batch``.
    """

    def __init__(self, fn: Callable, *, name: str | None = None, one_per_batch: bool = False, field: str = "text"):
        super().__init__(field=field)
        if not callable(fn):
            raise TypeError(f"fn must be a function (model, batch) -> dict of arrays, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        self.one_per_batch = bool(one_per_batch)

    def settings(self) -> dict:
        return {**super().settings(), "function": self.name}

    def __call__(self, model, batch: Batch):
        return self.fn(model, batch)


METHODS: dict[str, Callable[..., Method]] = {
    m.name: m for m in (Cache, LogitLensTop, DetectHeads, ActivationPatching, Generate)
}
"""Every method a sweep runs by name: name -> a factory taking the method's options (keyword
arguments) and returning a :class:`Method`. A new method adds one entry
(:func:`register_method`)."""


def register_method(name: str, factory: Callable[..., Method]) -> None:
    """Make ``factory(**options)`` the method called ``name`` (``attnlab sweep --method
    name``). A name already taken is replaced.

    >>> register_method("lengths", lambda **options: FunctionMethod(
    ...     lambda model, batch: {"length": batch.lengths}, name="lengths", **options))
    >>> make_method("lengths").name
    'lengths'
    >>> del METHODS["lengths"]
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (options -> Method), got {type(factory).__name__}")
    METHODS[name] = factory


def make_method(method: str | Method | Callable, options: Mapping[str, Any] | None = None) -> Method:
    """The :class:`Method` that ``method`` names (with ``options``), ``method`` itself, or a
    function wrapped in :class:`FunctionMethod`.

    Raises:
        ValueError: an unknown method name (the known ones are listed) or options it
            does not take.
    """
    options = dict(options or {})
    if isinstance(method, Method):
        if options:
            raise ValueError("options go to a method given by name; this method is already built")
        return method
    if isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; known: {', '.join(sorted(METHODS))}")
        try:
            return METHODS[method](**options)
        except TypeError as exc:
            raise ValueError(f"method {method!r}: {exc}") from None
    if callable(method):
        return FunctionMethod(method, **options)
    raise TypeError(f"method must be a method name, a Method or a function (model, batch) -> dict, "
                    f"got {type(method).__name__}")
