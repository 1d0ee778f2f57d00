"""A learner's function inside a real model: :func:`plugged` puts it in every attention
layer of a decoder (SmolLM2) through the layer's slots, and :func:`model_check` asks the
model "What is the capital of France?" with it.

The slots are the attention function (``Attention.attention_fn``, called as
:func:`attnlab.scaled_dot_product_attention` is, on the heads ``(N, H, L, D)``, with the
key/value heads ``(N, H_kv, S, D)`` and the cached keys included) and the position slot
(``Attention.rotary``) for :func:`~attnlab.exercises.tasks.apply_rotary`. Every exercise
gets the model's numbers in the shapes its task states: the key/value heads are repeated
for the query heads where the task has no grouped heads, and the causal mask is built
bottom-right (the last query sees every key) for the layer's causal attention.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from attnlab.core import causal_mask, scaled_dot_product_attention
from attnlab.exercises._run import LearnerError, _TooSlow, as_array, exit_message, time_limit, where_in_learner_code
from attnlab.nn.module import Module

__all__ = ["QUESTION", "ModelCheck", "model_check", "plugged"]

#: What the model is asked, through its chat template.
QUESTION = "What is the capital of France?"
#: New tokens at most ("The capital of France is Paris." is 7).
ANSWER_TOKENS = 8
#: The online-softmax exercise reads the keys this many at a time inside the model.
MODEL_BLOCK = 8


def _set_slot(attn, slot: str, value) -> None:
    """The one place that writes a layer's slot (``attention_fn`` or ``rotary``)."""
    setattr(attn, slot, value)


class _Learner:
    """Calls the learner's function inside the model; a fault becomes a :class:`LearnerError`
    that says where (which block, which shapes)."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name

    def __call__(self, block: int, args: tuple, *, need: tuple | None = None, dtype=None, many: int = 0):
        shapes = ", ".join(str(tuple(np.shape(a))) if hasattr(a, "shape") else repr(a) for a in args)
        what = f"block {block} of the model ({self.name}{shapes and f' on {shapes}'})"
        try:
            with np.errstate(all="ignore"):
                out = self.fn(*args)
        except _TooSlow:
            raise
        except SystemExit as exc:
            raise LearnerError(f"in the model, {exit_message(exc, what)}") from None
        except Exception as exc:
            raise LearnerError(f"in the model, your function raised {type(exc).__name__}: {exc}"
                               f"{where_in_learner_code(exc)} in {what}") from None
        outs = list(out) if many else [out]
        if many and len(outs) != many:
            raise LearnerError(f"in the model, your function returned {len(outs)} values in {what}; it must return "
                               f"{many}")
        arrays = [as_array(o, what) for o in outs]
        if need is not None:
            for a, n in zip(arrays, need if many else [need], strict=True):
                if a.shape != tuple(n):
                    raise LearnerError(f"in the model, your function returned shape {a.shape} in {what}; the "
                                       f"layer needs {tuple(n)}")
        if dtype is not None:
            arrays = [a if a.dtype == np.bool_ else a.astype(dtype, copy=False) for a in arrays]
        return tuple(arrays) if many else arrays[0]


def _repeat(kv: np.ndarray, Hq: int) -> np.ndarray:
    """``(N, H_kv, S, D) -> (N, Hq, S, D)``: key/value head ``g`` serves query heads
    ``g * G .. g * G + G - 1``."""
    H = kv.shape[-3]
    return kv if H == Hq else np.repeat(kv, Hq // H, axis=-3)


def _merge(x: np.ndarray) -> np.ndarray:
    """``(N, H, L, D) -> (N, L, H * D)``."""
    N, H, L, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(N, L, H * D)


def _split(x: np.ndarray, H: int) -> np.ndarray:
    """``(N, L, H * D) -> (N, H, L, D)``."""
    N, L, HD = x.shape
    return x.reshape(N, L, H, HD // H).transpose(0, 2, 1, 3)


def _bool_mask(attn_mask, L: int, S: int, causal: bool):
    """The layer's mask as bool ``(..., L, S)`` (True = takes part), the causal one
    (bottom-right) included; None when every key takes part."""
    m = None
    if attn_mask is not None:
        m = attn_mask if attn_mask.dtype == np.bool_ else attn_mask > -np.inf
    if causal and L > 1:
        c = causal_mask(L, S, align="bottom-right")
        m = c if m is None else m & c
    return m


def _one_for_all_heads(mask):
    """A layer mask ``(N, 1, L, S)`` as ``(N, L, S)``: the multi-head exercises take one mask
    for every head."""
    return mask[:, 0] if mask is not None and mask.ndim == 4 else mask


def _picks(state: dict, n: int, parts: int, dtype) -> tuple[np.ndarray, ...]:
    """``(I, P_0, .., P_{parts-1})``: the ``(n, n)`` identity and the ``(n, parts * n)``
    weights that pick part ``i`` of a ``parts * n``-wide input (made once per layer)."""
    key = ("picks", n, parts, np.dtype(dtype))
    if key not in state:
        eye = np.eye(n, dtype=dtype)
        picks = []
        for i in range(parts):
            w = np.zeros((n, parts * n), dtype=dtype)
            w[:, i * n:(i + 1) * n] = eye
            picks.append(w)
        state[key] = (eye, *picks)
    return state[key]


def _attention_fn(name: str, learner: _Learner, block: int, attn) -> Callable:
    """The layer's ``attention_fn`` for exercise ``name``: the model's heads in, the
    learner's function in the middle, ``(N, Hq, L, Dv)`` out."""
    causal = attn.causal
    state: dict = {}

    def fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, rng=None):
        if scale is not None and not np.isclose(scale, q.shape[-1] ** -0.5):
            raise ValueError(f"this model scales its scores by {scale}; the exercises' functions use 1/sqrt(E)")
        N, Hq, L, D = q.shape
        S = k.shape[-2]
        Dv = v.shape[-1]
        kx, vx = _repeat(k, Hq), _repeat(v, Hq)
        mask = _bool_mask(attn_mask, L, S, causal or is_causal)
        out_shape = (N, Hq, L, Dv)
        call = learner
        if name == "softmax":
            s = q @ kx.swapaxes(-1, -2) * np.float32(D ** -0.5)
            if mask is not None:
                s = np.where(mask, s, -np.inf)
            return call(block, (s, -1), need=s.shape, dtype=q.dtype) @ vx
        if name == "scaled_dot_product_attention":
            return call(block, (q, kx, vx, mask), need=out_shape, dtype=q.dtype)
        if name == "causal_mask":
            m = call(block, (L, S), need=(L, S))
            return scaled_dot_product_attention(q, kx, vx, attn_mask=m.astype(bool))
        if name == "split_heads":
            q2, k2, v2 = (call(block, (_merge(a), Hq), need=a.shape, dtype=q.dtype) for a in (q, kx, vx))
            return scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
        if name == "merge_heads":
            z = scaled_dot_product_attention(q, kx, vx, attn_mask=mask)
            return _split(call(block, (z,), need=(N, L, Hq * Dv), dtype=q.dtype), Hq)
        if name == "multi_head_attention":
            # Self-attention on x = [queries | keys | values] side by side, with weights that pick
            # each part out (identity blocks); the queries padded in front to the keys' length
            # (the padding rows' outputs are dropped).
            HD = Hq * D
            qw = np.zeros((N, S, HD), q.dtype)
            qw[:, S - L:] = _merge(q)
            x = np.concatenate([qw, _merge(kx), _merge(vx)], axis=-1)
            eye, w_q, w_k, w_v = _picks(state, HD, 3, q.dtype)
            m = _one_for_all_heads(mask)
            full = None
            if m is not None:
                full = np.ones((*m.shape[:-2], S, S), dtype=bool)
                full[..., S - L:, :] = m
            y = call(block, (x, w_q, w_k, w_v, eye, Hq, full), need=(N, S, HD), dtype=q.dtype)
            return _split(y[:, S - L:], Hq)
        if name == "cross_attention":
            HD = Hq * D
            eye, w_k, w_v = _picks(state, HD, 2, q.dtype)
            context = np.concatenate([_merge(kx), _merge(vx)], axis=-1)
            y = call(block, (_merge(q), context, eye, w_k, w_v, eye, Hq, _one_for_all_heads(mask)),
                     need=(N, L, HD), dtype=q.dtype)
            return _split(y, Hq)
        if name == "grouped_query_attention":
            return call(block, (q, k, v, mask), need=out_shape, dtype=q.dtype)
        if name == "online_softmax_attention":
            return call(block, (q, kx, vx, MODEL_BLOCK, mask), need=out_shape, dtype=q.dtype)
        if name == "cached_attention":
            # The learner's cache is the layer's memory: what the function returned at the
            # last token comes back now (the layer's own cache only gives the new keys).
            past = state.get("cache")
            P = S - L
            if past is None or past[0].shape[-2] != P:
                if past is not None or P:
                    got = "nothing" if past is None else f"{past[0].shape[-2]} keys"
                    raise LearnerError(f"in the model, block {block} expected a cache of {P} keys back from your "
                                       f"function at the last token, but it returned {got}")
                past = (kx[..., :0, :], vx[..., :0, :])
            out, kc, vc = call(block, (q, kx[..., P:, :], vx[..., P:, :], *past),
                               need=(out_shape, (N, Hq, S, D), (N, Hq, S, Dv)), dtype=q.dtype, many=3)
            state["cache"] = (kc, vc)
            return out
        raise ValueError(f"exercise {name!r} has no attention slot")

    fn.reset = lambda: state.pop("cache", None)  # a new sequence starts with an empty cache
    return fn


class _Rotary(Module):
    """The position slot with the learner's :func:`~attnlab.exercises.tasks.apply_rotary`
    (``forward(q, k, positions) -> (q, k)``, as :class:`attnlab.nn.RotaryEmbedding`)."""

    def __init__(self, learner: _Learner, block: int, original):
        super().__init__()
        config = original.config
        if config.rope_type != "default" or config.rotary_dim != config.head_dim:
            raise ValueError("this model's rotary embedding is scaled or partial; the exercise's apply_rotary is "
                             "the plain one")
        object.__setattr__(self, "learner", learner)
        self.block, self.theta = block, float(config.theta)

    def forward(self, q, k, positions):
        return self.rotate(q, positions), self.rotate(k, positions)

    def rotate(self, x, positions):
        positions = np.asarray(positions)
        if positions.ndim == 2:  # one row of positions per sequence
            return np.stack([self.rotate(x[i:i + 1], p)[0] for i, p in enumerate(positions)])
        return self.learner(self.block, (x, positions, self.theta), need=x.shape, dtype=x.dtype)


@contextlib.contextmanager
def plugged(model, name: str, fn: Callable) -> Iterator[None]:
    """Inside the ``with`` block, every attention layer of ``model`` computes with ``fn``,
    the learner's function of exercise ``name`` (see :func:`attnlab.exercises.names`).

    Args:
        model: a model whose ``layers`` have an ``attn`` (:class:`attnlab.nn.Attention`):
            SmolLM2, any Llama-family model, GPT-2, MiniLM (a causal layer gets the causal
            mask, an encoder's its padding mask).
        name: the exercise.
        fn: the function, with the exercise's signature.

    Raises:
        ValueError: an exercise with no place in a model, or a model whose attention the
            exercise does not describe (scaled scores, scaled rotary).
        LearnerError: (from the model's call) the function failed inside the model; the
            message names the block and the shapes.

    >>> import numpy as np
    >>> from attnlab.models import Llama, LlamaConfig
    >>> from attnlab.exercises import solution
    >>> cfg = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> model = Llama(cfg, rng=np.random.default_rng(0))
    >>> ids = np.array([[1, 2, 3, 4]])
    >>> with plugged(model, "grouped_query_attention", solution("grouped_query_attention")):
    ...     mine = model(ids)
    >>> bool(np.allclose(mine, model(ids), atol=1e-5))
    True
    """
    from attnlab.exercises._catalog import EXERCISES

    if name not in EXERCISES or not EXERCISES[name].in_model:
        raise ValueError(f"exercise {name!r} has no place in a model")
    learner = _Learner(fn, name)
    saved = []
    try:
        for i, layer in enumerate(model.layers):
            attn = layer.attn
            saved.append((attn, attn.attention_fn, attn.rotary))
            if name == "apply_rotary":
                if attn.rotary is None:
                    raise ValueError("this model has no rotary embedding to replace")
                _set_slot(attn, "rotary", _Rotary(learner, i, attn.rotary))
            else:
                if getattr(attn, "softcap", None) is not None:
                    raise ValueError("this model soft-caps its scores; the exercises' attention does not")
                _set_slot(attn, "attention_fn", _attention_fn(name, learner, i, attn))
        yield
    finally:
        for attn, fn_saved, rotary in saved:
            _set_slot(attn, "attention_fn", fn_saved)
            _set_slot(attn, "rotary", rotary)


def _reset(model) -> None:
    for layer in model.layers:
        reset = getattr(layer.attn.attention_fn, "reset", None)
        if reset is not None:
            reset()


@dataclass
class ModelCheck:
    """What a model did with the learner's function in it.

    Attributes:
        answer: the model's answer to :data:`QUESTION` (greedy, at most 8 tokens).
        paris: whether the answer says Paris.
        reference: the model's own answer.
        logit_change: the largest ``|logit - the model's own|`` over the prompt's positions.
        seconds: the time the model took with the function.
        error: why the model could not run with the function (then the rest is empty).
    """

    answer: str = ""
    paris: bool = False
    reference: str = ""
    logit_change: float | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.paris

    def __str__(self) -> str:
        if self.error is not None:
            return f"in SmolLM2: {self.error}"
        verdict = "still answers Paris" if self.paris else "no longer answers Paris"
        moved = "" if self.logit_change is None else f"; its logits moved by at most {self.logit_change:.2g}"
        if self.logit_change is not None and self.logit_change != self.logit_change:
            moved = "; its logits became NaN (your function gave NaN somewhere in the model)"
        return f"in SmolLM2 ({QUESTION!r}): {verdict}: {self.answer!r}{moved} (its own answer: {self.reference!r})"


#: The last model asked and its own answer: ``(model, logits, answer)`` (one model kept).
_REFERENCE: list = []


def _greedy(model, ids: np.ndarray) -> tuple[np.ndarray, str]:
    """The prompt's logits ``(T, V)`` and the greedy answer (at most :data:`ANSWER_TOKENS`,
    up to the end token), with the model's key/value cache."""
    eos = model.config.eos_token_id
    stop = set(np.atleast_1d(eos).tolist()) if eos is not None else set()
    cache = model.new_cache()
    logits = model(ids[None], cache=cache)[0]
    last, new = logits[-1], []
    while len(new) < ANSWER_TOKENS:
        token = int(np.argmax(last))
        if token in stop:
            break
        new.append(token)
        if len(new) < ANSWER_TOKENS:
            last = model(np.array([[token]]), cache=cache, logits_to_keep=1)[0, -1]
    return logits, model.tokenizer.decode(new, skip_special_tokens=True)


def _prompt_ids(model) -> np.ndarray:
    text = model.chat_prompt(QUESTION) if getattr(model, "chat_template", None) else QUESTION
    return model.encode(text)[0]


def model_check(model, name: str, fn: Callable, *, seconds: float | None = 120.0) -> ModelCheck:
    """Ask ``model`` :data:`QUESTION` with ``fn`` plugged in (:func:`plugged`) and compare
    with its own answer and logits. A fault of ``fn`` (it raises, returns the wrong shape,
    takes longer than ``seconds`` in all) is the result's ``error``, never an exception.

    Returns:
        A :class:`ModelCheck`.
    """
    ids = _prompt_ids(model)
    if not _REFERENCE or _REFERENCE[0] is not model:
        _REFERENCE[:] = [model, *_greedy(model, ids)]
    _, ref_logits, ref_answer = _REFERENCE
    result = ModelCheck(reference=ref_answer)
    start = time.perf_counter()
    try:
        with plugged(model, name, fn), time_limit(seconds):
            _reset(model)
            logits, answer = _greedy(model, ids)
    except _TooSlow:
        result.error = (f"the model took more than {seconds:g} s with your function (the time limit): is there a "
                        "loop over single numbers that NumPy could do at once?")
        return result
    except LearnerError as exc:
        result.error = str(exc)
        return result
    finally:
        result.seconds = time.perf_counter() - start
    result.answer = answer
    result.paris = "paris" in answer.lower()
    with np.errstate(invalid="ignore"):
        diff = np.abs(logits.astype(np.float64) - ref_logits)
    result.logit_change = float("nan") if np.isnan(diff).any() else float(diff.max())
    return result
