"""What the ``explain`` views show, as data: :class:`Explanation`, and the model registry.

An :class:`Explanation` holds one text run through one model: its tokens, every attention
map, static and contextual token vectors and (for the tutorial model) the step-by-step
trace. The CLI prints it, :mod:`attnlab.viz` draws it, the HTML report embeds it.

Models are looked up by name in :data:`MODELS` (``"module:function"``, imported only when
used). Every backend has the signature
``backend(text, *, seed=0, dim=128, heads=4, checkpoint=None) -> Explanation`` and ignores
the options that do not apply to it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

MODELS: dict[str, str] = {
    "random": "attnlab.text.pipeline:explain_random",
    "minilm": "attnlab.models.bert:explain_minilm",
    "checkpoint": "attnlab.train.checkpoint:explain_checkpoint",
}


@dataclass
class Explanation:
    """One text through one model.

    Attributes:
        text: the input text.
        tokens: the ``T`` token strings (word pieces for BERT).
        model: a human-readable description of the model that produced this.
        attentions: ``(layers, heads, T, T)`` attention weights; rows sum to 1.
        static: ``(T, D)`` token vectors before attention (embedding rows).
        contextual: ``(T, D)`` token vectors after the last layer.
        trace: the step-by-step record of one attention call (tutorial model), or None.
        created: ISO-8601 UTC time of creation.
        notes: remarks a reader should see (e.g. unknown words, truncation).
    """

    text: str
    tokens: list[str]
    model: str
    attentions: np.ndarray
    static: np.ndarray
    contextual: np.ndarray
    trace: object | None = None
    created: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds")
    )
    notes: list[str] = field(default_factory=list)

    def _repr_html_(self) -> str:  # Jupyter shows the interactive report inline
        from attnlab.viz import render_html

        return render_html(self, inline=True)


def explain(text: str, *, model: str = "random", **options) -> Explanation:
    """Run ``text`` through the model called ``model`` (a key of :data:`MODELS`)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    module, func = MODELS[model].split(":")
    return getattr(importlib.import_module(module), func)(text, **options)
