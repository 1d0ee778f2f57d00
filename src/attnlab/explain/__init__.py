"""What the ``explain`` views show, as data: :class:`Explanation`, :func:`explain` and the models.

An :class:`Explanation` holds one text run through one model: its tokens, every attention
map, the static and contextual token vectors, the step-by-step trace of one layer, the
layer and head to open on and, for decoders, what :mod:`attnlab.explain.inside` reads
from inside: the logit lens, the head detector scores and activation patching. The CLI
prints it, :mod:`attnlab.viz` draws it, the HTML report embeds it,
:meth:`Explanation.to_dict` is its JSON document.

Layers are numbered as everywhere in attnlab: layer 0 is the embeddings (no attention),
layer ``k`` is the output of the ``k``-th transformer block (``1..n``), negative numbers
count from the end. ``attentions[k - 1]`` holds layer ``k``'s maps. The head detector
scores and the patching result count blocks from 0, as the hook names do: block ``i``
makes layer ``i + 1``.

The models are callables in :data:`MODELS` (see :mod:`attnlab.explain.backends`); each
takes the text, ``layer``, ``head`` and ``trace`` plus options of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from attnlab.explain.attribution import Attribution, CircuitView
from attnlab.explain.backends import MODELS, checkpoint_model, gpt2_model, minilm_model, random_model
from attnlab.explain.inside import Lens, Patching
from attnlab.explain.words import WordComparison, compare_word

__all__ = [
    "MODELS",
    "Attribution",
    "CircuitView",
    "Explanation",
    "Lens",
    "Patching",
    "WordComparison",
    "checkpoint_model",
    "compare_word",
    "decode_array",
    "encode_ids",
    "encode_weights",
    "explain",
    "gpt2_model",
    "minilm_model",
    "random_model",
]

FORMAT = "attnlab-explanation"
# 2: layers numbered 1..n (0 = embeddings), "layers" and "model_name" added
# 3: attentions as 1e-4 codes (base64 of zlib'd uint16), vectors and steps rounded to 4
#    significant digits, steps only when asked, "unknown_tokens" added
# 4: "lens", "head_scores", "patching" (decoders) and "rollout" (encoders) added, null where
#    the model has none
# 5: "attribution" (decoders, explain --attribute) added, null where absent
FORMAT_VERSION = 5
#: Attention weights are stored in units of this (what the views show: 4 decimals).
WEIGHT_STEP = 1e-4
#: Vectors and trace steps keep this many significant digits in the JSON document.
DIGITS = 4


def round_significant(a, digits: int = DIGITS) -> np.ndarray:
    """``a`` rounded to ``digits`` significant digits (0, NaN and infinities unchanged).

    >>> round_significant(np.array([123456.0, -0.00123456, 0.0])).tolist()
    [123500.0, -0.001235, 0.0]
    """
    a = np.asarray(a, dtype=np.float64)
    finite = np.isfinite(a) & (a != 0)
    exp = np.zeros_like(a)
    exp[finite] = np.floor(np.log10(np.abs(a[finite])))
    k = (digits - 1 - exp).astype(np.int64)  # decimals to keep, per value
    out = a.copy()
    up = finite & (k >= 0)
    down = finite & (k < 0)
    # divide by an exact power of ten (never multiply by an inexact 10**-k): the result is
    # the double nearest the rounded decimal, so JSON writes it in its short form
    out[up] = np.rint(a[up] * 10.0 ** k[up]) / 10.0 ** k[up]
    out[down] = np.rint(a[down] / 10.0 ** -k[down]) * 10.0 ** -k[down]
    return out


def _array(a) -> dict:
    a = round_significant(a)
    values = np.where(np.isfinite(a), a, np.nan).tolist()  # -inf (masked scores) -> null
    return {"shape": list(a.shape), "values": _nan_to_none(values)}


def _nan_to_none(x):
    if isinstance(x, list):
        return [_nan_to_none(i) for i in x]
    return None if isinstance(x, float) and x != x else x


def encode_weights(attentions) -> dict:
    """Attention weights in ``[0, 1]`` as the JSON document stores them: codes
    ``round(w / WEIGHT_STEP)`` (uint16, little-endian), zlib-compressed, base64.

    >>> d = encode_weights(np.array([[0.25, 0.75]]))
    >>> d["shape"], d["dtype"], d["scale"], decode_array(d).tolist()
    ([1, 2], 'uint16', 0.0001, [[0.25, 0.75]])
    """
    import base64
    import zlib

    a = np.clip(np.asarray(attentions, dtype=np.float64), 0.0, 1.0)
    codes = np.rint(a / WEIGHT_STEP).astype("<u2")
    return {"shape": list(a.shape), "dtype": "uint16", "scale": WEIGHT_STEP, "encoding": "zlib+base64",
            "data": base64.b64encode(zlib.compress(codes.tobytes(), 6)).decode("ascii")}


def encode_ids(ids) -> dict:
    """Non-negative integers (token ids) as the JSON document stores them: ``uint16`` when
    they fit, else ``uint32`` (little-endian), zlib-compressed, base64.

    >>> d = encode_ids(np.array([[3, 70000]]))
    >>> d["shape"], d["dtype"], decode_array(d).tolist()
    ([1, 2], 'uint32', [[3, 70000]])
    """
    import base64
    import zlib

    a = np.asarray(ids, dtype=np.int64)
    if a.size and (a.min() < 0 or a.max() >= 1 << 32):
        raise ValueError(f"ids must lie in [0, 2**32), got values in [{a.min()}, {a.max()}]")
    dtype = "uint16" if not a.size or a.max() < 1 << 16 else "uint32"
    data = a.astype("<u2" if dtype == "uint16" else "<u4").tobytes()
    return {"shape": list(a.shape), "dtype": dtype, "encoding": "zlib+base64",
            "data": base64.b64encode(zlib.compress(data, 6)).decode("ascii")}


def decode_array(entry: dict) -> np.ndarray:
    """An array of the JSON document back as NumPy: ``{"shape", "values"}`` (nested lists,
    ``null`` for -inf), ``{"shape", "dtype", "scale", "encoding", "data"}`` (the
    attention weights and the lens's probabilities, see :func:`encode_weights`) or the
    same without ``scale`` (token ids, see :func:`encode_ids`; int64).

    >>> decode_array({"shape": [2], "values": [0.5, None]}).tolist()
    [0.5, -inf]
    """
    import base64
    import zlib

    shape = tuple(entry["shape"])
    if "data" in entry:
        dtypes = {"uint16": "<u2"} if "scale" in entry else {"uint16": "<u2", "uint32": "<u4"}
        if entry.get("encoding") != "zlib+base64" or entry.get("dtype") not in dtypes:
            raise ValueError(f"unknown array encoding {entry.get('encoding')!r} / dtype {entry.get('dtype')!r}")
        codes = np.frombuffer(zlib.decompress(base64.b64decode(entry["data"])), dtype=dtypes[entry["dtype"]])
        if "scale" not in entry:
            return codes.astype(np.int64).reshape(shape)
        return (codes.astype(np.float64) * float(entry["scale"])).reshape(shape)
    values = _nan_to_none(entry["values"])
    return np.array([-np.inf if v is None else v for v in np.ravel(np.array(values, dtype=object))],
                    dtype=np.float64).reshape(shape)


@dataclass
class Explanation:
    """One text through one model.

    Attributes:
        text: the input text.
        tokens: the ``T`` token strings (word pieces for BERT).
        model: a human-readable description of the model ("name: details").
        attentions: ``(n_layers, heads, T, T)`` attention weights; ``attentions[k - 1]`` is
            layer ``k``; rows sum to 1.
        static: ``(T, D)`` token vectors before attention (layer 0, the embeddings).
        contextual: ``(T, D)`` token vectors after the last layer.
        trace: the step-by-step record (:class:`attnlab.Trace`) of :attr:`layer`'s
            attention, or None.
        created: ISO-8601 UTC time of creation.
        notes: remarks a reader should see (e.g. unknown words, truncation).
        model_name: the key of :data:`MODELS` that made it (``""`` if built by hand).
        layer: the layer to show first, ``1..n_layers`` (None: the last).
        head: the head to show first (``0..heads-1``).
        unknown: how many of the tokens are the model's unknown token (``[UNK]``,
            ``<unk>``): their vectors say nothing about the text they replaced.
        lens: the logit lens (:class:`~attnlab.explain.inside.Lens`): the likeliest next
            tokens at each position after each layer ``0..n``; None for encoders.
        head_scores: :func:`attnlab.inspect.detect_heads` on the text's own ids, as
            ``{"previous_token", "duplicate_token", "induction"} -> (n_layers, heads)``;
            row ``i`` is block ``i`` (layer ``i + 1``). None for encoders.
        patching: activation patching of ``resid_pre`` from this text into a corrupted
            one (:class:`~attnlab.explain.inside.Patching`, ``(n_layers, T)``, row ``i``
            the residual entering block ``i``), or None.
        rollout: encoders: :func:`attnlab.inspect.attention_rollout` of the maps,
            ``(n_layers, T, T)``; ``rollout[k - 1]`` is the rollout through layers
            ``1..k`` (each row sums to 1). None for decoders.
        token_scheme: how the tokenizer writes its tokens (``"byte-level"``,
            ``"sentencepiece"``, ``"plain"``): what :meth:`readable_tokens` undoes for
            display (:func:`attnlab.text.readable_token`); :attr:`tokens` stay raw.
        attribution: decoders with ``attribute=True``: the predicted token's input
            attribution and, with a corrupted text, attribution patching and the EAP-IG
            circuit (:class:`~attnlab.explain.attribution.Attribution`), or None.
    """

    text: str
    tokens: list[str]
    model: str
    attentions: np.ndarray
    static: np.ndarray
    contextual: np.ndarray
    trace: object | None = None
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    notes: list[str] = field(default_factory=list)
    model_name: str = ""
    layer: int | None = None
    head: int = 0
    unknown: int = 0
    lens: Lens | None = None
    head_scores: dict[str, np.ndarray] | None = None
    patching: Patching | None = None
    rollout: np.ndarray | None = None
    token_scheme: str = "plain"
    attribution: Attribution | None = None

    def __post_init__(self) -> None:
        if self.layer is None:
            self.layer = int(np.shape(self.attentions)[0])

    @property
    def n_layers(self) -> int:
        return int(np.shape(self.attentions)[0])

    @property
    def n_heads(self) -> int:
        return int(np.shape(self.attentions)[1])

    def readable_tokens(self, tokens=None) -> list[str]:
        """:attr:`tokens` (or ``tokens``, e.g. the lens's strings) as a person reads them:
        ``'ĠParis'`` -> ``'␣Paris'`` (see :func:`attnlab.text.readable_token`); words and
        word pieces (``token_scheme="plain"``) as they are.

        >>> e = Explanation("Paris", ["ĠParis"], "toy", np.ones((1, 1, 1, 1)), np.eye(1), np.eye(1),
        ...                 token_scheme="byte-level")
        >>> e.readable_tokens(), e.tokens
        (['␣Paris'], ['ĠParis'])
        """
        from attnlab.text.tokens import readable_tokens

        tokens = list(self.tokens if tokens is None else tokens)
        return tokens if self.token_scheme == "plain" else readable_tokens(tokens, self.token_scheme)

    def weights(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """One head's ``(T, T)`` map; ``layer`` in attnlab's numbering (default: :attr:`layer`)."""
        from attnlab._validation import layer_number

        k = layer_number(self.layer if layer is None else layer, self.n_layers, embeddings=False)
        h = _head_index(self.head if head is None else head, self.n_heads)
        return np.asarray(self.attentions)[k - 1, h]

    def to_dict(self, *, steps: bool = False) -> dict:
        """The JSON document (``"format": "attnlab-explanation"``, version 5), sized to its
        content and rounded to what the views show.

        ``attentions`` is stored once, as codes of ``WEIGHT_STEP`` (``1e-4``) units
        (:func:`encode_weights`; :func:`decode_array` reads it back); ``static`` and
        ``contextual`` as ``{"shape", "values"}`` rounded to 4 significant digits. The
        step-by-step ``trace`` is written only with ``steps=True`` (otherwise ``null``):
        each step rounded the same way, ``-inf`` as ``null``, and a head's ``weights``,
        which are the attention map already stored, as ``{"same_as": ["attentions",
        layer - 1, head]}`` instead of a second copy. Text that no file can hold (lone
        surrogates) is written as U+FFFD.

        What a decoder shows from inside (``null`` when absent):

        - ``lens``: ``{"shape": [n + 1, T, k], "ids", "probs", "token_ids",
          "token_strings", "rows"}``: ``ids`` the likeliest tokens (:func:`encode_ids`),
          ``probs`` their probabilities in ``WEIGHT_STEP`` units (:func:`encode_weights`),
          ``token_strings[m]`` the string of ``token_ids[m]``; row ``k`` is layer ``k``.
        - ``head_scores``: ``{kind: {"shape": [n, H], "values"}}`` rounded to 4 significant
          digits; row ``i`` is block ``i`` (layer ``i + 1``).
        - ``patching``: ``{"hook", "metric", "values" (n, T), "corrupted_text",
          "corrupted_tokens", "clean_prediction", "corrupted_prediction", "clean_value",
          "corrupted_value", "rows"}``; row ``i`` patches the residual entering block ``i``.
        - ``rollout`` (encoders): ``(n_layers, T, T)`` in ``WEIGHT_STEP`` units
          (:func:`encode_weights`); entry ``k - 1`` is the rollout through layers ``1..k``.
        - ``attribution`` (``explain --attribute``): ``{"target": {"id", "token"}, "method",
          "steps", "baseline", "scores" (T,), "value", "baseline_value", "gap", "atp" (n, T)
          or null, "atp_clean" (n, T) or null, "circuit"}``; ``atp`` estimates
          ``patching.values - corrupted_value`` (the gradient at the corrupted run);
          ``circuit`` is ``{"edges": [[source, target, score], ...], "faithfulness",
          "circuit_value", "edges_scored", "steps"}`` or null.

        >>> att = np.full((1, 1, 2, 2), 0.5)
        >>> e = Explanation("a b", ["a", "b"], "toy", att, np.eye(2), np.eye(2))
        >>> d = e.to_dict()
        >>> d["layer"], d["layers"], d["attentions"]["shape"], d["trace"]
        (1, 1, [1, 1, 2, 2], None)
        >>> decode_array(d["attentions"])[0, 0].tolist()
        [[0.5, 0.5], [0.5, 0.5]]
        """
        from attnlab.viz.html_report import clean_text

        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model_name": self.model_name,
            "model": clean_text(self.model),
            "text": clean_text(self.text),
            "tokens": [clean_text(t) for t in self.tokens],
            "unknown_tokens": int(self.unknown),
            "created": self.created,
            "notes": [clean_text(n) for n in self.notes],
            "layers": self.n_layers,
            "heads": self.n_heads,
            "layer": int(self.layer),
            "head": int(self.head),
            "attentions": encode_weights(self.attentions),
            "static": _array(self.static),
            "contextual": _array(self.contextual),
            "trace": self._trace_dict() if steps and self.trace is not None else None,
            "lens": self._lens_dict(),
            "head_scores": (None if self.head_scores is None
                            else {kind: _array(v) for kind, v in self.head_scores.items()}),
            "patching": self._patching_dict(),
            "rollout": None if self.rollout is None else encode_weights(self.rollout),
            "attribution": self._attribution_dict(),
        }

    def _attribution_dict(self) -> dict | None:
        from attnlab.viz.html_report import clean_text

        a = self.attribution
        if a is None:
            return None
        c = a.circuit

        def num(x):  # rounded; NaN (an undefined share) as null
            x = float(round_significant(x))
            return x if np.isfinite(x) else None

        return {"target": {"id": a.target_id, "token": clean_text(a.target_token)}, "method": a.method,
                "steps": a.steps, "baseline": a.baseline, "scores": _array(a.scores), "value": num(a.value),
                "baseline_value": num(a.baseline_value), "gap": num(a.gap),
                "atp": None if a.atp is None else _array(a.atp),
                "atp_clean": None if a.atp_clean is None else _array(a.atp_clean),
                "circuit": None if c is None else {
                    "edges": [[s, t, num(v)] for s, t, v in c.edges], "faithfulness": num(c.faithfulness),
                    "circuit_value": num(c.circuit_value), "edges_scored": c.edges_scored, "steps": c.steps}}

    def _lens_dict(self) -> dict | None:
        from attnlab.viz.html_report import clean_text

        lens = self.lens
        if lens is None:
            return None
        used = sorted({int(i) for i in np.unique(lens.ids)})
        return {"shape": list(np.shape(lens.ids)),
                "rows": "layer 0 (the embeddings) to layer n (the output of block n - 1)",
                "ids": encode_ids(lens.ids), "probs": encode_weights(lens.probs),
                "token_ids": used, "token_strings": [clean_text(lens.strings[i]) for i in used]}

    def _patching_dict(self) -> dict | None:
        from attnlab.viz.html_report import clean_text

        p = self.patching
        if p is None:
            return None
        return {"hook": p.hook, "metric": clean_text(p.metric),
                "rows": f"block i: the residual entering block i ({p.hook}), layer i's output",
                "values": _array(p.values), "corrupted_text": clean_text(p.corrupted_text),
                "corrupted_tokens": [clean_text(t) for t in p.corrupted_tokens],
                "clean_prediction": {"id": int(p.clean_id), "token": clean_text(p.clean_token)},
                "corrupted_prediction": {"id": int(p.corrupted_id), "token": clean_text(p.corrupted_token)},
                "clean_value": float(round_significant(p.clean_value)),
                "corrupted_value": float(round_significant(p.corrupted_value))}

    def _trace_dict(self) -> dict:
        from attnlab.viz.html_report import clean_text

        tr = self.trace
        layer = tr.layer if tr.layer is not None else self.layer
        att = np.asarray(self.attentions)
        out = []
        for st in tr.steps:
            step = {"name": st.name, "shape": list(st.shape), "head": st.head, "description": st.description}
            v = np.asarray(st.values)
            if (st.name == "weights" and st.head is not None and layer is not None
                    and 1 <= layer <= att.shape[0] and v.shape == att.shape[2:]
                    and np.allclose(v, att[layer - 1, st.head], atol=1e-6)):
                step["same_as"] = ["attentions", int(layer) - 1, int(st.head)]
            else:
                step["values"] = _array(v)["values"]
            out.append(step)
        return {"tokens": [clean_text(t) for t in tr.tokens],
                "key_tokens": [clean_text(t) for t in tr.key_tokens], "num_heads": tr.num_heads,
                "scale": tr.scale, "layer": tr.layer, "head": tr.head, "steps": out}

    def _repr_html_(self) -> str:
        """What Jupyter shows: one line on the explanation and its head view (the other
        views one at a time with :func:`attnlab.viz.show`; the whole report with
        :func:`attnlab.viz.write_report`)."""
        import html

        from attnlab.viz.notebook import _HAS, VIEWS, show

        views = [v for v in VIEWS if v not in _HAS or getattr(self, _HAS[v], None) is not None]
        line = (f"<p>attnlab explanation: {len(self.tokens)} tokens, {self.n_layers} layers × {self.n_heads} "
                f"heads, {html.escape(self.model.split(':')[0])}. Other views: <code>attnlab.viz.show(e, "
                f"view=...)</code> with {', '.join(repr(v) for v in views if v != 'head')}.</p>")
        return line + show(self, "head")._repr_html_()


def _head_index(head: object, n_heads: int) -> int:
    if isinstance(head, bool) or not isinstance(head, int | np.integer):
        raise TypeError(f"head must be an int, got {type(head).__name__}")
    if not -n_heads <= int(head) < n_heads:
        raise ValueError(f"head must be in 0..{n_heads - 1} (or -{n_heads}..-1), got {head}")
    return int(head) % n_heads


def explain(
    text: str,
    *,
    model: str = "random",
    layer: int | None = None,
    head: int | None = None,
    trace: bool | None = None,
    **options,
) -> Explanation:
    """Run ``text`` through the model called ``model`` (a key of :data:`MODELS`).

    Args:
        text: the input text.
        model: ``"random"`` (the random-weight teaching model), ``"minilm"`` (the
            pretrained MiniLM), ``"checkpoint"`` (a trained recall model; pass
            ``path=``) or ``"gpt2"`` (a GPT-2 checkpoint folder; pass ``path=``).
        layer: the layer to open on and trace, ``1..n`` or negative (default: the last).
        head: the head to open on (default 0).
        trace: record the step-by-step trace of ``layer``; None records it for texts of
            at most :data:`attnlab.explain.backends.TRACE_MAX_TOKENS` tokens.
        **options: the model's own options (see :mod:`attnlab.explain.backends`).

    >>> e = explain("The cat sat", model="random", dim=8, heads=2)
    >>> e.tokens, e.attentions.shape, e.layer, e.trace is not None
    (['the', 'cat', 'sat'], (1, 2, 3, 3), 1, True)
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if isinstance(text, str):
        from attnlab.viz.html_report import clean_text

        text = clean_text(text)  # lone surrogates (undecodable bytes) -> U+FFFD everywhere
    return MODELS[model](text, layer=layer, head=head, trace=trace, **options)
