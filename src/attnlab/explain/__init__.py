"""What the ``explain`` views show, as data: :class:`Explanation`, :func:`explain` and the models.

An :class:`Explanation` holds one text run through one model: its tokens, every attention
map, the static and contextual token vectors, the step-by-step trace of one layer, and the
layer and head to open on. The CLI prints it, :mod:`attnlab.viz` draws it, the HTML report
embeds it, :meth:`Explanation.to_dict` is its JSON document.

Layers are numbered as everywhere in attnlab: layer 0 is the embeddings (no attention),
layer ``k`` is the output of the ``k``-th transformer block (``1..n``), negative numbers
count from the end. ``attentions[k - 1]`` holds layer ``k``'s maps.

The models are callables in :data:`MODELS` (see :mod:`attnlab.explain.backends`); each
takes the text, ``layer``, ``head`` and ``trace`` plus options of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from attnlab.explain.backends import MODELS, checkpoint_model, gpt2_model, minilm_model, random_model
from attnlab.explain.words import WordComparison, compare_word

__all__ = [
    "MODELS",
    "Explanation",
    "WordComparison",
    "checkpoint_model",
    "compare_word",
    "explain",
    "gpt2_model",
    "minilm_model",
    "random_model",
]

FORMAT = "attnlab-explanation"
FORMAT_VERSION = 2  # 2: layers numbered 1..n (0 = embeddings), "layers" and "model_name" added


def _array(a) -> dict:
    a = np.asarray(a, dtype=np.float64)
    return {"shape": list(a.shape), "values": a.tolist()}


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

    def __post_init__(self) -> None:
        if self.layer is None:
            self.layer = int(np.shape(self.attentions)[0])

    @property
    def n_layers(self) -> int:
        return int(np.shape(self.attentions)[0])

    @property
    def n_heads(self) -> int:
        return int(np.shape(self.attentions)[1])

    def weights(self, layer: int | None = None, head: int | None = None) -> np.ndarray:
        """One head's ``(T, T)`` map; ``layer`` in attnlab's numbering (default: :attr:`layer`)."""
        from attnlab._validation import layer_number

        k = layer_number(self.layer if layer is None else layer, self.n_layers, embeddings=False)
        h = _head_index(self.head if head is None else head, self.n_heads)
        return np.asarray(self.attentions)[k - 1, h]

    def to_dict(self) -> dict:
        """The JSON document (``"format": "attnlab-explanation"``, version 2) with every value.

        >>> att = np.full((1, 1, 2, 2), 0.5)
        >>> e = Explanation("a b", ["a", "b"], "toy", att, np.eye(2), np.eye(2))
        >>> d = e.to_dict()
        >>> d["layer"], d["layers"], d["attentions"]["shape"]
        (1, 1, [1, 1, 2, 2])
        """
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model_name": self.model_name,
            "model": self.model,
            "text": self.text,
            "tokens": list(self.tokens),
            "created": self.created,
            "notes": list(self.notes),
            "layers": self.n_layers,
            "heads": self.n_heads,
            "layer": int(self.layer),
            "head": int(self.head),
            "attentions": _array(self.attentions),
            "static": _array(self.static),
            "contextual": _array(self.contextual),
            "trace": None if self.trace is None else self.trace.to_dict(),
        }

    def _repr_html_(self) -> str:  # Jupyter shows the interactive report inline
        from attnlab.viz import render_html

        return render_html(self, inline=True)


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
    return MODELS[model](text, layer=layer, head=head, trace=trace, **options)
